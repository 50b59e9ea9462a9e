"""The coordinator's per-stream state machine (coordinator/stream.py): slots are given back on every
failure path, and the stream's states."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from coordinator.config import CoordinatorConfig
from coordinator.registry import Registry
from coordinator.routing import SessionAffinity
from coordinator.servicer import CoordinatorServicer, GenerateFailed
from coordinator.state import MemoryState
from coordinator.stream import Slot
from flashfleet.v1 import common_pb2, worker_pb2


class _BrokenPool:
    """A WorkerPool whose channels cannot be opened (as grpc refuses a malformed target)."""

    def stub(self, address):
        raise ValueError(f"cannot open a channel to {address!r}")

    async def drop(self, address):
        pass


def _registry() -> Registry:
    registry = Registry(lease_ttl_s=60.0)
    registry.register(worker_pb2.RegisterRequest(
        worker_id="w1", address="127.0.0.1:1", models=[common_pb2.ModelInfo(name="m")],
        load=worker_pb2.WorkerLoad(capacity=4)))
    return registry


def test_a_channel_that_fails_to_open_leaves_no_slot_taken():
    registry = _registry()
    servicer = CoordinatorServicer(CoordinatorConfig(port=0, route_attempts=2, retry_initial_wait_s=0.01,
                                                     max_queued=0),
                                   MemoryState("c1", registry, SessionAffinity(60.0)), _BrokenPool())

    async def run():
        request = common_pb2.GenerateRequest(model="m", prompt="hi", max_tokens=4)
        with pytest.raises(GenerateFailed) as failed:
            async for _ in servicer.generate(request, lambda: None):
                pass
        return failed.value

    failed = asyncio.run(run())
    assert failed.code == grpc.StatusCode.UNAVAILABLE and "could not open a channel" in failed.details
    (worker,) = registry.live()
    assert worker.in_flight == 0 and worker.unreachable


def test_a_slot_is_given_back_when_its_block_raises_and_kept_when_it_does_not():
    (worker,) = _registry().live()
    released = []
    with pytest.raises(RuntimeError):
        with Slot(worker, lambda: released.append(1)):
            assert worker.in_flight == 1
            raise RuntimeError("the call failed")
    assert worker.in_flight == 0 and released == [1]
    with Slot(worker, lambda: released.append(2)) as slot:
        pass
    assert worker.in_flight == 1 and slot.held
    slot.release()
    slot.release()  # once
    assert worker.in_flight == 0 and released == [1, 2]
