"""Classic speculative decoding with a small draft model that shares the target's tokenizer.

Algorithm: Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding") and
Chen et al. 2023 ("Accelerating Large Language Model Decoding with Speculative Sampling"), in the
form mlx-lm's `speculative_generate_step` (`mlx_lm/generate.py`) uses: the draft proposes k tokens,
the target scores all of them in one forward, and a draft token is accepted when it equals the
token the target itself chooses at that position (argmax under greedy, the target's own sample
under sampling). Every committed token is therefore the target's choice: greedy output equals
plain greedy output, and sampled output follows the target's distribution exactly (acceptance is
lower than with the papers' rejection-sampling rule, the price of that simplicity).

Differences from mlx-lm: one host sync per cycle (drafts and target choices come back in a single
`.tolist()`), the next cycle's draft is queued before the current cycle's tokens are yielded, k
shrinks so a cycle never drafts past `max_tokens`, and an EOS inside an accepted run ends the
generation at that token.
"""
from __future__ import annotations

import time
from typing import Any, Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from worker.sampling import greedy
from worker.decoding.base import Sampler, Step, accept_prefix, release_buffer_cache
from worker.decoding.plain import CLEAR_CACHE_EVERY_TOKENS, prefill_steps


def generate(
    prompt_tokens: list[int],
    max_tokens: int,
    sampler: Sampler,
    eos_ids: set[int],
    *,
    model: nn.Module,
    draft_model: nn.Module,
    num_draft_tokens: int = 3,
    cache: list[Any] | None = None,
    draft_cache: list[Any] | None = None,
    draft_sampler: Sampler | None = None,
    prefill_step_tokens: int = 512,
    stream: Any = generation_stream,
) -> Iterator[Step]:
    """Decodes by draft + verify cycles (the `decoding.base` decoding-generator contract).

    One cycle, with k = min(num_draft_tokens, max_tokens - generated - 1):
      1. the draft model proposes d_0..d_{k-1}, one forward each, queued with `mx.async_eval`;
      2. the target runs one forward over [y, d_0..d_{k-1}] (y = last committed token) and the
         sampler picks t_0..t_k from its k+1 logits rows;
      3. one host sync reads t and d; n = the longest prefix with d_i == t_i; the cycle commits
         t_0..t_n (n accepted draft tokens plus the target's bonus token t_n), cut after the
         first EOS;
      4. the target cache is trimmed by the rejected drafts, the draft cache by the drafts it
         processed beyond the committed tokens (`mlx_lm.models.cache.trim_prompt_cache`).

    Args:
        prompt_tokens: prompt ids, non-empty.
        max_tokens: most tokens to yield, >= 1.
        sampler: the target's token choice, logits (N, V) -> ids (N,) uint32; called once per
            cycle with N = k + 1.
        eos_ids: token ids that end the generation; the EOS token itself is yielded.
        model: the target mlx-lm model.
        draft_model: an mlx-lm model over the same vocabulary (it may be `model` itself).
        num_draft_tokens: draft tokens per cycle (the largest k), >= 1.
        cache: the target's cache list, updated in place (made here when None).
        draft_cache: the draft's cache list, updated in place (made here when None).
        draft_sampler: the draft's token choice; None drafts greedily (argmax), which keeps the
            request's random stream for the target alone.
        prefill_step_tokens: prompt tokens per prefill forward (both models).
        stream: MLX stream, entered around each piece of work and never across a `yield`.

    Yields:
        One `Step` per cycle: tokens t_0..t_n, drafted = k, accepted = the committed draft
        tokens, draft_s / verify_s in seconds (draft_s: the host time queueing the draft, whose
        device time lands in verify_s). When the generator is closed or finishes, the
        caches are trimmed back so they hold no uncommitted draft tokens.

    Raises:
        ValueError: empty prompt, max_tokens < 1, num_draft_tokens < 1, or a cache that cannot be
            trimmed (e.g. rotating or recurrent-state caches).
    """
    if not prompt_tokens:
        raise ValueError("prompt_tokens is empty")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    cache = make_prompt_cache(model) if cache is None else cache
    draft_cache = make_prompt_cache(draft_model) if draft_cache is None else draft_cache
    for name, c in (("target", cache), ("draft", draft_cache)):
        if not can_trim_prompt_cache(c):
            kinds = sorted({type(x).__name__ for x in c if not x.is_trimmable()})
            raise ValueError(f"draft-model speculative decoding needs a trimmable {name} cache, got {kinds}")
    draft_sampler = draft_sampler or greedy

    def _draft(draft_in: mx.array, k: int) -> tuple[list[mx.array], float]:
        """Queues k draft forwards from the tokens the draft has not seen; returns (1,) arrays."""
        start = time.perf_counter()
        drafts = []
        with mx.stream(stream):
            for _ in range(k):
                logits = draft_model(draft_in[None], cache=draft_cache)[:, -1, :]
                draft_in = draft_sampler(logits)
                mx.async_eval(draft_in)
                drafts.append(draft_in)
        return drafts, time.perf_counter() - start

    prompt = mx.array(prompt_tokens, mx.uint32)
    draft_in = yield from prefill_steps(draft_model, draft_cache, prompt, prefill_step_tokens, stream)
    y = yield from prefill_steps(model, cache, prompt, prefill_step_tokens, stream)

    ntoks = 0
    # Cache entries holding uncommitted draft tokens, rolled back in `finally`.
    target_extra = draft_extra = 0
    try:
        k = min(num_draft_tokens, max_tokens - 1)
        drafts, draft_s = _draft(draft_in, k)
        draft_extra = max(k - 1, 0)  # the draft never processes its own last proposal
        while True:
            start = time.perf_counter()
            with mx.stream(stream):
                logits = model(mx.concatenate([y, *drafts])[None], cache=cache)[0]  # (k+1, V)
                target_extra = k
                ids = mx.concatenate([sampler(logits), *drafts]).tolist()  # the one host sync
            verify_s = time.perf_counter() - start
            drafted = ids[k + 1 :]
            n, committed = accept_prefix(drafted, ids[: k + 1], eos_ids)
            c = len(committed)
            # The target processed y + d_0..d_{k-1} and keeps y + committed[:-1]. The draft
            # processed its pending inputs + d_0..d_{k-2} and keeps d_0..d_{c-2} (committed[:-1]).
            trim_prompt_cache(cache, k - (c - 1))
            trim_prompt_cache(draft_cache, max(k - c, 0))
            target_extra = draft_extra = 0
            ntoks += c
            step = Step(committed, drafted=k, accepted=min(n, c), draft_s=draft_s, verify_s=verify_s)
            if committed[-1] in eos_ids or ntoks >= max_tokens:
                yield step
                return
            if ntoks // CLEAR_CACHE_EVERY_TOKENS != (ntoks - c) // CLEAR_CACHE_EVERY_TOKENS:
                release_buffer_cache(stream)
            # Tokens the draft has not processed yet: on full acceptance its own last proposal,
            # then the bonus token. (k >= 1 here: k == 0 only in the cycle that reaches max_tokens.)
            pending = [drafted[-1], committed[-1]] if c == k + 1 else [committed[-1]]
            draft_in = mx.array(pending, mx.uint32)
            y = mx.array(committed[-1:], mx.uint32)
            k = min(num_draft_tokens, max_tokens - ntoks - 1)
            drafts, draft_s = _draft(draft_in, k)  # the device drafts while the caller handles step
            draft_extra = max(k - 1, 0)
            yield step
    finally:
        trim_prompt_cache(cache, target_extra)
        trim_prompt_cache(draft_cache, draft_extra)
