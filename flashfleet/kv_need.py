"""KV bytes a worker needs once every session it runs reaches its final length.

A worker's engine and the coordinator's migration policy compute it with this one formula, so a
move for memory happens on the same arithmetic the engine admits and preempts by
(worker/engine/scheduler.py `projected_bytes`): sessions of one decoding method share a batch
whose KV buffers hold every row at the batch's longest length, in whole buckets of
`POSITION_BUCKET` positions (worker/caches/rows.py), and attention needs working memory of two
copies of one layer of the largest batch (grouped K/V heads expanded where no fused kernel runs).
"""
from __future__ import annotations

from typing import Iterable

POSITION_BUCKET = 256  # positions a row's KV buffer grows by (worker/caches/rows.py STEP)


def bucket(positions: int) -> int:
    """`positions` rounded up to whole buckets (at least one)."""
    return max(POSITION_BUCKET, -(-positions // POSITION_BUCKET) * POSITION_BUCKET)


def final_need_bytes(rows: Iterable[tuple[int, int]], layers: int) -> int:
    """KV bytes of the batches holding `rows` at their final lengths, with attention's working memory.

    Args:
        rows: (final positions, KV bytes per position) per session, final positions being its
            context plus the tokens it may still generate. Sessions with equal bytes per position
            share one batch (one per decoding method: plain, or target + DFlash draft).
        layers: the target's attention layers (the working memory is 2/layers of the largest
            batch); 0 when unknown (no working memory counted).

    Returns:
        Bytes, 0 for no rows.
    """
    batches: dict[int, tuple[int, int]] = {}
    for positions, per_position in rows:
        n, longest = batches.get(per_position, (0, 0))
        batches[per_position] = (n + 1, max(longest, positions))
    sizes = [n * bucket(longest) * per_position for per_position, (n, longest) in batches.items()]
    working = 2 * max(sizes, default=0) // layers if layers > 0 else 0
    return sum(sizes) + working
