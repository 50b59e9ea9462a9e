"""A running session's KV state as host bytes, and back: the engine side of KV-transfer migration.

A batched session's state between iterations is its committed tokens t[:n] and its one-row
caches holding positions [0, n-1) (worker/engine/batch.py); a DFlash row's draft cache is
brought to the same length by folding its pending taps into it (`extend_context`, as the prompt
cache does). That state is exactly a prompt-cache entry, so a destination worker that imports it
admits the resumed request as a prompt-cache hit: it prefills only the tokens the state does not
cover. Greedy output depends only on the target's caches, so it continues token for token.

`snapshot` (engine thread) copies caches into host `CacheBytes`; `restore` (engine thread) makes
one-row `RowKVCache`s of them. Arrays travel as their raw bytes in C order; a dtype without a
numpy equivalent (bfloat16) is viewed as bytes, so the copy is exact. `fingerprint` names a model
so that a state loads only where the same weights and dtype run.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from flashfleet.kv_need import bucket
from worker.caches.rows import RowKVCache

FORMAT_VERSION = 1
DEFAULT_IMPORT_TTL_S = 30.0  # an imported state no request claims is dropped after this long


@dataclass(frozen=True)
class Layout:
    """One cache's array layout in a session state.

    Attributes:
        part: "target" or "draft".
        layer: the layer's index within its part.
        dtype: MLX dtype name of keys and values (e.g. "bfloat16").
        key_shape / value_shape: (1, kv_heads, positions, head_dim).
    """

    part: str
    layer: int
    dtype: str
    key_shape: tuple[int, ...]
    value_shape: tuple[int, ...]

    @property
    def itemsize(self) -> int:
        return getattr(mx, self.dtype).size

    @property
    def key_bytes(self) -> int:
        return int(np.prod(self.key_shape)) * self.itemsize

    @property
    def value_bytes(self) -> int:
        return int(np.prod(self.value_shape)) * self.itemsize

    def per_position(self) -> tuple:
        """The layout without its positions (what must match between workers)."""
        k, v = self.key_shape, self.value_shape
        return (self.part, self.layer, self.dtype, k[:2] + k[3:], v[:2] + v[3:])


@dataclass
class CacheBytes:
    """One cache's keys and values as flat uint8 host arrays (raw dtype bytes, C order)."""

    layout: Layout
    keys: np.ndarray
    values: np.ndarray


@dataclass
class SessionState:
    """A session's exportable state.

    Attributes:
        request_id: the session's request.
        mode: "plain" or "dflash".
        tokens: its committed token ids t[:n0] (prompt, then output).
        positions: positions every cache holds (n0 - 1).
        caches: target layers, then (DFlash) draft layers.
        model_fingerprint / draft_fingerprint: `fingerprint` of the target / the DFlash draft ("").
        format_version: `FORMAT_VERSION` of whoever wrote it.
    """

    request_id: str
    mode: str
    tokens: tuple[int, ...]
    positions: int
    caches: list[CacheBytes] = field(default_factory=list)
    model_fingerprint: str = ""
    draft_fingerprint: str = ""
    format_version: int = FORMAT_VERSION

    @property
    def layouts(self) -> list[Layout]:
        return [c.layout for c in self.caches]

    @property
    def payload_bytes(self) -> int:
        """Bytes of array data (every cache's keys and values)."""
        return sum(lay.key_bytes + lay.value_bytes for lay in self.layouts)


def fingerprint(model_path: Optional[Path], dtype: str = "") -> str:
    """`<directory name>:<sha256 of config.json, 16 hex>:<dtype>` of a model directory ("" for
    None). Two workers share a fingerprint when they load the same model at the same dtype."""
    if model_path is None:
        return ""
    cfg = Path(model_path) / "config.json"
    digest = hashlib.sha256(cfg.read_bytes()).hexdigest()[:16] if cfg.exists() else "-"
    return f"{Path(model_path).name}:{digest}:{dtype}"


def _host_bytes(a: mx.array) -> np.ndarray:
    """The raw bytes of an MLX array, flat uint8 (a copy on the host)."""
    return np.array(a.view(mx.uint8)).reshape(-1)


def snapshot(caches: list[RowKVCache], parts: list[str], positions: int) -> list[CacheBytes]:
    """Host copies of positions [0, positions) of one-row caches (engine thread).

    Args:
        caches: one-row caches, each holding at least `positions` positions.
        parts: "target" or "draft" per cache (layers count from 0 within a part).
        positions: positions to copy, >= 1.

    Raises:
        ValueError: a cache without keys, with more than one row, or shorter than `positions`.
    """
    out, index = [], {}
    for c, part in zip(caches, parts):
        if c.keys is None or c.batch_size != 1 or c.host_lengths[0] < positions:
            raise ValueError(f"a {part} cache holds {c.host_lengths} positions, not {positions}")
        k, v = c.keys[:, :, :positions], c.values[:, :, :positions]
        layer = index.get(part, 0)
        index[part] = layer + 1
        layout = Layout(part, layer, str(k.dtype).removeprefix("mlx.core."), tuple(k.shape), tuple(v.shape))
        out.append(CacheBytes(layout, _host_bytes(k), _host_bytes(v)))
    return out


def _device_array(raw: np.ndarray, shape: tuple[int, ...], dtype: str) -> mx.array:
    return mx.array(raw.reshape(*shape[:-1], -1)).view(getattr(mx, dtype)).reshape(shape)


def restore(caches: list[CacheBytes], positions: int) -> list[RowKVCache]:
    """One-row `RowKVCache`s holding positions [0, positions) of `caches` (engine thread); their
    buffers are padded to the allocation bucket, as a prefill's are."""
    out = []
    S = bucket(positions)
    for c in caches:
        lay = c.layout
        k = _device_array(c.keys, lay.key_shape, lay.dtype)
        v = _device_array(c.values, lay.value_shape, lay.dtype)
        pad = [(0, 0), (0, 0), (0, S - positions), (0, 0)]
        rc = RowKVCache(1)
        rc.keys, rc.values = mx.pad(k, pad), mx.pad(v, pad)
        rc.set_lengths([positions])
        mx.eval(rc.state)
        out.append(rc)
    return out

