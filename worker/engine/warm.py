"""Warming the batched forwards' shapes at load, so no stream waits on a kernel compile.

A forward's kernels depend on its shapes: on CUDA, MLX JIT-compiles kernels the first time it
meets a shape (attention per query and key length, `worker.small_gemm` per 16-row tile count of
each weight), and cuBLAS picks an algorithm per matmul shape. The batched engine meets a shape
per (batch size B, tokens a row L): plain steps are (B, 1), a DFlash iteration is a draft forward
and a verify of (B, L) for each block size L the policy may choose. `warm_shapes` runs one plain
step and the DFlash iterations of every block size, for every batch size from 1 to the worker's
capacity, on rows of a short dummy context (the first KV bucket), smallest first, within a time
budget; sessions then meet those shapes warm. Longer contexts' key lengths (a new 256-position
bucket) are met for the first time by the sessions that reach them.

Each DFlash shape's second run is timed (`WarmReport.costs`): a GPU worker's block-size policy
starts from those costs (`BatchBlockPolicy.seed`).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import mlx.core as mx

from worker.caches.rows import RowKVCache, make_row_caches
from worker.engine.batch import Batch, Row, dflash_cycle, plain_step
from worker.sampling import greedy

log = logging.getLogger(__name__)

CONTEXT = 16  # dummy prompt tokens a warm-up row holds


@dataclass(frozen=True)
class WarmReport:
    """What `warm_shapes` ran.

    Attributes:
        warmed: (mode, batch size, block size) of each shape warmed, in order.
        planned: how many shapes there were to warm.
        seconds: the time it took.
        costs: (batch size, context, block size, seconds) of each DFlash shape's second run:
            an iteration's cost with its kernels compiled (`BatchBlockPolicy.seed`).
    """

    warmed: tuple[tuple[str, int, int], ...]
    planned: int
    seconds: float
    costs: tuple[tuple[int, int, int, float], ...] = ()


def plan(batch_sizes: Sequence[int], blocks: Sequence[int], dflash: bool) -> list[tuple[str, int, int]]:
    """The shapes to warm, in order: per batch size (ascending) a plain step, then each DFlash
    block size (ascending) when the worker has a DFlash draft."""
    out = []
    for B in sorted(set(batch_sizes)):
        out.append(("plain", B, 1))
        if dflash:
            out += [("dflash", B, L) for L in sorted(set(blocks))]
    return out


def dummy_batch(target, B: int, context: int, draft=None, capture=None) -> Batch:
    """A greedy batch of B rows holding `context` dummy positions each (with a DFlash `draft`,
    their taps in the draft's context too, through `capture`), evaluated."""
    rows = [Row(greedy, context + 1, 5 + r, f"warmup-{r}") for r in range(B)]
    caches = make_row_caches(target, B)
    x = (mx.arange(B * context, dtype=mx.uint32).reshape(B, context) % 97) + 3
    if draft is None:
        target(x, cache=caches)
        mx.eval([c.state for c in caches])
        return Batch(caches, rows=rows)
    draft_caches = [RowKVCache(B) for _ in draft.layers]
    with capture:
        target(x, cache=caches)
    draft.extend_context(capture.hidden(), draft_caches)
    mx.eval([c.state for c in caches + draft_caches])
    return Batch(caches, draft_caches, pending_len=[0] * B, rows=rows)


def warm_shapes(models, capture, batch_sizes: Sequence[int], blocks: Sequence[int], budget_s: float,
                clock: Callable[[], float] = time.perf_counter) -> WarmReport:
    """Runs the batched forwards of every shape in `plan`, until `budget_s` seconds are spent.

    Each DFlash block size runs twice in a row, so the draft also meets the pending-tap width
    that block size leaves (its steady state at a fixed size); the second run is timed
    (`WarmReport.costs`). The dummy batches are freed after.

    Args:
        models: the loaded models (`worker.engine.modes.LoadedModels`).
        capture: the target's `HiddenCapture` at the draft's tapped layers (None without DFlash).
        batch_sizes: batch sizes to warm (1 .. the worker's capacity).
        blocks: DFlash block sizes (the block policy's candidates, 1 included).
        budget_s: seconds the warm-up may take; the shape running when it runs out is finished,
            the rest are skipped. 0: nothing is warmed.
        clock: monotonic seconds.
    """
    dflash = models.draft_kind == "dflash"
    shapes = plan(batch_sizes, blocks, dflash) if budget_s > 0 else []
    t0 = clock()
    warmed: list[tuple[str, int, int]] = []
    costs: list[tuple[int, int, int, float]] = []
    batches: dict[tuple[str, int], Optional[Batch]] = {}
    for mode, B, L in shapes:
        if clock() - t0 >= budget_s:
            break
        key = (mode, B)
        if key not in batches:
            batches.clear()  # one batch at a time: its memory goes before the next one's
            dflash_mode = mode == "dflash"
            batches[key] = dummy_batch(models.target, B, CONTEXT, models.draft if dflash_mode else None,
                                       capture if dflash_mode else None)
        batch = batches[key]
        if mode == "plain":
            plain_step(models.target, batch)
        else:
            dflash_cycle(models.target, models.draft, capture, batch, L)
            t = time.perf_counter()
            dflash_cycle(models.target, models.draft, capture, batch, L)
            costs.append((B, max(r.n for r in batch.rows), L, time.perf_counter() - t))
        warmed.append((mode, B, L))
    batches.clear()
    mx.clear_cache()
    return WarmReport(tuple(warmed), len(shapes), clock() - t0, tuple(costs))
