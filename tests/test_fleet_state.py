"""The fleet state's contract (coordinator/state/), for each implementation: membership and
leases, drain flags, placements, affinity and ownership."""
from __future__ import annotations

import asyncio

import pytest

from coordinator.registry import Registry, UnknownLease, WorkerIdInUse
from coordinator.routing import SessionAffinity
from coordinator.state import MemoryState, NotLive
from flashfleet.v1 import common_pb2, worker_pb2


def registration(worker_id: str, address: str = "127.0.0.1:1", capacity: int = 4) -> worker_pb2.RegisterRequest:
    return worker_pb2.RegisterRequest(worker_id=worker_id, address=address,
                                      models=[common_pb2.ModelInfo(name="m")],
                                      load=worker_pb2.WorkerLoad(capacity=capacity))


def memory_state(lease_ttl_s: float = 10.0, clock=None) -> MemoryState:
    registry = Registry(lease_ttl_s, **({"clock": clock} if clock else {}))
    return MemoryState("c1", registry, SessionAffinity(60.0))


def test_memory_state_membership_drain_and_placements():
    now = [0.0]
    state = memory_state(clock=lambda: now[0])

    async def scenario():
        rec = await state.register(registration("w1"))
        assert state.registry.get("w1") is rec and state.owns("w1")
        with pytest.raises(WorkerIdInUse):
            await state.register(registration("w1", address="127.0.0.1:2"))
        with pytest.raises(ValueError):
            await state.register(worker_pb2.RegisterRequest(worker_id="w2"))
        await state.heartbeat("w1", rec.lease_id, worker_pb2.WorkerLoad(capacity=6))
        assert rec.capacity == 6
        with pytest.raises(UnknownLease):
            await state.heartbeat("w1", "not-the-lease", worker_pb2.WorkerLoad())
        with pytest.raises(NotLive):
            await state.set_draining("nope")
        assert (await state.set_draining("w1")).draining
        old_lease = rec.lease_id
        again = await state.register(registration("w1"))  # re-registration keeps the drain
        assert again.draining and again.lease_id != old_lease
        state.place("r1", "w1", 0)
        state.place("r1", "w1", 12)  # after a move: the latest wins
        assert (await state.placement("r1")).tokens == 12
        state.unplace("r1")
        assert await state.placement("r1") is None
        state.place("r2", "w1", 3)
        now[0] = 11.0  # the lease runs out: the worker and the placements on it go
        assert state.registry.get("w1") is None
        assert await state.placement("r2") is None
        with pytest.raises(UnknownLease):
            await state.deregister("w1", again.lease_id)

    asyncio.run(scenario())
