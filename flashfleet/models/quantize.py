"""Quantize a model directory with mlx-lm: ``flashfleet models fetch NAME --quantize 4|8``.

The copy uses MLX's affine quantization (mlx-lm's ``quantize_model``, as ``mlx_lm.convert -q``):
every linear layer and the embedding whose input width is a multiple of the group size stores its
weights packed to 4 or 8 bits, with one 16-bit scale and bias per group of 64 weights; norms stay
16-bit. ``mlx_lm.load`` reads the result (config.json's ``quantization``), and so does a worker.

MLX is imported only when a model is quantized: the rest of :mod:`flashfleet.models` runs without it.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from .cache import MARKER_NAME
from .catalog import QUANTIZE_BITS, QUANTIZE_GROUP_SIZE

__all__ = ["QuantizeResult", "quantize_model_dir"]

_NOT_COPIED = ("config.json", "model.safetensors.index.json", MARKER_NAME)


@dataclass(frozen=True)
class QuantizeResult:
    """What :func:`quantize_model_dir` wrote.

    Attributes:
        out_dir: The quantized model directory.
        bits: Bits per quantized weight (4 or 8).
        group_size: Weights per scale and bias.
        dtype: Floating dtype of the scales, biases and unquantized parameters (``"bfloat16"`` or
            ``"float16"``).
        bits_per_weight: Average stored bits per parameter, scales and norms included.
        weights_bytes: Size of the ``*.safetensors`` files in bytes.
        seconds: Wall time in seconds.
    """

    out_dir: Path
    bits: int
    group_size: int
    dtype: str
    bits_per_weight: float
    weights_bytes: int
    seconds: float


def quantize_model_dir(
    src: str | Path, out_dir: str | Path, bits: int, group_size: int = QUANTIZE_GROUP_SIZE
) -> QuantizeResult:
    """Write a quantized copy of a dense model directory.

    Args:
        src: A dense model directory ``mlx_lm.load`` reads (config.json, ``*.safetensors``,
            tokenizer files), float32, bfloat16 or float16.
        out_dir: Directory to write into (created): config.json with ``quantization``,
            ``model.safetensors`` (+ index), and every other file of ``src`` (tokenizer,
            generation config) copied.
        bits: 4 or 8 (:data:`~flashfleet.models.catalog.QUANTIZE_BITS`).
        group_size: Weights per scale and bias; a layer whose input width is not a multiple of it
            stays dense.

    Returns:
        A :class:`QuantizeResult`.

    Raises:
        ValueError: ``bits`` not in ``QUANTIZE_BITS``, or ``src`` is already quantized.
        FileNotFoundError: ``src`` has no config.json or weights.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import compute_bits_per_weight, load_model, quantize_model, save_config, save_model

    if bits not in QUANTIZE_BITS:
        raise ValueError(f"cannot quantize to {bits} bits; choose one of {', '.join(map(str, QUANTIZE_BITS))}")
    src, out_dir = Path(src), Path(out_dir)
    started = time.perf_counter()
    model, config = load_model(src, lazy=True)
    if "quantization" in config:
        raise ValueError(f"{src} is already quantized ({config['quantization']}); quantize a dense model")
    floating = {p.dtype for _, p in tree_flatten(model.parameters()) if mx.issubdtype(p.dtype, mx.floating)}
    half = mx.float16 if floating == {mx.float16} else mx.bfloat16  # a float32 source is stored in bf16
    model.set_dtype(half)
    config["torch_dtype"] = "float16" if half == mx.float16 else "bfloat16"
    with contextlib.redirect_stdout(io.StringIO()):  # mlx-lm prints an [INFO] line
        model, config = quantize_model(model, config, group_size=group_size, bits=bits)
    bits_per_weight = float(compute_bits_per_weight(model))
    out_dir.mkdir(parents=True, exist_ok=True)
    save_model(out_dir, model, donate_model=True)
    save_config(config, out_dir / "config.json")
    for item in src.iterdir():
        if item.is_file() and item.suffix != ".safetensors" and item.name not in _NOT_COPIED:
            shutil.copy2(item, out_dir / item.name)
    return QuantizeResult(
        out_dir=out_dir,
        bits=bits,
        group_size=group_size,
        dtype=config["torch_dtype"],
        bits_per_weight=bits_per_weight,
        weights_bytes=sum(f.stat().st_size for f in out_dir.glob("*.safetensors")),
        seconds=time.perf_counter() - started,
    )
