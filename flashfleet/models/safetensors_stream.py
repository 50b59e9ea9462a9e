"""Write a ``.safetensors`` file one tensor at a time (no need to hold the whole model in memory).

The format is an 8-byte little-endian header length, a JSON header giving each tensor's dtype,
shape and byte range, then the raw little-endian data. All shapes are known before any data is
read, so the header is written first and tensors are streamed after it.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np

__all__ = ["DTYPES", "to_dtype_array", "write_streaming"]

# name accepted on the command line -> (safetensors dtype tag, bytes per element)
DTYPES = {"float32": ("F32", 4), "bfloat16": ("BF16", 2), "float16": ("F16", 2)}


def to_dtype_array(array: np.ndarray, dtype: str) -> np.ndarray:
    """Convert float32 data to the little-endian storage array of ``dtype`` (no extra copy for f32).

    Args:
        array: float32 data.
        dtype: ``"float32"``, ``"bfloat16"`` (round to nearest even, stored as uint16 bit
            patterns) or ``"float16"``.

    Returns:
        A C-contiguous array whose raw bytes are the safetensors payload.

    Raises:
        ValueError: Unknown dtype.
    """
    array = np.ascontiguousarray(array, dtype=np.float32)
    if dtype == "float32":
        return array.astype("<f4", copy=False)
    if dtype == "float16":
        return array.astype("<f2")
    if dtype == "bfloat16":
        bits = array.view(np.uint32)
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        # Rounding a NaN's mantissa can carry into the sign and exponent (0x7FFFFFFF -> -0.0):
        # keep a NaN a (quiet) NaN instead.
        nan = np.isnan(array)
        if nan.any():
            rounded = np.where(nan, (bits >> np.uint32(16)) | np.uint32(0x0040), rounded)
        return rounded.astype("<u2")
    raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")


def write_streaming(
    path: Path,
    specs: list[tuple[str, tuple[int, ...]]],
    arrays: Iterable[np.ndarray],
    dtype: str = "float32",
    metadata: dict[str, str] | None = None,
) -> int:
    """Write tensors to ``path`` in safetensors format, streaming their data.

    Args:
        path: Output file (overwritten).
        specs: ``(name, shape)`` of every tensor, in the order ``arrays`` yields them.
        arrays: float32 arrays, one per spec, produced lazily.
        dtype: Stored dtype, a key of :data:`DTYPES`.
        metadata: String-to-string ``__metadata__`` for the header.

    Returns:
        Bytes written.

    Raises:
        ValueError: Unknown dtype, or an array whose shape differs from its spec, or too few arrays.
    """
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    tag, itemsize = DTYPES[dtype]
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "mlx"})}
    offset = 0
    for name, shape in specs:
        nbytes = math.prod(shape) * itemsize
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    written = 0
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(raw)))
        out.write(raw)
        iterator = iter(arrays)
        for name, shape in specs:
            try:
                array = next(iterator)
            except StopIteration:
                raise ValueError(f"no data for tensor {name!r}") from None
            if tuple(array.shape) != tuple(shape):
                raise ValueError(f"tensor {name!r}: shape {tuple(array.shape)} != planned {tuple(shape)}")
            data = to_dtype_array(array, dtype)
            out.write(memoryview(data).cast("B"))
            written += data.nbytes
    return 8 + len(raw) + written
