"""Fewer kernels per forward: one matmul for an attention's q/k/v, one for an MLP's gate/up.

On the H200 a 0.5-1.5B target is bound by kernel launches, not by bandwidth (the 1.5B
decodes at 0.55 TB/s of the GPU's 4.8); a Qwen2.5 layer
runs three projection matmuls on the same input in attention and two in the MLP, so five of a
layer's matmuls can be two. `fuse_projections` concatenates each group's weights along the
output axis into one `nn.Linear` / `nn.QuantizedLinear` (stored on the parent module as
`qkv_proj_fused` / `gate_up_proj_fused`) and replaces the group's members with `_Part`
callables: the first member called with an input runs the fused matmul once and hands each
member its slice (a view, no kernel). No model code is copied, so it works for every mlx-lm
architecture whose attention calls `q_proj`, `k_proj`, `v_proj` and whose MLP calls `gate_proj`,
`up_proj` on one input (llama, qwen2, qwen3, gemma3_text, mistral, ...); groups of any other shape
are left as they are. The same idea as vLLM's `QKVParallelLinear` / `MergedColumnParallelLinear`
and llama.cpp's fused QKV tensors, done here at load time on an unmodified mlx-lm model.

Every output column is the same dot product over the same input as before; only the number of
matmuls changes. A BLAS may block the wider matmul differently, so outputs agree to rounding, not
always bit for bit (tests/test_fusion.py, CPU, float32: identical with MLX's own matmul, within
2.6e-5 on logits up to 15 with OpenBLAS; greedy tokens identical).

Concurrency: not thread-safe, like `worker.capture.HiddenCapture`: the worker runs all MLX work
for a model on its engine thread.
"""
from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn

from worker.capture import target_layers
from worker.small_gemm import SmallGemmLinear

GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj"), "qkv_proj_fused"),
          ("mlp", ("gate_proj", "up_proj"), "gate_up_proj_fused"))


class _Fused:
    """One fused matmul shared by its group's `_Part`s; keeps the slices of the last input only
    until each member has taken its own, so no activation outlives its forward."""

    __slots__ = ("linear", "bounds", "_x", "_outs")

    def __init__(self, linear: nn.Module, sizes: list[int]):
        self.linear = linear
        ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
        self.bounds = list(zip([0] + ends[:-1], ends))
        self._x = None
        self._outs: list | None = None

    def take(self, x: mx.array, i: int) -> mx.array:
        outs = self._outs
        if outs is None or x is not self._x or outs[i] is None:
            y = self.linear(x)
            outs = self._outs = [y[..., a:b] for a, b in self.bounds]
            self._x = x
        out, outs[i] = outs[i], None
        if not any(o is not None for o in outs):  # every member served: drop the references
            self._x = self._outs = None
        return out


class _Part:
    """Stands in for one projection of a fused group: (..., in) -> (..., out_i), as before."""

    __slots__ = ("fused", "index")

    def __init__(self, fused: _Fused, index: int):
        self.fused, self.index = fused, index

    def __call__(self, x: mx.array) -> mx.array:
        return self.fused.take(x, self.index)


def _signature(m) -> tuple | None:
    """What must agree for two projections to share a matmul (None: not a plain linear; a
    `SmallGemmLinear` counts as one, so fusing after `use_small_gemm` still fuses, and the fused
    copy keeps the class)."""
    if type(m) in (nn.Linear, SmallGemmLinear):
        return ("linear", m.weight.shape[1], m.weight.dtype, "bias" in m)
    if type(m) is nn.QuantizedLinear:
        return ("quantized", m.weight.shape[1], m.weight.dtype, m.group_size, m.bits,
                getattr(m, "mode", "affine"),
                "bias" in m, m.get("biases") is not None)
    return None


def _fuse_group(parent: nn.Module, names: tuple[str, ...], fused_name: str) -> bool:
    members = [parent.get(n) for n in names]
    sigs = [_signature(m) for m in members]
    if sigs[0] is None or any(s != sigs[0] for s in sigs):
        return False
    linear = copy.copy(members[0])  # same class and quantization settings
    for key in ("weight", "scales", "biases", "bias"):
        if members[0].get(key) is not None:
            linear[key] = mx.concatenate([m[key] for m in members], axis=0)
    fused = _Fused(linear, [m.weight.shape[0] for m in members])
    for i, n in enumerate(names):
        del parent[n]
        object.__setattr__(parent, n, _Part(fused, i))
    parent[fused_name] = linear
    return True


def fuse_projections(model: nn.Module) -> int:
    """Fuses, in every decoder layer of an mlx-lm model, q/k/v and gate/up into one matmul each.

    Call once after loading, before any forward; the model's outputs are unchanged (see the module
    docstring) and the unfused weights are released (the fused copies replace them).

    Args:
        model: an mlx-lm model with a `layers` list (`worker.capture.target_layers`); its
            projections `nn.Linear` or `nn.QuantizedLinear` (any bits), float weights of any dtype.

    Returns:
        The number of groups fused (0 when nothing matched: a model that already fuses them, such
        as phi3, a mixture of experts' MLP, or a projection of another class).

    Raises:
        TypeError: the model has no `layers` list.
    """
    n = 0
    for layer in target_layers(model):
        for child, names, fused_name in GROUPS:
            parent = layer.get(child) if isinstance(layer, nn.Module) else None
            if isinstance(parent, nn.Module) and fused_name not in parent \
                    and all(isinstance(parent.get(k), nn.Module) for k in names):
                n += _fuse_group(parent, names, fused_name)
    if n:
        mx.eval(model.parameters())
    return n
