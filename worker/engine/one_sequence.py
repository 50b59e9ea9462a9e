"""One sequence through the batched decoding functions: plain or DFlash, as a generator of Steps.

For code that decodes a single prompt outside a worker (a draft's held-out acceptance after
training, single-stream benchmarks): the same prefill, forwards and verdicts as a worker's batch of
one, so what these measure is what a worker runs.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional, Sequence

from worker.capture import HiddenCapture
from worker.engine.batch import Batch, Row, dflash_cycle, plain_step, prefill_chunk
from worker.caches.rows import RowKVCache, make_row_caches
from worker.decoding.base import Sampler, Step


def decode(target: Any, prompt_tokens: Sequence[int], max_tokens: int, sampler: Sampler,
           eos_ids: Iterable[int], *, draft: Any = None, block_size: Optional[int] = None,
           prefill_step_tokens: int = 512) -> Iterator[Step]:
    """Decodes one prompt; yields one `Step` per plain step or DFlash iteration.

    Args:
        target: an mlx-lm model.
        prompt_tokens: prompt ids, non-empty.
        max_tokens: at most this many tokens in total (>= 1).
        sampler: logits (N, V) -> ids (N,) (`worker.sampling`).
        eos_ids: the generation ends after the first of these.
        draft: a bound DFlash draft (`worker.models.dflash.Model`), or None for plain decoding.
        block_size: DFlash block size L (default the draft's), fixed for every iteration.
        prefill_step_tokens: prompt tokens per prefill forward.

    Yields:
        Steps whose tokens are cut after an EOS and at max_tokens; `drafted` = L - 1 and
        `accepted` the drafts the target kept, for DFlash iterations.

    Raises:
        ValueError: empty prompt, max_tokens < 1, block_size < 1.
    """
    if not prompt_tokens:
        raise ValueError("empty prompt")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    L = int(block_size or (draft.block_size if draft is not None else 1))
    if L < 1:
        raise ValueError("block_size must be >= 1")
    eos = frozenset(int(e) for e in eos_ids)
    tokens = list(prompt_tokens)
    cache = make_row_caches(target, 1)
    draft_cache = capture = None
    if draft is not None:
        draft.bind(target)
        draft_cache = [RowKVCache(1) for _ in draft.layers]
        capture = HiddenCapture(target, draft.target_layer_ids)
    head = tokens[:-1]
    for start in range(0, len(head), prefill_step_tokens):
        prefill_chunk(target, head[start: start + prefill_step_tokens], cache, draft, draft_cache, capture)
    batch = Batch(make_row_caches(target, 0), None if draft is None else [RowKVCache(0) for _ in draft.layers])
    row = Row(sampler, len(tokens), tokens[-1])
    batch.join(row, cache, draft_cache)
    done = 0
    while done < max_tokens:
        if draft is None:
            new, drafted, accepted = plain_step(target, batch)[0], 0, 0
        else:
            size = max(1, min(L, 1 << max(0, max_tokens - done - 1).bit_length()))
            res = dflash_cycle(target, draft, capture, batch, size)
            new, drafted, accepted = res.tokens[0], size - 1, res.accepted[0]
        new, stop = row.commit(new, eos, max_tokens - done)
        done += len(new)
        yield Step(new, drafted, accepted)
        if stop:
            return
