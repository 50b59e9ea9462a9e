"""A fake engine that speaks EngineProtocol without MLX: deterministic tokens on its own thread,
so servicer and coordinator tests run fast and need no model."""
from __future__ import annotations

import threading
import time

from worker.engine.types import (DoneEvent, Draining, EngineLoad, GenerationStats, InvalidRequest,
                                 ModelDescription, Overloaded, TokenEvent)


class FakeEngine:
    """Emits token i = (sum(prompt) + i) % 100 as text "<i>", one every token_delay_s (a request
    resumed after k tokens, `GenerationRequest.resume_tokens`, starts at i = k).

    Args:
        name: model name it serves.
        capacity: concurrent requests admitted; more raise Overloaded.
        token_delay_s: pause between tokens (to hold sessions open in load tests).
        refuse: raise this error class from submit() (to test retries).
        abort_delay_s: a cancelled request keeps its slot this long (a real engine frees it at
            its next turn, after the caller's call has ended).
    """

    def __init__(self, name="fake-model", capacity=4, token_delay_s=0.0, refuse=None,
                 max_context_tokens=4096, abort_delay_s=0.0):
        self.model = ModelDescription(name=name, max_context_tokens=max_context_tokens)
        self.capacity = capacity
        self.token_delay_s = token_delay_s
        self.refuse = refuse
        self.abort_delay_s = abort_delay_s
        self.active: dict[str, threading.Event] = {}
        self.submitted: list = []
        self.aborted: list[str] = []
        self._lock = threading.Lock()
        self.closed = False

    def encode_prompt(self, prompt, messages):
        if messages is not None:
            if any(not m["content"] for m in messages):
                raise InvalidRequest("empty message content")
            prompt = "".join(f"{m['role']}:{m['content']}\n" for m in messages)
        return [ord(c) % 100 for c in prompt]

    def submit(self, request, emit):
        if self.closed:
            raise Draining("closed")
        if self.refuse is not None:
            raise self.refuse("refused by test")
        if len(request.prompt_tokens) + request.max_tokens > self.model.max_context_tokens:
            raise InvalidRequest("prompt + max_tokens exceed the context")
        with self._lock:
            if request.request_id in self.active:  # as the real engine: ids are unique while running
                raise InvalidRequest(f"request_id {request.request_id!r} is already running")
            if len(self.active) >= self.capacity:
                raise Overloaded(f"capacity {self.capacity} reached")
            stop = threading.Event()
            self.active[request.request_id] = stop
            self.submitted.append(request)
        threading.Thread(target=self._run, args=(request, emit, stop), daemon=True).start()

    def _run(self, request, emit, stop):
        t0 = time.monotonic()
        base = sum(request.prompt_tokens)
        n, reason = 0, "length"
        for i in range(len(request.resume_tokens), request.max_tokens):  # a migrated request goes on after them
            if stop.wait(self.token_delay_s) if self.token_delay_s else stop.is_set():
                reason = "cancelled"
                break
            tok = (base + i) % 100
            emit(TokenEvent(request.request_id, (tok,), f"<{tok}>"))
            n += 1
        if reason == "cancelled" and self.abort_delay_s:
            time.sleep(self.abort_delay_s)
        with self._lock:
            self.active.pop(request.request_id, None)
        stats = GenerationStats(prompt_tokens=len(request.prompt_tokens) + len(request.resume_tokens), generated_tokens=n,
                                total_s=time.monotonic() - t0, mode="plain")
        emit(DoneEvent(request.request_id, reason, stats))

    def abort(self, request_id):
        with self._lock:
            stop = self.active.get(request_id)
        if stop is None:
            return False
        self.aborted.append(request_id)
        stop.set()
        return True

    def load(self):
        return EngineLoad(active_sessions=len(self.active), capacity=self.capacity,
                          kv_cache_bytes=1000 * len(self.active))

    def close(self):
        self.closed = True
        for stop in list(self.active.values()):
            stop.set()
