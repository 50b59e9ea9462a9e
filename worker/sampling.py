"""Per-request token samplers.

Modelled on mlx-lm's `mlx_lm/sample_utils.py` (`make_sampler` returns a plain callable, the hot part
is `mx.compile`d), with one difference: every non-greedy sampler owns its random key, derived from
the request's seed and advanced with `mx.random.split` on each call. It never reads or writes MLX's
global random state, so a seeded request reproduces its tokens no matter which other requests run
beside it on the engine thread.
"""
from __future__ import annotations

import math
import secrets

import mlx.core as mx

from flashfleet.requests import MAX_TEMPERATURE, SEED_LIMIT
from worker.engine.types import InvalidRequest, SamplingParams
from worker.decoding.base import Sampler


def validate_sampling(temperature: float, top_p: float, seed: int | None) -> None:
    """Checks sampling parameters without touching MLX (safe on any thread).

    Args:
        temperature: in [0, MAX_TEMPERATURE]; 0 means greedy.
        top_p: nucleus mass in (0, 1].
        seed: None, or an int in [0, 2**64).

    Raises:
        InvalidRequest: a parameter is out of range; the message names it and its valid range.
    """
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)
            and 0 <= temperature <= MAX_TEMPERATURE):
        raise InvalidRequest(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {temperature!r}")
    if not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        raise InvalidRequest(f"top_p must be in (0, 1], got {top_p!r}")
    if seed is not None and not (isinstance(seed, int) and 0 <= seed < SEED_LIMIT):
        raise InvalidRequest(f"seed must be an integer in [0, 2**64), got {seed!r}")


def greedy(logits: mx.array) -> mx.array:
    """Argmax sampler: logits (N, V) float -> token ids (N,) uint32."""
    return mx.argmax(logits, axis=-1)


@mx.compile
def _sample(logits: mx.array, key: mx.array, inv_temp: mx.array) -> mx.array:
    """One categorical draw per row of softmax(logits * inv_temp)."""
    return mx.random.categorical(logits.astype(mx.float32) * inv_temp, axis=-1, key=key)


@mx.compile
def _sample_top_p(logits: mx.array, key: mx.array, inv_temp: mx.array, top_p: mx.array) -> mx.array:
    """Temperature, then nucleus (top-p) filtering, then one categorical draw per row.

    The order (temperature before top-p) follows Hugging Face and vLLM. The nucleus is the
    smallest set of most likely tokens whose mass reaches top_p; ties at the threshold are kept.
    """
    logprobs = logits.astype(mx.float32) * inv_temp
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    sorted_lp = mx.sort(logprobs, axis=-1)  # ascending
    mass_above = mx.cumsum(mx.exp(sorted_lp), axis=-1, reverse=True, inclusive=False)
    num_dropped = (mass_above >= top_p).sum(axis=-1, keepdims=True)
    threshold = mx.take_along_axis(sorted_lp, num_dropped, axis=-1)
    logprobs = mx.where(logprobs < threshold, -mx.inf, logprobs)
    return mx.random.categorical(logprobs, axis=-1, key=key)


def make_sampler(temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None) -> Sampler:
    """Builds the sampler of one request.

    Args:
        temperature: 0 gives the greedy (argmax) sampler; > 0 samples from
            softmax(logits / temperature) restricted to the top-p nucleus.
        top_p: nucleus mass in (0, 1]; 1.0 disables the filter.
        seed: seed of the request's own random stream, in [0, 2**64); None draws one from the OS.

    Returns:
        A `Sampler`: logits (N, V) float -> token ids (N,) uint32. A non-greedy sampler splits its
        key once per call and samples the N rows independently with the new subkey, so the same
        seed and the same sequence of calls give the same tokens; its `at(logits, position)`
        keys each row by its sequence position instead (`sample_rows`, used where the number
        of calls depends on timing). It is not thread-safe: call it from the engine thread only.

    Raises:
        InvalidRequest: see `validate_sampling`.
    """
    validate_sampling(temperature, top_p, seed)
    if temperature == 0:
        return greedy
    seed = secrets.randbits(63) if seed is None else seed
    key = mx.random.key(seed)
    inv_temp = mx.array(1.0 / temperature, mx.float32)
    if top_p < 1.0:
        mass = mx.array(top_p, mx.float32)
        draw = lambda logits, subkey: _sample_top_p(logits, subkey, inv_temp, mass)  # noqa: E731
    else:
        draw = lambda logits, subkey: _sample(logits, subkey, inv_temp)  # noqa: E731

    def sample(logits: mx.array) -> mx.array:
        nonlocal key
        key, subkey = mx.random.split(key)
        return draw(logits, subkey)

    def sample_at(logits: mx.array, position: int) -> mx.array:
        # Row i is the token at sequence position `position + i`, drawn with that position's own
        # key: the same seed gives the same token there however the rows were batched.
        return mx.concatenate([draw(logits[i: i + 1], position_key(seed, position + i))
                               for i in range(logits.shape[0])])

    sample.at = sample_at
    return sample


def position_key(seed: int, position: int) -> mx.array:
    """The random key of the token at sequence `position` of a request seeded with `seed`
    (a uint64 mix of the two, as counter-based generators such as JAX's fold_in do)."""
    return mx.random.key((seed + (position + 1) * 0x9E3779B97F4A7C15) % SEED_LIMIT)


def sample_rows(sampler: Sampler, logits: mx.array, position: int) -> mx.array:
    """`sampler` applied to rows that are consecutive sequence positions from `position`:
    a `make_sampler` sampler keys each row by its position (`sample.at`), so a speculative
    method whose block sizes vary from run to run (the adaptive policy, chosen from measured
    times) still reproduces a seeded request's tokens; greedy and other samplers as they are.

    logits: (N, V) float; returns (N,) uint32."""
    at = getattr(sampler, "at", None)
    return sampler(logits) if at is None else at(logits, position)


def sampler_for(params: SamplingParams) -> Sampler:
    """`make_sampler` for a request's `SamplingParams`."""
    return make_sampler(params.temperature, params.top_p, params.seed)
