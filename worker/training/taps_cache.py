"""The paper's "offline" mode: the target's taps computed once and kept in memory per length class.

A length class's taps (rows x width x n_taps * D) either fit the `--cache-taps-gib` budget whole or
stay online (the target runs per batch). `classes_to_cache` picks the classes, `tap_cache_plan`
says so, `compute_class_taps` computes one class (`CachedTaps`).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import mlx.core as mx
import numpy as np


class CachedTaps:
    """One length class's cached target taps, kept as the batches that computed them.

    parts: mx.arrays (rows, width, n_taps * D), every one `rows_per_part` rows but the last;
    row r of the class (its `Trainer.local` index) is row r % rows_per_part of part r //
    rows_per_part. Kept apart because joining them (`mx.concatenate`) holds the class twice at
    its peak: 2 x 78.7 GiB did not fit the H200's 139 GiB."""

    def __init__(self, parts: Sequence[mx.array], rows_per_part: int):
        if any(p.shape[0] != rows_per_part for p in parts[:-1]) or not 0 < parts[-1].shape[0] <= rows_per_part:
            raise ValueError(f"every part but the last must hold {rows_per_part} rows")
        self.parts, self.per = list(parts), rows_per_part
        self.shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])

    @property
    def nbytes(self) -> int:
        """Bytes held (sum of the parts)."""
        return sum(p.nbytes for p in self.parts)

    def rows(self, local: np.ndarray) -> mx.array:
        """The taps of rows `local` (int array, (n,)) in that order: (n, width, n_taps * D).
        One slice per row and one concatenation: a few kernels per training step."""
        return mx.concatenate([self.parts[r // self.per][r % self.per: r % self.per + 1] for r in map(int, local)])



def classes_to_cache(sizes: Sequence[int], budget_bytes: float) -> list[int]:
    """The length classes whose taps to cache within `budget_bytes`, given each class's bytes
    `sizes`: the subset with the most bytes that fits (a class is cached whole or not at all; a
    step's time saved is about proportional to its tokens, so bytes cached measure the saving);
    with more than 12 classes, the largest first that fit. Empty if none fits."""
    if len(sizes) > 12:  # 2^n subsets stop being instant: largest classes first that fit
        chosen, total = [], 0
        for c in sorted(range(len(sizes)), key=lambda c: -sizes[c]):
            if sizes[c] and total + sizes[c] <= budget_bytes:
                chosen.append(c)
                total += sizes[c]
        return sorted(chosen)
    best: tuple[int, list[int]] = (0, [])
    for mask in range(1, 1 << len(sizes)):  # the default 4 length classes: 15 subsets
        chosen = [c for c in range(len(sizes)) if mask >> c & 1 and sizes[c] > 0]
        total = sum(sizes[c] for c in chosen)
        if best[0] < total <= budget_bytes:
            best = (total, chosen)
    return best[1]


def compute_class_taps(taps: Callable[[mx.array], mx.array], tokens: np.ndarray, rows: np.ndarray, width: int,
                       batch_size: int, progress: Callable[[int], object], log: Callable[[str], None]
                       ) -> Optional[CachedTaps]:
    """The taps of one length class, computed in batches and kept as computed (no concatenation,
    which would hold the class's bytes twice at its peak).

    Args:
        taps: the target's taps of a batch, (n, width) int ids -> (n, width, n_taps * D).
        tokens: (n_all, S) int32, the padded dataset; rows: the class's row indices (int array),
            in its `Trainer.local` order; width: the class's padded width.
        batch_size: rows per target forward (and per `CachedTaps` part).
        progress: called with the rows done after each batch.
        log: the message when the class does not fit.

    Returns:
        The class's `CachedTaps`; None when it holds no rows or its taps do not fit in memory
        (the backend raises while computing them: logged, and its steps run the target).

    Raises:
        RuntimeError: a backend failure other than memory.
    """
    parts = []
    try:
        for i in range(0, len(rows), batch_size):
            t = taps(mx.array(tokens[rows[i: i + batch_size], :width]))
            mx.eval(t)
            parts.append(t)
            progress(len(rows[i: i + batch_size]))
    except RuntimeError as e:  # MLX's allocation failures (CUDA, Metal) are RuntimeErrors
        if not any(w in str(e).lower() for w in ("out of memory", "malloc", "allocat")):
            raise  # a bug, not a full device: say so instead of training online quietly
        parts = t = None  # free what was computed before clearing the cache
        mx.clear_cache()
        log(f"taps: length class {width} did not fit in memory ({str(e)[:120]}); its steps run the target")
        return None
    return CachedTaps(parts, batch_size) if parts else None


def tap_cache_plan(trainer, cache_taps_gib: float) -> tuple[list[int], str]:
    """Which length classes' taps a `Trainer` caches within `cache_taps_gib` GiB
    (`Trainer.classes_to_cache`) and the log line that says so (what is cached, what it takes,
    what is left to run online)."""
    sizes, classes = trainer.class_tap_bytes(), trainer.classes_to_cache(cache_taps_gib * 2**30)
    gib = lambda b: f"{b / 2**30:.3g} GiB"  # noqa: E731 - tiny test data and 100 GiB runs alike
    if classes == [c for c, size in enumerate(sizes) if size]:  # every class that holds sequences
        return classes, f"taps: caching the target's taps of all sequences ({gib(sum(sizes))})"
    if classes:
        return classes, (f"taps: all would take {gib(sum(sizes))}, over --cache-taps-gib {cache_taps_gib:g}: caching "
                         f"length classes {[trainer.widths[c] for c in classes]} "
                         f"({gib(sum(sizes[c] for c in classes))}); the other classes' steps run the target")
    return classes, (f"taps: not cached (the smallest length class takes {gib(min((s for s in sizes if s), default=0))}, "
                     f"over --cache-taps-gib {cache_taps_gib:g}); every step runs the target")
