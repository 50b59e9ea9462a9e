"""Worker-side state shared between the engine thread and the event loop: the tokenizer's lock
held while resume tokens are decoded, and per-request bookkeeping touched on the loop alone."""
from __future__ import annotations

import threading

import grpc

from fakes import FakeEngine
from flashfleet.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from harness import LoopThread, wait_until
from worker.engine.intake import Intake
from worker.engine.modes import MODES
from worker.engine.types import GenerationRequest, ModelDescription
from worker.server import start_worker


class _LockCheckingTokenizer:
    """A character tokenizer (ids 1..99; 0 is EOS) whose every call checks that the intake's lock is held."""

    eos_token_ids = [0]

    def __init__(self):
        self.intake = None
        self.unlocked_calls = 0

    def _check(self):
        if not self.intake._lock.locked():
            self.unlocked_calls += 1

    def encode(self, text, add_special_tokens=True):
        self._check()
        return [1 + ord(c) % 99 for c in text]

    def decode(self, ids, **kwargs):
        self._check()
        return "".join(chr(ord("a") + (i - 1) % 26) for i in ids)


def test_resume_tokens_are_decoded_under_the_intake_lock():
    # The callers' threads share one tokenizer (encode_prompt runs in asyncio.to_thread): the
    # resume check must take the same lock as encoding.
    tok = _LockCheckingTokenizer()
    intake = Intake(tok, ModelDescription(name="m", max_context_tokens=256), 100, "", MODES)
    tok.intake = intake
    intake.encode_prompt("hello", None)
    request = GenerationRequest("r1", (5, 6, 7), max_tokens=10, resume_tokens=(1, 2, 3), resume_text="abc")
    assert intake.validate(request, None) == "plain"
    assert tok.unlocked_calls == 0


def test_engine_events_are_handled_on_the_loop_and_leave_no_state_behind():
    # The engine emits on its own thread; whether a request ended because it was cancelled,
    # moved or finished is decided on the loop, where Cancel records it. Many cancels racing
    # natural ends leave no request's bookkeeping behind.
    loop = LoopThread()
    engine = FakeEngine(capacity=64, token_delay_s=0.001)
    w = loop.run(start_worker(engine, "w1"))
    handled_on = set()
    on_event = w.servicer._on_event

    def spy(session, event):
        handled_on.add(threading.get_ident())
        on_event(session, event)

    w.servicer._on_event = spy
    try:
        with grpc.insecure_channel(f"127.0.0.1:{w.port}") as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            calls = []
            for i in range(40):
                req = common_pb2.GenerateRequest(model="fake-model", prompt=f"p{i}", max_tokens=3 + i % 5,
                                                 request_id=f"r{i}")
                calls.append(stub.Generate(req, timeout=10))
            for i in range(40):
                stub.Cancel(worker_pb2.CancelRequest(request_id=f"r{i}", reason="migrated" if i % 2 else ""))
            for i, call in enumerate(calls):
                if i % 2:  # moved: the coordinator drops such a call without reading it
                    call.cancel()
                    continue
                try:
                    for _ in call:
                        pass
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.CANCELLED, e
                call.cancel()
        assert handled_on == {loop.thread.ident}
        assert wait_until(lambda: not w.servicer._sessions and not engine.active, 15)
    finally:
        loop.run(w.stop(grace_s=0.5))
        loop.close()
