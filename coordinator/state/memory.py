"""The fleet's state in this process: the default, for one coordinator (coordinator/state/base.py)."""
from __future__ import annotations

from coordinator.registry import WorkerRecord
from coordinator.state.base import FleetState, NotLive, Placement
from flashfleet.v1 import common_pb2, worker_pb2


class MemoryState(FleetState):
    """`FleetState` whose local view is the whole state: leases expire by the registry's clock,
    this coordinator owns every worker, placements are a dict (dropped with their worker)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._placements: dict[str, Placement] = {}

    async def register(self, req: worker_pb2.RegisterRequest) -> WorkerRecord:
        """See `FleetState.register`."""
        return self.registry.register(req)

    async def heartbeat(self, worker_id: str, lease_id: str, load: worker_pb2.WorkerLoad) -> WorkerRecord:
        """See `FleetState.heartbeat`."""
        return self.registry.heartbeat(worker_id, lease_id, load)

    async def deregister(self, worker_id: str, lease_id: str) -> WorkerRecord:
        """See `FleetState.deregister`."""
        return self.registry.deregister(worker_id, lease_id)

    async def set_draining(self, worker_id: str) -> WorkerRecord:
        """See `FleetState.set_draining`."""
        rec = self.registry.get(worker_id)
        if rec is None:
            raise NotLive(f"no live worker {worker_id!r}")
        rec.draining = True
        return rec

    def owns(self, worker_id: str) -> bool:
        """Always True: the only coordinator owns every worker."""
        return True

    def place(self, request_id: str, worker_id: str, tokens: int,
              request: common_pb2.GenerateRequest | None = None) -> None:
        """See `FleetState.place` (only what `placement` answers is kept)."""
        self._placements[request_id] = Placement(request_id, worker_id, self.coordinator_id, tokens)

    def unplace(self, request_id: str) -> None:
        """See `FleetState.unplace`."""
        self._placements.pop(request_id, None)

    async def placement(self, request_id: str) -> Placement | None:
        """See `FleetState.placement`: None also once its worker left the registry."""
        p = self._placements.get(request_id)
        return p if p is not None and self.registry.get(p.worker_id) is not None else None

    async def put_api_key(self, digest: str, role: str) -> None:
        """See `FleetState.put_api_key` (this coordinator's keys)."""
        self.api_keys.put(digest, role)

    async def delete_api_key(self, digest: str) -> bool:
        """See `FleetState.delete_api_key`."""
        return self.api_keys.remove(digest)
