"""GGUF tensors -> Hugging Face / MLX tensors: names, dequantization and layout fixes.

llama.cpp renames tensors and, for some architectures, changes them on the way into GGUF:

* ``llama``: the rows of the Q and K projections are permuted (``permute_qk``) so that rotary
  embedding pairs are adjacent; :func:`unpermute_qk` undoes it for HF's half-split rotary layout.
* ``gemma3``: every RMSNorm weight is stored as ``1 + w``; MLX's Gemma adds the 1 itself.
* no ``output.weight``: the LM head is tied to the token embeddings.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

__all__ = ["PlannedTensor", "hf_tensor_name", "permute_qk", "plan_tensors", "unpermute_qk"]

_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_PER_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
}

# The norm after attention is called differently per family: llama/qwen2 have two norms per
# layer, Gemma 3 has four.
_PER_LAYER_BY_ARCH = {
    "gemma3": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
_PER_LAYER_DEFAULT = {"ffn_norm": "post_attention_layernorm"}

_CHUNK_BYTES = 32 << 20  # dequantize at most this many stored bytes at once

_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)$")


def hf_tensor_name(gguf_name: str, architecture: str) -> str:
    """Map a llama.cpp tensor name to its Hugging Face name.

    Args:
        gguf_name: e.g. ``"blk.3.attn_q.weight"``.
        architecture: GGUF ``general.architecture`` (``llama``, ``qwen2``, ``gemma3``).

    Returns:
        e.g. ``"model.layers.3.self_attn.q_proj.weight"``.

    Raises:
        ValueError: The tensor name is not one this converter knows.
    """
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    if match:
        layer, kind, suffix = match.groups()
        table = {**_PER_LAYER, **_PER_LAYER_BY_ARCH.get(architecture, _PER_LAYER_DEFAULT)}
        if kind in table:
            return f"model.layers.{layer}.{table[kind]}.{suffix}"
    raise ValueError(f"cannot map GGUF tensor {gguf_name!r} of architecture {architecture!r}")


def permute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation of Q/K rows (HF half-split rotary -> interleaved pairs).

    Args:
        weight: ``(n_head * head_dim, ...)`` projection weight or bias, HF layout.
        n_head: Number of heads this projection has (KV heads for K).

    Returns:
        The rows reordered as llama.cpp's ``convert_hf_to_gguf.py`` writes them.
    """
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo :func:`permute_qk`: GGUF interleaved rotary rows -> HF half-split rows.

    Args:
        weight: ``(n_head * head_dim, ...)`` projection weight or bias as stored in a llama GGUF.
        n_head: Number of heads this projection has (KV heads for K).

    Returns:
        The rows in Hugging Face order (``unpermute_qk(permute_qk(w, h), h) == w``).
    """
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


@dataclass(frozen=True)
class PlannedTensor:
    """One output tensor: its HF name and shape, and how to make it from the GGUF.

    Attributes:
        name: Hugging Face tensor name.
        shape: Shape in numpy (row-major) order, e.g. ``(out_features, in_features)``.
        source: The GGUF tensor (a ``gguf.ReaderTensor``).
        n_head_permuted: For llama Q/K, the head count to un-permute with; else ``None``.
        norm_offset: Added to the values after dequantization (``-1.0`` for Gemma norms).
    """

    name: str
    shape: tuple[int, ...]
    source: object
    n_head_permuted: int | None = None
    norm_offset: float = 0.0

    def materialize(self) -> np.ndarray:
        """Dequantize and fix up this tensor.

        Returns:
            A float32 array of :attr:`shape`.
        """
        from gguf.quants import dequantize

        tensor = self.source
        raw = tensor.data
        if raw.ndim >= 2 and raw.shape[0] > 1 and raw.size > _CHUNK_BYTES:
            # Dequantize a block of rows at a time: the gguf package's intermediates are several
            # times the output size, which matters for a 150k-row embedding matrix.
            data = np.empty(self.shape, dtype=np.float32)
            flat = data.reshape(raw.shape[0], -1)
            step = max(1, _CHUNK_BYTES // max(1, raw[0].nbytes))
            for start in range(0, raw.shape[0], step):
                rows = dequantize(raw[start : start + step], tensor.tensor_type)
                flat[start : start + step] = rows.reshape(rows.shape[0], -1)
        else:
            data = np.asarray(dequantize(raw, tensor.tensor_type), dtype=np.float32).reshape(self.shape)
        if self.n_head_permuted is not None:
            data = unpermute_qk(data, self.n_head_permuted)
        if self.norm_offset:
            data = data + np.float32(self.norm_offset)
        return np.ascontiguousarray(data)


def plan_tensors(tensors, architecture: str, n_head: int, n_head_kv: int) -> list[PlannedTensor]:
    """Decide the output tensors for a GGUF's tensors, without reading any data.

    Args:
        tensors: ``GGUFReader.tensors``.
        architecture: GGUF ``general.architecture``.
        n_head: Attention (query) heads.
        n_head_kv: Key/value heads.

    Returns:
        One :class:`PlannedTensor` per GGUF tensor, in file order (``rope_freqs`` and similar
        precomputed tables are skipped).

    Raises:
        ValueError: A tensor this converter cannot map.
    """
    planned = []
    for tensor in tensors:
        if tensor.name in ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"):
            continue
        name = hf_tensor_name(tensor.name, architecture)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        heads = None
        if architecture == "llama" and tensor.name.endswith(("attn_q.weight", "attn_q.bias")):
            heads = n_head
        elif architecture == "llama" and tensor.name.endswith(("attn_k.weight", "attn_k.bias")):
            heads = n_head_kv
        offset = -1.0 if architecture == "gemma3" and tensor.name.endswith("norm.weight") else 0.0
        planned.append(PlannedTensor(name, shape, tensor, heads, offset))
    return planned


def iter_materialized(planned: list[PlannedTensor]) -> Iterator[tuple[PlannedTensor, np.ndarray]]:
    """Yield ``(plan, float32 array)`` one tensor at a time (keeps peak memory to one tensor).

    Args:
        planned: From :func:`plan_tensors`.

    Yields:
        Each plan with its dequantized, fixed-up data.
    """
    for plan in planned:
        yield plan, plan.materialize()
