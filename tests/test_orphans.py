"""A worker keeps a session whose upstream vanished without a Cancel (its coordinator died) for a
grace period, and a call resuming the same request after a prefix of its output re-attaches to it
(worker/servicer.py); a Cancel, a deadline or the grace period's end aborts it."""
from __future__ import annotations

import grpc
import pytest

from fakes import FakeEngine
from flashfleet.requests import RESUME_ONLY_HEADER
from flashfleet.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from harness import LoopThread, wait_until
from worker.server import start_worker

MAX_TOKENS = 60


@pytest.fixture
def worker():
    loop = LoopThread()
    engine = FakeEngine(token_delay_s=0.005)
    w = loop.run(start_worker(engine, "w1", orphan_grace_s=1.0))
    yield w, engine
    loop.run(w.stop(grace_s=0.5))
    loop.close()


def _request(max_tokens=MAX_TOKENS, **kw) -> common_pb2.GenerateRequest:
    return common_pb2.GenerateRequest(model="fake-model", prompt="tell me", max_tokens=max_tokens,
                                      request_id="r1", **kw)


def _read_some(address: str, n_chunks: int, max_tokens=MAX_TOKENS) -> tuple[list[int], str]:
    """Opens Generate on a channel of its own, reads `n_chunks` chunks, then drops the channel
    (no Cancel RPC: as when the coordinator dies)."""
    ch = grpc.insecure_channel(address)
    call = worker_pb2_grpc.WorkerStub(ch).Generate(_request(max_tokens), timeout=30)
    ids, text = [], []
    for _, resp in zip(range(n_chunks), call):
        ids.extend(resp.chunk.token_ids)
        text.append(resp.chunk.text)
    ch.close()
    return ids, "".join(text)


def _rest(stub, ids, text, max_tokens=MAX_TOKENS, **kw) -> tuple[list[int], common_pb2.GenerateResponse]:
    out, last = [], None
    for resp in stub.Generate(_request(max_tokens, resume_token_ids=ids, resume_text=text), timeout=30, **kw):
        out.extend(resp.chunk.token_ids)
        last = resp
    return out, last


def test_a_session_whose_upstream_vanished_is_resumed_where_it_was(worker):
    w, engine = worker
    address = f"127.0.0.1:{w.port}"
    ids, text = _read_some(address, 10)
    assert wait_until(lambda: w.servicer.orphans == ["r1"])
    with grpc.insecure_channel(address) as ch:
        rest, last = _rest(worker_pb2_grpc.WorkerStub(ch), ids, text, metadata=((RESUME_ONLY_HEADER, "1"),))
    expected = [(sum(ord(c) % 100 for c in "tell me") + i) % 100 for i in range(MAX_TOKENS)]
    assert ids + rest == expected  # nothing lost, nothing repeated
    assert len(engine.submitted) == 1  # re-attached, not started again
    stats = last.complete.stats
    assert last.complete.finish_reason == common_pb2.FINISH_REASON_LENGTH
    # read as a session resumed after `ids`: the coordinator adds them back once
    assert stats.generated_tokens == MAX_TOKENS - len(ids)
    assert wait_until(lambda: not w.servicer._sessions)


def test_a_finished_orphan_is_kept_with_its_end_until_resumed(worker):
    w, engine = worker
    address = f"127.0.0.1:{w.port}"
    ids, text = _read_some(address, 5)
    assert wait_until(lambda: not engine.active, 10)  # it finished while nobody read it
    with grpc.insecure_channel(address) as ch:
        rest, last = _rest(worker_pb2_grpc.WorkerStub(ch), ids, text)
    assert len(ids + rest) == MAX_TOKENS and last.WhichOneof("kind") == "complete"
    assert len(engine.submitted) == 1


def test_resume_only_is_refused_where_no_session_is_kept_and_an_orphan_expires(worker):
    w, engine = worker
    address = f"127.0.0.1:{w.port}"
    with grpc.insecure_channel(address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            _rest(stub, [1, 2], "<1><2>", metadata=((RESUME_ONLY_HEADER, "1"),))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        ids, text = _read_some(address, 3, max_tokens=2000)
        assert wait_until(lambda: w.servicer.orphans == ["r1"])
        assert wait_until(lambda: not w.servicer._sessions and not engine.active, 5)  # grace (1 s) over
        assert engine.aborted == ["r1"]
        with pytest.raises(grpc.RpcError) as e:
            _rest(stub, ids, text, max_tokens=2000, metadata=((RESUME_ONLY_HEADER, "1"),))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_cancel_ends_an_orphan_and_a_different_prefix_starts_afresh(worker):
    w, engine = worker
    address = f"127.0.0.1:{w.port}"
    with grpc.insecure_channel(address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        _read_some(address, 3, max_tokens=2000)
        assert wait_until(lambda: w.servicer.orphans == ["r1"])
        assert stub.Cancel(worker_pb2.CancelRequest(request_id="r1")).cancelled
        assert wait_until(lambda: not w.servicer._sessions and not engine.active, 5)
        _read_some(address, 3, max_tokens=2000)
        assert wait_until(lambda: w.servicer.orphans == ["r1"])
        # not a prefix of its output: the kept one is ended, the request runs anew after those tokens
        rest, last = _rest(stub, [7, 7], "<7><7>", max_tokens=40)
        assert len(rest) == 38 and len(engine.submitted) == 3
        assert wait_until(lambda: not w.servicer._sessions and not engine.active, 5)
