"""A worker's Subscribe stream carries the responses of the Generate calls that name it, in
batches (worker/servicer.py `_Subscription`), and the coordinator relays through it
(coordinator/subscription.py): the same tokens as a plain call, each call carrying only its
status; a broken subscription ends its calls UNAVAILABLE and keeps their sessions for a resume."""
from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from coordinator import subscription
from coordinator.subscription import SubscribedCall, WorkerSubscription
from fakes import FakeEngine
from flashfleet.requests import SUBSCRIPTION_HEADER
from flashfleet.v1 import common_pb2, coordinator_pb2_grpc, worker_pb2, worker_pb2_grpc
from harness import LoopThread, start_cluster, wait_until
from worker.server import start_worker

PROMPT = "tell me"
BASE = sum(ord(c) % 100 for c in PROMPT)  # FakeEngine's token i is (BASE + i) % 100


def _expected(n: int, start: int = 0) -> list[int]:
    return [(BASE + i) % 100 for i in range(start, n)]


def _request(request_id: str, max_tokens: int = 40, **kw) -> common_pb2.GenerateRequest:
    return common_pb2.GenerateRequest(model="fake-model", prompt=PROMPT, max_tokens=max_tokens,
                                      request_id=request_id, **kw)


@pytest.fixture
def worker():
    loop = LoopThread()
    engine = FakeEngine(token_delay_s=0.005)
    w = loop.run(start_worker(engine, "w1", orphan_grace_s=5.0))
    yield w, engine
    loop.run(w.stop(grace_s=0.5))
    loop.close()


class _Subscriber:
    """A Subscribe stream read on a thread of its own: `batches` collects what arrives."""

    def __init__(self, address: str, subscription_id: str = "s1"):
        self.channel = grpc.insecure_channel(address)
        self.call = worker_pb2_grpc.WorkerStub(self.channel).Subscribe(
            worker_pb2.SubscribeRequest(subscription_id=subscription_id))
        self.batches: list[worker_pb2.ResponseBatch] = []
        self.error: grpc.RpcError | None = None
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for batch in self.call:
                self.batches.append(batch)
        except grpc.RpcError as e:
            self.error = e

    def responses(self, request_id: str) -> list[common_pb2.GenerateResponse]:
        return [r for b in self.batches for r in b.responses if r.request_id == request_id]

    def close(self) -> None:
        self.call.cancel()
        self._thread.join(10)
        self.channel.close()


def test_the_calls_naming_a_subscription_send_their_responses_on_it(worker):
    w, _ = worker
    address = f"127.0.0.1:{w.port}"
    sub = _Subscriber(address)
    try:
        assert wait_until(lambda: sub.batches)
        assert not sub.batches[0].responses  # the first batch says it is open
        results: dict[str, list] = {}

        def generate(rid: str) -> None:
            with grpc.insecure_channel(address) as ch:
                results[rid] = list(worker_pb2_grpc.WorkerStub(ch).Generate(
                    _request(rid), metadata=((SUBSCRIPTION_HEADER, "s1"),), timeout=30))

        threads = [threading.Thread(target=generate, args=(rid,)) for rid in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert results == {"a": [], "b": []}  # the calls carry no message and end OK
        # (a call can end before its Complete's batch is read: two streams)
        assert wait_until(lambda: all(sub.responses(rid) and sub.responses(rid)[-1].HasField("complete")
                                      for rid in ("a", "b")))
        for rid in ("a", "b"):
            responses = sub.responses(rid)
            assert [t for r in responses[:-1] for t in r.chunk.token_ids] == _expected(40)
            assert responses[-1].complete.stats.generated_tokens == 40
    finally:
        sub.close()


def test_an_unknown_or_empty_subscription_is_refused(worker):
    w, engine = worker
    with grpc.insecure_channel(f"127.0.0.1:{w.port}") as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(_request("r"), metadata=((SUBSCRIPTION_HEADER, "nobody"),), timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "subscribe again" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Subscribe(worker_pb2.SubscribeRequest(), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not engine.submitted  # nothing started for a call that cannot send its responses


def test_a_call_whose_subscription_closes_ends_unavailable_and_its_session_is_kept(worker):
    w, engine = worker
    address = f"127.0.0.1:{w.port}"
    sub = _Subscriber(address)
    assert wait_until(lambda: sub.batches)
    errors = []

    def generate() -> None:
        with grpc.insecure_channel(address) as ch:
            try:
                list(worker_pb2_grpc.WorkerStub(ch).Generate(
                    _request("r", max_tokens=400), metadata=((SUBSCRIPTION_HEADER, "s1"),), timeout=30))
            except grpc.RpcError as e:
                errors.append(e)

    t = threading.Thread(target=generate)
    t.start()
    assert wait_until(lambda: len(sub.responses("r")) >= 3)
    sub.close()
    t.join(10)
    assert errors and errors[0].code() == grpc.StatusCode.UNAVAILABLE
    assert wait_until(lambda: w.servicer.orphans == ["r"])  # kept for its client to resume
    got = sub.responses("r")
    ids = [t for r in got for t in r.chunk.token_ids]
    text = "".join(r.chunk.text for r in got)
    with grpc.insecure_channel(address) as ch:  # a plain call resumes it after what arrived
        rest = list(worker_pb2_grpc.WorkerStub(ch).Generate(
            _request("r", max_tokens=400, resume_token_ids=ids, resume_text=text), timeout=30))
    assert ids + [t for r in rest for t in r.chunk.token_ids] == _expected(400)
    assert len(engine.submitted) == 1  # re-attached, not started again


def test_the_coordinator_relays_through_the_subscription_with_identical_tokens():
    c = start_cluster({"w1": FakeEngine(token_delay_s=0.002)})
    try:
        pool = c.coordinator.servicer.pool
        address = c.workers[0].advertise_address
        assert wait_until(lambda: address in pool._subscriptions and pool._subscriptions[address].live)
        assert c.coordinator_registry.get_sample_value("flashfleet_coordinator_worker_subscriptions") == 1.0
        opened = []
        real = WorkerSubscription.generate

        def spy(self, request, **kw):
            opened.append(request.request_id)
            return real(self, request, **kw)

        WorkerSubscription.generate = spy
        try:
            with grpc.insecure_channel(c.address) as ch:
                responses = list(coordinator_pb2_grpc.CoordinatorStub(ch).Generate(
                    common_pb2.GenerateRequest(model="fake-model", prompt=PROMPT, max_tokens=120), timeout=30))
        finally:
            WorkerSubscription.generate = real
        assert len(opened) == 1  # the request went through the subscription
        assert [t for r in responses[:-1] for t in r.chunk.token_ids] == _expected(120)
        assert "".join(r.chunk.text for r in responses[:-1]) == "".join(f"<{t}>" for t in _expected(120))
        assert responses[-1].complete.stats.generated_tokens == 120
        assert not pool._subscriptions[address]._calls  # nothing left attached
    finally:
        c.close()


def test_a_worker_without_subscribe_gets_plain_calls():
    """A worker whose Subscribe answers UNIMPLEMENTED (an older one) streams on each call."""

    class NoSubscribe(worker_pb2_grpc.WorkerServicer):
        async def Generate(self, request, context):
            for i in range(3):
                yield common_pb2.GenerateResponse(request_id=request.request_id,
                                                  chunk=common_pb2.Chunk(token_ids=[i], text=str(i)))
            yield common_pb2.GenerateResponse(request_id=request.request_id, complete=common_pb2.Complete())

    async def run():
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(NoSubscribe(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        from coordinator.servicer import WorkerPool
        pool = WorkerPool()
        address = f"127.0.0.1:{port}"
        sub = pool.subscribe(address)
        for _ in range(200):
            if sub.unsupported:
                break
            await asyncio.sleep(0.01)
        call = pool.generate(address, _request("r"), timeout=10)
        out = []
        while (resp := await call.read()) is not grpc.aio.EOF:
            out.append(resp)
        await pool.close()
        await server.stop(None)
        return sub.unsupported, out

    unsupported, out = asyncio.run(run())
    assert unsupported
    assert [r.chunk.token_ids[0] for r in out[:3]] == [0, 1, 2] and out[3].WhichOneof("kind") == "complete"


class _FakeCall:
    """A grpc.aio call stand-in: `end` finishes it with EOF or an AioRpcError."""

    def __init__(self):
        self._done = asyncio.get_running_loop().create_future()
        self.cancelled = False

    def end(self, result=grpc.aio.EOF):
        self._done.set_result(result)

    async def read(self):
        result = await self._done
        if isinstance(result, BaseException):
            raise result
        return result

    def cancel(self):
        self.cancelled = True
        return True


class _FakeSubscription:
    def detach(self, sub_call):
        pass


def _chunk(i: int) -> common_pb2.GenerateResponse:
    return common_pb2.GenerateResponse(request_id="r", chunk=common_pb2.Chunk(token_ids=[i]))


def test_a_subscribed_call_reads_its_complete_even_after_its_call_ended(monkeypatch):
    monkeypatch.setattr(subscription, "COMPLETE_WAIT_S", 0.2)

    async def run():
        # the Complete after the call's OK end (two HTTP/2 streams): still read, then EOF
        raw = _FakeCall()
        call = SubscribedCall(_FakeSubscription(), "r", raw)
        call.deliver(_chunk(1))
        raw.end()
        await asyncio.sleep(0.05)
        call.deliver(common_pb2.GenerateResponse(request_id="r", complete=common_pb2.Complete()))
        got = [await call.read(), await call.read(), await call.read()]
        assert got[0].chunk.token_ids == [1] and got[1].WhichOneof("kind") == "complete"
        assert got[2] is grpc.aio.EOF
        # an OK end with no Complete: EOF once COMPLETE_WAIT_S has passed
        raw = _FakeCall()
        call = SubscribedCall(_FakeSubscription(), "r", raw)
        raw.end()
        assert await asyncio.wait_for(call.read(), 2) is grpc.aio.EOF
        # an error status after chunks: the chunks first, then the error
        raw = _FakeCall()
        call = SubscribedCall(_FakeSubscription(), "r", raw)
        call.deliver(_chunk(2))
        raw.end(grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), "boom"))
        await asyncio.sleep(0.01)
        assert (await call.read()).chunk.token_ids == [2]
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.read()
        assert e.value.code() == grpc.StatusCode.INTERNAL
        call.deliver(_chunk(3))  # late responses of an ended call are dropped
        with pytest.raises(grpc.aio.AioRpcError):
            await call.read()
        # chunks that queued while the reader was busy come as one; the Complete stays apart
        raw = _FakeCall()
        call = SubscribedCall(_FakeSubscription(), "r", raw)
        for i in (4, 5, 6):
            call.deliver(_chunk(i))
        call.deliver(common_pb2.GenerateResponse(request_id="r", complete=common_pb2.Complete()))
        merged = await call.read()
        assert list(merged.chunk.token_ids) == [4, 5, 6] and merged.request_id == "r"
        assert (await call.read()).WhichOneof("kind") == "complete" and await call.read() is grpc.aio.EOF
        # cancel: the call is cancelled and a read raises CancelledError
        raw = _FakeCall()
        call = SubscribedCall(_FakeSubscription(), "r", raw)
        call.cancel()
        assert raw.cancelled
        with pytest.raises(asyncio.CancelledError):
            await call.read()

    asyncio.run(run())


def test_what_queued_goes_as_one_batch_under_its_byte_limit():
    from worker.servicer import MAX_BATCH_BYTES, _Subscription

    async def run():
        sub = _Subscription("s")
        batches = sub.batches()
        assert not (await anext(batches)).responses
        big = "x" * (MAX_BATCH_BYTES * 6 // 10)
        for i in range(3):
            sub.send(common_pb2.GenerateResponse(request_id=f"big{i}", chunk=common_pb2.Chunk(text=big)))
        for i in range(5):
            sub.send(_chunk(i))
        sizes = [[r.request_id for r in (await anext(batches)).responses] for _ in range(3)]
        return sizes

    got = asyncio.run(run())
    # what queued while no batch was written goes as one, but two big ones would pass the
    # limit: each goes alone, the small ones ride with the last
    assert got == [["big0"], ["big1"], ["big2", "r", "r", "r", "r", "r"]]
