"""The target's decode forward as one compiled MLX graph, reused for every step of a shape.

Why: on the H200 a 0.5-1.5B target is bound by per-operation overhead, not bandwidth (a 1.5B
step reads 3.55 GB in 5.7-6.4 ms, 0.55 TB/s), and building a forward's graph in Python takes
2.6-3.0 ms (docs/benchmarks.md, "Compiled forward"). An
`mx.compile`d function is traced once per input shape; later calls replay the traced graph from
C++ (no Python per operation) and fuse chains of elementwise operations into single kernels.

What stops an mlx-lm forward from being compiled as it is: its KV cache keeps `offset` as a
Python int (slices, RoPE offsets and masks baked into the trace would be stale on the next step)
and returns a key length that grows every step (a new shape, so a new trace, every step). Here
the forward runs on `_OffsetCache` stand-ins instead: the offset is an int32 scalar array (MLX's
`slice_update` takes array start indices and `fast.rope` an array offset), and every update
returns the whole fixed-size buffer of `worker.models.dflash.PaddedKVCache` with an additive mask
that hides the positions not yet written. So the trace depends only on (tokens per forward,
buffer length): a verify of B tokens retraces once per 256-position bucket, as its attention
kernels already compile once per bucket on CUDA.

No model code is copied: the mlx-lm model's own `__call__` runs on the stand-ins (any model that
passes `cache.offset` on to RoPE without reading it, calls `update_and_fetch` and builds its mask
with `cache.make_mask`: llama, qwen2, qwen3 and the other full-attention architectures;
`compilable_model` rules out the known exceptions, and a model that fails its first trace runs
uncompiled). The operations are the uncompiled forward's over the same padded cache, except
that a one-token step attends over the masked buffer instead of the exact slice: equal in
float32 on the CPU (tests/test_compiled_forward.py); in bf16 on a GPU the different attention
kernel can round differently and flip a near-tie, as a multi-token verify already can.
"""
from __future__ import annotations

import logging
import os
from functools import partial
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE

from worker.capture import HiddenCapture
from worker.models.dflash import PaddedKVCache, additive_mask, takes_additive_masks
from worker.small_attention import patched_sdpa, uses_small_attention

log = logging.getLogger(__name__)


class _OffsetCache:
    """A PaddedKVCache's buffers inside a traced forward, with the offset as an array.

    keys, values: (1, H_kv, S, head_dim) buffers; offset: int32 scalar array, the positions
    already written. `update_and_fetch` writes L new positions at offset and returns the whole
    buffers; `make_mask` returns the additive (L, S) mask for them (0 where a query may look:
    key position <= its own; -inf elsewhere, the unwritten tail included)."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array):
        self.keys, self.values, self.offset = keys, values, offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.keys = mx.slice_update(self.keys, keys, self.offset, axes=(2,))
        self.values = mx.slice_update(self.values, values, self.offset, axes=(2,))
        self.offset = self.offset + keys.shape[2]
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        if window_size is not None:  # `compilable` keeps sliding-window models out
            raise NotImplementedError("a compiled forward does not support sliding-window layers")
        query_pos = self.offset + mx.arange(N)
        return additive_mask(mx.arange(self.keys.shape[2])[None, :] <= query_pos[:, None], self.keys.dtype)


def compilable_model(model: nn.Module) -> bool:
    """Whether `CompiledTarget` can run this model at all: mlx-lm gives it plain `KVCache`s only
    (no sliding-window, rotating or recurrent layers), the architecture hands masks to attention
    unchanged, additive ones included (`takes_additive_masks`), and no RoPE reads the offset in
    Python (mlx-lm's `DynamicNTKScalingRoPE` compares it with the context limit). A model that
    still reads the offset in Python fails its first trace; `CompiledTarget` then runs it
    uncompiled."""
    return _own_cache_if_compilable(model) is not None


def _own_cache_if_compilable(model: nn.Module) -> Optional[list]:
    """mlx-lm's prompt cache of the model when `compilable_model` holds, else None."""
    if any(isinstance(m, DynamicNTKScalingRoPE) for _, m in model.named_modules()):
        return None
    own = make_prompt_cache(model)
    return own if all(type(c) is KVCache for c in own) and takes_additive_masks(model) else None


def compilable(model: nn.Module, cache: Sequence) -> bool:
    """`compilable_model(model)`, and this cache has a `PaddedKVCache` for each layer (the caches
    of `worker.spec.dflash.make_target_cache`)."""
    if not cache or any(type(c) is not PaddedKVCache for c in cache):
        return False
    own = _own_cache_if_compilable(model)
    return own is not None and len(own) == len(cache)


class CompiledTarget:
    """Runs `model(tokens, cache)` (optionally capturing tapped layers) as a compiled graph.

    Usage, on the caches of `worker.spec.dflash.make_target_cache`:

        fwd = CompiledTarget(target, capture)       # once per session (or per worker)
        logits, taps = fwd(tokens, cache)            # tokens (K, L) uint32
        # logits (K, L, V) in the model's dtype; taps (K, L, n_taps * D) or None
        fwd.choose_row(cache, i)                     # K > 1: keep candidate row i's keys

    With K > 1 the rows are candidate blocks at the same positions (a batched DFlash verify,
    `worker.models.dflash.Model.propose`): each attends over the cached prefix and its own
    tokens. Until the next forward the caches' buffers are views of K-row buffers (K times the
    KV memory), so callers keep K > 1 to short buffers.

    Each call writes the L positions into the caches' buffers and advances their offsets, as
    the uncompiled forward would; the buffers grow by whole `PaddedKVCache.step` buckets first
    (outside the graph), so a new trace happens once per (L, buffer length). MLX keeps every
    trace of a function and searches them on each call, so buffers longer than `max_positions`
    run uncompiled instead (same values): the traces stay bounded, about 5 block lengths x
    max_positions / 256 buckets, and at such lengths attention, not graph building, dominates.

    Args:
        model: an mlx-lm model for which `compilable(model, cache)` holds.
        capture: a `HiddenCapture` on the same model (its `queue` is ignored inside a trace),
            or None for logits only.
        max_positions: the longest KV buffer run compiled (default 8192, or
            `FLASHFLEET_COMPILE_MAX_POSITIONS` from the environment).

    Raises (on call):
        ValueError: a cache is empty (prefill uncompiled first: a prompt's chunk lengths vary,
            and the buffers' shape and dtype come from the first forward) or the caches
            disagree on their offsets (a forward must see one sequence); K > 1 rows where
            the forward cannot run compiled (`branches_fit` says so beforehand).
    """

    def __init__(self, model: nn.Module, capture: Optional[HiddenCapture] = None,
                 max_positions: Optional[int] = None):
        self.model, self.capture = model, capture
        self.max_positions = int(max_positions if max_positions is not None
                                 else os.environ.get("FLASHFLEET_COMPILE_MAX_POSITIONS", "8192"))
        # one compiled forward per attention path (`worker.small_attention`): a trace records
        # the kernels it ran, so the two must not share one
        self._fns = {False: mx.compile(self._forward), True: mx.compile(partial(self._forward))}
        self.broken = False  # a trace failed: every call runs uncompiled
        self.rows_broken = False  # a trace of candidate rows failed: one row a verify from now on
        self._rows = None  # the last forward's K-row buffers, until `choose_row`

    def _eager(self, tokens: mx.array, cache: Sequence[PaddedKVCache]):
        if self.capture is None:
            return self.model(tokens, cache=cache), None
        with self.capture:
            logits = self.model(tokens, cache=cache)
        return logits, self.capture.hidden()

    def _forward(self, tokens: mx.array, offset: mx.array, keys: list, values: list):
        K = tokens.shape[0]  # candidate rows at the same positions: each attends over its own copy
        if K > 1:
            keys = [mx.broadcast_to(k, (K, *k.shape[1:])) for k in keys]
            values = [mx.broadcast_to(v, (K, *v.shape[1:])) for v in values]
        caches = [_OffsetCache(k, v, offset) for k, v in zip(keys, values)]
        if self.capture is None:
            logits, taps = self.model(tokens, cache=caches), None
        else:
            queue, self.capture.queue = self.capture.queue, False  # no async_eval inside a trace
            try:
                with self.capture:
                    logits = self.model(tokens, cache=caches)
                taps = self.capture.hidden()
            finally:
                self.capture.queue = queue
        return logits, taps, [c.keys for c in caches], [c.values for c in caches]

    def __call__(self, tokens: mx.array, cache: Sequence[PaddedKVCache]):
        offset = cache[0].offset
        if any(c.keys is None for c in cache):
            raise ValueError("CompiledTarget needs caches that hold the prompt; prefill first")
        if any(c.offset != offset for c in cache):
            raise ValueError(f"caches at different offsets {sorted({c.offset for c in cache})}")
        L = tokens.shape[1]
        for c in cache:
            c.reserve(L)
        K = tokens.shape[0]
        if self.broken or (K > 1 and self.rows_broken) or cache[0].keys.shape[2] > self.max_positions:
            if K > 1:
                raise ValueError("candidate rows need the compiled forward (see `branches_fit`)")
            return self._eager(tokens, cache)
        attn = uses_small_attention(self.model)
        try:
            with patched_sdpa(attn):
                logits, taps, keys, values = self._fns[attn](tokens, mx.array(offset, dtype=mx.int32),
                                                             [c.keys for c in cache], [c.values for c in cache])
        except (ValueError, RuntimeError, TypeError) as e:
            # A model whose code reads the offset in Python (evaluates an array inside the
            # trace): nothing was written (reserve only grew the buffers), so run it op by op
            # from now on; a failed trace of candidate rows only stops rows (one row may trace).
            log.warning("compiled forward of %s failed to trace %s (%s); running %s", type(self.model).__name__,
                        f"{K} candidate rows" if K > 1 else "", e,
                        "one row a verify" if K > 1 else "it uncompiled")
            if K > 1:
                self.rows_broken = True
                raise ValueError("candidate rows failed to trace") from e
            self.broken = True
            return self._eager(tokens, cache)
        self._rows = (keys, values) if K > 1 else None
        for c, k, v in zip(cache, keys, values):
            # K rows: the caches hold row 0's buffers (a view) until `choose_row` picks another
            c.keys, c.values, c.offset = (k, v, offset + L) if K == 1 else (k[:1], v[:1], offset + L)
            c.rows_held = K
        return logits, taps

    def branches_fit(self, cache: Sequence[PaddedKVCache], n: int) -> bool:
        """Whether a forward of candidate rows with n tokens each would run compiled here (the
        only way rows run): not broken, and the buffer after it within `max_positions`."""
        return (not self.broken and not self.rows_broken and cache[0].keys is not None
                and cache[0].key_length(n) <= self.max_positions)

    def choose_row(self, cache: Sequence[PaddedKVCache], row: int) -> None:
        """After a forward of K candidate rows, keeps row `row`'s keys and values in the caches
        (views of that forward's K-row buffers; row 0 is kept unless this is called) and lets go
        of the K-row buffers (they stay alive only as long as the caches' views do).

        Raises:
            ValueError: no forward of candidate rows since the last call."""
        if self._rows is None:
            raise ValueError("choose_row: no forward of candidate rows to choose from")
        if row:
            for c, k, v in zip(cache, *self._rows):
                c.keys, c.values = k[row: row + 1], v[row: row + 1]
        self._rows = None


def shared_compiled_target(model: nn.Module, layer_ids: Optional[Sequence[int]]) -> CompiledTarget:
    """The `CompiledTarget` of this model capturing `layer_ids` (None: no taps), made once and
    kept on the model, so that sessions share its traces (a trace per shape costs a graph build
    and, on CUDA, kernel compiles; a new instance would trace again)."""
    key = None if layer_ids is None else tuple(int(i) for i in layer_ids)
    store = model.__dict__.get("_flashfleet_compiled")
    if store is None:
        store = {}
        object.__setattr__(model, "_flashfleet_compiled", store)
    if key not in store:
        store[key] = CompiledTarget(model, None if key is None else HiddenCapture(model, key))
    return store[key]
