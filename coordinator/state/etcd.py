"""The fleet's state in etcd, shared by several active coordinators (coordinator/state/base.py).

Keys, under `PREFIX`:

    workers/<worker id>      WorkerEntry (state.proto)  on the worker's lease
    drain/<worker id>        ""                         on the worker's lease
    placements/<request id>  PlacementEntry             on the worker's lease
    moves/<request id>       MoveEntry                  on the source worker's lease
    owners/<worker id>       owning coordinator's id    on that coordinator's lease
    affinity/<session id>    worker id                  on the binding coordinator's affinity lease
    apikeys/<SHA-256 digest> role ("client", "admin")   no lease: kept until deleted

A worker's liveness is its etcd lease (TTL `lease_ttl_s`): the coordinator that receives its
heartbeats keeps the lease alive and writes the heartbeat's load; when the worker dies, etcd
deletes its keys after the TTL, which every coordinator sees through its watch. A worker
registers with any one coordinator and is visible to all. Each worker has one owner among the
coordinators (a create-if-absent on owners/<id>, attached to the owner's own lease, so it goes
when the owner dies and the next coordinator to receive the worker's heartbeat takes over): the
owner alone runs the migration policy's own moves off the worker and counts its lease's expiry.
For a stream another coordinator proxies, the owner decides from that stream's placement (which
carries what the policy reads of the request) and the worker's load, and writes moves/<request
id>; the proxying coordinator, following the same watch, makes the move at the stream's next
chunk and deletes the entry.
Affinity entries live on a lease per coordinator that is renewed for `session_ttl_s` x 1.5 and
replaced every `session_ttl_s` / 2, so an entry outlives its last binding by between
`session_ttl_s` and 1.5 x that, however many sessions there are.

Every coordinator's view (`registry`, `affinity`, drain marks, owners) follows one watch of the
prefix, resumed from its last revision when the stream breaks, re-read whole when etcd compacted
past it. Writes that routing does not wait for (placements, affinity) go through one queue in
order, so a stream's placement is never written after its removal.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from collections.abc import Coroutine

import grpc

from coordinator.registry import UnknownLease, WorkerRecord
from coordinator.state.base import FleetState, NotLive, Placement
from coordinator.state.etcd_client import MAX_TXN_OPS, EtcdClient, EtcdUnavailable, Event, WatchCompacted, Write
from flashfleet.v1 import common_pb2, state_pb2, worker_pb2

log = logging.getLogger("flashfleet.coordinator.state")

PREFIX = b"/flashfleet/"
WORKERS, DRAIN, PLACEMENTS, OWNERS, AFFINITY, MOVES, APIKEYS = (b"workers/", b"drain/", b"placements/", b"owners/",
                                                                b"affinity/", b"moves/", b"apikeys/")
WRITE_QUEUE_MAX = 10_000  # background writes waiting at most; beyond that they are dropped (logged)
CLOSE_FLUSH_S = 2.0  # on close, queued background writes get this long to finish


def _key(kind: bytes, name: str) -> bytes:
    return PREFIX + kind + name.encode()


def _lease_hex(lease: int) -> str:
    return f"{lease:x}"


class EtcdState(FleetState):
    """`FleetState` in etcd.

    Args:
        coordinator_id, registry, affinity: as `FleetState` (the registry must not expire leases
            itself: `Registry(expires=False)`).
        endpoints: etcd members, "host:port" or "http://host:port".
        lease_ttl_s: a worker's lease TTL, seconds (rounded up to a whole second, etcd's unit).
        session_ttl_s: how long an affinity entry outlives its last binding, at least.
    """

    shared = True

    def __init__(self, coordinator_id: str, registry, affinity, endpoints, lease_ttl_s: float,
                 session_ttl_s: float):
        super().__init__(coordinator_id, registry, affinity)
        self.client = EtcdClient(endpoints)
        self._ttl = max(1, math.ceil(lease_ttl_s))
        self._session_ttl_s = session_ttl_s
        self._own_lease = 0  # this coordinator's lease: its ownerships live on it
        self._affinity_lease = 0
        self._affinity_lease_since = 0.0
        self._owners: dict[str, str] = {}  # worker id -> owning coordinator id (watched)
        self._drained: set[str] = set()  # worker ids with a drain key (watched)
        self._leaving: set[str] = set()  # worker ids whose entry says it deregistered
        self._placements: dict[str, Placement] = {}  # request id -> its placement (watched)
        self._on_worker: dict[str, set[str]] = {}  # worker id -> request ids placed on it (watched)
        # Background writes in order: a Write (a plain put or delete), or a coroutine doing more.
        self._writes: collections.deque[Write | Coroutine] = collections.deque()
        self._writes_waiting = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._ready = asyncio.Event()
        affinity.on_bind = self._bound

    async def start(self) -> None:
        """Takes this coordinator's lease, reads the state and starts following it.

        Raises:
            ConnectionError (EtcdUnavailable): no etcd endpoint answered.
        """
        self._own_lease = await self.client.grant(self._ttl)
        revision = await self._load()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._follow(revision + 1)), loop.create_task(self._keep_own_lease()),
                       loop.create_task(self._write_loop())]
        log.info("coordinator %s shares the fleet state in etcd (%s)", self.coordinator_id,
                 ", ".join(self.client.targets))

    async def close(self) -> None:
        """Stops following etcd, revokes this coordinator's lease (its ownerships go at once,
        so other coordinators take them over at the workers' next heartbeats) and closes the
        client. Background writes already queued (a stream's placement removed as it ended)
        get `CLOSE_FLUSH_S` seconds to finish first."""
        if self._tasks:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.flush(), CLOSE_FLUSH_S)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._own_lease:
            with contextlib.suppress(EtcdUnavailable, grpc.aio.AioRpcError):
                await self.client.revoke(self._own_lease)
        await self.client.close()

    # Following etcd
    async def _load(self) -> int:
        """Replaces the view with etcd's state; returns the revision read."""
        kvs, revision = await self.client.get_prefix(PREFIX)
        seen_workers = set()
        self._owners.clear()
        self._drained.clear()
        self._placements.clear()
        self._on_worker.clear()
        self.api_keys.clear()
        for kv in kvs:
            self._apply(Event("put", kv.key, kv.value, kv.lease, kv.mod_revision))
            if kv.key.startswith(PREFIX + WORKERS):
                seen_workers.add(kv.key[len(PREFIX + WORKERS):].decode())
        for rec in self.registry.live():
            if rec.worker_id not in seen_workers:
                self.registry.drop(rec.worker_id, "expired")
        return revision

    async def _follow(self, revision: int) -> None:
        """Applies every change from `revision` on, for as long as the coordinator runs: a
        broken watch resumes (etcd_client.py), a compacted one reads the whole state anew."""
        while True:
            try:
                async for events in self.client.watch_prefix(PREFIX, revision):
                    for ev in events:
                        self._apply(ev)
                    revision = events[-1].revision + 1
            except WatchCompacted as e:
                log.warning("%s: reading the fleet state anew", e)
                while True:
                    try:
                        revision = await self._load() + 1
                        break
                    except (EtcdUnavailable, grpc.aio.AioRpcError) as e:
                        log.warning("cannot read the fleet state from etcd: %s", e)
                        await asyncio.sleep(1.0)

    def _apply(self, ev: Event) -> None:
        """Brings the view up to one change of etcd's state."""
        rest = ev.key[len(PREFIX):]
        kind, _, name_b = rest.partition(b"/")
        kind += b"/"
        name = name_b.decode()
        if kind == WORKERS:
            if ev.kind == "put":
                entry = state_pb2.WorkerEntry.FromString(ev.value)
                if entry.leaving:
                    self._leaving.add(name)
                    return
                self._leaving.discard(name)
                rec = self.registry.upsert(entry.worker, _lease_hex(ev.lease))
                rec.draining = name in self._drained
                if self.on_worker_change is not None:
                    self.on_worker_change()
            else:
                reason = "deregistered" if name in self._leaving else "expired"
                self._leaving.discard(name)
                if self.registry.drop(name, reason) is not None:
                    log.info("worker %s left the fleet (%s)", name, reason)
                if self._owners.get(name) == self.coordinator_id:
                    self._spawn_write(self.client.delete_if(_key(OWNERS, name), self.coordinator_id.encode()))
        elif kind == DRAIN:
            (self._drained.add if ev.kind == "put" else self._drained.discard)(name)
            rec = self.registry.get(name)
            if rec is not None:
                rec.draining = name in self._drained
        elif kind == OWNERS:
            if ev.kind == "put":
                self._owners[name] = ev.value.decode()
            else:
                self._owners.pop(name, None)
        elif kind == AFFINITY:
            if ev.kind == "put":
                self.affinity.remember(name, ev.value.decode())
            else:
                self.affinity.forget(name)
        elif kind == PLACEMENTS:
            self._unindex_placement(name)
            if ev.kind == "put":
                e = state_pb2.PlacementEntry.FromString(ev.value)
                p = Placement(name, e.worker_id, e.coordinator_id, e.tokens, e.model, e.mode, e.max_tokens, e.seeded)
                self._placements[name] = p
                self._on_worker.setdefault(p.worker_id, set()).add(name)
        elif kind == MOVES and ev.kind == "put":
            move = state_pb2.MoveEntry.FromString(ev.value)
            if move.coordinator_id == self.coordinator_id and self.on_move is not None:
                self.on_move(name, move.to_worker_id, move.reason)
        elif kind == APIKEYS:
            if ev.kind == "delete":
                self.api_keys.remove(name)
            else:
                try:
                    self.api_keys.put(name, ev.value.decode())
                except ValueError as e:  # written by something else than a coordinator
                    log.warning("ignoring the API key entry %s in etcd: %s", name[:12], e)

    def _unindex_placement(self, request_id: str) -> None:
        old = self._placements.pop(request_id, None)
        if old is not None:
            on = self._on_worker.get(old.worker_id)
            if on is not None:
                on.discard(request_id)
                if not on:
                    del self._on_worker[old.worker_id]

    # Leases of this coordinator
    async def _keep_own_lease(self) -> None:
        """Renews this coordinator's lease every third of its TTL; takes a new one when it was
        lost (etcd unreachable for longer than the TTL: its ownerships went with it and are
        taken again at the workers' next heartbeats)."""
        while True:
            await asyncio.sleep(self._ttl / 3)
            try:
                if await self.client.keepalive(self._own_lease) <= 0:
                    self._own_lease = await self.client.grant(self._ttl)
                    log.warning("coordinator %s lost its etcd lease; took a new one", self.coordinator_id)
                if self._affinity_lease and await self.client.keepalive(self._affinity_lease) <= 0:
                    self._affinity_lease = 0
            except (EtcdUnavailable, grpc.aio.AioRpcError) as e:
                log.warning("cannot renew coordinator %s's etcd lease: %s", self.coordinator_id, e)

    async def _current_affinity_lease(self) -> int:
        now = time.monotonic()
        if not self._affinity_lease or now - self._affinity_lease_since > self._session_ttl_s / 2:
            self._affinity_lease = await self.client.grant(max(1, math.ceil(self._session_ttl_s * 1.5)))
            self._affinity_lease_since = now
        return self._affinity_lease

    # Background writes, in order
    def _spawn_write(self, write: Write | Coroutine) -> None:
        """Queues a background write: a `Write`, or a coroutine for one that needs more (a
        read first, a compare-and-swap)."""
        if len(self._writes) >= WRITE_QUEUE_MAX:
            if not isinstance(write, Write):
                write.close()
            log.warning("etcd writes are %d behind; dropped one", WRITE_QUEUE_MAX)
            return
        self._writes.append(write)
        self._writes_waiting.set()

    async def _write_loop(self) -> None:
        """Applies the background writes in order. The plain puts and deletes queued behind one
        another go out as one transaction (`_write_batch`): at hundreds of requests a second,
        each placed and then forgotten, a round trip per write would fall behind and cost the
        coordinator a gRPC call each."""
        writes = self._writes
        while True:
            if not writes:
                self._writes_waiting.clear()
                await self._writes_waiting.wait()
                continue
            first = writes.popleft()
            try:
                if isinstance(first, Write):
                    batch = {first.key: first}  # a key twice: its latest write (etcd refuses repeats)
                    while writes and isinstance(writes[0], Write) and len(batch) < MAX_TXN_OPS:
                        w = writes.popleft()
                        batch.pop(w.key, None)
                        batch[w.key] = w
                    await self._write_batch(list(batch.values()))
                else:
                    await first
            except (EtcdUnavailable, grpc.aio.AioRpcError) as e:
                log.debug("a background etcd write failed: %s", e)
            except Exception:  # one bad write must not stop the ones after it
                log.exception("a background etcd write failed")

    async def _write_batch(self, batch: list[Write]) -> None:
        """One transaction for `batch`; when a put's lease has gone (its worker's lease expired:
        etcd then refuses the whole transaction), each write alone, those of gone leases skipped."""
        try:
            await self.client.write_all(batch)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND or len(batch) == 1:
                raise
            for w in batch:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await self.client.write_all([w])

    def _bound(self, session_id: str, worker_id: str) -> None:
        async def write():
            await self.client.put(_key(AFFINITY, session_id), worker_id.encode(), await self._current_affinity_lease())
        self._spawn_write(write())

    # FleetState
    async def _claim(self, worker_id: str) -> None:
        """Becomes the worker's owner if it has none (compare-and-swap)."""
        if worker_id in self._owners:
            return
        created, owner = await self.client.create(_key(OWNERS, worker_id), self.coordinator_id.encode(),
                                                  self._own_lease)
        self._owners[worker_id] = owner.decode()
        if created:
            log.info("coordinator %s owns worker %s", self.coordinator_id, worker_id)

    async def register(self, req: worker_pb2.RegisterRequest) -> WorkerRecord:
        """See `FleetState.register`: a new etcd lease for the worker, its entry on it, its drain
        mark carried over from its previous lease. Raises EtcdUnavailable (a ConnectionError)
        when etcd cannot be reached."""
        self.registry.check_registration(req)
        lease = await self.client.grant(self._ttl)
        if req.worker_id in self._drained:
            await self.client.put(_key(DRAIN, req.worker_id), b"", lease)
        await self.client.put(_key(WORKERS, req.worker_id), state_pb2.WorkerEntry(worker=req).SerializeToString(),
                              lease)
        rec = self.registry.upsert(req, _lease_hex(lease))
        rec.draining = req.worker_id in self._drained
        await self._claim(req.worker_id)
        return rec

    async def _live_lease(self, worker_id: str, lease_id: str) -> tuple[int, WorkerRecord]:
        rec = self.registry.get(worker_id)
        if rec is None or rec.lease_id != lease_id:
            raise UnknownLease(f"no live lease {lease_id!r} for worker {worker_id!r}; register again")
        return int(lease_id, 16), rec

    async def heartbeat(self, worker_id: str, lease_id: str, load: worker_pb2.WorkerLoad) -> WorkerRecord:
        """See `FleetState.heartbeat`: renews the worker's etcd lease and writes its load."""
        lease, rec = await self._live_lease(worker_id, lease_id)
        if await self.client.keepalive(lease) <= 0:
            raise UnknownLease(f"the lease of worker {worker_id!r} expired; register again")
        req = worker_pb2.RegisterRequest(worker_id=worker_id, address=rec.address, models=rec.models, load=load)
        try:
            await self.client.put(_key(WORKERS, worker_id), state_pb2.WorkerEntry(worker=req).SerializeToString(),
                                  lease)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:  # the lease ran out between the two calls
                raise UnknownLease(f"the lease of worker {worker_id!r} expired; register again") from None
            raise
        rec = self.registry.upsert(req, lease_id)
        await self._claim(worker_id)
        return rec

    async def deregister(self, worker_id: str, lease_id: str) -> WorkerRecord:
        """See `FleetState.deregister`: marks the entry leaving, then revokes the lease (its
        keys go: every coordinator sees a clean leave, not an expiry)."""
        lease, rec = await self._live_lease(worker_id, lease_id)
        req = worker_pb2.RegisterRequest(worker_id=worker_id, address=rec.address, models=rec.models, load=rec.load)
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.client.put(_key(WORKERS, worker_id),
                                  state_pb2.WorkerEntry(worker=req, leaving=True).SerializeToString(), lease)
        await self.client.revoke(lease)
        self._leaving.add(worker_id)
        return self.registry.drop(worker_id, "deregistered") or rec

    async def set_draining(self, worker_id: str) -> WorkerRecord:
        """See `FleetState.set_draining`: the drain key on the worker's lease."""
        rec = self.registry.get(worker_id)
        if rec is None:
            raise NotLive(f"no live worker {worker_id!r}")
        try:
            await self.client.put(_key(DRAIN, worker_id), b"", int(rec.lease_id, 16))
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise NotLive(f"worker {worker_id!r} left") from None
            raise
        self._drained.add(worker_id)
        rec.draining = True
        return rec

    def owns(self, worker_id: str) -> bool:
        """See `FleetState.owns`: this coordinator holds owners/<worker id>."""
        return self._owners.get(worker_id) == self.coordinator_id

    def place(self, request_id: str, worker_id: str, tokens: int,
              request: common_pb2.GenerateRequest | None = None) -> None:
        """See `FleetState.place`: placements/<request id> on the worker's lease, written in the
        background."""
        rec = self.registry.get(worker_id)
        if rec is None:
            return
        entry = state_pb2.PlacementEntry(worker_id=worker_id, coordinator_id=self.coordinator_id, tokens=tokens)
        if request is not None:
            entry.model, entry.mode = request.model, request.mode
            entry.max_tokens = request.max_tokens if request.HasField("max_tokens") else 0
            entry.seeded = request.HasField("seed") and request.temperature > 0
        value = entry.SerializeToString()
        self._spawn_write(Write(_key(PLACEMENTS, request_id), value, int(rec.lease_id, 16)))

    def unplace(self, request_id: str) -> None:
        """See `FleetState.unplace` (in the background, after any earlier write for it)."""
        self._spawn_write(Write(_key(PLACEMENTS, request_id)))

    async def placement(self, request_id: str) -> Placement | None:
        """See `FleetState.placement`: read from etcd (a placement on any coordinator)."""
        kv = await self.client.get(_key(PLACEMENTS, request_id))
        if kv is None:
            return None
        e = state_pb2.PlacementEntry.FromString(kv.value)
        return Placement(request_id, e.worker_id, e.coordinator_id, e.tokens, e.model, e.mode, e.max_tokens, e.seeded)

    def foreign_placements(self, worker_id: str) -> list[Placement]:
        """See `FleetState.foreign_placements`: from the watched placements/ entries."""
        found = (self._placements.get(r) for r in self._on_worker.get(worker_id, ()))
        return [p for p in found if p is not None and p.coordinator_id != self.coordinator_id]

    def request_move(self, placement: Placement, to_worker_id: str, reason: str) -> None:
        """See `FleetState.request_move`: moves/<request id> on the source worker's lease, written
        in the background."""
        rec = self.registry.get(placement.worker_id)
        if rec is None:
            return
        value = state_pb2.MoveEntry(coordinator_id=placement.coordinator_id, from_worker_id=placement.worker_id,
                                    to_worker_id=to_worker_id, reason=reason).SerializeToString()
        self._spawn_write(Write(_key(MOVES, placement.request_id), value, int(rec.lease_id, 16)))

    def move_taken(self, request_id: str) -> None:
        """See `FleetState.move_taken`: deletes moves/<request id> in the background."""
        self._spawn_write(Write(_key(MOVES, request_id)))

    async def put_api_key(self, digest: str, role: str) -> None:
        """See `FleetState.put_api_key`: apikeys/<digest> in etcd (no lease), and in this
        coordinator's view at once (the others' views follow through their watches).

        Raises:
            ValueError: a malformed digest or an unknown role.
            EtcdUnavailable: no etcd member answered.
        """
        from flashfleet.auth import check_key_entry

        check_key_entry(digest, role)
        await self.client.put(_key(APIKEYS, digest), role.encode())
        self.api_keys.put(digest, role)

    async def delete_api_key(self, digest: str) -> bool:
        """See `FleetState.delete_api_key`.

        Raises:
            EtcdUnavailable: no etcd member answered.
        """
        deleted = await self.client.delete(_key(APIKEYS, digest)) > 0
        return self.api_keys.remove(digest) or deleted

    async def flush(self) -> None:
        """Waits until every background write queued so far is done (tests, shutdown)."""
        done = asyncio.get_running_loop().create_future()

        async def mark():
            done.set_result(None)
        self._spawn_write(mark())
        await done
