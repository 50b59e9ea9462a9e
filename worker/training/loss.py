"""DFlash training targets and loss (one job: what each block position is scored against).

Paper (Chen et al. 2026, arXiv 2602.06036, §4.2 and Fig. 5) and SpecForge
(`OnlineDFlashModel`): block position k = 1..B-1
of the block anchored at p is labelled x_{p+k}; its cross-entropy is weighted by
w_k = exp(-(k-1)/gamma) (early positions matter most: a draft token only counts if every token
before it was accepted), and the loss is sum(w * CE) / sum(w) over the real labels (kept anchors,
p + k inside the sequence).
"""
from __future__ import annotations

import math

import mlx.core as mx

# gamma per block size used by the paper / SpecForge configs (note §4.1).
PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """Decay gamma: the paper's value for B = 16 / 10 / 8 (7 / 5 / 4), else about 0.45 * B."""
    return PAPER_GAMMA.get(int(block_size), max(1.0, round(0.45 * block_size, 1)))


def position_weights(block_size: int, gamma: float) -> mx.array:
    """w_k = exp(-(k-1)/gamma) for k = 1..B-1: (B-1,) float32 (w_1 = 1)."""
    return mx.array([math.exp(-(k - 1) / gamma) for k in range(1, block_size)], dtype=mx.float32)


def block_targets(
    tokens: mx.array, lengths: mx.array, anchors: mx.array, keep: mx.array, block_size: int, gamma: float
) -> tuple[mx.array, mx.array]:
    """Labels and loss weights of every block position.

    Args:
        tokens: (Bsz, S) int token ids (right-padded).
        lengths: (Bsz,) int real lengths.
        anchors: (Bsz, N) int anchor positions.
        keep: (Bsz, N) bool, False for padding anchors.
        block_size: B.
        gamma: decay of the position weights.

    Returns:
        labels: (Bsz, N, B-1) int32, x_{p+k} (clipped index where p + k is past the end).
        weights: (Bsz, N, B-1) float32, w_k where the label is real, else 0.
    """
    bsz, S = tokens.shape
    n = anchors.shape[1]
    idx = anchors.astype(mx.int32)[..., None] + mx.arange(1, block_size)[None, None]
    valid = keep[..., None] & (idx < lengths.astype(mx.int32)[:, None, None])
    flat = mx.clip(idx, 0, S - 1).reshape(bsz, n * (block_size - 1))
    labels = mx.take_along_axis(tokens, flat, axis=1).reshape(bsz, n, block_size - 1).astype(mx.int32)
    weights = valid.astype(mx.float32) * position_weights(block_size, gamma)
    return labels, weights


def weighted_cross_entropy(logits: mx.array, labels: mx.array, weights: mx.array) -> mx.array:
    """sum(w * CE) / sum(w), CE computed in float32.

    Args:
        logits: (..., V) any float dtype.
        labels: (...) int; a label < 0 (a token outside the draft vocabulary,
            `Model.draft_index`) is left out, as if its weight were 0.
        weights: (...) float32, >= 0.

    Returns:
        Scalar float32 (0 when every weight is 0). Units: nats per (weighted) token.
    """
    x = logits.astype(mx.float32)
    inside = labels >= 0
    picked = mx.take_along_axis(x, mx.maximum(labels, 0)[..., None], axis=-1)[..., 0]
    w = weights * inside
    ce = mx.logsumexp(x, axis=-1) - picked
    return (ce * w).sum() / mx.maximum(w.sum(), 1e-6)


def acceptance_stats(logits: mx.array, labels: mx.array, weights: mx.array) -> tuple[mx.array, mx.array]:
    """Teacher-forced acceptance of the drafts, from one training batch (no decoding).

    A block position counts as accepted when the draft's argmax equals its label and every
    earlier position of the block did too (DFlash accepts the longest matching prefix). A label
    < 0 (outside the draft vocabulary) is real but can never be matched, as in decoding.

    Args:
        logits: (..., B-1, V) draft logits.
        labels: (..., B-1) int.
        weights: (..., B-1) float; > 0 marks a real label.

    Returns:
        accuracy: (B-1,) float32, top-1 accuracy per block position over real labels.
        tau: scalar float32, mean over blocks with a real first label of (accepted prefix + 1):
            an estimate of the acceptance length tau at decoding time.
    """
    real = weights > 0
    correct = (mx.argmax(logits, axis=-1) == labels) & real
    lead = tuple(range(correct.ndim - 1))
    accuracy = correct.sum(axis=lead).astype(mx.float32) / mx.maximum(real.sum(axis=lead), 1)
    prefix = mx.cumprod(correct.astype(mx.float32), axis=-1).sum(axis=-1)
    blocks = real[..., 0]
    tau = 1.0 + (prefix * blocks).sum() / mx.maximum(blocks.sum(), 1)
    return accuracy, tau
