"""A fake engine that speaks EngineProtocol without MLX: deterministic tokens on its own thread,
so servicer and coordinator tests run fast and need no model; and `SlowProfile`, which an
`Engine(profile=...)` takes to run several times slower (a heterogeneous fleet on one machine)."""
from __future__ import annotations

import threading
import time

from worker.engine.profile import DecodeCostEntry, DecodeProfile, SessionSnapshot
from worker.engine.types import (DoneEvent, Draining, EngineLoad, GenerationStats, InvalidRequest,
                                 ModelDescription, Overloaded, TokenEvent)


class SlowProfile(DecodeProfile):
    """A `DecodeProfile` that makes its engine `slowdown` times slower (>= 1): the engine thread
    records each decode iteration and prefill chunk right after running it, and this sleeps
    (slowdown - 1) x its measured time there and records slowdown x the time, so the worker's
    speed and its reported profile agree.

    Args:
        slowdown: the factor, >= 1.
        sleep: how to sleep (a test of this class injects a fake).
    """

    def __init__(self, slowdown: float, sleep=time.sleep, **kwargs):
        super().__init__(**kwargs)
        if not slowdown >= 1:
            raise ValueError(f"slowdown must be >= 1, got {slowdown}")
        self.slowdown, self._sleep = slowdown, sleep

    def _slow(self, seconds: float) -> float:
        if seconds > 0:
            self._sleep((self.slowdown - 1) * seconds)
        return seconds * self.slowdown

    def decode(self, batch_size: int, context: int, block: int, seconds: float) -> None:
        super().decode(batch_size, context, block, self._slow(seconds))

    def prefill(self, tokens: int, seconds: float) -> None:
        super().prefill(tokens, self._slow(seconds))


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
        kv_budget_bytes: the KV budget `load()` reports (0: unknown).
        kv_bytes_per_token: the model's KV bytes per token of context (0: unknown); a running
            request holds this much per prompt token, at least 1000 bytes.
        seconds_per_iteration: the decode profile `load()` reports: an iteration of B rows costs
            B x this (batch buckets 1, 2, 4, 8; one context bucket); None reports none. `load()`
            always reports each running request as a session (context = prompt + tokens so far).

    A finished request's prompt stays in a prompt cache (1000 bytes each in `load()`): a later
    prompt reports as `cached_tokens` its longest common prefix with one of them, at most all its
    tokens but the last (the engine prefills at least one).

    Attributes:
        alive: the real engine's property (its thread runs); a test sets it False to play an
            engine thread that died (`worker.watchdog`). Tokens keep coming regardless.
    """

    def __init__(self, name="fake-model", capacity=4, token_delay_s=0.0, refuse=None,
                 max_context_tokens=4096, abort_delay_s=0.0, kv_budget_bytes=1 << 20,
                 kv_bytes_per_token=0, seconds_per_iteration=None):
        self.model = ModelDescription(name=name, max_context_tokens=max_context_tokens,
                                      kv_bytes_per_token=kv_bytes_per_token)
        self.kv_budget_bytes = kv_budget_bytes
        self.seconds_per_iteration = seconds_per_iteration
        self._progress: dict[str, tuple[int, int]] = {}  # request id -> (context tokens, remaining)
        self.prompt_cache: list[tuple[int, ...]] = []
        self._kv_held: dict[str, int] = {}
        self.capacity = capacity
        self.token_delay_s = token_delay_s
        self.refuse = refuse
        self.abort_delay_s = abort_delay_s
        self.active: dict[str, threading.Event] = {}
        self.submitted: list = []
        self.aborted: list[str] = []
        self._lock = threading.Lock()
        self.closed = False
        self.alive = True

    def encode_prompt(self, prompt, messages, tools=None):
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
            self._kv_held[request.request_id] = max(1000, self.model.kv_bytes_per_token * len(request.prompt_tokens))
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
            with self._lock:
                self._progress[request.request_id] = (len(request.prompt_tokens) + i + 1, request.max_tokens - i - 1)
            emit(TokenEvent(request.request_id, (tok,), f"<{tok}>"))
            n += 1
        if reason == "cancelled" and self.abort_delay_s:
            time.sleep(self.abort_delay_s)
        prompt = tuple(request.prompt_tokens)
        with self._lock:
            self.active.pop(request.request_id, None)
            self._kv_held.pop(request.request_id, None)
            self._progress.pop(request.request_id, None)
            cached = max((_common_prefix(prompt, p) for p in self.prompt_cache), default=0)
            self.prompt_cache.append(prompt)
        stats = GenerationStats(prompt_tokens=len(request.prompt_tokens) + len(request.resume_tokens),
                                generated_tokens=n, total_s=time.monotonic() - t0, mode="plain",
                                cached_tokens=max(0, min(cached, len(prompt) - 1)))
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
        with self._lock:
            sessions = tuple(SessionSnapshot(rid, ctx, self._kv_held.get(rid, 0), 0.0, 1.0, left)
                             for rid, (ctx, left) in self._progress.items())
            s = self.seconds_per_iteration
            profile = () if s is None else tuple(DecodeCostEntry(b, 256, s * b, 10) for b in (1, 2, 4, 8))
            return EngineLoad(active_sessions=len(self.active), capacity=self.capacity,
                              kv_cache_bytes=sum(self._kv_held.values()), kv_budget_bytes=self.kv_budget_bytes,
                              prompt_cache_bytes=1000 * len(self.prompt_cache), sessions=sessions,
                              decode_profile=profile)

    def close(self):
        self.closed = True
        for stop in list(self.active.values()):
            stop.set()


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
