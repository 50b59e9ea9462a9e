"""The fleet's state behind one small interface: membership and worker leases, drain flags,
session placements, session affinity, and which coordinator owns each worker's once-only duties.

Every coordinator keeps a local view of the state (`registry`, `affinity`) that routing reads
without awaiting: a request's path never waits on the store. Writes go through a `FleetState`:

- `MemoryState` (coordinator/state/memory.py, the default): the view is the state; one
  coordinator, nothing else to run.
- `EtcdState` (coordinator/state/etcd.py): the state lives in etcd, shared by several active
  coordinators; each one's view follows etcd through watches, and a worker's liveness is an etcd
  lease that the coordinator receiving its heartbeats keeps alive.

API keys (`api_keys`, flashfleet/auth.py `ApiKeys`) are part of the state too, as SHA-256 digests
with their roles: a coordinator seeds them from its keys file at start, PutApiKey adds more, and
with etcd every coordinator accepts the keys any of them was given.

What stays per coordinator either way: the streams it proxies (`WorkerRecord.in_flight`, which is
why a worker's own RESOURCE_EXHAUSTED is the capacity check that holds across coordinators), and
`unreachable` marks from its own failed calls.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable

from coordinator.registry import Registry, WorkerRecord
from coordinator.routing import SessionAffinity
from flashfleet.auth import ApiKeys
from flashfleet.v1 import common_pb2, worker_pb2

# (request id, destination worker id, reason): a move the owner of a stream's worker decided.
MoveHandler = Callable[[str, str, str], None]


@dataclass(frozen=True)
class Placement:
    """Where a request's stream runs.

    Attributes:
        request_id: the request.
        worker_id: the worker decoding it.
        coordinator_id: the coordinator proxying its stream.
        tokens: tokens the coordinator had forwarded to the client when it wrote this (the
            client's own count may be higher: placements are written when a stream is placed or
            moves, not per token).
        model, mode, max_tokens, seeded: what the migration policy needs of the request (max_tokens
            0: unset; seeded: a seeded sampled request), so the worker's owner can decide moves of
            a stream another coordinator proxies.
    """

    request_id: str
    worker_id: str
    coordinator_id: str
    tokens: int = 0
    model: str = ""
    mode: int = 0
    max_tokens: int = 0
    seeded: bool = False

    def request(self) -> common_pb2.GenerateRequest:
        """A request carrying what the migration policy reads of the placed one (no prompt)."""
        req = common_pb2.GenerateRequest(request_id=self.request_id, model=self.model, mode=self.mode)
        if self.max_tokens:
            req.max_tokens = self.max_tokens
        if self.seeded:
            req.seed, req.temperature = 0, 1.0
        return req


class NotLive(LookupError):
    """No live worker has the id."""


class FleetState(abc.ABC):
    """The fleet's state as one coordinator sees and changes it.

    Attributes:
        coordinator_id: this coordinator's id (unique among those sharing the state).
        registry: the local view of the live workers (routing reads it synchronously).
        affinity: the local view of session affinity; its `bind` also records the binding in
            the shared state.
        shared: other coordinators see this state (a worker registers with one of them; its
            RegisterResponse says so).
        api_keys: the API keys every coordinator sharing the state accepts (digest -> role;
            flashfleet/auth.py `ApiKeys`), the local view that the guards read synchronously.
        on_worker_change: called (on the event loop) when the view took a worker's entry from
            the shared store (a registration or heartbeat through any coordinator), so capacity
            may have grown and the admission queue re-checks; None: nothing to tell.
        on_move: called (on the event loop) with (request id, destination worker id, reason) when
            the owner of a worker, another coordinator, decided to move a stream this coordinator
            proxies off it (`request_move`); None: nothing to tell.
    """

    shared = False

    def __init__(self, coordinator_id: str, registry: Registry, affinity: SessionAffinity):
        self.coordinator_id = coordinator_id
        self.registry = registry
        self.affinity = affinity
        self.api_keys = ApiKeys()
        self.on_worker_change = None
        self.on_move: MoveHandler | None = None

    def foreign_placements(self, worker_id: str) -> list[Placement]:
        """Streams from `worker_id` that other coordinators proxy, as this coordinator's view
        knows them (none with one coordinator)."""
        return []

    def request_move(self, placement: Placement, to_worker_id: str, reason: str) -> None:
        """Asks the coordinator proxying `placement`'s stream to move it to `to_worker_id` for
        `reason` (its owner's decision; that coordinator's `on_move` is told). Does not wait for
        the store; nothing to do with one coordinator (it proxies every stream)."""

    def move_taken(self, request_id: str) -> None:
        """Forgets a move request for `request_id` once this coordinator acted on it (or found
        no such stream). Does not wait for the store."""

    async def start(self) -> None:
        """Connects to the store and loads the current state into the local view (a no-op in
        memory). Raises ConnectionError when the store cannot be reached."""

    async def close(self) -> None:
        """Stops following the store and gives up this coordinator's ownerships."""

    @abc.abstractmethod
    async def register(self, req: worker_pb2.RegisterRequest) -> WorkerRecord:
        """Adds or renews a worker and starts its lease (`Registry.register` semantics).

        Raises:
            ValueError: empty worker_id, address or model list.
            coordinator.registry.WorkerIdInUse: another live worker at another address holds the id.
        """

    @abc.abstractmethod
    async def heartbeat(self, worker_id: str, lease_id: str, load: worker_pb2.WorkerLoad) -> WorkerRecord:
        """Renews a worker's lease and records its load.

        Raises:
            coordinator.registry.UnknownLease: the lease is unknown or expired.
        """

    @abc.abstractmethod
    async def deregister(self, worker_id: str, lease_id: str) -> WorkerRecord:
        """Removes a worker (clean shutdown).

        Raises:
            coordinator.registry.UnknownLease: the lease is unknown or expired.
        """

    @abc.abstractmethod
    async def set_draining(self, worker_id: str) -> WorkerRecord:
        """Marks a live worker draining for every coordinator (routing sends it nothing new, the
        migration policy moves its sessions); the mark lasts while its lease does, across
        re-registration.

        Raises:
            NotLive: no live worker has the id.
        """

    @abc.abstractmethod
    def owns(self, worker_id: str) -> bool:
        """Whether this coordinator runs the once-only duties for the worker: the migration
        policy's own moves of sessions off it, and counting its lease's expiry. At most one
        coordinator owns a worker at a time."""

    @abc.abstractmethod
    def place(self, request_id: str, worker_id: str, tokens: int,
              request: common_pb2.GenerateRequest | None = None) -> None:
        """Records that this coordinator streams `request_id` from `worker_id` (after routing,
        and after each move), `tokens` forwarded so far, for `request` (its model, mode and
        sampling go with the placement). Does not wait for the store."""

    @abc.abstractmethod
    def unplace(self, request_id: str) -> None:
        """Forgets a request's placement (its stream ended). Does not wait for the store."""

    @abc.abstractmethod
    async def placement(self, request_id: str) -> Placement | None:
        """The request's placement, or None (unknown, ended, or its worker left)."""

    @abc.abstractmethod
    async def put_api_key(self, digest: str, role: str) -> None:
        """Has every coordinator sharing the state accept the API key whose SHA-256 digest is
        `digest` (flashfleet/auth.py `key_digest`), in `role`; replaces its earlier role.

        Raises:
            ValueError: a malformed digest or an unknown role (`flashfleet.auth.check_key_entry`).
        """

    @abc.abstractmethod
    async def delete_api_key(self, digest: str) -> bool:
        """Has every coordinator stop accepting the key with `digest`; True when one was accepted."""

    async def seed_api_keys(self, keys: dict[str, str]) -> None:
        """Adds a keys file's keys (key -> role, `flashfleet.auth.load_api_keys`), by digest:
        called at start, so the file stays the source of the keys it names (their roles as it
        says) while keys added through PutApiKey stay too."""
        from flashfleet.auth import key_digest

        for key, role in keys.items():
            await self.put_api_key(key_digest(key), role)
