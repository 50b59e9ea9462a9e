"""Anchors and attention masks of DFlash training (one job: which key each block query may see).

Training follows the paper (Chen et al. 2026, "DFlash: Block Diffusion for Flash Speculative
Decoding", arXiv 2602.06036, §4.2) as SpecForge implements it
(`specforge/algorithms/common/dflash_family_model.py::OnlineDFlashModel`): pick random **anchor** positions p in the response; each
anchor starts a block `[x_p, MASK x (B-1)]` at sequence positions p .. p+B-1 whose labels are
x_{p+1} .. x_{p+B-1}. A query of block j sees

  - the context feature (fused target taps) at positions kv < p_j, strictly: at inference the
    anchor token is the last committed one, and the target has not run on it yet, so its own
    hidden state (and everything after it) does not exist;
  - the keys of its own block (bidirectionally; causally and/or windowed only for drafts whose
    attention is configured that way, mirroring `worker.models.dflash.Attention._mask`);
  - nothing of any other block.

SpecForge writes this as one sparse (S + N*B)-wide Flex-Attention mask
(`dense_mask` rebuilds it for inspection); the trainer uses the two factors directly
(`context_mask`, `block_mask`), which is the same attention without the N*B x N*B zeros.
"""
from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np


def valid_anchor_range(prompt_len: int, length: int) -> tuple[int, int]:
    """Anchors p allowed in one sequence: [lo, hi) with lo = prompt_len, hi = length - 1.

    An anchor is a response token (inference anchors a block on a generated token: the prefill's
    sampled token or a later bonus), and it needs at least one label after it (p + 1 < length).
    SpecForge's rule, `loss_mask[p] and loss_mask[p + 1]`, gives the same range when the loss
    mask covers exactly the response.

    Args:
        prompt_len: number of prompt tokens (templated), >= 1.
        length: number of real tokens (prompt + response), padding excluded.

    Returns:
        (lo, hi); empty when hi <= lo.
    """
    return int(prompt_len), int(length) - 1


def sample_anchors(
    rng: np.random.Generator, prompt_lens: np.ndarray, lengths: np.ndarray, num_anchors: int
) -> tuple[np.ndarray, np.ndarray]:
    """Random anchors per sequence, without replacement (re-drawn each step: the augmentation).

    Args:
        rng: numpy random generator (the caller derives it from seed and step, so a resumed run
            draws the same anchors).
        prompt_lens: (Bsz,) int, templated prompt length of each sequence.
        lengths: (Bsz,) int, real length (prompt + response) of each sequence.
        num_anchors: N, anchors per sequence; sequences with fewer valid positions get all of
            them plus padding anchors.

    Returns:
        anchors: (Bsz, N) int32 positions, sorted ascending among the kept ones; padding
            anchors are 0.
        keep: (Bsz, N) bool, False for padding anchors (they carry no loss).
    """
    bsz = len(lengths)
    anchors = np.zeros((bsz, num_anchors), dtype=np.int32)
    keep = np.zeros((bsz, num_anchors), dtype=bool)
    for i in range(bsz):
        lo, hi = valid_anchor_range(prompt_lens[i], lengths[i])
        n_valid = max(0, hi - lo)
        if n_valid == 0:
            continue
        k = min(num_anchors, n_valid)
        pick = np.sort(rng.choice(n_valid, size=k, replace=False)) + lo
        anchors[i, :k] = pick
        keep[i, :k] = True
    return anchors, keep


def context_mask(
    anchors: mx.array, seq_len: int, block_size: int, window: Optional[int] = None
) -> mx.array:
    """Which context positions each block query may attend to (built on the device, in-graph).

    Args:
        anchors: (Bsz, N) int anchor positions p_j.
        seq_len: S, context positions per sequence (the padded length).
        block_size: B.
        window: sliding window of the draft layer (None: full attention). Query k of block j sits
            at position p_j + k and, as at inference, sees keys with (p_j + k) - kv < window.

    Returns:
        (Bsz, N, B, S) bool: True where query k of block j may see context position kv; always
        kv < p_j (never the anchor's own position nor anything after it).
    """
    kv = mx.arange(seq_len)[None, None, None, :]
    p = anchors.astype(mx.int32)[:, :, None, None]
    visible = kv < p
    if window:
        q = p + mx.arange(block_size)[None, None, :, None]
        visible = visible & (q - kv < window)
    return mx.broadcast_to(visible, (*anchors.shape, block_size, seq_len))


def block_mask(block_size: int, causal: bool = False, window: Optional[int] = None) -> mx.array:
    """Which keys of its own block each block query may attend to.

    Args:
        block_size: B.
        causal: the draft layer is causal inside the block (sliding layers by default; published
            DFlash drafts are bidirectional).
        window: sliding window (None: none).

    Returns:
        (B, B) bool [query k, key k']: all True for a bidirectional full-attention draft.
    """
    q = mx.arange(block_size)[:, None]
    k = mx.arange(block_size)[None, :]
    visible = mx.ones((block_size, block_size), dtype=mx.bool_)
    if causal:
        visible = visible & (k <= q)
    if window:
        visible = visible & (q - k < window)
        if not causal:
            visible = visible & (k - q < window)
    return visible


def dense_mask(ctx_mask: np.ndarray, blk_mask: np.ndarray) -> np.ndarray:
    """The SpecForge-style full mask of one sequence, for inspection and tests.

    Args:
        ctx_mask: (N, B, S) bool, `context_mask` of one sequence (numpy or mlx).
        blk_mask: (B, B) bool, `block_mask`.

    Returns:
        (N*B, S + N*B) bool numpy: rows are block queries (block-major), columns are the S
        context positions followed by the N*B block keys; block j's queries see only block j's
        keys.
    """
    ctx_mask, blk_mask = np.array(ctx_mask), np.array(blk_mask)
    n, b, s = ctx_mask.shape
    out = np.zeros((n * b, s + n * b), dtype=bool)
    out[:, :s] = ctx_mask.reshape(n * b, s)
    for j in range(n):
        out[j * b:(j + 1) * b, s + j * b: s + (j + 1) * b] = blk_mask
    return out
