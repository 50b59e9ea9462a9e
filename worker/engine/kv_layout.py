"""What one position of a session's KV caches costs, and how their arrays are laid out, per
decoding mode: measured on the loaded models by writing one position (dtypes and head layouts
vary by model). The scheduler sizes rows with the costs; an imported state must match the layouts.
"""
from __future__ import annotations

import mlx.core as mx

from worker.caches.rows import STEP, RowKVCache, make_row_caches
from worker.capture import HiddenCapture
from worker.engine.kv_transfer import Layout


def measure(models, capture: HiddenCapture | None) -> tuple[dict[str, int], dict[str, list[tuple]]]:
    """KV bytes per row position and the caches' layouts, per batched mode (engine thread).

    Args:
        models: the loaded models (`worker.engine.modes.LoadedModels`).
        capture: the target's hidden-state capture for a DFlash draft (None without one).

    Returns:
        (bytes_per_position, layouts): per mode ("plain", and "dflash" with a DFlash draft), the
        bytes one position costs over every layer's keys and values (target, then draft), and
        `Layout.per_position` of each cache, target layers then draft layers.

    Raises:
        ValueError: the target has non-attention layers (`make_row_caches`).
    """
    caches = make_row_caches(models.target, 1)
    models.target(mx.array([[0]], dtype=mx.uint32), cache=caches)
    mx.eval([c.state for c in caches])
    target = sum(c.nbytes for c in caches) // STEP
    sizes = {"plain": target}
    layouts = {"plain": [lay.per_position() for lay in _layouts(caches, "target")]}
    if models.draft_kind == "dflash":
        d = [RowKVCache(1) for _ in models.draft.layers]
        with capture:
            models.target(mx.array([[0]], dtype=mx.uint32), cache=make_row_caches(models.target, 1))
        models.draft.extend_context(capture.hidden(), d)
        mx.eval([c.state for c in d])
        sizes["dflash"] = target + sum(c.nbytes for c in d) // STEP
        layouts["dflash"] = layouts["plain"] + [lay.per_position() for lay in _layouts(d, "draft")]
    return sizes, layouts


def _layouts(caches: list[RowKVCache], part: str) -> list[Layout]:
    dtype = (lambda c: str(c.keys.dtype).removeprefix("mlx.core."))
    return [Layout(part, i, dtype(c), tuple(c.keys.shape), tuple(c.values.shape)) for i, c in enumerate(caches)]
