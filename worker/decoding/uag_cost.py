"""When cross-tokenizer drafting pays: choose the draft length k (or plain decoding) from measurements.

A round cost model for UAG, where the draft runs k *sequential* steps and every round also pays
for translation (CPU) and a draft re-sync. The round model (docs/uag.md, after Leviathan, Kalman & Matias 2023,
"Fast Inference from Transformers via Speculative Decoding", ICML, eq. (1) and Thm 3.8):

    k draft tokens  ->  m ≈ f·k target tokens        f = fertility (target tokens per draft token)
    E[N | m] = (1 − a^(m+1)) / (1 − a)               a = acceptance per proposed TARGET token
    cost(k)  = D(k) + X + V(m)                        seconds
        D(k) = d0 + d1·k      draft: re-sync feed + k sequential steps (measured, linear fit)
        X                     translation both ways, CPU (measured mean)
        V(m) = v0 + v1·(m+1)  target verify of m+1 tokens (measured, linear fit; V(0) = a plain
                              decode step, so plain steps feed the same fit)
    R(k) = E[N | f·k] / cost(k) tokens/s,   R_plain = 1 / V(0)

k* = argmax R(k) over the candidates; plain decoding when R(k*) < min_gain · R_plain. With
d0 = X = v1 = 0 and f = 1 this is Leviathan's S = (1 − a^(k+1)) / ((1 − a)(k·c + 1)), c = d1/v0.
On a CPU v1 > 0 (verify grows with the tokens) and the draft is sequential, so small k usually
wins, and a low `a` (varied prose, a weak draft) makes plain decoding the answer.

Estimating a: a round proposing m target tokens with j accepted is a truncated geometric
observation; a = S / (S + F) with S = Σ j, F = rounds with j < m, both decayed per round.
All of it is plain Python (no MLX).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


class DecayedLine:
    """Exponentially weighted least-squares line y ≈ b0 + b1·x (b1 clamped to >= 0).

    Args:
        decay: weight of the old sums per new point, in (0, 1].
    """

    def __init__(self, decay: float = 0.9):
        self.decay = decay
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.count = 0

    def add(self, x: float, y: float) -> None:
        """Adds the point (x, y) with weight 1, after decaying the older points by `decay`."""
        d = self.decay
        self.w = self.w * d + 1.0
        self.sx = self.sx * d + x
        self.sy = self.sy * d + y
        self.sxx = self.sxx * d + x * x
        self.sxy = self.sxy * d + x * y
        self.count += 1

    def predict(self, x: float) -> Optional[float]:
        """The fitted value at x; the weighted mean while all x are equal; None with no data."""
        if self.w == 0:
            return None
        mx_, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx_ * mx_
        if var <= 1e-12:
            return my
        slope = max(0.0, (self.sxy / self.w - mx_ * my) / var)
        return max(0.0, my + slope * (x - mx_))


@dataclass(frozen=True)
class UagDecision:
    """Result of `UagCostModel.decide`: k (0 = plain decoding) and the estimates behind it.

    Attributes:
        k: draft tokens per round (0 = plain decoding).
        tokens_per_s: expected R(k) of the best speculative k (None while unmeasured).
        plain_tokens_per_s: expected R_plain = 1 / V(0) (None while unmeasured).
        acceptance_rate: the `a` per proposed target token the decision used.
        fertility: the f (target tokens per draft token) it used.
    """

    k: int
    tokens_per_s: Optional[float]
    plain_tokens_per_s: Optional[float]
    acceptance_rate: float
    fertility: float


class UagCostModel:
    """Acceptance, fertility and cost estimates of one session, and the choice of k.

    Args:
        prior_acceptance: a before any observation, in [0, 1].
        prior_weight: pseudo-rounds behind the prior.
        decay: per-round decay of acceptance counts and of the cost fits, in (0, 1].
        min_gain: speculate only when R(k*) >= min_gain · R_plain.

    Raises:
        ValueError: prior_acceptance or decay out of range.
    """

    def __init__(self, prior_acceptance: float = 0.5, prior_weight: float = 2.0, decay: float = 0.9,
                 min_gain: float = 1.05):
        if not 0.0 <= prior_acceptance <= 1.0 or not 0.0 < decay <= 1.0:
            raise ValueError("prior_acceptance must be in [0, 1] and decay in (0, 1]")
        self.decay = decay
        self.min_gain = min_gain
        self._succ = prior_acceptance * prior_weight
        self._fail = (1.0 - prior_acceptance) * prior_weight
        self._fert_num = self._fert_den = 0.0
        self.draft = DecayedLine(decay)  # seconds vs k
        self.verify = DecayedLine(decay)  # seconds vs m + 1
        self._translate = 0.0
        self._translate_n = 0

    # -- observations ----------------------------------------------------------------------
    def observe_round(self, k: int, proposed: int, accepted: int) -> None:
        """One verify outcome: k draft tokens became `proposed` target tokens, `accepted` kept."""
        if k > 0:
            self._fert_num = self._fert_num * self.decay + proposed
            self._fert_den = self._fert_den * self.decay + k
        if proposed > 0:
            self._succ = self._succ * self.decay + accepted
            self._fail = self._fail * self.decay + (1.0 if accepted < proposed else 0.0)

    def observe_costs(self, k: int, proposed: int, draft_s: float, translate_s: float,
                      verify_s: float) -> None:
        """Measured times of one round, seconds (k = 0 for a plain step: only verify_s counts)."""
        self.verify.add(proposed + 1, verify_s)
        if k > 0:
            self.draft.add(k, draft_s)
            w = 0.8 if self._translate_n else 0.0
            self._translate = w * self._translate + (1 - w) * translate_s
            self._translate_n += 1

    # -- estimates -------------------------------------------------------------------------
    @property
    def acceptance_rate(self) -> float:
        """a = S / (S + F): the decayed estimate of acceptance per proposed target token."""
        total = self._succ + self._fail
        return self._succ / total if total > 0 else 0.0

    @property
    def fertility(self) -> float:
        """Target tokens per draft token (1.0 before any round)."""
        return self._fert_num / self._fert_den if self._fert_den > 0 else 1.0

    def expected_tokens(self, proposed: float, a: Optional[float] = None) -> float:
        """E[N | m] = (1 − a^(m+1)) / (1 − a): committed tokens of a round proposing m."""
        a = self.acceptance_rate if a is None else a
        if a >= 1.0:
            return proposed + 1.0
        return (1.0 - a ** (proposed + 1.0)) / (1.0 - a)

    def round_cost(self, k: int) -> Optional[float]:
        """D(k) + X + V(f·k) in seconds; None until draft and verify were measured."""
        m = self.fertility * k
        d, v = self.draft.predict(k), self.verify.predict(m + 1)
        if d is None or v is None:
            return None
        return d + self._translate + v

    def throughput(self, k: int) -> Optional[float]:
        """R(k) tokens/s (k = 0: plain decoding, 1 / V(0))."""
        if k == 0:
            v = self.verify.predict(1)
            return 1.0 / v if v else None
        c = self.round_cost(k)
        return self.expected_tokens(self.fertility * k) / c if c else None

    def decide(self, candidates: Sequence[int]) -> UagDecision:
        """The k of `candidates` (k >= 1) with the highest R(k), or 0 when plain decoding wins
        (R(k*) < min_gain · R_plain); the largest candidate while no k has measured costs."""
        plain = self.throughput(0)
        scored = [(self.throughput(k), k) for k in candidates if k > 0]
        scored = [(r, k) for r, k in scored if r is not None]
        a, f = self.acceptance_rate, self.fertility
        if not scored:
            return UagDecision(max(candidates), None, plain, a, f)
        best_r, best_k = max(scored)
        if plain is not None and best_r < self.min_gain * plain:
            return UagDecision(0, best_r, plain, a, f)
        return UagDecision(best_k, best_r, plain, a, f)


class UagPolicy:
    """Schedule around `UagCostModel` for `worker.decoding.cross_tokenizer.generate`.

    Explores first (each of the smallest, largest k and plain decoding `min_samples` times),
    then follows `decide`; while decoding plainly it probes the best k every `probe_every`
    rounds so a session whose text turns repetitive can return to drafting. The first round is
    not measured (lazy set-up and compilation).

    Args:
        max_k: the largest k, >= 1.
        candidates: k values to consider (default 1, 2, 3, 4, 6, 8 up to max_k).
        model: the cost model (a fresh one by default).
        min_samples: measured rounds per explored setting.
        probe_every: plain rounds between probes.

    Raises:
        ValueError: max_k < 1.

    Usage:
        k = policy.next_k()          # 0 = plain step
        ... run the round ...
        policy.observe(k, proposed, accepted, draft_s, translate_s, verify_s)
    """

    def __init__(self, max_k: int, candidates: Optional[Sequence[int]] = None,
                 model: Optional[UagCostModel] = None, *, min_samples: int = 2, probe_every: int = 16):
        if max_k < 1:
            raise ValueError("max_k must be >= 1")
        base = candidates if candidates is not None else (1, 2, 3, 4, 6, 8)
        self.candidates = sorted({max_k, *(k for k in base if 1 <= k <= max_k)})
        self.model = model or UagCostModel()
        self.min_samples = min_samples
        self.probe_every = probe_every
        self._explore = [self.candidates[-1], self.candidates[0], 0]
        self._counts: dict[int, int] = {}
        self._rounds = 0
        self._plain_run = 0
        self.decision: Optional[UagDecision] = None

    def next_k(self) -> int:
        """k for the next round (0 = a plain step): an exploration setting that still lacks
        `min_samples` measured rounds, else the cost model's choice, or a probe at the best k
        after `probe_every` plain rounds."""
        for k in self._explore:
            if self._counts.get(k, 0) < self.min_samples:
                return k
        self.decision = d = self.model.decide(self.candidates)
        if d.k == 0 and self._plain_run >= self.probe_every:
            self._plain_run = 0
            return max(self.candidates, key=lambda k: self.model.throughput(k) or 0.0)
        return d.k

    def observe(self, k: int, proposed: int, accepted: int, draft_s: float, translate_s: float,
                verify_s: float) -> None:
        """Feeds one round: k draft tokens (0 for a plain step) that became `proposed` target
        tokens, `accepted` of them kept, and its measured times in seconds (ignored for the
        session's first round, the warm-up)."""
        first = self._rounds == 0
        self._rounds += 1
        self._plain_run = self._plain_run + 1 if k == 0 else 0
        self.model.observe_round(k, proposed, accepted)
        if not first:
            self._counts[k] = self._counts.get(k, 0) + 1
            self.model.observe_costs(k, proposed, draft_s, translate_s, verify_s)
