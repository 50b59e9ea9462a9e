"""The target model of a run: found (directory or catalog name), loaded, fingerprinted, its config."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import mlx.core as mx


def target_fingerprint(path: Path) -> str:
    """Identifies a target directory's weights: config.json plus the size and edges of each
    safetensors file (cheap; a full hash of large weights would take long)."""
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read())
    return h.hexdigest()[:16]


def resolve_target(ref: str | os.PathLike) -> Path:
    """A model directory (with config.json) as is, else a fetched catalog name through
    `flashfleet.models.resolve_model` (imported only then: the flashfleet package loads gRPC).

    Raises:
        FileNotFoundError / NotADirectoryError: as `resolve_model`.
    """
    path = Path(ref).expanduser()
    if (path / "config.json").is_file():
        return path.resolve()
    from flashfleet.models import resolve_model

    return resolve_model(ref)


def load_target(path: Path, dtype: mx.Dtype):
    """mlx_lm.load, cast to `dtype`, frozen, evaluated. Returns (model, tokenizer)."""
    from mlx_lm import load

    model, tokenizer = load(str(path))
    model.set_dtype(dtype)
    model.freeze()
    mx.eval(model.parameters())
    return model, tokenizer


def target_config(target_path: Path) -> dict:
    """The target's config.json (a multimodal one's text_config merged in), or {} when it cannot
    be read (the loader reports that itself)."""
    try:
        c = json.loads((target_path / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return {**c.get("text_config", {}), **c} if isinstance(c, dict) else {}

