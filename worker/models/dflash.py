"""DFlash block-diffusion draft model (Chen et al. 2026, "DFlash: Block Diffusion for Flash
Speculative Decoding", arXiv 2602.06036), in the shape of mlx-lm's `models/llama.py`.

The draft is a small stack of Qwen3-style decoder layers (q/k RMSNorm, SwiGLU MLP) with the
target's hidden size D. It has no embedding and no LM head: it borrows the target's, frozen
(`Model.bind`). Conditioning ("KV injection", paper §3 and App. A.3): the outputs of a few tapped
target layers are concatenated (n_taps * D), projected by `fc` to D and RMS-normalised by
`hidden_norm` into a context feature; in every draft layer that feature goes through the layer's
own `k_proj`/`k_norm`/RoPE and `v_proj` and becomes extra keys/values. Context positions never
produce queries. Their K/V are cached once per context position (the draft cache holds context
K/V only). The block `[last committed token, MASK x (B-1)]` attends bidirectionally to itself and
to all cached context; one forward drafts B-1 tokens (logits at block positions 1..B-1).

Positions: with T context positions cached and S new ones in this call, the new context sits at
T..T+S-1 and the block at T+S..T+S+L-1, i.e. the block's first token (the last committed token)
is at the sequence position the target will give it.

Hugging Face weight names are kept verbatim (`fc.weight`, `hidden_norm.weight`, `norm.weight`,
`layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `layers.{i}.self_attn.{q,k}_norm.weight`,
`layers.{i}.mlp.{gate,up,down}_proj.weight`, `layers.{i}.{input,post_attention}_layernorm.weight`),
so a published z-lab checkpoint loads unchanged (see `worker/models/dflash_checkpoint.py`).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import BaseModelArgs
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3 import MLP
from mlx_lm.models.rope_utils import initialize_rope

from worker.caches.padded import PaddedKVCache, additive_mask
from worker.capture import target_embed_fn, target_head_fn


def default_target_layer_ids(num_target_layers: int, num_taps: int = 5) -> list[int]:
    """Taps spread evenly over target layers 1 .. L-3 (z-lab `build_target_layer_ids`).

    `ids[i] = round(1 + i * (L - 4) / (n - 1))`; one tap is `L // 2`. For shallow targets the
    number of taps is reduced so the ids stay distinct (at most L - 3 taps, at least one).

    Args:
        num_target_layers: L, the target's decoder-layer count (>= 1).
        num_taps: wanted number of tapped layers (the published drafts use 5).

    Returns:
        Sorted 0-based layer ids.

    Raises:
        ValueError: num_target_layers or num_taps < 1.
    """
    L = int(num_target_layers)
    if L < 1 or num_taps < 1:
        raise ValueError("num_target_layers and num_taps must be >= 1")
    n = max(1, min(num_taps, L - 3))
    if n == 1:
        return [L // 2]
    span = (L - 3) - 1
    return [int(round(1 + i * span / (n - 1))) for i in range(n)]


@dataclass
class ModelArgs(BaseModelArgs):
    """Fields of a DFlash draft's config.json (unknown keys are ignored by `from_dict`).

    `target_layer_ids` and `mask_token_id` live under `dflash_config` in published checkpoints;
    `block_size` is a top-level field (older SpecForge configs also put it under dflash_config).
    """

    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float = 1e-6
    head_dim: Optional[int] = None
    vocab_size: Optional[int] = None
    rope_theta: float = 1_000_000.0
    rope_scaling: Optional[Dict[str, Union[float, str]]] = None
    rope_parameters: Optional[dict] = None
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    block_size: Optional[int] = None
    num_target_layers: Optional[int] = None
    layer_types: Optional[List[str]] = None
    sliding_window: Optional[int] = None
    is_causal: Optional[bool] = None
    dflash_config: Dict[str, Any] = field(default_factory=dict)
    quantization: Optional[Dict[str, int]] = None  # {"group_size", "bits"}: mlx-lm's convention
    draft_vocab_size: Optional[int] = None  # EAGLE-3's field: rows of the head the draft proposes from
    model_type: str = "qwen3"
    architectures: List[str] = field(default_factory=lambda: ["DFlashDraftModel"])

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.rope_parameters:  # transformers >= 5 nests rope settings
            self.rope_theta = self.rope_parameters.get("rope_theta", self.rope_theta)
            if self.rope_scaling is None and self.rope_parameters.get("rope_type", "default") != "default":
                self.rope_scaling = self.rope_parameters
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError("layer_types must have num_hidden_layers entries")
        unknown = set(self.layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"unsupported draft layer_types {sorted(unknown)}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need sliding_window")
        self.dflash_config = dc = dict(self.dflash_config)  # never mutate the caller's dict
        if self.block_size is None:
            self.block_size = int(dc.get("block_size", 16))
        if dc.get("conv_kernel_size") or dc.get("selector_top_k"):
            raise ValueError("DFlash2 drafts (grouped conv + candidate selector) are not supported")
        if "target_layer_ids" not in dc:
            if self.num_target_layers is None:
                raise ValueError("config has neither dflash_config.target_layer_ids nor num_target_layers")
            # Older z-lab configs: one tap per draft layer (later ones keep the ids in dflash_config).
            dc["target_layer_ids"] = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)

    @property
    def target_layer_ids(self) -> list[int]:
        """0-based target layers whose outputs the draft is conditioned on (n_taps of them)."""
        return [int(i) for i in self.dflash_config["target_layer_ids"]]

    @property
    def mask_token_id(self) -> Optional[int]:
        """Target token id filling the block's B-1 positions to draft (None when unset)."""
        m = self.dflash_config.get("mask_token_id")
        return None if m is None else int(m)

    @property
    def input_embedding_scale(self) -> float:
        """Factor applied to the borrowed target embeddings of the block (1.0 by default)."""
        return float(self.dflash_config.get("input_embedding_scale", 1.0))


class Attention(nn.Module):
    """Block queries over [cached context K/V, new context K/V, block K/V], bidirectional
    (sliding layers: windowed, and causal inside the block unless `is_causal` is False). The
    mask (`make_mask`, built once per forward by `Model`) also hides a padded cache's unused tail."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = n_heads = args.num_attention_heads
        self.n_kv_heads = n_kv_heads = args.num_key_value_heads
        head_dim = args.head_dim
        self.scale = head_dim**-0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=bias)
        self.q_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        self.rope = initialize_rope(
            head_dim,
            base=args.rope_theta,
            traditional=False,
            scaling_config=args.rope_scaling,
            max_position_embeddings=args.max_position_embeddings,
        )
        sliding = args.layer_types[layer_idx] == "sliding_attention"
        self.window = args.sliding_window if sliding else None
        self.causal = sliding if args.is_causal is None else bool(args.is_causal)

    # Public per-layer pieces, for callers that keep the K/V themselves (the batched engine,
    # worker/engine/batch.py, writes them into per-row caches). Offsets may be one int or one per
    # row, shape (B,) int32, for rows at different positions.

    def keys_values(self, x: mx.array, offset) -> tuple[mx.array, mx.array]:
        """This layer's keys (RoPE at `offset` + i) and values of x (B, L, D): each
        (B, n_kv_heads, L, head_dim), in x's dtype."""
        B, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return self.rope(k, offset=offset), v

    def queries(self, x: mx.array, offset) -> mx.array:
        """This layer's queries of x (B, L, D), RoPE at `offset` + i: (B, n_heads, L, head_dim)."""
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        return self.rope(q, offset=offset)

    def attend(self, q: mx.array, keys: mx.array, values: mx.array, mask) -> mx.array:
        """Attention of q (B, n_heads, L, hd) over keys / values (B, n_kv_heads, N, hd) under
        `mask` (None, boolean, or additive; broadcast to (B, n_heads, L, N)), through the
        output projection: (B, L, D)."""
        B, _, L, _ = q.shape
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def extend(self, ctx: mx.array, cache: KVCache) -> None:
        """Appends context K/V for ctx (B, S, D), the fused context feature, at positions
        cache.offset..cache.offset+S-1 without running the block."""
        k, v = self.keys_values(ctx, cache.offset)
        cache.update_and_fetch(k, v)

    def __call__(
        self, x: mx.array, ctx: Optional[mx.array], cache: KVCache, mask: Optional[mx.array] = None
    ) -> mx.array:
        B, L, _ = x.shape
        T = cache.offset
        S = 0 if ctx is None else ctx.shape[1]
        # One projection over [new context; block]: their positions are contiguous (T .. T+S+L-1).
        kv_in = x if S == 0 else mx.concatenate([ctx, x], axis=1)
        k, v = self.keys_values(kv_in, T)
        q = self.queries(x, T + S)
        # The block K/V are written after the context and trimmed off by the caller (Model),
        # which avoids concatenating the whole cached context with the block in every layer.
        keys, values = cache.update_and_fetch(k, v)
        return self.attend(q, keys, values, mask)

    def make_mask(self, L: int, n_valid: int, n_keys: int,
                  dtype: Optional[mx.Dtype] = None) -> Optional[mx.array]:
        """(L, n_keys) mask for L block queries ending at position n_valid - 1; keys at n_valid
        and beyond are padding. Boolean, or additive in `dtype` (`additive_mask`); None when
        everything is visible."""
        if isinstance(n_valid, int) and not (self.window or self.causal or n_keys > n_valid):
            return None
        qpos = (n_valid - L + mx.arange(L))[:, None]
        kpos = mx.arange(n_keys)[None]
        visible = kpos < n_valid
        if self.causal:
            visible = visible & (kpos <= qpos)
        if self.window:
            visible = visible & (qpos - kpos < self.window)
            if not self.causal:
                visible = visible & (kpos - qpos < self.window)
        return additive_mask(visible, dtype)


class DecoderLayer(nn.Module):
    """Pre-norm Qwen3-style layer: h = x + attn(norm(x), ctx), out = h + SwiGLU MLP(norm(h)).

    Called as layer(x (B, L, D) block states, ctx (B, S, D) new context feature or None, cache,
    mask); returns (B, L, D). The cache gains the ctx and block K/V (`Model` trims the block's).
    """

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(
        self, x: mx.array, ctx: Optional[mx.array], cache: KVCache, mask: Optional[mx.array] = None
    ) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), ctx, cache, mask)
        return h + self.mlp(self.post_attention_layernorm(h))

@dataclass(frozen=True)
class _VocabMaps:
    """A draft vocabulary (a plain object, so MLX never takes its arrays for weights)."""

    ids: mx.array  # (K,) int32 ascending target ids: draft index -> target id
    t2d: mx.array  # (V,) int32: target id -> draft index, -1 outside the vocabulary


class Model(nn.Module):
    """The DFlash draft. Call `bind(target)` before `__call__` (the loaders do it).

    Attributes:
        layers: the draft decoder layers.
        fc: Linear(n_taps * D -> D, no bias) fusing the tapped target hidden states.
        hidden_norm: RMSNorm of the fused context feature.
        norm: final RMSNorm before the borrowed LM head.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        D = args.hidden_size
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.fc = nn.Linear(len(args.target_layer_ids) * D, D, bias=False)
        self.hidden_norm = nn.RMSNorm(D, eps=args.rms_norm_eps)
        self.norm = nn.RMSNorm(D, eps=args.rms_norm_eps)
        self._embed = None  # plain attributes (bound methods), not child modules: never saved
        self._head = None
        self._head_for = None  # rows -> head function, set by bind
        self._bound_to = None  # weak reference to the bound target
        self._vocab_maps: Optional[_VocabMaps] = None  # a draft vocabulary, or None (the whole head)

    @property
    def target_layer_ids(self) -> list[int]:
        """Tapped target layers (0-based), as in `ModelArgs.target_layer_ids`."""
        return self.args.target_layer_ids

    @property
    def mask_token_id(self) -> int:
        """The MASK token id of the block's draft positions."""
        return self.args.mask_token_id

    @property
    def block_size(self) -> int:
        """B, the trained block size: the last committed token + B-1 drafted tokens."""
        return int(self.args.block_size)

    @property
    def vocab(self) -> Optional[mx.array]:
        """The draft vocabulary: (K,) int32 ascending target ids, or None (the whole head)."""
        return None if self._vocab_maps is None else self._vocab_maps.ids

    def bind(self, target: nn.Module) -> "Model":
        """Borrows the target's token embedding and LM head (frozen; not copied, not saved).

        With a draft vocabulary (`set_vocab`) only its rows of the head are kept (one copy).
        Binding again to the same target changes nothing."""
        if self._bound_to is not None and self._bound_to() is target:
            return self
        self._bound_to = weakref.ref(target)  # a plain attribute: not a child module, never saved
        self._embed = target_embed_fn(target)
        self._head_for = lambda rows: target_head_fn(target, rows)
        self._head = self._head_for(self.vocab)
        return self

    def set_vocab(self, token_ids) -> "Model":
        """Restricts the draft's proposals to `token_ids` (a draft vocabulary), or lifts it (None).

        EAGLE-3's reduced draft vocabulary (Li et al. 2025, "EAGLE-3", `draft_vocab_size`,
        `d2t`): the draft scores only the K most frequent tokens of its training data, so its
        head reads K instead of V rows per forward (on Qwen2.5 V = 151,936: the head is most of
        a small draft's bytes) and training's cross-entropy spans K classes. A token outside it
        can never be drafted; verification is unchanged, so the output stays the target's.

        Args:
            token_ids: K distinct target ids (any int sequence or array), or None.

        Raises:
            ValueError: empty, repeated, or outside [0, vocab_size) ids.
        """
        if token_ids is None:
            self._vocab_maps = None
            self.args.draft_vocab_size = None
        else:
            ids = np.unique(np.asarray(token_ids, dtype=np.int64).reshape(-1))
            n = int(np.asarray(token_ids).size)
            V = self.args.vocab_size
            if n == 0 or ids.size != n:
                raise ValueError(f"a draft vocabulary needs distinct token ids ({n} given, {ids.size} distinct)")
            if ids[0] < 0 or (V is not None and ids[-1] >= V):
                raise ValueError(f"draft vocabulary ids must lie in [0, {V}); got {ids[0]}..{ids[-1]}")
            t2d = np.full(int(V if V is not None else ids[-1] + 1), -1, dtype=np.int32)
            t2d[ids] = np.arange(ids.size, dtype=np.int32)
            self._vocab_maps = _VocabMaps(mx.array(ids.astype(np.int32)), mx.array(t2d))
            self.args.draft_vocab_size = int(ids.size)
        if self._head_for is not None:
            self._head = self._head_for(self.vocab)
        return self

    def draft_index(self, token_ids: mx.array) -> mx.array:
        """Target ids -> positions in the draft's logits (int32, same shape); -1 for an id outside
        the draft vocabulary. Identity (as int32) without one."""
        if self._vocab_maps is None:
            return token_ids.astype(mx.int32)
        return self._vocab_maps.t2d[token_ids]

    def draft_tokens(self, logits: mx.array) -> mx.array:
        """The draft's proposals from its logits: argmax over the last axis, as target ids
        (uint32, the logits' shape without the last axis)."""
        best = mx.argmax(logits, axis=-1)
        return best if self._vocab_maps is None else self._vocab_maps.ids[best].astype(mx.uint32)

    def make_cache(self) -> list[PaddedKVCache]:
        """One context-only cache per draft layer (trimmable, full context kept)."""
        return [PaddedKVCache() for _ in self.layers]

    def sanitize(self, weights: dict) -> dict:
        """Strips a `model.` prefix and drops any embedding / head stored with the draft."""
        out = {}
        for k, v in weights.items():
            if k.startswith("model."):
                k = k[len("model."):]
            if k.startswith(("embed_tokens.", "lm_head.")):
                continue
            out[k] = v
        return out

    def context(self, target_hidden: mx.array) -> mx.array:
        """Fused context feature: (B, S, n_taps * D) -> (B, S, D)."""
        return self.hidden_norm(self.fc(target_hidden))

    def extend_context(self, target_hidden: mx.array, cache: list[KVCache]) -> None:
        """Appends S context positions (target taps (B, S, n_taps * D)) to every layer's cache."""
        ctx = self.context(target_hidden)
        for layer, c in zip(self.layers, cache):
            layer.self_attn.extend(ctx, c)

    def hidden_states(
        self, inputs: mx.array, target_hidden: Optional[mx.array], cache: list[KVCache]
    ) -> mx.array:
        """Draft hidden states of a block.

        Args:
            inputs: block token ids (B, L) int: [last committed token, MASK, ...].
            target_hidden: taps of the S positions not yet in the draft cache,
                (B, S, n_taps * D), or None when S = 0. They are appended to the cache.
            cache: from `make_cache`; holds context K/V only, before and after the call.

        Returns:
            (B, L, D) after the final norm.
        """
        h = self.block_embeddings(inputs)
        ctx = None if target_hidden is None else self.context(target_hidden)
        L = inputs.shape[1]
        n_new = L + (0 if ctx is None else ctx.shape[1])
        n_valid = cache[0].offset + n_new
        n_keys = cache[0].key_length(n_new) if isinstance(cache[0], PaddedKVCache) else n_valid
        for layer, c, mask in zip(self.layers, cache, self._layer_masks(L, n_valid, n_keys, h.dtype)):
            h = layer(h, ctx, c, mask)
        for c in cache:  # drop the block's K/V: only context positions stay cached
            c.trim(L)
        return self.norm(h)

    def target_embedding(self, ids: mx.array) -> mx.array:
        """The bound target's token embedding of `ids` (any shape, int ids): (*ids.shape, D) in
        the embedding's dtype, without the draft's `input_embedding_scale`.

        Raises:
            RuntimeError: the draft is not bound to a target (`bind`).
        """
        if self._embed is None:
            raise RuntimeError("DFlash draft is not bound to a target; call bind(target)")
        return self._embed(ids)

    def block_embeddings(self, inputs: mx.array) -> mx.array:
        """The block's input: the target's embedding of `inputs` (B, L) int ids (the last
        committed token, then MASK ids), scaled as the draft was trained: (B, L, D).

        Raises:
            RuntimeError: the draft is not bound to a target (`bind`).
        """
        h = self.target_embedding(inputs)
        scale = self.args.input_embedding_scale
        return h * scale if scale != 1.0 else h

    def _layer_masks(self, L: int, n_valid, n_keys: int, dtype: mx.Dtype) -> list:
        """Each layer's block mask; one per (window, causal) kind, shared by the layers."""
        masks: dict = {}
        for layer in self.layers:
            a = layer.self_attn
            kind = (a.window, a.causal)
            if kind not in masks:
                masks[kind] = a.make_mask(L, n_valid, n_keys, dtype if PaddedKVCache.additive else None)
        return [masks[(layer.self_attn.window, layer.self_attn.causal)] for layer in self.layers]

    def head(self, h: mx.array) -> mx.array:
        """Logits of final-normed hidden states h (..., D) through the target's head: (..., V),
        V being the draft vocabulary's size K when it has one (`draft_tokens` maps them to
        target ids)."""
        return self._head(h)

    def __call__(
        self, inputs: mx.array, target_hidden: Optional[mx.array], cache: list[KVCache]
    ) -> mx.array:
        """Draft logits for block positions 1..L-1: (B, L-1, V), through the target's head; V is
        the draft vocabulary's size K when it has one (`draft_tokens` maps them to target ids)."""
        return self.head(self.hidden_states(inputs, target_hidden, cache)[:, 1:])
