"""The target cache classic and cross-tokenizer drafts verify on."""
from __future__ import annotations

import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from worker.models.dflash import PaddedKVCache, takes_additive_masks


def make_target_cache(target: nn.Module) -> list:
    """The target's prompt cache with every layer trimmable.

    Plain `KVCache`s become `PaddedKVCache`s, so a verify's attention keeps its key length for
    256 positions at a time (on CUDA every new length of a multi-query attention costs a kernel
    compile; see `PaddedKVCache`). Sliding-window layers' `RotatingKVCache`s stop being trimmable
    once they wrap (mlx-lm #1423), so they are replaced too: mlx-lm models pass `window_size`
    when they build the mask of a sliding layer, and `make_mask` honours it, so attention is
    unchanged (memory of those layers grows with the context instead of staying at the window).
    Masks are additive where the architecture takes them (`takes_additive_masks`).

    Raises:
        ValueError: some layer's cache cannot be trimmed (e.g. recurrent GatedDeltaNet state).
    """
    additive_ok = takes_additive_masks(target)
    cache = [PaddedKVCache(additive_ok) if type(c) in (KVCache, RotatingKVCache) else c
             for c in make_prompt_cache(target)]
    bad = {type(c).__name__ for c in cache if not c.is_trimmable()}
    if bad:
        raise ValueError(f"DFlash needs a trimmable target cache; got {sorted(bad)}")
    return cache
