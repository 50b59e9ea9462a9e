"""A batched KV cache whose rows keep their own lengths: the layout the batched engine decodes on.

mlx-lm's `BatchKVCache` (mlx_lm/models/cache.py) left-pads rows to one shared write index, so
`trim` rolls every row back alike; speculative decoding keeps a different number of verified
tokens in each row. Here rows are left-aligned and right-padded: row r holds positions
[0, lengths[r]) at the start of its buffer row, a forward of L tokens writes them at
[lengths[r], lengths[r] + L) with one scatter (`mx.put_along_axis`), and the mask hides, per row,
every key past the query's own position. Rolling row r back is setting its length: O(1), no data
moves, and rejected positions are overwritten by the next write.

The buffer grows in `STEP`-position buckets (a new key length is a new kernel shape on CUDA), and
forwards attend over the whole buffer; the mask hides the padding.
"""
from __future__ import annotations

import threading
from typing import Optional, Sequence

import mlx.core as mx

from flashfleet.kv_need import POSITION_BUCKET, bucket

STEP = POSITION_BUCKET  # buffer positions are allocated in buckets of this many
# Arrays one forward's layers would each build alike (positions, advanced lengths, scatter
# indices), kept by the first layer for the next ones; per thread (each engine thread its own).
# An entry is used only for the very input arrays it was built from, so it is never stale.
_shared = threading.local()


class RowKVCache:
    """The keys and values of one attention layer for B sequences of their own lengths.

    Attributes:
        keys: (B, H, S, Dk) or None before the first write.
        values: (B, H, S, Dv) or None.
        lengths: (B,) int32 on the device, positions held per row; also the RoPE offset of each
            row's next token (`offset`, which mlx-lm models read).
        host_lengths: the same lengths as Python ints (the scheduler's bookkeeping).
        additive_dtype: masks are additive in this dtype (0 / -inf, what fused attention kernels
            take on CUDA), or boolean when None.

    Models call `make_mask` once per forward (before any layer writes), then every layer's
    `update_and_fetch`; both size the buffer the same way, so the mask matches the keys.
    """

    def __init__(self, batch: int = 1, additive_dtype: Optional[mx.Dtype] = None):
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        self.lengths = mx.zeros((batch,), mx.int32)
        self.host_lengths: list[int] = [0] * batch
        self.additive_dtype = additive_dtype

    # ----- what mlx-lm models use --------------------------------------------------------------

    @property
    def offset(self) -> mx.array:
        """(B,) int32: the position of each row's next token (RoPE offset)."""
        return self.lengths

    @property
    def batch_size(self) -> int:
        return len(self.host_lengths)

    def buffer_length(self, new_tokens: int) -> int:
        """S after a write of `new_tokens` positions a row: the current S, or the bucket that holds
        the longest row's new end."""
        have = 0 if self.keys is None else self.keys.shape[2]
        return max(have, bucket(max(self.host_lengths, default=0) + new_tokens))

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None,
                  **_: object) -> mx.array:
        """(B, 1, N, S) mask of N new queries a row: query i of row r (position lengths[r] + i)
        sees keys at positions <= its own, within `window_size` when given."""
        S = self.buffer_length(N)
        qpos = (self.lengths[:, None] + mx.arange(N, dtype=mx.int32))[:, :, None]  # (B, N, 1)
        kpos = mx.arange(S, dtype=mx.int32)[None, None]
        visible = kpos <= qpos
        if window_size is not None:
            visible = visible & (qpos - kpos < window_size)
        return as_attention_mask(visible[:, None], self.additive_dtype)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Writes keys (B, H, L, Dk) / values (B, H, L, Dv) at each row's [length, length + L),
        advances the lengths by L, and returns the whole buffers (B, H, S, D*).

        Every layer of a forward starts from the same lengths: the positions and the advanced
        lengths are built by the first layer and shared by the next ones (`_shared`), so a
        forward builds them once, not once per layer (host time on a launch-bound GPU)."""
        L = keys.shape[2]
        memo = getattr(_shared, "advance", None)
        if memo is not None and memo[0] is self.lengths and memo[1] == L and memo[2] == self.host_lengths:
            positions, lengths, host = memo[3:]
        else:
            positions = self.lengths[:, None] + mx.arange(L, dtype=mx.int32)[None]
            lengths, host = self.lengths + L, [n + L for n in self.host_lengths]
            _shared.advance = (self.lengths, L, self.host_lengths, positions, lengths, host)
        self.write(keys, values, positions, L)
        self.lengths, self.host_lengths = lengths, host
        return self.keys, self.values

    def write(self, keys: mx.array, values: mx.array, positions: mx.array, extent: int) -> None:
        """Scatters keys (B, H, L, Dk) / values (B, H, L, Dv) to per-row positions (B, L) int32,
        distinct within a row and below (longest row's length + extent); the buffer grows to
        `buffer_length(extent)`. Lengths are left to the caller. The scatter indices of one
        `positions` array and shape are built once for every layer (`_shared`)."""
        B, H, _, _ = keys.shape
        self._grow(B, H, keys.shape[3], values.shape[3], keys.dtype, extent)
        memo = getattr(_shared, "index", None)
        if memo is not None and memo[0] is positions and memo[1] == keys.shape and memo[2] == values.shape:
            kidx, vidx = memo[3:]
        else:
            idx = positions[:, None, :, None]
            kidx = mx.broadcast_to(idx, keys.shape)
            vidx = kidx if values.shape == keys.shape else mx.broadcast_to(idx, values.shape)
            _shared.index = (positions, keys.shape, values.shape, kidx, vidx)
        self.keys = mx.put_along_axis(self.keys, kidx, keys, axis=2)
        self.values = mx.put_along_axis(self.values, vidx, values, axis=2)

    def reserve(self, new_tokens: int) -> None:
        """Grows the buffer now for a write of `new_tokens` positions a row, evaluated at once, so
        the growth's copy is not part of a forward's graph (whose layers would all hold their old
        and new buffers at the same time). A no-op before the first write (the shapes are unknown)."""
        if self.keys is not None and self.buffer_length(new_tokens) > self.keys.shape[2]:
            self._grow(*self.keys.shape[:2], self.keys.shape[3], self.values.shape[3], self.keys.dtype, new_tokens)
            mx.eval(self.keys, self.values)

    def _grow(self, B: int, H: int, Dk: int, Dv: int, dtype: mx.Dtype, new_tokens: int) -> None:
        S = self.buffer_length(new_tokens)
        if self.keys is None:
            self.keys = mx.zeros((B, H, S, Dk), dtype)
            self.values = mx.zeros((B, H, S, Dv), dtype)
        elif S > self.keys.shape[2]:
            pad = [(0, 0), (0, 0), (0, S - self.keys.shape[2]), (0, 0)]
            self.keys, self.values = mx.pad(self.keys, pad), mx.pad(self.values, pad)

    @property
    def state(self) -> list:
        """Arrays to evaluate after a forward (`mx.eval`)."""
        return [a for a in (self.keys, self.values, self.lengths) if a is not None]

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drops the last n positions of every row (mlx-lm's prompt-cache protocol)."""
        n = min(n, min(self.host_lengths, default=0))
        self.set_lengths([h - n for h in self.host_lengths])
        return n

    @property
    def nbytes(self) -> int:
        """Bytes the buffers hold (all B x S positions, padding included)."""
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    # ----- rows ----------------------------------------------------------------------------------

    def set_lengths(self, host_lengths: Sequence[int], device_lengths: Optional[mx.array] = None) -> None:
        """Sets every row's length (speculative rollback: O(1)); `device_lengths` when the device
        already has them (no host-to-device copy)."""
        self.host_lengths = [int(n) for n in host_lengths]
        if device_lengths is None:
            device_lengths = mx.array(self.host_lengths, dtype=mx.int32)
        # The same array for every layer given it (no per-layer cast), so a forward's layers share
        # their positions (`update_and_fetch`).
        self.lengths = device_lengths if device_lengths.dtype == mx.int32 else device_lengths.astype(mx.int32)

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keeps the given rows in this order (sessions leaving the batch); the buffer shrinks to
        the longest kept row's bucket."""
        self.host_lengths = [self.host_lengths[r] for r in rows]
        if not rows:
            self.keys = self.values = None
            self.lengths = mx.zeros((0,), mx.int32)
            return
        idx = mx.array(list(rows), dtype=mx.int32)
        self.lengths = self.lengths[idx]
        if self.keys is not None:
            S = min(self.keys.shape[2], bucket(max(self.host_lengths)))
            self.keys, self.values = self.keys[idx, :, :S], self.values[idx, :, :S]

    def extend(self, other: "RowKVCache") -> None:
        """Appends other's rows after this cache's (sessions joining the batch)."""
        if other.keys is None and self.keys is None:
            pass
        else:
            ref = self.keys if self.keys is not None else other.keys
            refv = self.values if self.values is not None else other.values
            S = max(bucket(max(self.host_lengths + other.host_lengths, default=0)),
                    *(c.keys.shape[2] for c in (self, other) if c.keys is not None))

            def padded(c: RowKVCache, a: Optional[mx.array], like: mx.array) -> mx.array:
                if a is None:
                    return mx.zeros((c.batch_size, like.shape[1], S, like.shape[3]), like.dtype)
                return a if a.shape[2] == S else mx.pad(a, [(0, 0), (0, 0), (0, S - a.shape[2]), (0, 0)])

            self.keys = mx.concatenate([padded(self, self.keys, ref), padded(other, other.keys, ref)])
            self.values = mx.concatenate([padded(self, self.values, refv), padded(other, other.values, refv)])
        self.host_lengths = self.host_lengths + other.host_lengths
        self.lengths = mx.concatenate([self.lengths, other.lengths])

    def row(self, r: int) -> "RowKVCache":
        """A one-row copy of row r, its buffer cut to its own bucket (a prompt-cache entry)."""
        out = RowKVCache(1, self.additive_dtype)
        n = self.host_lengths[r]
        out.set_lengths([n])
        if self.keys is not None:
            S = min(self.keys.shape[2], bucket(n))
            out.keys = mx.contiguous(self.keys[r: r + 1, :, :S])
            out.values = mx.contiguous(self.values[r: r + 1, :, :S])
        return out


def share_lengths(caches: Sequence[RowKVCache]) -> None:
    """Gives every cache the first one's device lengths array where they hold the same lengths
    (the layers of one model always do), so the next forward's layers share their positions
    (`RowKVCache.update_and_fetch`); call after changing the caches' rows layer by layer."""
    if caches:
        first = caches[0]
        for c in caches[1:]:
            if c.host_lengths == first.host_lengths:
                c.lengths = first.lengths


def as_attention_mask(visible: mx.array, dtype: Optional[mx.Dtype]) -> mx.array:
    """A boolean mask as attention takes it: unchanged when dtype is None, else additive in
    `dtype` (0 where visible, -inf elsewhere; every query sees at least its own key)."""
    if dtype is None:
        return visible
    return mx.where(visible, mx.array(0, dtype), mx.array(-float("inf"), dtype))


def make_row_caches(model, batch: int = 1, additive_dtype: Optional[mx.Dtype] = None) -> list[RowKVCache]:
    """One `RowKVCache` per entry of the model's mlx-lm prompt cache.

    Sliding-window layers keep the whole sequence too (mlx-lm models pass `window_size` when they
    build a sliding layer's mask, and `make_mask` honours it), so attention is unchanged.

    Raises:
        ValueError: a layer's cache is not a KV cache (recurrent or state-space layers): the
            batched engine cannot serve such a model.
    """
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    kinds = [type(c) for c in make_prompt_cache(model)]
    bad = sorted({k.__name__ for k in kinds if k not in (KVCache, RotatingKVCache)})
    if bad:
        raise ValueError(f"the batched engine serves attention models only; this model's caches include {bad}")
    caches = [RowKVCache(batch, additive_dtype) for _ in kinds]
    share_lengths(caches)
    return caches
