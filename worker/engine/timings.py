"""A robust estimate of what a repeated piece of work costs, from its recent wall-clock timings.

A timing is the work's own cost plus whatever the machine added: the thread descheduled for
another process, a lock held by another thread, a page fault. What is added is never negative
and comes in bursts, so on a busy host a mean of timings (even a decayed one) follows the load,
not the work: one plain decode step that waited 10 ms for a CPU makes speculation look cheap.
The least of a few recent timings is the estimate that noise cannot push up (timeit's advice for
the same reason); it follows a cost that grows (a growing context) within `window` samples.

Timings of one kind of work arrive at very different rates (a plain step every iteration, a
probe of another block size every few hundred), so the samples that count are those taken close
to the newest one, by the caller's clock of iterations: a probe long ago says nothing of now.
"""
from __future__ import annotations

from collections import deque


class RecentTimings:
    """The least of the last `window` timings taken within `horizon` ticks of the newest one.

    Args:
        window: how many timings are kept (>= 1).
        horizon: how far back (in the caller's ticks, e.g. engine iterations) from the newest
            timing an older one still counts (>= 0).

    Raises:
        ValueError: window < 1 or horizon < 0.
    """

    def __init__(self, window: int = 16, horizon: int = 64):
        if window < 1 or horizon < 0:
            raise ValueError(f"window must be >= 1 and horizon >= 0, got {window} / {horizon}")
        self.horizon = horizon
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)

    def add(self, tick: int, seconds: float) -> None:
        """One timing of `seconds`, taken at `tick` (ticks never decrease)."""
        self._samples.append((tick, seconds))

    def __len__(self) -> int:
        """Timings that count now (those within `horizon` of the newest)."""
        if not self._samples:
            return 0
        newest = self._samples[-1][0]
        return sum(1 for t, _ in self._samples if newest - t <= self.horizon)

    def estimate(self) -> float | None:
        """Seconds the work costs: the least timing that counts (None before any)."""
        if not self._samples:
            return None
        newest = self._samples[-1][0]
        return min(s for t, s in self._samples if newest - t <= self.horizon)
