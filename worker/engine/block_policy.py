"""The block size of each batched DFlash iteration, from measured costs at this batch size and context.

Model (after Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative
Decoding", ICML, §3.1): row r commits on average E_r(L) tokens per iteration at block size L
(accepted drafts + the bonus, `Acceptance.expected`), and the batch commits sum_r E_r(L) tokens
in c(L | B, context) seconds, the measured wall time of one iteration (draft forward + verify of
B x L tokens + the host sync). The policy picks L* = argmax_L sum_r E_r(L) / c(L), and plain
steps (L = 1) whenever R(L*) < min_gain * R(1).

Why measured per batch size: a verify of B x L tokens costs about one decode step while the
device is bound by reading the weights (small B x L), then grows with B x L once it is bound by
arithmetic; on a CPU it grows almost linearly from the start. vLLM turns speculation off above a
batch size for the same reason (`speculative_disable_by_batch_size`). Costs are kept per
(batch-size bucket, context bucket, L), buckets being powers of two, each the least of its recent
timings (worker/engine/timings.py: a host busy with other work only adds time, and a mean would
let one plain step that waited for a CPU make speculation look cheap, then keep it chosen since
plain steps would no longer be timed); plain steps are timed `min_plain_samples` times in a
bucket before any size is weighed against them. An L not measured
in a bucket is explored (its first sample dropped as warm-up: graph set-up, kernel compiles) in
increasing order while it or a larger size could still pay (`choose`), and from time to time
(`explore_every` iterations, doubling while the choice holds) the policy re-measures a
neighbouring size (while plain, the speculative size that could pay most) so the estimates
follow the context and the rows' acceptance.

A DFlash draft's acceptance is not geometric: the draft is right in bursts (a row that keeps its
first drafts tends to keep many), so the chance of keeping draft i given drafts 0..i-1 were kept
rises with i, and a rate fitted from short blocks underestimates what a long block commits. Each
row's `Acceptance` therefore keeps decayed counts per draft position (a censored estimate: a
cycle that rejected at position j says nothing of the positions after j) and E_r(L) is the sum
over k < L of prod_{i<k} h_r,i, h_r,i the row's conditional acceptance at position i. A position
the row has not verified yet takes the previous position's rate as its prior, so before any long
block ran, E_r(L) is the geometric curve of the short blocks' rate; `choose` measures an unknown
size when an optimistic E_r(L) (the rates of positions not verified yet raised by one standard
deviation of their prior) could pay, so a good draft is measured at long blocks even where short ones do not pay (a device whose
verify of 16 tokens costs what one of 2 costs), and a draft rarely right is never run at long
blocks.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

from worker.engine.timings import RecentTimings

RATIO_DECAY = 0.7  # weight of the old mean in each cross-bucket cost ratio c(L) / c(1)


class Acceptance:
    """A row's (or the worker's) acceptance by draft position, from decayed counts.

    Position i (0 = the first draft token) counts the cycles that verified it (`reached`: every
    earlier draft was kept and the block had a draft at i) and those that kept it (`passed`).
    Its conditional acceptance is the posterior mean (passed_i + w p_i) / (reached_i + w), where
    the prior p_i is `prior[i]`, or past the prior's end the estimate at position i - 1.

    Args:
        prior: prior conditional acceptance by position, each in [0, 1] (the last one is extended
            by the estimates themselves); default [0.5].
        weight: the prior's weight w, in cycles (> 0).
        decay: weight of a position's old counts each time a cycle reaches it, [0, 1).

    Raises:
        ValueError: weight <= 0, a prior outside [0, 1], decay outside [0, 1).
    """

    def __init__(self, prior: Sequence[float] = (0.5,), weight: float = 2.0, decay: float = 0.95):
        if weight <= 0 or not 0 <= decay < 1 or not prior or any(not 0 <= p <= 1 for p in prior):
            raise ValueError(f"bad acceptance prior {list(prior)} / weight {weight} / decay {decay}")
        self.prior = [float(p) for p in prior]
        self.weight = float(weight)
        self.decay = decay
        self.reached: list[float] = []
        self.passed: list[float] = []
        self._curves: dict[tuple[int, bool], list[float]] = {}  # (L_max, optimistic) -> E(1..L_max)

    @classmethod
    def known(cls, rate: float) -> "Acceptance":
        """A row that keeps each draft with probability `rate` (geometric acceptance), known for
        certain (simulations and tests)."""
        return cls([rate], weight=1e12)

    def observe(self, drafted: int, accepted: int) -> None:
        """One cycle: its first `accepted` of `drafted` draft tokens kept."""
        self._curves.clear()
        for i in range(min(accepted + 1, drafted)):
            if i == len(self.reached):
                self.reached.append(0.0)
                self.passed.append(0.0)
            self.reached[i] = self.reached[i] * self.decay + 1.0
            self.passed[i] = self.passed[i] * self.decay + (1.0 if i < accepted else 0.0)

    def rates(self, n: int, optimistic: bool = False) -> list[float]:
        """Conditional acceptance at positions 0..n-1: posterior means; `optimistic`: a position
        with less than one cycle's weight of its own counts raised by one standard deviation of its
        prior (w pseudo-cycles at its mean)."""
        out, prev = [], self.prior[0]
        for i in range(n):
            p = self.prior[i] if i < len(self.prior) else prev
            seen = self.reached[i] if i < len(self.reached) else 0.0
            kept = self.passed[i] if i < len(self.passed) else 0.0
            m = (kept + self.weight * p) / (seen + self.weight)
            prev = m
            if optimistic and seen < 1.0:  # never (or long not) verified: its prior could be low
                m = min(1.0, m + math.sqrt(m * (1.0 - m) / (self.weight + 1.0)))
            out.append(m)
        return out

    def expected(self, L: int, optimistic: bool = False) -> float:
        """E(L): mean tokens a block of L commits (bonus included), >= 1."""
        return self.curve(L, optimistic)[L - 1]

    def curve(self, L_max: int, optimistic: bool = False) -> list[float]:
        """[E(1), .., E(L_max)] (kept until the next `observe`: the policy reads it every
        iteration)."""
        key = (L_max, optimistic)
        if key not in self._curves:
            out, total, survive = [1.0], 1.0, 1.0
            for r in self.rates(max(0, L_max - 1), optimistic):
                survive *= r
                total += survive
                out.append(total)
            self._curves[key] = out
        return self._curves[key]

    def as_prior(self, n: int, weight: float = 2.0) -> "Acceptance":
        """A new row's acceptance whose prior is this one's estimates at positions 0..n-1."""
        return Acceptance(self.rates(max(1, n)), weight=weight)


CONTEXT_FLOOR = 256  # the smallest context bucket of measured iteration costs, tokens


def pow2_bucket(n: int, floor: int = 1) -> int:
    """The power-of-two bucket of `n` (its upper bound), at least `floor`."""
    return max(floor, 1 << max(0, int(n) - 1).bit_length())


class BatchBlockPolicy:
    """Chooses each batched DFlash iteration's block size from measured iteration costs.

    Args:
        max_block: the draft's trained block size B (largest L).
        min_gain: speculate only when the best block's expected tokens/s is at least this
            multiple of plain steps'.
        cost_window: each cost is the least of this many recent timings of its size (those
            within `cost_horizon` iterations of its newest one).
        cost_horizon: iterations; see `cost_window`.
        min_plain_samples: plain steps timed in a bucket (within the horizon) before a block
            size is weighed against them.
        explore_every: iterations to the first re-measurement of a size other than the choice;
            the interval doubles while the choice holds (up to 16x) and resets when it moves.

    Raises:
        ValueError: max_block < 1, cost_window < 1, cost_horizon < 0 or min_plain_samples outside
            [1, cost_window].
    """

    def __init__(self, max_block: int, min_gain: float = 1.05, cost_window: int = 16, cost_horizon: int = 64,
                 min_plain_samples: int = 8, explore_every: int = 64):
        if max_block < 1:
            raise ValueError("max_block must be >= 1")
        if cost_window < 1 or cost_horizon < 0 or not 1 <= min_plain_samples <= cost_window:
            raise ValueError("cost_window >= 1, cost_horizon >= 0 and 1 <= min_plain_samples <= cost_window")
        self.candidates = sorted({1, max_block, *(c for c in (2, 4, 8) if c < max_block)})
        self.min_gain = min_gain
        self.cost_window, self.cost_horizon = cost_window, cost_horizon
        self.min_plain_samples = min_plain_samples
        self.explore_every = explore_every
        self._timings: dict[tuple[int, int], dict[int, RecentTimings]] = {}
        self._costs: dict[tuple[int, int], dict[int, float]] = {}  # the timings' estimates
        self._seeded: set[tuple[int, int]] = set()  # buckets whose plain cost warm-up measured
        self._seen: dict[tuple[int, int, int], int] = {}
        self._ratios: dict[int, float] = {}  # L -> c(L) / c(1), from the buckets that measured both
        self._iterations = 0
        self._explore_turn = 0
        self._gap = explore_every  # iterations to the next re-measurement; doubles while the choice holds
        self._next_explore = explore_every
        self._last_best: Optional[int] = None

    @staticmethod
    def key(batch_size: int, context: int) -> tuple[int, int]:
        """(batch-size bucket, context bucket) that costs are kept under."""
        return pow2_bucket(batch_size), pow2_bucket(context, CONTEXT_FLOOR)

    def cost(self, batch_size: int, context: int, L: int) -> Optional[float]:
        """Estimated seconds of an iteration at block size L (None: never measured in this bucket)."""
        return self._costs.get(self.key(batch_size, context), {}).get(L)

    def observe(self, batch_size: int, context: int, L: int, seconds: float) -> None:
        """The wall time of one iteration run at block size L (the first one per bucket and size
        is dropped: warm-up)."""
        k = self.key(batch_size, context)
        seen = self._seen.get((*k, L), 0)
        self._seen[(*k, L)] = seen + 1
        if seen == 0:
            return
        self._record(k, L, seconds)

    def seed(self, batch_size: int, context: int, L: int, seconds: float) -> None:
        """An iteration cost measured before serving, with its kernels already compiled (the
        worker's shape warm-up, worker/engine/warm.py): kept as a measurement, the bucket's next
        iteration at this size is not dropped as a warm-up, and a seeded plain cost is weighed
        without waiting for `min_plain_samples` timings."""
        k = self.key(batch_size, context)
        self._seen[(*k, L)] = max(1, self._seen.get((*k, L), 0))
        if L == 1:
            self._seeded.add(k)
        self._record(k, L, seconds)

    def _record(self, k: tuple[int, int], L: int, seconds: float) -> None:
        timings = self._timings.setdefault(k, {})
        if L not in timings:
            timings[L] = RecentTimings(self.cost_window, self.cost_horizon)
        timings[L].add(self._iterations, seconds)
        costs = self._costs.setdefault(k, {})
        costs[L] = timings[L].estimate()
        if L != 1 and 1 in costs:  # how much dearer than a plain step this size is, for other buckets
            ratio = costs[L] / costs[1]
            old = self._ratios.get(L)
            self._ratios[L] = ratio if old is None else RATIO_DECAY * old + (1 - RATIO_DECAY) * ratio

    def _cost_bound(self, costs: dict[int, float], L: int) -> float:
        """A lower bound of c(L) in a bucket with these measured costs (`choose`)."""
        below = sorted(c for c in costs if c < L)
        bound = max(costs[c] for c in below)
        bound = max([bound] + [costs[1] * r for c, r in self._ratios.items() if c <= L])
        spec = [c for c in below if c > 1]
        if len(spec) >= 2:
            a, b = spec[-2:]
            bound = max(bound, costs[b] + (costs[b] - costs[a]) / (b - a) * (L - b))
        return bound

    def choose(self, acceptance: Sequence[Acceptance], context: int, max_useful: int) -> int:
        """The block size of the next iteration.

        Sizes not measured in this bucket are measured smallest first, each when it or a larger
        size could pay: c(L) is bounded from below by the dearest measured smaller size, by its
        cost relative to a plain step where other buckets measured it, and by the line through
        the two largest measured sizes below it (an iteration's cost is flat while the device
        reads weights, then grows with L: convex, so the line stays under it), and by the cost
        relative to a plain step that other buckets measured for it or a smaller size; a size could pay
        when the rows' optimistic E_r(L) over that bound reaches both min_gain x R(1) and the best
        measured rate. So a draft rarely right is probed at small blocks and then left alone,
        sizes whose cost grows with L (a CPU) stop being probed early, and a good draft is
        measured at long blocks even where short ones do not pay (a verify of 16 tokens costing
        what one of 2 costs).

        Args:
            acceptance: each row's `Acceptance`.
            context: the longest row's committed tokens.
            max_useful: the largest L any row can still use (its remaining tokens).
        """
        self._iterations += 1
        cands = [c for c in self.candidates if c <= max(1, max_useful)] or [1]
        k = self.key(len(acceptance), context)
        costs = self._costs.get(k, {})
        if 1 not in costs or (k not in self._seeded and len(self._timings[k][1]) < self.min_plain_samples):
            return 1  # too few plain timings to weigh anything against
        means = [a.curve(cands[-1]) for a in acceptance]
        tokens = {c: sum(m[c - 1] for m in means) for c in cands}  # sum_r E_r(c)
        hopes: Optional[dict[int, float]] = None
        plain = len(acceptance) / costs[1]
        rates = {1: plain}
        for c in cands[1:]:
            if c in costs:
                rates[c] = tokens[c] / costs[c]
                continue
            if hopes is None:
                curves = [a.curve(cands[-1], optimistic=True) for a in acceptance]
                hopes = {d: sum(h[d - 1] for h in curves) for d in cands}
            goal = max(self.min_gain * plain, max(rates.values()))
            if any(hopes[d] / self._cost_bound(costs, d) >= goal for d in cands if d >= c):
                return c  # it or a larger size could pay: measure it in this bucket
        best = max(rates, key=rates.get)
        if best != 1 and rates[best] < self.min_gain * plain:
            best = 1
        if best != self._last_best:  # the choice moved: watch it closely again
            self._last_best, self._gap = best, self.explore_every
            self._next_explore = self._iterations + self._gap
        if self.explore_every and self._iterations >= self._next_explore and len(cands) > 1:
            # Re-measure a neighbour of the choice so the estimates follow a growing context; while
            # the choice holds, the next re-measurement comes twice as late (at most 16x).
            self._gap = min(16 * self.explore_every, 2 * self._gap)
            self._next_explore = self._iterations + self._gap
            if best == 1 and len(rates) > 1:
                # Plain steps learn nothing of the drafts: re-measure the size that could pay most,
                # so rows whose acceptance dipped are seen again at the blocks that need it.
                curves = [a.curve(cands[-1], optimistic=True) for a in acceptance]
                return max((c for c in rates if c > 1), key=lambda c: sum(h[c - 1] for h in curves) / costs[c])
            i = cands.index(best)
            self._explore_turn += 1
            return cands[i + 1] if (self._explore_turn % 2 and i + 1 < len(cands)) or i == 0 else cands[i - 1]
        return best
