"""The block size of each batched DFlash iteration, from measured costs at this batch size and context.

Model (Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative
Decoding", ICML, §3.1 eq. (1)): a row whose drafted tokens are each accepted with probability
a_r, acceptance stopping at the first rejection, commits on average

    E_r(L) = (1 - a_r^L) / (1 - a_r)      tokens per iteration at block size L (= L when a_r = 1)

and the batch commits sum_r E_r(L) tokens in c(L | B, context) seconds, the measured wall time of
one iteration (draft forward + verify of B x L tokens + the host sync). The policy picks
L* = argmax_L sum_r E_r(L) / c(L), and plain steps (L = 1) whenever R(L*) < min_gain * R(1).

Why measured per batch size: a verify of B x L tokens costs about one decode step while the
device is bound by reading the weights (small B x L), then grows with B x L once it is bound by
arithmetic; on a CPU it grows almost linearly from the start. vLLM turns speculation off above a
batch size for the same reason (`speculative_disable_by_batch_size`). Costs are exponential
means per (batch-size bucket, context bucket, L), buckets being powers of two; an L not measured
in a bucket is explored (its first sample dropped as warm-up: graph set-up, kernel compiles) in
increasing order while it could still pay (`choose`), and from time to time (`explore_every`
iterations, doubling while the choice holds) the policy re-measures a neighbouring size so the
estimates follow the context as it grows.

Acceptance a_r comes from each row's own decayed counts (`Acceptance`): a truncated geometric
observation per cycle (j successes, plus one failure when j < L - 1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass
class Acceptance:
    """A row's decayed acceptance counts (maximum-likelihood a = succ / (succ + fail)).

    Attributes:
        succ: decayed accepted draft tokens.
        fail: decayed cycles that ended on a rejection.
    """

    succ: float = 1.0
    fail: float = 1.0
    decay: float = 0.9

    def observe(self, drafted: int, accepted: int) -> None:
        """One cycle: `accepted` of `drafted` draft tokens kept."""
        if drafted <= 0:
            return
        self.succ = self.succ * self.decay + accepted
        self.fail = self.fail * self.decay + (1.0 if accepted < drafted else 0.0)

    @property
    def rate(self) -> float:
        return self.succ / (self.succ + self.fail)


def expected_tokens(a: float, L: int) -> float:
    """E(L) = (1 - a^L) / (1 - a): mean tokens committed by a block of L (bonus included)."""
    return float(L) if a >= 1.0 else (1.0 - a ** L) / (1.0 - a)


def pow2_bucket(n: int, floor: int = 1) -> int:
    """The power-of-two bucket of `n` (its upper bound), at least `floor`."""
    return max(floor, 1 << max(0, int(n) - 1).bit_length())


class BatchBlockPolicy:
    """Chooses each batched DFlash iteration's block size from measured iteration costs.

    Args:
        max_block: the draft's trained block size B (largest L).
        min_gain: speculate only when the best block's expected tokens/s is at least this
            multiple of plain steps'.
        cost_decay: weight of the old mean in each cost estimate, [0, 1).
        explore_every: iterations to the first re-measurement of a size other than the choice;
            the interval doubles while the choice holds (up to 16x) and resets when it moves.

    Raises:
        ValueError: max_block < 1.
    """

    def __init__(self, max_block: int, min_gain: float = 1.05, cost_decay: float = 0.7,
                 explore_every: int = 64):
        if max_block < 1:
            raise ValueError("max_block must be >= 1")
        self.candidates = sorted({1, max_block, *(c for c in (2, 4, 8) if c < max_block)})
        self.min_gain = min_gain
        self.cost_decay = cost_decay
        self.explore_every = explore_every
        self._costs: dict[tuple[int, int], dict[int, float]] = {}
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
        return pow2_bucket(batch_size), pow2_bucket(context, 256)

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
        costs = self._costs.setdefault(k, {})
        old = costs.get(L)
        costs[L] = seconds if old is None else self.cost_decay * old + (1 - self.cost_decay) * seconds
        if L != 1 and 1 in costs:  # how much dearer than a plain step this size is, for other buckets
            ratio = costs[L] / costs[1]
            old = self._ratios.get(L)
            self._ratios[L] = ratio if old is None else self.cost_decay * old + (1 - self.cost_decay) * ratio

    def choose(self, acceptance: Sequence[float], context: int, max_useful: int) -> int:
        """The block size of the next iteration.

        Sizes are explored in increasing order, and only while they could pay: an iteration's
        cost does not fall as L grows, so the dearest measured smaller size bounds c(L) from
        below, and a size whose expected tokens over that bound cannot reach min_gain x R(1) is
        not tried (a draft that is rarely right is never run at large blocks). A size measured
        in other buckets but not this one is estimated from there (its cost relative to a plain
        step) and measured here only if that estimate says it pays.

        Args:
            acceptance: each row's acceptance rate a_r in [0, 1].
            context: the longest row's committed tokens.
            max_useful: the largest L any row can still use (its remaining tokens).
        """
        self._iterations += 1
        cands = [c for c in self.candidates if c <= max(1, max_useful)] or [1]
        costs = self._costs.get(self.key(len(acceptance), context), {})
        if 1 not in costs:
            return 1
        plain = len(acceptance) / costs[1]
        floor = costs[1]
        rates = {1: plain}
        for c in cands[1:]:
            bound = sum(expected_tokens(a, c) for a in acceptance) / floor
            if bound < self.min_gain * plain:
                break  # larger blocks gain at most what this one could
            tokens = sum(expected_tokens(a, c) for a in acceptance)
            if c in costs:
                floor = max(floor, costs[c])
                rates[c] = tokens / costs[c]
                continue
            if c not in self._ratios or tokens / (costs[1] * self._ratios[c]) >= self.min_gain * plain:
                return c  # unknown, or estimated to pay: measure it in this bucket
            floor = max(floor, costs[1] * self._ratios[c])
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
            i = cands.index(best)
            self._explore_turn += 1
            return cands[i + 1] if (self._explore_turn % 2 and i + 1 < len(cands)) or i == 0 else cands[i - 1]
        return best
