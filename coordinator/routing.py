"""Choosing a worker for a request: session affinity first, then power of two choices.

Power of two choices (Mitzenmacher 2001; Ray Serve's default `pow_2_router.py`): sample two
candidate workers at random and take the less utilised one (busy sessions / capacity). It spreads
load nearly as well as scanning all workers while staying O(1) and avoiding the herd effect of
always picking the global minimum from stale load reports.
"""
from __future__ import annotations

import random
import time
from typing import Callable, Iterable

from coordinator.registry import WorkerRecord
from flashfleet.v1 import common_pb2


def _mode_name(mode: int) -> str:
    """The SDK's and CLI's name of a decode mode: DECODE_MODE_DFLASH -> "dflash"."""
    return common_pb2.DecodeMode.Name(mode).removeprefix("DECODE_MODE_").lower()


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
        """Returns the chosen worker.

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
        return a if a.utilisation <= b.utilisation else b


class SessionAffinity:
    """Remembers which worker served each session, forgetting sessions unused for ttl_s.

    Args:
        ttl_s: seconds after which an unused session's affinity is dropped.
        clock: monotonic seconds.
    """

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.ttl_s = ttl_s
        self._clock = clock
        self._by_session: dict[str, tuple[str, float]] = {}

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
        """Binds a session to a worker and restarts its ttl_s; an empty session_id is ignored."""
        if session_id:
            self._by_session[session_id] = (worker_id, self._clock())

    def forget_worker(self, worker_id: str) -> None:
        """Drops every session bound to a worker (it expired or left)."""
        for sid in [s for s, (w, _) in self._by_session.items() if w == worker_id]:
            del self._by_session[sid]

    def __len__(self) -> int:
        now = self._clock()
        return sum(1 for _, t in self._by_session.values() if now - t <= self.ttl_s)


def route(model: str, session_id: str, workers: Iterable[WorkerRecord], exclude: set[str],
          router: PowerOfTwoRouter, affinity: SessionAffinity,
          mode: int = common_pb2.DECODE_MODE_AUTO) -> WorkerRecord:
    """Chooses the worker for one attempt of a request.

    Only workers serving the model (with a draft of the right kind for a speculative `mode`) are
    eligible, and of those the ones not marked `unreachable` while any of them has room. The session's worker
    wins while it is live, eligible, has room and was not tried; otherwise the router picks among
    the other eligible workers.

    Raises:
        NoWorker: no live worker serves the model.
        AllBusy: all that do are full or already tried.
    """
    workers = list(workers)
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
    sticky = affinity.lookup(session_id)
    for w in eligible:
        if w.worker_id == sticky and w.busy < w.capacity:
            return w
    if not eligible:
        raise AllBusy(f"all {len(serving)} worker(s) serving {model!r} failed or are full")
    return router.choose_worker(eligible)
