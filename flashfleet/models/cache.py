"""Where fetched models live, and turning a model name or path into a local directory.

Layout::

    $FLASHFLEET_HOME/models/            (or ~/.cache/flashfleet/models/)
        SmolLM2-135M-Instruct/
            config.json  generation_config.json  model.safetensors (bfloat16)
            tokenizer.json  tokenizer_config.json
            flashfleet-model.json       marker: written last, holds the GGUF sha256
        SmolLM2-135M-Instruct-4bit/     `models fetch NAME --quantize 4`: the same files, weights
            ...                         in MLX's 4-bit affine layout; marker with `quantization`
        .SmolLM2-135M-Instruct.lock     held while a fetch of that model runs
        .SmolLM2-135M-Instruct.tmp-*/   a fetch in progress (removed when it ends)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .catalog import ModelSpec, UnknownModelError, get_spec, known_names, quantized_name, split_quantized_name

__all__ = [
    "MARKER_NAME",
    "ModelNotFetchedError",
    "cache_root",
    "is_complete",
    "marker_bits",
    "model_dir",
    "read_marker",
    "resolve_model",
    "served_model_name",
]

MARKER_NAME = "flashfleet-model.json"


class ModelNotFetchedError(FileNotFoundError):
    """A catalog model (or other name) that has no local directory yet."""


def cache_root() -> Path:
    """The directory fetched models are kept in.

    Returns:
        ``$FLASHFLEET_HOME/models`` when ``FLASHFLEET_HOME`` is set, else ``~/.cache/flashfleet/models``
        (not created here).
    """
    home = os.environ.get("FLASHFLEET_HOME")
    base = Path(home).expanduser() if home else Path.home() / ".cache" / "flashfleet"
    return base / "models"


def model_dir(name: str) -> Path:
    """The cache directory of a catalog model (it may not exist yet).

    Args:
        name: Catalog name, or a quantized copy's name (``quantized_name``).

    Returns:
        ``cache_root() / name``.
    """
    return cache_root() / name


def read_marker(directory: Path) -> dict[str, Any] | None:
    """The completion marker of a fetched model directory.

    Args:
        directory: A model directory.

    Returns:
        The marker's content, or ``None`` when it is missing or unreadable.
    """
    try:
        return json.loads((Path(directory) / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def marker_bits(marker: dict[str, Any] | None) -> int | None:
    """Bits per weight of a quantized copy's marker (``quantization.bits``), None for a dense one."""
    quantization = (marker or {}).get("quantization")
    return int(quantization["bits"]) if isinstance(quantization, dict) and "bits" in quantization else None


def is_complete(directory: Path, spec: ModelSpec, dtype: str | None = None, bits: int | None = None) -> bool:
    """Whether ``directory`` holds a finished fetch of ``spec``.

    Args:
        directory: The model directory.
        spec: The catalog entry; its sha256 must match the marker's.
        dtype: When given, the stored weight dtype must also match.
        bits: Quantized copies: the bits per weight the marker must record; None (default) asks
            for a dense copy (a marker without ``quantization``).

    Returns:
        True when the marker matches and the model files are present.
    """
    marker = read_marker(directory)
    if not marker or marker.get("sha256") != spec.sha256 or marker_bits(marker) != bits:
        return False
    if dtype is not None and marker.get("dtype") != dtype:
        return False
    return all((Path(directory) / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))


def served_model_name(name_or_path: str | os.PathLike) -> str:
    """The name clients ask a worker for when it serves `name_or_path`: a directory's own name,
    a catalog model's catalog spelling (``smollm2-135m-instruct`` -> ``SmolLM2-135M-Instruct``,
    the name clients default to; ``smollm2-135m-instruct-4bit`` -> ``SmolLM2-135M-Instruct-4bit``),
    else the text as given."""
    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    if path.is_dir():
        return path.resolve().name
    base, bits = split_quantized_name(text)
    try:
        return quantized_name(get_spec(base).name, bits)
    except UnknownModelError:
        return text


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """Turn a model reference into a local model directory.

    Args:
        name_or_path: Either a local directory with a ``config.json`` (HF/MLX layout), or a
            catalog name (e.g. ``"SmolLM2-135M-Instruct"``) or quantized copy's name
            (``"SmolLM2-135M-Instruct-4bit"``) that has been fetched.

    Returns:
        The absolute path of the model directory.

    Raises:
        ModelNotFetchedError: (a ``FileNotFoundError``) the name is a catalog model not fetched
            yet, or neither a model directory nor a catalog name; the message says to run
            ``flashfleet models fetch NAME``.
        NotADirectoryError: The path exists but is not a model directory (no ``config.json``).
    """
    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path.resolve()
        raise NotADirectoryError(f"{path} is a directory but not a model directory (no config.json)")
    base, bits = split_quantized_name(text)
    try:
        spec = get_spec(base)
    except UnknownModelError:
        spec = None
    if spec is not None:
        name = quantized_name(spec.name, bits)
        directory = model_dir(name)
        if is_complete(directory, spec, bits=bits):
            return directory.resolve()
        command = f"flashfleet models fetch {spec.name}" + (f" --quantize {bits}" if bits else "")
        raise ModelNotFetchedError(
            f"model {name!r} is not fetched yet (looked in {directory}); run `{command}` first"
        )
    raise ModelNotFetchedError(
        f"{text!r} is neither a local model directory (with config.json) nor a known model name. "
        f"Known models: {', '.join(known_names())}; fetch one with `flashfleet models fetch NAME`"
    )
