"""The coordinator's per-stream state machine (coordinator/stream.py): slots are given back on every
failure path, and the stream's states."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from coordinator.config import CoordinatorConfig
from coordinator.migration import MigrationPolicy
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

    def generate(self, address, request, *, timeout, metadata=()):
        return self.stub(address).Generate(request, timeout=timeout, metadata=metadata)

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


# ----- in_flight after a worker re-registers, a channel drops, or a client leaves a resume ---------

class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Call:
    """A worker's Generate call whose messages the test feeds (`feed`; an AioRpcError to fail it)."""

    def __init__(self):
        self.messages: asyncio.Queue = asyncio.Queue()
        self.cancelled = False

    def feed(self, item) -> None:
        self.messages.put_nowait(item)

    async def read(self):
        item = await self.messages.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class _Pool:
    """A WorkerPool of fake workers: each Generate opens a `_Call` kept in `calls[address]`; a
    worker in `answer_first` answers its first read with a chunk at once, one in `gone` fails it
    UNAVAILABLE (its process died); Cancel is recorded."""

    def __init__(self, answer_first=()):
        self.calls: dict[str, list[_Call]] = {}
        self.cancels: list[tuple[str, str]] = []
        self.answer_first = set(answer_first)
        self.gone: set[str] = set()

    def generate(self, address, request, *, timeout, metadata=()):
        return self.stub(address).Generate(request, timeout=timeout, metadata=metadata)

    def stub(self, address):
        pool = self

        class Stub:
            def Generate(self, request, timeout=None, metadata=None):
                call = _Call()
                pool.calls.setdefault(address, []).append(call)
                if address in pool.gone:
                    call.feed(grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                                   grpc.aio.Metadata(), "connection refused"))
                elif address in pool.answer_first:
                    call.feed(_chunk(1))
                return call

            async def Cancel(self, request, timeout=None):
                pool.cancels.append((address, request.request_id))
                return worker_pb2.CancelResponse()
        return Stub()

    async def drop(self, address):
        pass


def _chunk(token: int) -> worker_pb2.GenerateResponse:
    return common_pb2.GenerateResponse(chunk=common_pb2.Chunk(token_ids=[token], text="x"))


def _register(registry: Registry, worker_id: str, address: str):
    return registry.register(worker_pb2.RegisterRequest(
        worker_id=worker_id, address=address, models=[common_pb2.ModelInfo(name="m")],
        load=worker_pb2.WorkerLoad(capacity=4)))


def _servicer(registry: Registry, pool) -> CoordinatorServicer:
    config = CoordinatorConfig(port=0, route_attempts=1, max_queued=0, lease_ttl_s=10.0, heartbeat_interval_s=0.5,
                               migration=MigrationPolicy(enabled=False))
    return CoordinatorServicer(config, MemoryState("c1", registry, SessionAffinity(60.0)), pool)


def test_a_worker_that_registers_again_mid_stream_is_left_with_no_stream_counted():
    """Re-registration under a live lease keeps the record (the stream is released from it);
    after an expiry it makes a new record, which never counted the old stream: either way the
    worker's live record is back at 0 when the stream ends, and so is the record it left."""
    clock = _Clock()
    registry = Registry(lease_ttl_s=10.0, clock=clock)
    first = _register(registry, "w1", "127.0.0.1:1")
    pool = _Pool()
    servicer = _servicer(registry, pool)

    async def run():
        request = common_pb2.GenerateRequest(model="m", prompt="hi", max_tokens=4, request_id="r1")
        got = []

        async def consume():
            async for resp in servicer.generate(request, lambda: None):
                got.append(resp)
        task = asyncio.get_running_loop().create_task(consume())
        while "127.0.0.1:1" not in pool.calls:
            await asyncio.sleep(0.01)
        (call,) = pool.calls["127.0.0.1:1"]
        call.feed(_chunk(1))
        while not got:
            await asyncio.sleep(0.01)
        assert first.in_flight == 1
        assert _register(registry, "w1", "127.0.0.1:1") is first and first.in_flight == 1  # live: same record
        clock.now += 11.0  # the lease runs out (no heartbeat) and the worker registers again
        second = _register(registry, "w1", "127.0.0.1:1")
        assert second is not first and second.in_flight == 0
        call.feed(common_pb2.GenerateResponse(complete=common_pb2.Complete(finish_reason=common_pb2.FINISH_REASON_LENGTH)))
        call.feed(grpc.aio.EOF)  # a worker's call ends after its Complete
        await task
        return second

    second = asyncio.run(run())
    assert first.in_flight == 0 and second.in_flight == 0 and registry.get("w1").in_flight == 0


def test_a_channel_that_drops_mid_stream_leaves_no_stream_counted():
    registry = Registry(lease_ttl_s=10.0)
    worker = _register(registry, "w1", "127.0.0.1:1")
    pool = _Pool(answer_first=["127.0.0.1:1"])
    servicer = _servicer(registry, pool)

    async def run():
        request = common_pb2.GenerateRequest(model="m", prompt="hi", max_tokens=4, request_id="r1")
        with pytest.raises(GenerateFailed) as failed:
            async for _ in servicer.generate(request, lambda: None):
                pool.gone.add("127.0.0.1:1")  # the worker died: its call breaks, and it refuses a re-attach
                pool.calls["127.0.0.1:1"][0].feed(grpc.aio.AioRpcError(
                    grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "connection reset"))
        return failed.value

    failed = asyncio.run(run())
    assert failed.code == grpc.StatusCode.UNAVAILABLE
    assert worker.in_flight == 0 and worker.unreachable


def test_a_client_that_leaves_while_its_resume_probes_the_workers_leaves_no_slot_taken():
    """A resumed request probes every worker at once; the client leaves after one answered
    (it holds the session) while another still has not: both slots are given back, and the one
    that answered is told to end the session."""
    registry = Registry(lease_ttl_s=10.0)
    holder = _register(registry, "w1", "127.0.0.1:1")
    slow = _register(registry, "w2", "127.0.0.1:2")
    pool = _Pool(answer_first=["127.0.0.1:1"])
    servicer = _servicer(registry, pool)

    async def run():
        request = common_pb2.GenerateRequest(model="m", prompt="hi", max_tokens=8, request_id="r1",
                                             resume_token_ids=[5, 6], resume_text="ab")

        async def consume():
            async for _ in servicer.generate(request, lambda: None):
                pass
        task = asyncio.get_running_loop().create_task(consume())
        while len(pool.calls) < 2 or not pool.calls["127.0.0.1:1"][0].messages.empty():
            await asyncio.sleep(0.01)  # w1 answered its probe (its chunk was read); w2 says nothing
        await asyncio.sleep(0.05)
        assert holder.in_flight == 1 and slow.in_flight == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):  # the Cancel to the holder runs in the background
            if pool.cancels:
                break
            await asyncio.sleep(0.01)

    asyncio.run(run())
    assert holder.in_flight == 0 and slow.in_flight == 0
    assert ("127.0.0.1:1", "r1") in pool.cancels and pool.calls["127.0.0.1:1"][0].cancelled


def test_a_call_that_fails_with_no_other_worker_re_attaches_to_its_session_on_the_same_worker():
    """The call to the only worker breaks UNAVAILABLE mid-stream (a keepalive ping timed out on a
    loaded host) while the worker lives and keeps the session: the stream re-attaches there,
    resumed after the tokens already sent, and ends with every slot given back."""
    from flashfleet.requests import RESUME_ONLY_HEADER

    registry = Registry(lease_ttl_s=10.0)
    worker = _register(registry, "w1", "127.0.0.1:1")
    opened = []

    class Pool(_Pool):
        def stub(self, address):
            inner = super().stub(address)

            class Stub:
                def Generate(self, request, timeout=None, metadata=None):
                    opened.append((request, dict(metadata or ())))
                    call = inner.Generate(request, timeout, metadata)
                    if len(opened) == 1:  # the first call: one chunk, then the connection breaks
                        call.feed(_chunk(1))
                        call.feed(grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                                       grpc.aio.Metadata(), "Stream removed (ping timeout)"))
                    else:  # the re-attached session goes on
                        call.feed(_chunk(2))
                        call.feed(common_pb2.GenerateResponse(complete=common_pb2.Complete(
                            finish_reason=common_pb2.FINISH_REASON_LENGTH)))
                        call.feed(grpc.aio.EOF)
                    return call

                Cancel = inner.Cancel
            return Stub()

    servicer = _servicer(registry, Pool())

    async def run():
        request = common_pb2.GenerateRequest(model="m", prompt="hi", max_tokens=2, request_id="r1")
        return [resp async for resp in servicer.generate(request, lambda: None)]

    got = asyncio.run(run())
    assert [list(r.chunk.token_ids) for r in got if r.WhichOneof("kind") == "chunk"] == [[1], [2]]
    assert got[-1].WhichOneof("kind") == "complete"
    (first, _), (again, metadata) = opened
    assert list(again.resume_token_ids) == [1] and metadata.get(RESUME_ONLY_HEADER) == "1"
    assert worker.in_flight == 0 and not worker.unreachable
