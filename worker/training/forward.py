"""The draft's training forward: many anchored blocks per sequence in one pass (one job).

At inference (`worker.models.dflash.Model`) one block attends to a cache of context K/V. In
training (paper §4.2; SpecForge `OnlineDFlashModel`, design note §4.2) every sequence carries N
blocks at once, each anchored at its own position p_j and seeing only the context before p_j.
This module computes exactly the inference attention for all of them, from the same weights:

    ctx  = hidden_norm(fc(taps))                          (Bsz, S, D)      positions 0 .. S-1
    h    = embed([x_p, MASK x (B-1)]) * scale             (Bsz*N, B, D)    positions p .. p+B-1
    per layer: Q from the block only; K/V from [ctx ; own block], each through the layer's own
    k_proj/k_norm/RoPE and v_proj ("KV injection"); scores against the context are masked by
    `masks.context_mask` (kv < p_j, optional window), against the own block by
    `masks.block_mask`; one softmax over both.

The forward is functional: it reads the weights from a parameter tree (the draft's own layout,
`draft.parameters()`), so the trainer can keep float32 master weights and run it in bfloat16.
`tests/test_training.py` checks it against the inference forward position for position.
"""
from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from worker.models.dflash import Model
from worker.training.masks import block_mask, context_mask


def _linear(x: mx.array, p: dict) -> mx.array:
    y = x @ p["weight"].T
    return y + p["bias"] if "bias" in p else y


def _rms(x: mx.array, w: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, w, eps)


def cast_tree(params, dtype: Optional[mx.Dtype]):
    """Casts the floating leaves of a parameter tree (lists/dicts of arrays) to `dtype`."""
    if dtype is None:
        return params
    if isinstance(params, dict):
        return {k: cast_tree(v, dtype) for k, v in params.items()}
    if isinstance(params, (list, tuple)):
        return [cast_tree(v, dtype) for v in params]
    return params.astype(dtype) if mx.issubdtype(params.dtype, mx.floating) else params


def block_inputs(tokens: mx.array, anchors: mx.array, block_size: int, mask_token_id: int) -> mx.array:
    """Noise blocks `[x_p, MASK x (B-1)]` for every anchor.

    Args:
        tokens: (Bsz, S) int token ids.
        anchors: (Bsz, N) int anchor positions.
        block_size: B.
        mask_token_id: the draft's MASK id.

    Returns:
        (Bsz, N, B) int32 block token ids.
    """
    first = mx.take_along_axis(tokens, anchors.astype(mx.int32), axis=1)[..., None]
    masks = mx.full((*anchors.shape, block_size - 1), mask_token_id, dtype=first.dtype)
    return mx.concatenate([first, masks], axis=-1).astype(mx.int32)


def _attention(attn, p: dict, x: mx.array, ctx: mx.array, pos0: mx.array, cmask: mx.array,
               bmask: mx.array, eps: float, bsz: int, n: int) -> mx.array:
    BN, B, _ = x.shape
    S = ctx.shape[1]
    H, Hkv = attn.n_heads, attn.n_kv_heads
    rep = H // Hkv
    q = _rms(_linear(x, p["q_proj"]).reshape(BN, B, H, -1), p["q_norm"]["weight"], eps)
    hd = q.shape[-1]
    q = attn.rope(q.transpose(0, 2, 1, 3), offset=pos0)  # (BN, H, B, hd) at p .. p+B-1
    kb = _rms(_linear(x, p["k_proj"]).reshape(BN, B, Hkv, hd), p["k_norm"]["weight"], eps)
    kb = attn.rope(kb.transpose(0, 2, 1, 3), offset=pos0)  # (BN, Hkv, B, hd)
    vb = _linear(x, p["v_proj"]).reshape(BN, B, Hkv, hd).transpose(0, 2, 1, 3)
    kc = _rms(_linear(ctx, p["k_proj"]).reshape(bsz, S, Hkv, hd), p["k_norm"]["weight"], eps)
    kc = attn.rope(kc.transpose(0, 2, 1, 3), offset=0)  # (Bsz, Hkv, S, hd) at 0 .. S-1
    vc = _linear(ctx, p["v_proj"]).reshape(bsz, S, Hkv, hd).transpose(0, 2, 1, 3)

    q = q * attn.scale
    # Query head h uses KV head h // rep (mlx's grouped-query convention).
    qc = q.reshape(bsz, n, Hkv, rep, B, hd).transpose(0, 2, 3, 1, 4, 5).reshape(bsz, Hkv, rep * n * B, hd)
    sc = (qc @ kc.transpose(0, 1, 3, 2)).reshape(bsz, Hkv, rep, n, B, S)
    sb = q.reshape(BN, Hkv, rep * B, hd) @ kb.transpose(0, 1, 3, 2)  # (BN, Hkv, rep*B, B)
    sb = sb.reshape(bsz, n, Hkv, rep, B, B).transpose(0, 2, 3, 1, 4, 5)
    neg = mx.array(-mx.inf, dtype=mx.float32)
    scores = mx.concatenate([
        mx.where(cmask[:, None, None], sc.astype(mx.float32), neg),
        mx.where(bmask, sb.astype(mx.float32), neg),
    ], axis=-1)
    probs = mx.softmax(scores, axis=-1).astype(x.dtype)
    pc, pb = probs[..., :S], probs[..., S:]
    oc = pc.reshape(bsz, Hkv, rep * n * B, S) @ vc  # (Bsz, Hkv, rep*N*B, hd)
    oc = oc.reshape(bsz, Hkv, rep, n, B, hd).transpose(0, 3, 1, 2, 4, 5)  # (Bsz, N, Hkv, rep, B, hd)
    ob = pb.transpose(0, 3, 1, 2, 4, 5).reshape(BN, Hkv, rep * B, B) @ vb  # (BN, Hkv, rep*B, hd)
    out = oc + ob.reshape(bsz, n, Hkv, rep, B, hd)
    out = out.transpose(0, 1, 4, 2, 3, 5).reshape(BN, B, H * hd)
    return _linear(out, p["o_proj"])


def block_hidden(
    draft: Model,
    params: dict,
    taps: mx.array,
    block_ids: mx.array,
    anchors: mx.array,
) -> mx.array:
    """Final-norm draft hidden states of every anchored block, as inference would compute them.

    For block j of sequence b this equals `draft.hidden_states(block_ids[b, j], taps[b, :p_j],
    fresh cache)` (context = target taps of positions < p_j, block at positions p_j .. p_j+B-1).

    Args:
        draft: the bound draft (its modules give the config: heads, RoPE, windows, eps; its
            `target_embedding` is the target's frozen embedding).
        params: weights in `draft.parameters()` layout, already in the compute dtype.
        taps: (Bsz, S, n_taps * D) concatenated target layer outputs of the clean sequence.
        block_ids: (Bsz, N, B) int block tokens (`block_inputs`).
        anchors: (Bsz, N) int anchor positions p_j (padding anchors: any position; their output
            is garbage and must carry zero loss weight).

    Returns:
        (Bsz * N, B, D) in the params' dtype.
    """
    args = draft.args
    eps = float(args.rms_norm_eps)
    bsz, n, B = block_ids.shape
    S = taps.shape[1]
    dtype = params["fc"]["weight"].dtype
    ctx = _rms(_linear(taps.astype(dtype), params["fc"]), params["hidden_norm"]["weight"], eps)
    h = draft.target_embedding(block_ids.reshape(bsz * n, B)).astype(dtype)  # RuntimeError unbound
    scale = args.input_embedding_scale
    if scale != 1.0:
        h = h * scale
    pos0 = anchors.reshape(bsz * n).astype(mx.int32)
    masks = {}
    for layer, lp in zip(draft.layers, params["layers"]):
        attn = layer.self_attn
        key = (attn.window, attn.causal)
        if key not in masks:
            masks[key] = (context_mask(anchors, S, B, attn.window),
                          block_mask(B, causal=attn.causal, window=attn.window))
        cmask, bmask = masks[key]
        x = _rms(h, lp["input_layernorm"]["weight"], eps)
        h = h + _attention(attn, lp["self_attn"], x, ctx, pos0, cmask, bmask, eps, bsz, n)
        x = _rms(h, lp["post_attention_layernorm"]["weight"], eps)
        m = lp["mlp"]
        h = h + _linear(nn.silu(_linear(x, m["gate_proj"])) * _linear(x, m["up_proj"]), m["down_proj"])
    return _rms(h, params["norm"]["weight"], eps)
