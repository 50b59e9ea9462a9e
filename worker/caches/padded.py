"""KV caches whose multi-token updates keep one key length per bucket of positions: the caches the
per-session speculative methods (classic draft models, cross-tokenizer drafts) verify and draft
on, and a DFlash draft's own cache outside the batched engine (`worker.models.dflash.Model.make_cache`).
"""
from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache, create_attention_mask, make_prompt_cache

from flashfleet.kv_need import POSITION_BUCKET


def additive_mask(visible: mx.array, dtype: Optional[mx.Dtype]) -> mx.array:
    """A boolean attention mask as the additive one attention kernels take: 0 where `visible`,
    -inf elsewhere, in `dtype` (the queries' dtype); `visible` unchanged when dtype is None.

    Why: `mx.fast.scaled_dot_product_attention` turns a boolean mask into an additive one inside
    every call when its fused kernel takes no boolean masks (CUDA's cuDNN path, MLX 0.32: two
    `full_like` and a `where` per call, mlx/fast.cpp), i.e. three kernels per layer of a 16-token
    verify, 84 on a 28-layer target; converted once per forward here, the layers share it. The
    values it gives attention are the same (exp(-inf) = 0); every query sees at least its own key,
    so no row is all -inf.
    """
    if dtype is None:
        return visible
    return mx.where(visible, mx.array(0, dtype), mx.array(-float("inf"), dtype))


# mlx-lm architectures whose layers hand the mask from `create_attention_mask` to attention
# unchanged (mlx_lm.models.base.scaled_dot_product_attention takes boolean and additive masks
# alike). Others may read it as boolean (deepseek_v32: `mx.where(mask, scores, -inf)`), so their
# masks stay boolean: slower on CUDA, never wrong.
ADDITIVE_MASK_MODELS = frozenset({
    "llama", "mistral", "smollm3", "qwen2", "qwen3", "qwen3_moe", "gemma3", "gemma3_text", "phi3",
    "starcoder2", "olmo2", "granite", "cohere", "internlm2", "minicpm", "exaone", "glm4",
    "ministral3", "mistral3",
})


def takes_additive_masks(model: nn.Module) -> bool:
    """Whether an mlx-lm model's attention masks may be additive (its `model_type` is in
    `ADDITIVE_MASK_MODELS`)."""
    kind = getattr(model, "model_type", None) or getattr(getattr(model, "args", None), "model_type", None)
    return kind in ADDITIVE_MASK_MODELS


class PaddedKVCache(KVCache):
    """A `KVCache` whose multi-token updates attend over the whole allocated buffer, with a mask.

    Why: on MLX's CUDA backend, `mx.fast.scaled_dot_product_attention` with more than one query
    compiles a kernel per key length (measured on the H200, MLX 0.32.4: ~65 ms for each new
    length, with or without cuDNN; a matmul of the same shapes costs 0.2 ms). A speculative
    verify (classic or cross-tokenizer draft) or a DFlash draft call on this cache has a new key
    length every cycle, so every cycle would pay that.
    Here the buffer grows in `step` (`flashfleet.kv_need.POSITION_BUCKET`, 256) position buckets and multi-token updates return the
    full buffer, so the key length changes once per 256 positions; `make_mask` returns the
    matching mask (causal, optionally windowed; additive in the keys' dtype once the cache holds
    keys and `additive_ok`, see `additive_mask`), which also hides the unused tail. One-token
    updates (plain decode steps) return the exact slice and need no mask, as in `KVCache`.
    Trimming only moves `offset` (O(1)).
    The bucket is the batched caches' (worker/caches/rows.py), whose size the coordinator's KV
    estimate assumes (flashfleet/kv_need.py).
    """

    step = POSITION_BUCKET
    additive = True  # False: boolean masks (the same attention, more graph operations)
    additive_ok = False  # also for caches made without __init__ (mlx-lm's `from_state`)

    def __init__(self, additive_ok: bool = False):
        """additive_ok: the model reading this cache's masks takes additive ones (it hands them
        to attention unchanged: `takes_additive_masks`); False keeps them boolean."""
        super().__init__()
        self.additive_ok = additive_ok

    def update_and_fetch(self, keys, values):
        """Writes keys (B, H, S, Dk) and values (B, H, S, Dv) at positions offset..offset+S-1.

        Returns:
            (keys, values) to attend over: the exact (B, H, offset+S, D*) slices when S == 1,
            else the whole buffers (B, H, `key_length(S)`, D*), whose positions past offset+S
            `make_mask` hides.
        """
        prev = self.offset
        end = prev + keys.shape[2]
        if self.keys is None:
            B, H, _, Dk = keys.shape
            size = -(-end // self.step) * self.step
            self.keys = mx.zeros((B, H, size, Dk), keys.dtype)
            self.values = mx.zeros((B, H, size, values.shape[3]), values.dtype)
        else:
            self.reserve(keys.shape[2])
        self.keys[..., prev:end, :] = keys
        self.values[..., prev:end, :] = values
        self.offset = end
        if keys.shape[2] == 1:
            return self.keys[..., :end, :], self.values[..., :end, :]
        return self.keys, self.values

    def reserve(self, n: int) -> None:
        """Grows the buffers (by whole buckets, zero-filled) so that n more positions fit,
        without writing any. Needs a cache that already holds keys (their shape and dtype)."""
        if self.offset + n > self.keys.shape[2]:
            grow = self.key_length(n) - self.keys.shape[2]
            B, H, _, Dk = self.keys.shape
            self.keys = mx.concatenate([self.keys, mx.zeros((B, H, grow, Dk), self.keys.dtype)], axis=2)
            self.values = mx.concatenate(
                [self.values, mx.zeros((B, H, grow, self.values.shape[3]), self.values.dtype)], axis=2)

    def key_length(self, n: int) -> int:
        """Keys an update of n > 1 positions will return (the buffer length after it)."""
        end = self.offset + n
        size = 0 if self.keys is None else self.keys.shape[2]
        return size if end <= size else -(-end // self.step) * self.step

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        """The attention mask of N new queries at positions offset..offset+N-1 (mlx-lm's
        `make_mask` signature; call it before `update_and_fetch`).

        Returns:
            For N == 1 what mlx-lm's `create_attention_mask` gives (None, or a windowed
            boolean array with `window_size`); for N > 1 an (N, key_length(N))
            causal mask, optionally windowed, False/-inf on the padded tail: boolean, or
            additive in the keys' dtype (see the class docstring).
        """
        if N == 1:
            return create_attention_mask(N, self.offset, return_array, window_size)
        mask = create_causal_mask(N, self.offset, window_size=window_size)  # (N, offset + N)
        pad = self.key_length(N) - (self.offset + N)
        if pad:
            mask = mx.pad(mask, [(0, 0), (0, pad)])  # padded keys: False
        # The first forward (empty cache) does not know the dtype yet: boolean, as mlx-lm's.
        dtype = self.keys.dtype if self.additive and self.additive_ok and self.keys is not None else None
        return additive_mask(mask, dtype)


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
        raise ValueError(f"speculative decoding needs a trimmable target cache; got {sorted(bad)}")
    return cache
