"""Logit penalties and biases of one row: logit_bias, repetition, presence and frequency penalties.

Applied to the target's logits before a token is chosen (greedy or sampled, before temperature
and top-p), in mlx-lm's order (`mlx_lm.sample_utils.make_logits_processors`):

    logit_bias          logit[t] += bias[t]                                   (OpenAI's)
    repetition_penalty  logit[t] = logit[t] / p if logit[t] >= 0 else logit[t] * p,
                        for every token t of the prompt and the output
                        (CTRL, Keskar et al. 2019, arXiv 1909.05858; Hugging Face's
                        RepetitionPenaltyLogitsProcessor, mlx-lm's make_repetition_penalty)
    presence_penalty    logit[t] -= presence,          for every token t of the output
    frequency_penalty   logit[t] -= frequency * c[t],  c[t]: times the output holds t
                        (both OpenAI's: over the generated tokens, not the prompt)

mlx-lm counts only the last 20 tokens (its `*_context_size`) by default; here, as in OpenAI's
API, Hugging Face and vLLM, every token counts.

A row keeps its counts on the device as dense (V,) float32 vectors (the output's counts, and the
prompt's and output's together for the repetition penalty), updated as tokens commit. A DFlash
verify of the block [b, d_1 .. d_{L-1}] penalises its position j with the counts after d_1 .. d_j
as well (a cumulative sum of the drafts' one-hots, on the device): position j's token commits only
if d_1 .. d_j did, so it is chosen under the penalty state a plain step would have there, and
greedy speculative output equals greedy plain output. The draft's proposals are penalised with the
committed state (the drafts before them in the block not counted): cheap, and only the acceptance
depends on it.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import mlx.core as mx

from flashfleet.requests import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_TOKENS, MAX_PENALTY, MAX_REPETITION_PENALTY
from worker.engine.types import InvalidRequest, SamplingParams


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def validate_penalties(params: SamplingParams, vocab_size: Optional[int]) -> None:
    """Checks a request's penalties and logit bias without touching MLX (any thread).

    Args:
        params: the request's sampling parameters.
        vocab_size: the target's vocabulary size V (logit_bias ids must be below it); None: unchecked.

    Raises:
        InvalidRequest: a value out of its range, or a logit_bias id outside [0, V) or repeated;
            the message names the field and its range.
    """
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not (_number(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
            raise InvalidRequest(f"{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
    p = params.repetition_penalty
    if not (_number(p) and 0 < p <= MAX_REPETITION_PENALTY):
        raise InvalidRequest(f"repetition_penalty must be a number in (0, {MAX_REPETITION_PENALTY:g}] "
                             f"(1 = none), got {p!r}")
    bias = params.logit_bias
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise InvalidRequest(f"logit_bias has {len(bias):,} tokens; at most {MAX_LOGIT_BIAS_TOKENS:,} are served")
    seen = set()
    for token, value in bias:
        if not isinstance(token, int) or token < 0 or (vocab_size is not None and token >= vocab_size):
            raise InvalidRequest(f"logit_bias token ids must be integers in [0, {vocab_size}), got {token!r}")
        if token in seen:
            raise InvalidRequest(f"logit_bias names token {token} twice")
        seen.add(token)
        if not (_number(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise InvalidRequest(f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                 f"got {value!r} for token {token}")


class RowPenalties:
    """One row's penalty state on the engine thread.

    Args:
        params: the request's sampling parameters (`SamplingParams.penalized` true).
        prompt: the prompt's token ids (counted by the repetition penalty only).
        vocab_size: V, the columns of the target's logits.
    """

    def __init__(self, params: SamplingParams, prompt: Sequence[int], vocab_size: int):
        self.vocab_size = vocab_size
        self.presence = float(params.presence_penalty)
        self.frequency = float(params.frequency_penalty)
        self.repetition = float(params.repetition_penalty)
        self.bias: Optional[mx.array] = None  # (V,) float32
        if params.logit_bias:
            ids = mx.array([t for t, _ in params.logit_bias], dtype=mx.int32)
            values = mx.array([v for _, v in params.logit_bias], dtype=mx.float32)
            self.bias = mx.zeros((vocab_size,), mx.float32).at[ids].add(values)
        # (V,) float32 counts: the output's (presence, frequency), the prompt's and output's (repetition).
        self.counts = mx.zeros((vocab_size,), mx.float32) if (self.presence or self.frequency) else None
        self.occurs = None
        if self.repetition != 1.0:
            self.occurs = mx.zeros((vocab_size,), mx.float32)
            if prompt:
                self.occurs = self.occurs.at[mx.array(list(prompt), dtype=mx.int32)].add(1.0)

    def state(self) -> list[mx.array]:
        """The device arrays (to evaluate with an iteration's read-back, so their graphs stay short)."""
        return [a for a in (self.bias, self.counts, self.occurs) if a is not None]

    def advance(self, tokens: Sequence[int]) -> None:
        """Counts committed output tokens."""
        if not tokens or (self.counts is None and self.occurs is None):
            return
        ids = mx.array(list(tokens), dtype=mx.int32)
        if self.counts is not None:
            self.counts = self.counts.at[ids].add(1.0)
        if self.occurs is not None:
            self.occurs = self.occurs.at[ids].add(1.0)

    def apply(self, logits: mx.array, drafted: Optional[mx.array] = None,
              ids: Optional[mx.array] = None) -> mx.array:
        """The penalised logits of L consecutive positions.

        Args:
            logits: (L, V) logits (any float dtype), or (L, K) with `ids`.
            drafted: (L-1,) the block's drafted tokens d_1 .. d_{L-1}: position j is penalised
                after the committed tokens and d_1 .. d_j; None: every position after the
                committed tokens only.
            ids: (K,) target ids of the logits' columns (a draft vocabulary), or None (all V).

        Returns:
            (L, V) (or (L, K)) float32 logits.
        """
        lg = logits.astype(mx.float32)
        L = lg.shape[0]
        extra = None
        if drafted is not None and L > 1 and (self.counts is not None or self.occurs is not None):
            one_hot = (drafted.astype(mx.int32)[:, None] == mx.arange(self.vocab_size, dtype=mx.int32)[None])
            extra = mx.concatenate([mx.zeros((1, self.vocab_size), mx.float32),
                                    mx.cumsum(one_hot.astype(mx.float32), axis=0)])

        def at(v: mx.array) -> mx.array:  # a (V,) or (L, V) state on the logits' columns
            return v if ids is None else v[..., ids]

        if self.bias is not None:
            lg = lg + at(self.bias)
        if self.occurs is not None:
            seen = at(self.occurs if extra is None else self.occurs + extra) > 0
            p = self.repetition
            lg = mx.where(seen, mx.where(lg < 0, lg * p, lg / p), lg)
        if self.counts is not None:
            c = at(self.counts if extra is None else self.counts + extra)
            lg = lg - (self.presence * (c > 0).astype(mx.float32) + self.frequency * c)
        return lg
