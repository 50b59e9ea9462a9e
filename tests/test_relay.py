"""Fewer messages per token, same tokens: the worker sends the chunks queued behind the one it
sends as one message (worker/servicer.py `flashfleet.coalesce`), and the coordinator's relay forwards
exactly the worker's tokens and text, counting them for resumes (coordinator/stream.py)."""
from __future__ import annotations

import grpc
import pytest

from fakes import FakeEngine
from flashfleet.coalesce import MAX_COALESCED, coalesce
from flashfleet.v1 import common_pb2, coordinator_pb2_grpc, worker_pb2_grpc
from harness import start_cluster
from worker.engine.types import DoneEvent, GenerationStats, TokenEvent

PROMPT = "tell me"
BASE = sum(ord(c) % 100 for c in PROMPT)  # FakeEngine's token i is (BASE + i) % 100, its text "<token>"


def _expected(n: int) -> list[int]:
    return [(BASE + i) % 100 for i in range(n)]


def _chunk(ids, text, logprobs=0, prompt_logprobs=0) -> common_pb2.GenerateResponse:
    return common_pb2.GenerateResponse(request_id="r", chunk=common_pb2.Chunk(
        text=text, token_ids=ids, logprobs=[common_pb2.TokenLogprob(token_id=i, logprob=-1.0) for i in range(logprobs)],
        prompt_logprobs=[common_pb2.TokenLogprob(token_id=i) for i in range(prompt_logprobs)]))


def test_coalesce_merges_only_the_queued_chunks_and_keeps_them():
    complete = common_pb2.GenerateResponse(request_id="r", complete=common_pb2.Complete(worker_id="w"))
    queued = [_chunk([], "", prompt_logprobs=3), _chunk([1], "a", 1), _chunk([2, 3], "bc", 2),
              _chunk([4], "d", 2), complete]  # the last chunk lists one more logprob: the EOS's
    before = [r.SerializeToString() for r in queued]
    first, i = coalesce(queued, 0)  # prompt log-probabilities go alone, first
    assert i == 1 and first is queued[0]
    merged, i = coalesce(queued, 1)  # then every chunk up to the Complete, as one
    assert i == 4 and merged.request_id == "r"
    assert list(merged.chunk.token_ids) == [1, 2, 3, 4] and merged.chunk.text == "abcd"
    assert len(merged.chunk.logprobs) == 5 and not merged.chunk.prompt_logprobs
    assert [r.SerializeToString() for r in queued] == before  # a resume reads the chunks as they were
    alone, i = coalesce(queued, 3)  # nothing queued behind it: the chunk itself
    assert i == 4 and alone is queued[3]
    many = [_chunk([t], "x") for t in range(MAX_COALESCED + 5)]
    capped, i = coalesce(many, 0)
    assert i == MAX_COALESCED and list(capped.chunk.token_ids) == list(range(MAX_COALESCED))


class BurstEngine(FakeEngine):
    """FakeEngine's tokens, all emitted (one event each, then the end) before `submit` returns:
    a burst that is queued whole before the worker sends any of it."""

    def submit(self, request, emit):
        self.submitted.append(request)
        first = len(request.resume_tokens)
        for i in range(first, request.max_tokens):
            tok = (BASE + i) % 100
            emit(TokenEvent(request.request_id, (tok,), f"<{tok}>"))
        emit(DoneEvent(request.request_id, "length", GenerationStats(
            prompt_tokens=len(request.prompt_tokens) + first, generated_tokens=request.max_tokens - first,
            mode="plain")))


def _stream(stub, **kw) -> tuple[list[common_pb2.GenerateResponse], common_pb2.GenerateResponse]:
    responses = list(stub.Generate(common_pb2.GenerateRequest(model="fake-model", prompt=PROMPT, **kw), timeout=30))
    assert responses[-1].WhichOneof("kind") == "complete"
    return responses[:-1], responses[-1]


@pytest.fixture
def burst_cluster():
    c = start_cluster({"w1": BurstEngine()})
    yield c
    c.close()


def test_the_worker_sends_queued_chunks_as_one_message_and_the_relay_passes_it_on(burst_cluster):
    with grpc.insecure_channel(burst_cluster.workers[0].advertise_address) as ch:
        chunks, done = _stream(worker_pb2_grpc.WorkerStub(ch), max_tokens=40, request_id="direct")
    # 40 events queued before the first write: one message carries them all
    assert len(chunks) == 1
    assert list(chunks[0].chunk.token_ids) == _expected(40)
    assert chunks[0].chunk.text == "".join(f"<{t}>" for t in _expected(40))
    assert done.complete.stats.generated_tokens == 40
    with grpc.insecure_channel(burst_cluster.address) as ch:
        relayed, done = _stream(coordinator_pb2_grpc.CoordinatorStub(ch), max_tokens=40)
    assert [r.chunk.SerializeToString() for r in relayed] == [c.chunk.SerializeToString() for c in chunks]
    assert done.complete.served_by == ["w1"] and done.complete.stats.generated_tokens == 40


def test_the_relay_is_token_identical_to_the_worker():
    c = start_cluster({"w1": FakeEngine(token_delay_s=0.002)})
    try:
        with grpc.insecure_channel(c.workers[0].advertise_address) as ch:
            direct, _ = _stream(worker_pb2_grpc.WorkerStub(ch), max_tokens=120, request_id="direct")
        with grpc.insecure_channel(c.address) as ch:
            relayed, done = _stream(coordinator_pb2_grpc.CoordinatorStub(ch), max_tokens=120)
    finally:
        c.close()
    for responses in (direct, relayed):
        assert [t for r in responses for t in r.chunk.token_ids] == _expected(120)
        assert "".join(r.chunk.text for r in responses) == "".join(f"<{t}>" for t in _expected(120))
        assert 1 <= len(responses) <= 120  # never more messages than tokens
    assert done.complete.stats.generated_tokens == 120 and done.complete.finish_reason == common_pb2.FINISH_REASON_LENGTH
