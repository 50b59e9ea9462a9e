"""The coordinator's registry of workers: registration, heartbeat leases and expiry.

Workers register, then keep their lease alive with heartbeats that carry their load. A worker whose
last heartbeat is older than the lease TTL is expired: it gets no new sessions and is removed. The
clock is injected so tests can age leases without sleeping (as Ray Serve's
ReplicaQueueLengthCache does).
"""
from __future__ import annotations

import math
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from flashfleet.v1 import common_pb2, worker_pb2

Clock = Callable[[], float]


class WorkerIdInUse(Exception):
    """A registration under a worker id another live worker holds."""


@dataclass
class WorkerRecord:
    """One registered worker.

    Attributes:
        worker_id, address: identity and "host:port" of its Worker service.
        lease_id: changes on every (re-)registration.
        models: what it serves (ModelInfo protos).
        load: latest WorkerLoad from a heartbeat.
        last_heartbeat_s: clock reading of the latest heartbeat.
        in_flight: streams the coordinator has open to it now (fresher than load).
        served_requests: requests routed to it that finished.
        unreachable: a call to it failed UNAVAILABLE (before or after its first message: the
            process is gone, the host unreachable, or it is draining) since its last heartbeat; routing
            passes it over while another worker can take the request, instead of trying it
            first on every request until its lease runs out.
        draining: an operator drains it (Coordinator.DrainWorker): routing sends it nothing new
            and the migration policy moves its sessions away; kept across re-registration.
        profile_cache: (the load it was parsed from, its parsed decode profile), kept by the
            migration policy (coordinator/migration.py) so a profile is parsed once per heartbeat.
        need_cache: (the load, the model, the KV bytes its sessions will need), likewise.
    """

    worker_id: str
    address: str
    lease_id: str
    models: list[common_pb2.ModelInfo]
    load: worker_pb2.WorkerLoad
    last_heartbeat_s: float
    in_flight: int = 0
    served_requests: int = 0
    model_names: frozenset[str] = field(default=frozenset())
    unreachable: bool = False
    draining: bool = False
    profile_cache: tuple = field(default=(None, None), repr=False, compare=False)
    need_cache: tuple = field(default=(None, "", 0), repr=False, compare=False)
    on_change: Callable[["WorkerRecord"], None] | None = field(default=None, repr=False, compare=False)

    def changed(self) -> None:
        """Tells the registry holding the record that its free slots may have changed (a stream
        took or gave back one): its index of workers with a free slot follows."""
        if self.on_change is not None:
            self.on_change(self)

    def serves(self, model: str, mode: int = common_pb2.DECODE_MODE_AUTO) -> bool:
        """True when the worker serves `model` and, for a speculative mode (DRAFT, DFLASH, UAG),
        has a draft of that kind loaded."""
        if model not in self.model_names:
            return False
        if mode in (common_pb2.DECODE_MODE_AUTO, common_pb2.DECODE_MODE_PLAIN):
            return True
        return any(m.name == model and m.draft_mode == mode for m in self.models)

    @property
    def capacity(self) -> int:
        """Concurrent sessions the worker accepts, from its latest load report (at least 1)."""
        return max(self.load.capacity, 1)

    @property
    def busy(self) -> int:
        """Sessions active on the worker: the streams this coordinator has open to it. Exact and
        current, unlike the heartbeat's count, which lags by up to one heartbeat interval and
        made idle workers look full right after a burst."""
        return self.in_flight

    @property
    def kv_free_bytes(self) -> int | None:
        """KV bytes new sessions can have on the worker, from its latest heartbeat; None when it
        reports no KV budget (unknown)."""
        return self.load.kv_free_bytes if self.load.kv_budget_bytes > 0 else None

    def kv_bytes_per_token(self, model: str) -> int:
        """KV-cache bytes one token of context of `model` takes on this worker, as it registered
        them (target plus draft); 0 when unknown."""
        return next((m.kv_bytes_per_token for m in self.models if m.name == model), 0)

    @property
    def utilisation(self) -> float:
        """busy / capacity: the load `PowerOfTwoRouter` compares (may exceed 1 while the
        worker's reported capacity is below the streams open to it)."""
        return self.busy / self.capacity


class _FreeSet:
    """Workers with a free slot for one model: add, remove and a random draw in O(1) each."""

    def __init__(self):
        self.items: list[WorkerRecord] = []
        self._pos: dict[str, int] = {}

    def add(self, rec: WorkerRecord) -> None:
        i = self._pos.get(rec.worker_id)
        if i is None:
            self._pos[rec.worker_id] = len(self.items)
            self.items.append(rec)
        else:
            self.items[i] = rec

    def discard(self, worker_id: str) -> None:
        i = self._pos.pop(worker_id, None)
        if i is None:
            return
        last = self.items.pop()
        if i < len(self.items):
            self.items[i] = last
            self._pos[last.worker_id] = i


class UnknownLease(LookupError):
    """Heartbeat or deregistration for a worker/lease the registry does not hold (expired)."""


class Registry:
    """Workers by id, with lease expiry. Not thread-safe: used from the coordinator's event loop.

    Args:
        lease_ttl_s: seconds without heartbeat after which a worker expires.
        clock: monotonic seconds (time.monotonic by default).
        on_remove: called with each removed record and the reason, "expired" or
            "deregistered" (metrics, session affinity, logging).
        expires: whether leases expire by this registry's clock; False when the registry is a
            view of a shared store whose own leases decide (coordinator/state/etcd.py: it then
            calls `upsert` and `drop`).

    Attributes:
        grace: seconds a lease gets beyond `lease_ttl_s` now, or None: how late the coordinator
            itself answers RPCs (coordinator/overload.py), so a heartbeat that waits in its
            queue does not expire a live worker.
    """

    def __init__(self, lease_ttl_s: float, clock: Clock = time.monotonic,
                 on_remove: Callable[[WorkerRecord, str], None] | None = None, expires: bool = True):
        self.lease_ttl_s = lease_ttl_s
        self._clock = clock
        self._on_remove = on_remove
        self._workers: dict[str, WorkerRecord] = {}
        # No worker's latest heartbeat is older than this clock reading: the oldest at the last
        # sweep, or a later registration's. Heartbeats only make them newer, so it stays a bound
        # and `expire` sweeps the workers only once a lease may really have run out, not on every
        # call (every heartbeat and routing decision calls it).
        self._oldest_heartbeat_s = math.inf
        self.frozen = not expires
        self.grace: Callable[[], float] | None = None
        # Per model: the workers serving it (registration order) and those of them with a free
        # slot, kept as slots are taken and given back, so admission and routing look at a few
        # workers, not the whole fleet, per request.
        self._serving: dict[str, dict[str, WorkerRecord]] = {}
        self._free: dict[str, _FreeSet] = {}
        self._indexed: dict[str, frozenset[str]] = {}  # worker id -> the models it is indexed under
        self._rng = random.Random()

    def freeze(self) -> None:
        """Stops lease expiry for good: the coordinator is shutting down and refuses new RPCs,
        heartbeats included, so a lease running out then says nothing about the worker (and
        must not count as an expiry in the metrics and alerts)."""
        self.frozen = True

    def register(self, req: worker_pb2.RegisterRequest) -> WorkerRecord:
        """Adds a worker, or renews one that registers again (it restarted, or its lease ran
        out), and starts a new lease. A worker registering again keeps its record, so the
        streams open to it stay counted on the record they will be released from.

        Raises:
            ValueError: empty worker_id, address or model list.
            WorkerIdInUse: another worker at another address holds a live lease under this id
                and was not found unreachable (two workers given one --worker-id).
        """
        self.check_registration(req)
        return self.upsert(req, uuid.uuid4().hex)

    def check_registration(self, req: worker_pb2.RegisterRequest) -> None:
        """Raises what `register` raises for `req`, changing nothing."""
        if not req.worker_id or not req.address:
            raise ValueError("worker_id and address are required")
        if not req.models:
            raise ValueError("a worker must serve at least one model")
        self.expire()
        rec = self._workers.get(req.worker_id)
        if rec is not None and rec.address != req.address and not rec.unreachable:
            raise WorkerIdInUse(
                f"worker id {req.worker_id!r} is in use by the worker at {rec.address} (its lease is live): "
                f"give this worker another --worker-id, or stop that one (its lease ends "
                f"{max(0.0, self.lease_ttl_s - self.heartbeat_age_s(rec)):.0f} s after its last heartbeat)")

    def upsert(self, req: worker_pb2.RegisterRequest, lease_id: str) -> WorkerRecord:
        """Adds the worker or updates its record (address, models, load, lease) as of now,
        clearing its `unreachable` mark; what this coordinator counts on the record (streams,
        served requests, the drain mark) stays. No checks: `register` makes them."""
        now = self._clock()
        rec = self._workers.get(req.worker_id)
        if rec is None:
            rec = self._workers[req.worker_id] = WorkerRecord(req.worker_id, req.address, "", [], req.load, now)
        rec.address, rec.lease_id, rec.models, rec.load = req.address, lease_id, list(req.models), req.load
        rec.model_names = frozenset(m.name for m in req.models)
        rec.last_heartbeat_s, rec.unreachable = now, False
        self._oldest_heartbeat_s = min(self._oldest_heartbeat_s, now)
        rec.on_change = self._index
        self._index(rec)
        return rec

    def _index(self, rec: WorkerRecord) -> None:
        """Brings the per-model index up to `rec` (its models, whether it has a free slot); a
        record no longer in the registry (a stream outlived its worker's lease) is not indexed."""
        if self._workers.get(rec.worker_id) is not rec:
            return
        old = self._indexed.get(rec.worker_id, frozenset())
        if old != rec.model_names:
            for model in old - rec.model_names:
                self._unindex_model(rec.worker_id, model)
            for model in rec.model_names - old:
                self._serving.setdefault(model, {})[rec.worker_id] = rec
            self._indexed[rec.worker_id] = rec.model_names
        free = rec.in_flight < rec.capacity
        for model in rec.model_names:
            if free:
                self._free.setdefault(model, _FreeSet()).add(rec)
            elif model in self._free:
                self._free[model].discard(rec.worker_id)

    def _unindex_model(self, worker_id: str, model: str) -> None:
        serving = self._serving.get(model)
        if serving is not None:
            serving.pop(worker_id, None)
            if not serving:
                del self._serving[model]
        free = self._free.get(model)
        if free is not None:
            free.discard(worker_id)
            if not free.items:
                del self._free[model]

    def _unindex(self, rec: WorkerRecord) -> None:
        for model in self._indexed.pop(rec.worker_id, frozenset()):
            self._unindex_model(rec.worker_id, model)

    def serving(self, model: str) -> list[WorkerRecord]:
        """The live workers serving `model` (any mode), in registration order."""
        self.expire()
        return list(self._serving.get(model, {}).values())

    def free_sample(self, model: str, k: int) -> list[WorkerRecord]:
        """Up to `k` live workers serving `model` with a free slot (busy < capacity): all of them
        when there are at most `k`, else `k` drawn at random. O(k), whatever the fleet's size."""
        self.expire()
        free = self._free.get(model)
        if free is None:
            return []
        items = free.items
        return list(items) if len(items) <= k else self._rng.sample(items, k)

    def drop(self, worker_id: str, reason: str) -> WorkerRecord | None:
        """Removes a worker for `reason` ("expired" or "deregistered", told to `on_remove`);
        returns its record, or None when it was not there."""
        rec = self._workers.pop(worker_id, None)
        if rec is not None:
            self._unindex(rec)
            if self._on_remove:
                self._on_remove(rec, reason)
        return rec

    def heartbeat(self, worker_id: str, lease_id: str, load: worker_pb2.WorkerLoad) -> WorkerRecord:
        """Renews a lease and records the worker's load.

        Raises:
            UnknownLease: the worker is not registered or its lease changed/expired.
        """
        rec = self._get_live(worker_id, lease_id)
        rec.load = load
        rec.last_heartbeat_s = self._clock()
        rec.unreachable = False  # it is alive: route to it again
        self._index(rec)  # its capacity may have changed
        return rec

    def deregister(self, worker_id: str, lease_id: str) -> WorkerRecord:
        """Removes a worker (clean shutdown).

        Raises:
            UnknownLease: as for heartbeat.
        """
        return self.drop(self._get_live(worker_id, lease_id).worker_id, "deregistered")

    def expire(self) -> list[WorkerRecord]:
        """Removes every worker whose lease ran out; returns them (none once frozen)."""
        if self.frozen:
            return []
        now = self._clock()
        ttl = self.lease_ttl_s + (self.grace() if self.grace is not None else 0.0)
        if now - self._oldest_heartbeat_s <= ttl:  # also for no workers (inf)
            return []
        gone = [r for r in self._workers.values() if now - r.last_heartbeat_s > ttl]
        for rec in gone:
            del self._workers[rec.worker_id]
            self._unindex(rec)
            if self._on_remove:
                self._on_remove(rec, "expired")
        self._oldest_heartbeat_s = min((r.last_heartbeat_s for r in self._workers.values()), default=math.inf)
        return gone

    def live(self) -> list[WorkerRecord]:
        """Workers with a valid lease (expires stale ones first)."""
        self.expire()
        return list(self._workers.values())

    def get(self, worker_id: str) -> WorkerRecord | None:
        """The live worker `worker_id`, or None (expires stale leases first)."""
        self.expire()
        return self._workers.get(worker_id)

    def heartbeat_age_s(self, rec: WorkerRecord) -> float:
        """Seconds since `rec`'s latest heartbeat (or registration), by the registry's clock."""
        return self._clock() - rec.last_heartbeat_s

    def _get_live(self, worker_id: str, lease_id: str) -> WorkerRecord:
        self.expire()
        rec = self._workers.get(worker_id)
        if rec is None or rec.lease_id != lease_id:
            raise UnknownLease(f"no live lease {lease_id!r} for worker {worker_id!r}; register again")
        return rec
