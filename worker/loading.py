"""Loading a target model in the dtype its device computes in best.

Fetched models are stored in a 16-bit dtype (bfloat16, or the source's float16) and some in 4 or
8 bits (MLX affine quantization, 16-bit scales). A worker picks the compute dtype at load:

- on a GPU (Metal or CUDA): the stored 16-bit dtype; a model stored in float32 (any local
  directory in float32, such as the tests' tiny models) is cast to bfloat16. Half the bytes per weight is
  about half the time of a memory-bound decode step.
- on a CPU: float32. MLX's CPU backend has no bfloat16 matrix kernels; float32 matmuls go to
  BLAS (OpenBLAS when preloaded, `flashfleet.blas`), so decoding is faster in float32 even though
  the weights are read from 16-bit files (docs/operations.md, "Model storage and quantization",
  has the measured numbers).

`$FLASHFLEET_COMPUTE_DTYPE` (``float32``, ``bfloat16``, ``float16``; default ``auto``) overrides the
choice, for instance to run a GPU in float32 when comparing outputs token for token.

Only floating-point parameters are cast (`mlx.nn.Module.set_dtype`): the packed uint32 weights of
quantized layers stay as they are, their scales and biases take the compute dtype (a bfloat16
scale is exact in float32).
"""
from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten

__all__ = ["COMPUTE_DTYPE_ENV", "DTYPES", "compute_dtype", "load_target", "stored_dtype"]

COMPUTE_DTYPE_ENV = "FLASHFLEET_COMPUTE_DTYPE"
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
_HALF = (mx.bfloat16, mx.float16)


def compute_dtype(stored: mx.Dtype | None = None, device: mx.Device | None = None) -> mx.Dtype:
    """The dtype a model's floating-point parameters should have on `device`.

    Args:
        stored: the model's stored floating dtype (`stored_dtype`); None when unknown.
        device: default `mx.default_device()`.

    Returns:
        `$FLASHFLEET_COMPUTE_DTYPE` when set to a dtype name; else on a GPU `stored` when it is
        bfloat16 or float16, bfloat16 otherwise; on a CPU float32.

    Raises:
        ValueError: `$FLASHFLEET_COMPUTE_DTYPE` is neither ``auto`` nor a name in `DTYPES`.
    """
    name = os.environ.get(COMPUTE_DTYPE_ENV, "auto").strip().lower() or "auto"
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"{COMPUTE_DTYPE_ENV}={name!r}: choose auto, {', '.join(DTYPES)}")
        return DTYPES[name]
    device = device or mx.default_device()
    if device.type == mx.DeviceType.gpu:
        return stored if stored is not None and stored in _HALF else mx.bfloat16
    return mx.float32


def stored_dtype(model: nn.Module) -> mx.Dtype | None:
    """The floating dtype holding most of a model's floating-point parameter elements.

    For a quantized model that is the dtype of its scales, biases and norms (the packed weights
    are uint32 and not counted).

    Returns:
        An MLX floating dtype, or None when the model has no floating-point parameters.
    """
    counts: Counter = Counter()
    for _, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            counts[p.dtype] += p.size
    return counts.most_common(1)[0][0] if counts else None


def load_target(path: str | os.PathLike, dtype: mx.Dtype | None = None):
    """`mlx_lm.load` a model directory and cast its floating parameters to the compute dtype.

    Args:
        path: a model directory (`config.json`, `*.safetensors`, tokenizer files), dense or
            quantized (mlx-lm's `quantization` config).
        dtype: the compute dtype; default `compute_dtype(stored_dtype(model))`.

    Returns:
        (model, tokenizer): the mlx-lm model, parameters evaluated in the compute dtype, and its
        `TokenizerWrapper`, as `mlx_lm.load` returns them.

    Raises:
        FileNotFoundError / ValueError: as `mlx_lm.load` (missing files, unsupported model type).
        ValueError: a bad `$FLASHFLEET_COMPUTE_DTYPE` (see `compute_dtype`).
    """
    from mlx_lm import load

    model, tokenizer = load(str(Path(path)))
    stored = stored_dtype(model)
    want = dtype or compute_dtype(stored)
    if stored is not None and any(
        p.dtype != want for _, p in tree_flatten(model.parameters()) if mx.issubdtype(p.dtype, mx.floating)
    ):
        model.set_dtype(want)  # floating parameters only: packed quantized weights stay uint32
        mx.eval(model.parameters())
    return model, tokenizer
