"""When speculation stops paying: choose the block size, or plain decoding, from measurements.

The model (Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative
Decoding", ICML, §3.1 eq. (1) and §3.4): if each drafted token is accepted with probability `a`,
independently, and acceptance stops at the first rejection, a cycle that drafts k = B - 1 tokens
commits on average

    E[n | B] = (1 - a^B) / (1 - a)          tokens  (accepted prefix + the target's bonus token;
                                                      = B when a = 1, = 1 for B = 1)

and costs c(B) = draft_s(B) + verify_s(B) seconds. Expected throughput is R(B) = E[n | B] / c(B)
tokens/s. Plain decoding is the case B = 1: E = 1, c(1) = one decode step. The decision is
B* = argmax_B R(B) over the candidate sizes, and plain decoding whenever
R(B*) < min_gain * R(1).

Why costs are measured per session instead of assumed: on the H200 (MLX CUDA, bf16;
/work/shared/research/h200-costs.md) verifying 16 tokens costs about one decode step at 512
tokens of context (1.5B model: 6.99 vs 6.41 ms) but twice one at 8K context (12.84 vs 6.27 ms),
and on CPUs verify cost grows about linearly with the block. A fixed cost ratio would pick the
wrong block on one of them; the measured curve does not.

Estimating `a`: acceptance is a prefix, so a cycle with k drafts and j accepted is a truncated
geometric observation (j successes, plus one failure when j < k). The maximum-likelihood estimate
is a = S / (S + F) with S = sum j and F = number of cycles with j < k. Both counts decay by
`decay` per observed cycle (a window of about 1 / (1 - decay) cycles), so `a` follows the session
(code vs prose, a growing context). The i.i.d. assumption is Leviathan's; DFlash acceptance falls
with the position in the block, which makes E[n | B] slightly optimistic for large B, and the
measured costs keep that error from compounding.

Costs: exponentially weighted means of measured cycle times per block size (the first
measurement of each size is dropped as warm-up: lazy graph set-up, kernel compilation). Sizes not
measured yet are interpolated linearly between measured ones and held flat outside them.

Everything here is plain Python (no MLX): `CostModel` holds the estimates and decides;
`AdaptiveBlockPolicy` adds the schedule (what to time, when to explore, when to probe while
decoding plainly) for `worker.spec.dflash.dflash_generate`.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class Decision:
    """Result of `CostModel.decide`.

    Attributes:
        block_size: chosen block size B (1 = plain decoding).
        tokens_per_s: expected throughput of the choice.
        plain_tokens_per_s: expected throughput of plain decoding (None when c(1) is unknown).
        acceptance_rate: the `a` the decision used.
    """

    block_size: int
    tokens_per_s: Optional[float]
    plain_tokens_per_s: Optional[float]
    acceptance_rate: float


class CostModel:
    """Acceptance and cost estimates of one session, and the block-size decision.

    Args:
        prior_acceptance: `a` before any observation.
        prior_weight: pseudo-observations (cycles) behind the prior.
        decay: per-cycle decay of the acceptance counts, in (0, 1].
        cost_decay: weight of the old mean in the per-size cost average, in [0, 1).
        min_gain: speculate only when R(B*) >= min_gain * R(1).
        cost_window: 0: costs are exponentially weighted means (`cost_decay`); n > 0: the
            median of the last n cycles per size (robust to single slow cycles; simulated no
            better than the mean under spikes or drift, so not the policy's default).
        optimism: z >= 0; the speculate-or-plain test evaluates R(B*) at acceptance
            a + z * sqrt(a (1 - a) / n), n = S + F, the decayed counts (`acceptance_bound`), so
            it falls back to plain decoding only when speculation loses by a margin. With decay
            n levels off (at about 1 / (1 - decay) cycles' worth), so the margin is a lasting
            one, not one that shrinks with evidence, and it is wider than z standard errors of
            the decayed estimate (whose effective sample is about (1 + decay) / (1 - decay)
            cycles): z was tuned by simulation, not derived. The choice among block sizes uses
            `a` itself.

    Raises:
        ValueError: prior_acceptance, decay or cost_decay out of range.
    """

    def __init__(
        self,
        prior_acceptance: float = 0.5,
        prior_weight: float = 2.0,
        decay: float = 0.9,
        cost_decay: float = 0.7,
        min_gain: float = 1.05,
        cost_window: int = 0,
        optimism: float = 0.0,
    ):
        if not 0.0 <= prior_acceptance <= 1.0:
            raise ValueError("prior_acceptance must be in [0, 1]")
        if not 0.0 < decay <= 1.0 or not 0.0 <= cost_decay < 1.0:
            raise ValueError("decay must be in (0, 1] and cost_decay in [0, 1)")
        self.decay = decay
        self.cost_decay = cost_decay
        self.min_gain = min_gain
        self._succ = prior_acceptance * prior_weight
        self._fail = (1.0 - prior_acceptance) * prior_weight
        self.cost_window = max(0, int(cost_window))
        self.optimism = float(optimism)
        self._cost: dict[int, float] = {}
        self._seen: dict[int, int] = {}  # measurements this session, warm-up included
        self._kept: dict[int, int] = {}  # measurements behind the estimate (seeded ones included)
        self._recent: dict[int, list] = {}

    # -- observations ----------------------------------------------------------------------
    def observe_cycle(self, drafted: int, accepted: int) -> None:
        """One verify outcome: `accepted` of `drafted` draft tokens kept (0 <= accepted <= drafted)."""
        if drafted <= 0:
            return
        self._succ = self._succ * self.decay + accepted
        self._fail = self._fail * self.decay + (1.0 if accepted < drafted else 0.0)

    def observe_cost(self, block_size: int, seconds: float) -> bool:
        """Measured wall time of one cycle (draft + verify) at `block_size`; B = 1 is a plain step.
        Returns whether it was kept (False for the warm-up measurement of a size)."""
        n = self._seen.get(block_size, 0)
        self._seen[block_size] = n + 1
        if n == 0:
            return False  # warm-up measurement (also after seeding: it may hold a kernel compile)
        self._kept[block_size] = self._kept.get(block_size, 0) + 1
        if self.cost_window:
            recent = self._recent.setdefault(block_size, [])
            recent.append(seconds)
            del recent[:-self.cost_window]
            self._cost[block_size] = statistics.median(recent)
            return True
        old = self._cost.get(block_size)
        w = self.cost_decay
        self._cost[block_size] = seconds if old is None else w * old + (1 - w) * seconds
        return True

    def seed_cost(self, block_size: int, seconds: float, samples: int) -> None:
        """Starts `block_size` as measured: cost `seconds` counts as `samples` kept measurements
        (so the policy does not explore it), e.g. from a worker's `CostMemory`. The session's own
        first measurement of the size is still dropped as warm-up (a kernel compile on CUDA at
        a new shape); later ones update the cost as usual."""
        self._cost[block_size] = seconds
        self._kept[block_size] = max(self._kept.get(block_size, 0), samples)
        if self.cost_window:
            self._recent[block_size] = [seconds]

    def samples(self, block_size: int) -> int:
        """Cost measurements kept for `block_size` (warm-up excluded)."""
        return self._kept.get(block_size, 0)

    # -- estimates -------------------------------------------------------------------------
    @property
    def acceptance_rate(self) -> float:
        """a = S / (S + F): the decayed maximum-likelihood estimate of per-token acceptance."""
        total = self._succ + self._fail
        return self._succ / total if total > 0 else 0.0

    def expected_tokens(self, block_size: int, a: Optional[float] = None) -> float:
        """E[n | B] = (1 - a^B) / (1 - a): committed tokens per cycle of block size B."""
        a = self.acceptance_rate if a is None else a
        if a >= 1.0:
            return float(block_size)
        return (1.0 - a**block_size) / (1.0 - a)

    def cycle_cost(self, block_size: int) -> Optional[float]:
        """Seconds per cycle at B: measured, interpolated, or held flat; None with no data."""
        if block_size in self._cost:
            return self._cost[block_size]
        spec = sorted(b for b in self._cost if b > 1)
        if block_size == 1 or not spec:
            return None
        lo = [b for b in spec if b < block_size]
        hi = [b for b in spec if b > block_size]
        if not lo:
            return self._cost[hi[0]]
        if not hi:
            return self._cost[lo[-1]]
        b0, b1 = lo[-1], hi[0]
        w = (block_size - b0) / (b1 - b0)
        return (1 - w) * self._cost[b0] + w * self._cost[b1]

    def throughput(self, block_size: int) -> Optional[float]:
        """R(B) = E[n | B] / c(B) in tokens/s; None while c(B) is unknown."""
        c = self.cycle_cost(block_size)
        return None if not c else self.expected_tokens(block_size) / c

    def acceptance_bound(self) -> float:
        """a + optimism * sqrt(a (1 - a) / n) over the decayed counts n = S + F: the acceptance
        the speculate-or-not test uses, so one noisy dip does not switch to plain decoding."""
        a, n = self.acceptance_rate, self._succ + self._fail
        if not self.optimism or n <= 0:
            return a
        return min(1.0, a + self.optimism * (a * (1.0 - a) / n) ** 0.5)

    def decide(self, candidates: Sequence[int]) -> Decision:
        """Best block size among `candidates` (1 = plain); the largest one while nothing is measured.

        B* maximizes R(B) at the estimated `a`; plain decoding wins when R(B*), evaluated at
        `acceptance_bound()` when `optimism` is set, is below min_gain * R(1).
        """
        a = self.acceptance_rate
        plain = self.throughput(1) if 1 in candidates else None
        best, best_r = None, None
        for b in candidates:
            if b <= 1:
                continue
            r = self.throughput(b)
            if r is not None and (best_r is None or r > best_r):
                best, best_r = b, r
        if best is None:
            spec = [b for b in candidates if b > 1]
            return Decision(max(spec) if spec else 1, None, plain, a)
        bound_r = best_r
        if self.optimism and plain is not None:
            bound_r = self.expected_tokens(best, self.acceptance_bound()) / self.cycle_cost(best)
        if plain is not None and bound_r < self.min_gain * plain:
            return Decision(1, plain, plain, a)
        return Decision(best, best_r, plain, a)


# The policy's acceptance window (~10 cycles), plain-mode probe interval (8 steps) and optimism
# (plain decoding only when speculation loses even at acceptance + 1.5 sqrt(a (1 - a) / n), see
# `CostModel`), chosen by
# simulating the fifth H200 session's costs (plain step 5.57 ms, cycles 9.0-9.8 ms for B = 2-16)
# with geometric acceptance p (`python bench/bench_block_policy.py`, docs/benchmarks.md). Without
# the optimism a noisy dip of the estimate sends the policy to plain decoding, where only the
# probes bring new evidence, so it stays there long: at p = 0.565 (tau 2.3; fixed B = 16 at 236
# tok/s, plain at 180) it spent 28% of its cycles in plain steps and reached 226 tok/s (window ~20
# cycles), 187 (window 10, probe every 32). With it: 237, and at p = 0.45, where speculation barely
# pays, 191 (fixed 187, plain 180); a useless draft (p = 0.2) still falls back (170; fixed 129),
# and a collapse of acceptance (0.9 -> 0) turns it to plain after about 25 cycles.
POLICY_ACCEPTANCE_DECAY = 0.9
POLICY_OPTIMISM = 1.5


CONTEXT_BUCKET_MIN = 512  # tokens; the H200's costs barely move below 4K (h200-costs.md)


def context_bucket(context_tokens: int) -> int:
    """The context-length bucket a cycle cost is kept under: the smallest power of two >= the
    context (tokens in the KV cache), at least `CONTEXT_BUCKET_MIN`."""
    return max(CONTEXT_BUCKET_MIN, 1 << max(int(context_tokens) - 1, 0).bit_length())


class CostMemory:
    """Cycle costs per block size and context length shared by the sessions of one worker (one
    target and draft on one machine), so a new session starts from them instead of trying every
    block size first.

    Why: costs belong to the machine, the models and the context length, acceptance to the
    session. A fresh policy spends its first cycles measuring every candidate size (3 cycles
    each), which is a large part of a short generation: simulated over 30-cycle generations on the
    H200's costs (`python bench/bench_block_policy.py --short 30`, docs/benchmarks.md), policies
    sharing a memory ran at 288 tok/s against 271 cold at p = 0.65 (fixed block 293) and fell back
    from a useless draft (p = 0.05) at 158 against 141 (plain 180).

    Why per context length: verifying a block costs more as the KV cache grows, a plain step
    hardly more (H200, 1.5B target: 16 tokens 7.0 ms at 512 tokens of context and 12.8 ms at 8K,
    one token 6.4 and 6.3 ms; /work/shared/research/h200-costs.md), so the best block differs
    between a short and a long session, and one memory for both would seed each with the other's
    costs (`python bench/bench_block_policy.py --short 30 --mixed`, docs/benchmarks.md).
    Costs are kept per `context_bucket` (powers of two from 512 tokens); a session is seeded from
    the nearest bucket that has a size (the longer one on a tie).

    Every cycle cost a policy keeps (not a size's first, warm-up measurement in a session: on
    CUDA it may include a kernel compile) updates an exponentially weighted mean per bucket and
    size here.

    Args:
        decay: weight of the old mean, in [0, 1).

    Raises:
        ValueError: decay out of range.
    """

    def __init__(self, decay: float = 0.9):
        if not 0.0 <= decay < 1.0:
            raise ValueError("decay must be in [0, 1)")
        self.decay = decay
        self.buckets: dict[int, dict[int, float]] = {}  # context bucket -> {block size: seconds}

    def observe(self, block_size: int, seconds: float, context_tokens: int = 0) -> None:
        """One cycle's wall time at `block_size` (1 = a plain step), seconds, with
        `context_tokens` tokens in the target's KV cache."""
        costs = self.buckets.setdefault(context_bucket(context_tokens), {})
        old = costs.get(block_size)
        costs[block_size] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

    def costs_at(self, context_tokens: int = 0) -> dict[int, float]:
        """{block size: seconds} for a session at `context_tokens`: each size from the nearest
        bucket that has it (distance in powers of two; the longer context on a tie)."""
        here = context_bucket(context_tokens).bit_length()
        out: dict[int, tuple[int, float]] = {}  # size -> (rank of its bucket, cost)
        for bucket, costs in self.buckets.items():
            rank = 2 * abs(bucket.bit_length() - here) - (bucket.bit_length() > here)
            for b, c in costs.items():
                if b not in out or rank < out[b][0]:
                    out[b] = (rank, c)
        return {b: c for b, (_, c) in out.items()}

    def clear(self) -> None:
        """Forgets every cost (the worker's warm-up requests are no request's)."""
        self.buckets.clear()


class AdaptiveBlockPolicy:
    """Schedule around `CostModel`: which block size to run next and whether to time it.

    Costs come from each cycle's own wall time as it normally runs: a plain step, or a
    speculative cycle whose draft was queued before the previous Step was handed out (one host
    sync). A "timed" cycle is timed apart (draft and verify, an extra sync, no draft queued
    ahead) for the metrics only: it runs slower than the cycles the model predicts, so its time
    is not fed to the model (the first H200 runs fed it, and the policy then chose plain decoding
    with a draft that beat it by 1.3x). While a candidate size has fewer than `min_samples`
    kept measurements it is explored (largest first), afterwards the chosen size is timed apart
    every `time_every` cycles and one other candidate is run every `explore_every` cycles. While
    decoding plainly, a speculative probe runs every `probe_every` steps so the acceptance
    estimate stays current.

    Args:
        max_block_size: the draft's block size (trained B); larger blocks are never tried.
        candidates: block sizes to choose from, default (1, 2, 4, 8, 16) capped at the maximum,
            plus the maximum itself. 1 (plain) is always included.
        model: the CostModel (default: a fresh one with decay `POLICY_ACCEPTANCE_DECAY` and
            optimism `POLICY_OPTIMISM`).
        min_samples: kept cost measurements per size before exploring stops.
        time_every: time the chosen size's draft and verify apart every n-th cycle (for the
            metrics; 0, the default: never, as the worker runs without `spec_timing_sync`, which
            passes 8). Until 2026-12-01 the default was 8, so the benchmark's and the
            simulation's policy paid a cycle timed apart (1.28x on the H200) every 8 cycles that
            the worker's did not.
        explore_every: run one other candidate every n-th cycle, to keep its cost current.
        probe_every: while decoding plainly, one speculative cycle every n plain steps.
        memory: a worker's `CostMemory`: the sizes it knows start measured (no exploration), and
            every cost this policy measures goes into it.
        context_tokens: the session's context when it starts (its prompt, tokens): which of the
            memory's context buckets seeds the costs.

    Raises:
        ValueError: max_block_size < 1.

    Usage:
        bs, timed = policy.next_block_size()
        ... run a cycle at bs (draft and verify timed apart when `timed`) ...
        policy.observe(bs, drafted, accepted, None if timed else cycle_seconds)
    """

    def __init__(
        self,
        max_block_size: int,
        candidates: Optional[Sequence[int]] = None,
        model: Optional[CostModel] = None,
        *,
        min_samples: int = 2,
        time_every: int = 0,
        explore_every: int = 64,
        probe_every: int = 8,
        memory: Optional[CostMemory] = None,
        context_tokens: int = 0,
    ):
        if max_block_size < 1:
            raise ValueError("max_block_size must be >= 1")
        base = candidates if candidates is not None else (2, 4, 8, 16)
        self.candidates = sorted({1, max_block_size, *(b for b in base if 1 <= b <= max_block_size)})
        self.model = model or CostModel(decay=POLICY_ACCEPTANCE_DECAY, optimism=POLICY_OPTIMISM)
        self.min_samples = min_samples
        self.time_every = max(0, time_every)
        self.explore_every = max(1, explore_every)
        self.probe_every = max(1, probe_every)
        self._cycles = 0
        self._plain_run = 0
        self._explore_idx = 0
        self.memory = memory
        if memory is not None:
            known = memory.costs_at(context_tokens)
            for b in self.candidates:
                if b in known:
                    self.model.seed_cost(b, known[b], min_samples)
        self.decision = self.model.decide(self.candidates)

    def next_block_size(self) -> tuple[int, bool]:
        """(block size for the next cycle, whether to time its draft and verify apart)."""
        m = self.model
        if len(self.candidates) == 1:
            return 1, True
        for b in reversed(self.candidates):  # explore: every size needs measurements
            if m.samples(b) < self.min_samples:
                return b, b == 1
        self.decision = d = m.decide(self.candidates)
        if d.block_size == 1:
            if self._plain_run >= self.probe_every:
                spec = [b for b in self.candidates if b > 1]
                best = max(spec, key=lambda b: m.throughput(b) or 0.0)
                self._plain_run = 0
                return best, False
            return 1, True
        if self._cycles % self.explore_every == self.explore_every - 1:
            others = [b for b in self.candidates if b != d.block_size]
            self._explore_idx = (self._explore_idx + 1) % len(others)
            b = others[self._explore_idx]
            return b, b == 1
        return d.block_size, self.time_every > 0 and self._cycles % self.time_every == 0

    def observe(self, block_size: int, drafted: int, accepted: int, seconds: Optional[float],
                context_tokens: int = 0) -> None:
        """Feeds one cycle: drafted/accepted counts, its wall time as it normally runs (None for
        a cycle timed apart, or when unknown) and the context it ran at (tokens in the target's
        KV cache, for the memory's bucket)."""
        self._cycles += 1
        self._plain_run = self._plain_run + 1 if drafted == 0 else 0
        self.model.observe_cycle(drafted, accepted)
        if seconds is not None and self.model.observe_cost(block_size, seconds) and self.memory is not None:
            self.memory.observe(block_size, seconds, context_tokens)
