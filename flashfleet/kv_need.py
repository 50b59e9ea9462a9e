"""KV bytes a worker needs: the one formula of the engine's budget and the coordinator's moves.

Sessions of one decoding method share a batch whose KV buffers hold every row at the batch's
longest length, in whole buckets of `POSITION_BUCKET` positions (worker/caches/rows.py):
`batch_bytes`. Attention needs working memory of two copies of one target layer of the largest
batch (grouped K/V heads expanded where no fused kernel runs): `working_bytes`. The engine
admits and preempts by these two (worker/engine/scheduler.py `projected_bytes`, the next
iteration's lengths) and the coordinator's migration policy moves for memory by them
(`final_need_bytes`, every session at its final length), so both sides do the same arithmetic.
"""
from __future__ import annotations

from typing import Iterable

POSITION_BUCKET = 256  # positions a row's KV buffer grows by (worker/caches/rows.py STEP)


def bucket(positions: int) -> int:
    """`positions` rounded up to whole buckets (at least one)."""
    return max(POSITION_BUCKET, -(-positions // POSITION_BUCKET) * POSITION_BUCKET)


def batch_bytes(rows: int, positions: int, per_position: int) -> int:
    """KV bytes of a batch of `rows` rows whose buffers hold `positions` positions each (rounded
    up to whole buckets), at `per_position` bytes per position of a row (all its layers)."""
    return rows * bucket(positions) * per_position


def working_bytes(largest_batch_bytes: int, layers: int) -> int:
    """Attention's working memory beside the caches: two copies of one of the target's `layers`
    attention layers of the largest batch (0 when `layers` is unknown, 0)."""
    return 2 * largest_batch_bytes // layers if layers > 0 else 0


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
    sizes = [batch_bytes(n, longest, per_position) for per_position, (n, longest) in batches.items()]
    return sum(sizes) + working_bytes(max(sizes, default=0), layers)
