"""The DFlash draft's block forward as one compiled MLX graph, reused for every cycle of a shape.

Why: on the H200 a DFlash cycle is bound by per-operation overhead, not bandwidth, and the draft
(2.15 ms of a 10.55 ms cycle, measured on the H200) builds its graph in Python every cycle; the target's
verify already runs compiled (`worker.compiled_forward`). An `mx.compile`d function is traced once
per input shape and replayed from C++, with chains of elementwise operations fused.

What varies between cycles and would retrace every cycle: the new context positions S (the taps
of the tokens the last verify kept, 1..B) and the cache offset T. Here the taps are padded to a
fixed P rows (the draft's trained block size) and T and S are int32 scalar arrays
(`Model.padded_draft`): the new context's K/V are written at T (padding included), then the
block's at T+S over the padding, and the mask shows keys below T+S+L only. So a trace depends on
(block length L, buffer length) alone, like the target's. Because S is an array, the next
cycle's draft can be queued before the host knows S (`CompiledDraft.queue`: S, the first token
and the taps still on the device, computed from the verify's verdict). Calls it cannot run that
way (no cache yet, more than P pending taps, a buffer past `max_positions`, a draft that is not
a `worker.models.dflash.Model`) run the eager forward: the same values.
"""
from __future__ import annotations

import logging
import os
from functools import partial
from typing import Optional, Sequence

import mlx.core as mx

from worker.models.dflash import COMPILED_DRAFT_ATTR, Model, PaddedKVCache
from worker.small_attention import patched_sdpa, uses_small_attention

log = logging.getLogger(__name__)


class CompiledDraft:
    """Runs a DFlash draft's block forward and its proposal (`Model.propose`) as a compiled graph.

    Usage, on the draft's `make_cache()` caches:

        fwd = shared_compiled_draft(draft)              # once per draft (shared by sessions)
        blocks = fwd(block_ids, taps, cache)            # block_ids (1, L) uint32
        # blocks (branches, L) uint32 target ids, [first token, drafts]; taps (1, S, n_taps * D) or None

    Each call appends the S context positions to the caches (offset += S), as
    `Model.__call__` followed by `Model.propose` does, and returns the same blocks.

    Args:
        draft: a bound `worker.models.dflash.Model`.
        max_positions: the longest cache buffer run compiled (default 8192, or
            `FLASHFLEET_COMPILE_MAX_POSITIONS`): MLX keeps every trace, so buffers past it run
            eagerly and the traces stay bounded (block lengths x max_positions / 256 buckets).

    Raises (on call):
        ValueError: the caches disagree on their offsets.
    """

    def __init__(self, draft: Model, max_positions: Optional[int] = None):
        self.draft = draft
        self.pad = int(draft.block_size)
        self.taps_width = len(draft.target_layer_ids) * int(draft.args.hidden_size)
        self.max_positions = int(max_positions if max_positions is not None
                                 else os.environ.get("FLASHFLEET_COMPILE_MAX_POSITIONS", "8192"))
        self._fns = {}  # (branches, small attention) -> the compiled forward proposing that many blocks
        self.broken = False  # a trace failed: every call runs eagerly

    def _eager(self, block_ids: mx.array, taps: Optional[mx.array], cache, branches: int) -> mx.array:
        return self.draft.propose(self.draft(block_ids, taps, cache)[0], block_ids[0, :1], branches)

    def __call__(self, block_ids: mx.array, taps: Optional[mx.array],
                 cache: Sequence[PaddedKVCache], branches: int = 1) -> mx.array:
        T = self._offset(cache)
        S = 0 if taps is None else taps.shape[1]
        L = block_ids.shape[1]
        if self.broken or S > self.pad or any(c.keys is None for c in cache):
            return self._eager(block_ids, taps, cache, branches)
        if not self._fits(cache, L):
            return self._eager(block_ids, taps, cache, branches)
        if taps is None:
            taps = mx.zeros((1, self.pad, self.taps_width), cache[0].keys.dtype)
        blocks = self._run(block_ids, taps, mx.array(S, dtype=mx.int32), cache, branches)
        if blocks is None:
            return self._eager(block_ids, taps[:, :S] if S else None, cache, branches)
        for c in cache:
            c.offset = T + S
        return blocks

    def queue(self, first: mx.array, taps: mx.array, n_new: mx.array, L: int,
              cache: Sequence[PaddedKVCache], branches: int = 1) -> Optional[mx.array]:
        """The next cycle's draft, built before the host knows how many verified positions the
        target keeps: the verdict is still on the device, so the draft can be queued right
        behind the verify (`worker.spec.dflash`, "overlap").

        Args:
            first: (1,) integer array, the block's first token (the verify's bonus token).
            taps: (1, n, n_taps * D) taps of the verified positions, n <= the draft's block size;
                rows from `n_new` on are not context (any values).
            n_new: int32 scalar array, 1 <= n_new <= n: the positions the target keeps.
            L: block length (first token + L-1 masks).
            cache: the draft's caches (holding context already).
            branches: candidate blocks to propose (`Model.propose`).

        Returns:
            (branches, L) uint32 blocks, as `__call__` would give them for `taps[:, :n_new]`; the
            caches' buffers then hold that context, but their offsets stay: the caller adds the
            kept count to every cache's `offset` once it has read it. None when the call cannot
            run compiled (no cache yet, a block longer than the draft's, a buffer past
            `max_positions`, a failed trace): no context was written (the buffers may have grown
            by a bucket), so draft after the read-back instead.

        Raises:
            ValueError: the caches disagree on their offsets.
        """
        self._offset(cache)
        if self.broken or taps.shape[1] > self.pad or any(c.keys is None for c in cache):
            return None
        if not self._fits(cache, L):
            return None
        block_ids = mx.concatenate([first.reshape(1, 1).astype(mx.uint32),
                                    mx.full((1, L - 1), int(self.draft.mask_token_id), mx.uint32)], axis=1)
        return self._run(block_ids, taps, n_new, cache, branches)

    def _offset(self, cache: Sequence[PaddedKVCache]) -> int:
        T = cache[0].offset
        if any(c.offset != T for c in cache):
            raise ValueError(f"draft caches at different offsets {sorted({c.offset for c in cache})}")
        return T

    def _fits(self, cache: Sequence[PaddedKVCache], L: int) -> bool:
        """Grows the buffers for a padded call of block length L; whether they stay compiled."""
        for c in cache:
            c.reserve(self.pad + L)
        return cache[0].keys.shape[2] <= self.max_positions

    def _run(self, block_ids: mx.array, taps: mx.array, S: mx.array, cache: Sequence[PaddedKVCache],
             branches: int) -> Optional[mx.array]:
        """The compiled forward on taps padded to `pad` rows (S real); writes the caches' buffers,
        not their offsets. None (and `broken` set) when it fails to trace."""
        if taps.shape[1] < self.pad:
            taps = mx.pad(taps, [(0, 0), (0, self.pad - taps.shape[1]), (0, 0)])
        attn = uses_small_attention(self.draft)  # a trace per attention path (it records kernels)
        fn = self._fns.get((branches, attn))
        if fn is None:
            fn = self._fns[branches, attn] = mx.compile(partial(self.draft.padded_draft, branches=branches))
        try:
            with patched_sdpa(attn):
                blocks, keys, values = fn(block_ids, taps, mx.array(cache[0].offset, dtype=mx.int32), S,
                                          [c.keys for c in cache], [c.values for c in cache])
        except (ValueError, RuntimeError, TypeError) as e:
            log.warning("compiled draft forward failed to trace (%s); drafting eagerly from now on", e)
            self.broken = True
            return None
        for c, k, v in zip(cache, keys, values):
            c.keys, c.values = k, v
        return blocks


def compiled_draft_pays() -> bool:
    """Whether the worker compiles the draft by default on this device: on a GPU, yes (the H200:
    a DFlash cycle 2.5-5.2% shorter in each of 4 processes, docs/benchmarks.md "The draft's
    forward compiled"); on the CPU, no: there the padded context rows are real arithmetic (the
    SmolLM2 draft's forward took 169 ms compiled against 138 ms eager, float32, 2 cores)."""
    return mx.default_device().type == mx.gpu


def shared_compiled_draft(draft: Model) -> CompiledDraft:
    """The `CompiledDraft` of this draft, made once and kept on it, so sessions share its traces
    (each costs a graph build and, on CUDA, kernel compiles)."""
    fwd = draft.__dict__.get(COMPILED_DRAFT_ATTR)
    if fwd is None:
        fwd = CompiledDraft(draft)
        object.__setattr__(draft, COMPILED_DRAFT_ATTR, fwd)
    return fwd
