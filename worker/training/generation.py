"""The target answers many prompts at once: static left-padded batches for training data.

Draft training needs the target's own answers to thousands of prompts (the paper regenerates
~800 K responses; Chen et al. 2026, arXiv 2602.06036, §4.2). Throughput is all that matters here,
not latency, so each batch is the simplest thing a GPU runs fast: `batch_size` prompts
left-padded to one length, one prefill, then one decode step for the whole batch at a time with
MLX's asynchronous evaluation, no host synchronisation per token (only every `SYNC_EVERY` steps,
to stop once every row has ended). Rows that ended keep decoding until the next check; once at
least `compact_at` of the rows still decoding have ended, the batch drops them (the caches'
`filter`), so a batch whose answers are mostly short stops paying for the rows that are done. That
is still simpler and cheaper than mlx-lm's continuous batching (`BatchGenerator`), which keeps
one cache per sequence, merges caches whenever rows join and syncs every step.

The caches are mlx-lm's `BatchKVCache` / `BatchRotatingKVCache` (per-row RoPE offsets and padding
masks), chosen per layer from the model's own `make_prompt_cache`, so any mlx-lm model whose
layers use plain or sliding-window KV caches works (llama, qwen2, qwen3, gemma3, ...).
"""
from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

from worker.decoding.base import release_buffer_cache

SYNC_EVERY = 16  # decode steps between checks of "every row has ended" and of the time limit
COMPACT_AT = 0.5  # drop the ended rows once this fraction of the rows still decoding has ended


def make_batch_cache(model, left_padding: Sequence[int]) -> list:
    """One mlx-lm batch cache per layer, matching the layer's own cache type.

    Args:
        model: an mlx-lm model.
        left_padding: per row, the number of pad tokens in front of its prompt.

    Returns:
        A list of `BatchKVCache` / `BatchRotatingKVCache`, one per entry of the model's cache.

    Raises:
        ValueError: the model uses a cache type without a batched form (e.g. a state-space layer).
    """
    from mlx_lm.models.cache import (BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache,
                                     make_prompt_cache)

    pads = [int(p) for p in left_padding]
    out = []
    for c in make_prompt_cache(model):
        if isinstance(c, RotatingKVCache):
            out.append(BatchRotatingKVCache(c.max_size, pads))
        elif isinstance(c, KVCache):
            out.append(BatchKVCache(pads))
        else:
            raise ValueError(f"batched generation does not support the cache type {type(c).__name__}")
    return out


def generate_responses(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    *,
    batch_size: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    pad_id: int = 0,
    max_seconds: Optional[float] = None,
    progress: Optional[Callable[[int], None]] = None,
    compact_at: float = COMPACT_AT,
) -> list[list[int]]:
    """The target's answers to token prompts, `batch_size` prompts at a time.

    Prompts are taken in the given order (callers interleave corpora, so a time limit keeps every
    corpus). Greedy at temperature 0, else mlx-lm's sampler with top-p.

    Args:
        model: the mlx-lm target.
        prompts: templated prompt ids (each non-empty).
        max_new_tokens: at most this many generated tokens per prompt (> 0).
        eos_ids: a row ends after any of these; the EOS token is kept.
        batch_size: rows decoded together (>= 1).
        temperature / top_p: sampling; temperature 0 is greedy.
        seed: MLX random seed for sampling.
        pad_id: token id used for left padding (masked out; any valid id).
        max_seconds: wall-time limit; when reached, the running batch stops where it is (its rows
            keep what they have) and later prompts come back empty; the first batch always starts.
            None: no limit.
        progress: called with the number of prompts of each finished batch.
        compact_at: at each check (every `SYNC_EVERY` steps), rows that have ended are dropped
            from the batch when they are at least this fraction of the rows still decoding
            (0: whenever any has ended; above 1: never). Greedy answers do not depend on it in
            exact arithmetic (tested on the CPU in float32); on a GPU in bf16 another batch shape
            can round a near-tie differently. Sampled answers depend on it through the random
            stream, reproducibly.

    Returns:
        One list of generated ids per prompt, in prompt order, each cut after its first EOS.

    Raises:
        ValueError: max_new_tokens < 1, batch_size < 1 or an empty prompt.
    """
    import mlx.core as mx
    import numpy as np
    from mlx_lm.sample_utils import make_sampler

    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    mx.random.seed(seed)
    sample = make_sampler(temp=temperature, top_p=top_p) if temperature > 0 else (
        lambda logits: mx.argmax(logits, axis=-1))
    eos_set = {int(e) for e in eos_ids}
    eos = mx.array(sorted(eos_set) or [-1])
    t0 = time.perf_counter()
    out: list[list[int]] = [[] for _ in prompts]
    for start in range(0, len(prompts), batch_size):
        if start and max_seconds is not None and time.perf_counter() - t0 > max_seconds:
            break
        rows = [list(map(int, p)) for p in prompts[start:start + batch_size]]
        width = max(len(r) for r in rows)
        pads = [width - len(r) for r in rows]
        cache = make_batch_cache(model, pads)
        x = mx.array([[pad_id] * p + r for p, r in zip(pads, rows)])
        if width > 1:  # prefill the cache only: logits of every prompt position would be rows x width x vocab
            model(x[:, :-1], cache=cache)
            mx.eval([c.state for c in cache])
        tok = sample(model(x[:, -1:], cache=cache)[:, -1, :])
        ended = (tok[:, None] == eos[None]).any(axis=1)
        live = np.arange(len(rows))  # batch row -> row of this chunk, for the rows still decoding
        segments, steps = [], [tok]  # (live, tokens of each step) before each compaction
        mx.async_eval(tok, ended)
        for step in range(1, max_new_tokens):
            if step % SYNC_EVERY == 0:
                done = np.array(ended)
                if done.all():
                    break
                if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
                    break
                n_done = int(done.sum())
                if n_done and n_done >= compact_at * len(live):
                    keep = np.flatnonzero(~done)
                    segments.append((live, steps))
                    idx = mx.array(keep)
                    for c in cache:
                        c.filter(idx)
                    tok, ended, live, steps = tok[idx], ended[idx], live[keep], []
            tok = sample(model(tok[:, None], cache=cache)[:, -1, :])
            ended = ended | (tok[:, None] == eos[None]).any(axis=1)
            steps.append(tok)
            mx.async_eval(tok, ended)
        segments.append((live, steps))
        answers: list[list[int]] = [[] for _ in rows]
        for seg_rows, seg_steps in segments:
            if seg_steps:
                for r, ids in zip(seg_rows.tolist(), np.array(mx.stack(seg_steps, axis=1)).tolist()):
                    answers[r].extend(ids)
        for i, row in enumerate(answers):
            cut = next((j + 1 for j, t in enumerate(row) if t in eos_set), len(row))
            out[start + i] = row[:cut]
        del cache
        if progress is not None:
            progress(len(rows))
    # Hand the batches' buffers back: MLX keeps freed buffers cached (nvidia-smi showed 138,199 MiB
    # in use during batch-1024 generation on the H200), and the training that follows needs other
    # shapes. In that run the first 10 training steps took 147 s, against 1.8 s in an earlier run
    # with a capped cache; that the cache caused it is a guess, not yet checked on the GPU.
    release_buffer_cache()  # clears, then waits: without the wait the next call failed on CUDA
    return out
