"""Choosing a worker for a request: session affinity first, then power of two choices, both
preferring workers with KV memory for the request.

Power of two choices (Mitzenmacher 2001; Ray Serve's default `pow_2_router.py`): sample two
candidate workers at random and take the less utilised one (busy sessions / capacity), the one
with more free KV bytes on a tie. It spreads load nearly as well as scanning all workers while
staying O(1) and avoiding the herd effect of always picking the global minimum from stale load
reports.

KV room: each heartbeat carries the worker's free KV bytes (its budget less its running
sessions' caches; the prompt cache gives way) and registration its KV bytes per token of
context. A request may need up to `request_tokens_bound` tokens of KV; a worker whose free bytes
are below that times its bytes per token is passed over while another worker has room (there
the request would wait for memory, or its growth would evict the prompt cache and preempt the
newest session, which resumes later by recomputing its cache). A worker
that reports no budget or no bytes per token counts as having room. Free bytes lag by up to one
heartbeat interval, so this is a preference, never a refusal: with no worker that has room, the
request goes where it would have gone anyway.
"""
from __future__ import annotations

import random
import time
from collections import OrderedDict
from typing import Callable, Iterable

from coordinator.registry import WorkerRecord
from flashfleet.requests import WORKER_DEFAULT_MAX_TOKENS
from flashfleet.v1 import common_pb2


def _mode_name(mode: int) -> str:
    """The SDK's and CLI's name of a decode mode: DECODE_MODE_DFLASH -> "dflash"."""
    return common_pb2.DecodeMode.Name(mode).removeprefix("DECODE_MODE_").lower()


def request_tokens_bound(request: common_pb2.GenerateRequest) -> int:
    """Upper bound on the tokens of context a request holds on its worker, without a tokenizer:
    the UTF-8 bytes of its prompt (or of its messages' contents), since a byte-level BPE token
    covers at least one byte, plus max_tokens (unset: `WORKER_DEFAULT_MAX_TOKENS`). Chat-template
    tokens around the messages are not counted. How far above the true count it lies depends on
    the tokenizer and the text.
    """
    if request.WhichOneof("input") == "messages":
        prompt_bytes = sum(len(m.content.encode()) for m in request.messages.messages)
    else:
        prompt_bytes = len(request.prompt.encode())
    budget = request.max_tokens if request.HasField("max_tokens") else WORKER_DEFAULT_MAX_TOKENS
    return prompt_bytes + budget


def has_kv_room(worker: WorkerRecord, model: str, tokens: int) -> bool:
    """Whether `worker` reports free KV bytes for `tokens` tokens of context of `model`; True
    when it reports no KV budget, no bytes per token, or tokens is 0 (nothing to compare)."""
    free = worker.kv_free_bytes
    per_token = worker.kv_bytes_per_token(model)
    return free is None or per_token == 0 or tokens <= 0 or free >= tokens * per_token


def _kv_free_key(worker: WorkerRecord) -> int:
    """Free KV bytes for tie-breaking; -1 when unknown (a known amount wins)."""
    free = worker.kv_free_bytes
    return -1 if free is None else free


class NoWorker(LookupError):
    """No live worker serves the model (NOT_FOUND)."""


class AllBusy(RuntimeError):
    """Every eligible worker is at capacity or was already tried (RESOURCE_EXHAUSTED)."""


class PowerOfTwoRouter:
    """Picks the less utilised of two random eligible workers.

    Args:
        rng: random source (seedable in tests).
    """

    def __init__(self, rng: random.Random | None = None):
        self._rng = rng or random.Random()

    def choose_worker(self, candidates: list[WorkerRecord]) -> WorkerRecord:
        """Returns the chosen worker: the less utilised of two sampled at random, on a tie the
        one with more free KV bytes (a reported amount before an unknown one).

        Args:
            candidates: live workers serving the model, not yet tried for this request.

        Raises:
            AllBusy: candidates is empty or all of them are full.
        """
        free = [w for w in candidates if w.busy < w.capacity]
        if not free:
            raise AllBusy("every worker serving this model is at capacity; retry later")
        if len(free) == 1:
            return free[0]
        a, b = self._rng.sample(free, 2)
        if a.utilisation != b.utilisation:
            return a if a.utilisation < b.utilisation else b
        return a if _kv_free_key(a) >= _kv_free_key(b) else b


MAX_AFFINITY_SESSIONS = 100_000  # session ids remembered at most (each ~200 bytes)


class SessionAffinity:
    """Remembers which worker served each session, forgetting sessions unused for ttl_s and,
    past `max_sessions`, the least recently bound.

    Entries are kept in the order they were last bound, so each `bind` drops the expired ones
    from the front: memory stays bounded by the sessions bound within ttl_s and by
    `max_sessions`, however many session ids clients ever send (they choose them).

    Args:
        ttl_s: seconds after which an unused session's affinity is dropped.
        clock: monotonic seconds.
        max_sessions: entries kept at most (>= 1).

    Attributes:
        on_bind: called with (session_id, worker_id) after each `bind` (the shared state
            records it for the other coordinators, coordinator/state/); None: nothing else to do.

    Raises:
        ValueError: max_sessions < 1.
    """

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic,
                 max_sessions: int = MAX_AFFINITY_SESSIONS):
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.on_bind: Callable[[str, str], None] | None = None
        self._clock = clock
        self._by_session: OrderedDict[str, tuple[str, float]] = OrderedDict()  # oldest bind first

    def lookup(self, session_id: str) -> str | None:
        """The worker id of a session, or None (empty id, unknown, or unused for over ttl_s,
        which also drops it). A lookup does not refresh the ttl; `bind` does."""
        if not session_id:
            return None
        entry = self._by_session.get(session_id)
        if entry is None:
            return None
        if self._clock() - entry[1] > self.ttl_s:
            del self._by_session[session_id]
            return None
        return entry[0]

    def bind(self, session_id: str, worker_id: str) -> None:
        """Binds a session to a worker and restarts its ttl_s, then tells `on_bind`; an empty
        session_id is ignored."""
        if not session_id:
            return
        self.remember(session_id, worker_id)
        if self.on_bind is not None:
            self.on_bind(session_id, worker_id)

    def remember(self, session_id: str, worker_id: str) -> None:
        """`bind` without telling `on_bind`: a binding another coordinator made."""
        now = self._clock()
        self._by_session[session_id] = (worker_id, now)
        self._by_session.move_to_end(session_id)
        while self._by_session:
            oldest, (_, t) = next(iter(self._by_session.items()))
            if now - t <= self.ttl_s and len(self._by_session) <= self.max_sessions:
                break
            del self._by_session[oldest]

    def forget(self, session_id: str) -> None:
        """Drops one session's binding (a no-op when it has none)."""
        self._by_session.pop(session_id, None)

    def forget_worker(self, worker_id: str) -> None:
        """Drops every session bound to a worker (it expired or left)."""
        for sid in [s for s, (w, _) in self._by_session.items() if w == worker_id]:
            del self._by_session[sid]

    def __len__(self) -> int:
        now = self._clock()
        return sum(1 for _, t in self._by_session.values() if now - t <= self.ttl_s)


def route(model: str, session_id: str, workers: Iterable[WorkerRecord], exclude: set[str],
          router: PowerOfTwoRouter, affinity: SessionAffinity,
          mode: int = common_pb2.DECODE_MODE_AUTO, tokens: int = 0) -> WorkerRecord:
    """Chooses the worker for one attempt of a request.

    Only workers serving the model (with a draft of the right kind for a speculative `mode`) and
    not being drained are eligible, and of those the ones not marked `unreachable` while any of them has a free slot.
    The session's worker (where its earlier turns are in the prompt cache) wins while it is live,
    eligible, has a free slot, was not tried, and has KV room for `tokens` tokens of context or no
    other eligible worker has; otherwise the router picks among the eligible workers with KV room
    (`has_kv_room`), or among all eligible ones when none has.

    Args:
        tokens: tokens of context the request may hold (`request_tokens_bound`); 0 skips the
            KV-room preference.

    Raises:
        NoWorker: no live worker serves the model (or every one that does is being drained).
        AllBusy: all that do are full or already tried.
    """
    workers = list(workers)
    if any(w.draining and w.serves(model) for w in workers):
        workers = [w for w in workers if not w.draining]
        if not any(w.serves(model) for w in workers):
            raise NoWorker(f"every live worker serving {model!r} is being drained")
    if not any(w.serves(model) for w in workers):
        raise NoWorker(f"no live worker serves model {model!r}")
    serving = [w for w in workers if w.serves(model, mode)]
    if not serving:
        served = sorted({_mode_name(m) for m in common_pb2.DecodeMode.values()
                         if m != common_pb2.DECODE_MODE_AUTO and any(w.serves(model, m) for w in workers)})
        raise NoWorker(f"no live worker serving {model!r} has a draft for mode {_mode_name(mode)!r} (modes served "
                       f"for it: {', '.join(served)}); start a worker with a draft of that kind, or use mode 'auto'")
    eligible = [w for w in serving if w.worker_id not in exclude]
    # A worker that just failed to answer is a last resort (it may be back: then its heartbeat
    # clears the mark), not every request's first try; it still serves when the others are full.
    eligible = [w for w in eligible if not w.unreachable and w.busy < w.capacity] or eligible
    roomy = [w for w in eligible if w.busy < w.capacity and has_kv_room(w, model, tokens)]
    sticky = affinity.lookup(session_id)
    for w in eligible:
        if w.worker_id == sticky and w.busy < w.capacity and (not roomy or any(r is w for r in roomy)):
            return w
    if not eligible:
        raise AllBusy(f"all {len(serving)} worker(s) serving {model!r} failed or are full")
    return router.choose_worker(roomy or eligible)
