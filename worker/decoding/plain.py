"""Plain autoregressive decoding: the baseline every speculative method must match under greedy.

The loop is mlx-lm's `generate_step` (`mlx_lm/generate.py`): a chunked prefill, then pipelined
steps where step n+1 is queued with `mx.async_eval` before token n is read back to the host, so
the device never idles while the caller handles a token.
"""
from __future__ import annotations

from typing import Any, Generator, Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache

from worker.sampling import sample_rows
from worker.decoding.base import Sampler, Step, release_buffer_cache

CLEAR_CACHE_EVERY_TOKENS = 256  # return freed buffers to the allocator this often, as mlx-lm does


def prefill(model: nn.Module, cache: list[Any], tokens: mx.array, step_tokens: int) -> mx.array:
    """Feeds all prompt tokens but the last to the model, `step_tokens` at a time.

    Evaluates the cache state and frees MLX's buffer cache after each chunk, as mlx-lm does, so
    peak memory stays at one chunk's activations. Call it inside `with mx.stream(...)`.

    Args:
        model: an mlx-lm language model, `model(tokens (1, L) uint32, cache=cache)`.
        cache: the model's cache list (from `make_prompt_cache`), updated in place.
        tokens: prompt ids, shape (P,) uint32, P >= 1.
        step_tokens: tokens per forward, >= 1.

    Returns:
        The last prompt token, shape (1,) uint32: the input of the first decode step.
    """
    while tokens.size > 1:
        n = min(step_tokens, tokens.size - 1)
        model(tokens[:n][None], cache=cache)
        mx.eval([c.state for c in cache])
        tokens = tokens[n:]
        release_buffer_cache()
    return tokens


def prefill_steps(model: nn.Module, cache: list[Any], tokens: mx.array, step_tokens: int,
                  stream: Any = generation_stream) -> Generator[Step, None, mx.array]:
    """`prefill` that yields an empty `Step` after every chunk but the last.

    A long prompt then takes one chunk per engine turn instead of blocking every other session
    on the worker for the whole prefill, and an abort takes effect at the next chunk. Use it with
    `y = yield from prefill_steps(...)` inside a decoding generator.

    Args and returns as for `prefill`; `stream` is entered around each chunk only.
    """
    while tokens.size > 1:
        n = min(step_tokens, tokens.size - 1)
        with mx.stream(stream):
            model(tokens[:n][None], cache=cache)
            mx.eval([c.state for c in cache])
        tokens = tokens[n:]
        release_buffer_cache(stream)
        if tokens.size > 1:
            yield Step([])
    return tokens


def generate(
    prompt_tokens: list[int],
    max_tokens: int,
    sampler: Sampler,
    eos_ids: set[int],
    *,
    model: nn.Module,
    cache: list[Any] | None = None,
    prefill_step_tokens: int = 512,
    stream: Any = generation_stream,
) -> Iterator[Step]:
    """Decodes one token per step (the `decoding.base` decoding-generator contract).

    Args:
        prompt_tokens: prompt ids, non-empty.
        max_tokens: most tokens to yield, >= 1.
        sampler: logits (1, V) -> token id (1,) uint32; greedy or the request's seeded sampler.
        eos_ids: token ids that end the generation; the EOS token itself is yielded.
        model: the target mlx-lm model.
        cache: the target's cache list, updated in place (made here when None). The caller may
            read `nbytes` from it while the generator runs.
        prefill_step_tokens: prompt tokens per prefill forward.
        stream: MLX stream to run on. It is entered around each piece of work, never across a
            `yield`, so several generators can interleave on one thread.

    Yields:
        Empty `Step`s while prefilling a prompt longer than one chunk (see `prefill_steps`),
        then one `Step` per token (drafted = accepted = 0). The cache never holds tokens beyond the
        ones yielded, so closing the generator needs no rollback.

    Raises:
        ValueError: empty prompt or max_tokens < 1.
    """
    if not prompt_tokens:
        raise ValueError("prompt_tokens is empty")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if cache is None:
        cache = make_prompt_cache(model)

    position = [len(prompt_tokens)]  # sequence position of the token the next step samples

    def _step(y: mx.array) -> mx.array:
        with mx.stream(stream):
            logits = model(y[None], cache=cache)[:, -1, :]
            y = sample_rows(sampler, logits, position[0])  # keyed as DFlash keys it
            mx.async_eval(y)
        position[0] += 1
        return y

    y = yield from prefill_steps(model, cache, mx.array(prompt_tokens, mx.uint32),
                                 prefill_step_tokens, stream)
    y = _step(y)
    n = 0
    while True:
        if n + 1 < max_tokens:
            next_y = _step(y)  # queue step n+1 before reading token n
        token = y.item()
        n += 1
        yield Step([token])
        if token in eos_ids or n == max_tokens:
            return
        if n % CLEAR_CACHE_EVERY_TOKENS == 0:
            release_buffer_cache(stream)
        y = next_y
