"""Where fetched models live, and turning a model name or path into a local directory.

Layout::

    $FLASHFLEET_HOME/models/            (or ~/.cache/flashfleet/models/)
        SmolLM2-135M-Instruct/
            config.json  generation_config.json  model.safetensors
            tokenizer.json  tokenizer_config.json
            flashfleet-model.json       marker: written last, holds the GGUF sha256
        .SmolLM2-135M-Instruct.lock     held while a fetch of that model runs
        .SmolLM2-135M-Instruct.tmp-*/   a fetch in progress (removed when it ends)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .catalog import ModelSpec, UnknownModelError, get_spec, known_names

__all__ = [
    "MARKER_NAME",
    "ModelNotFetchedError",
    "cache_root",
    "is_complete",
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
        name: Catalog name.

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


def is_complete(directory: Path, spec: ModelSpec, dtype: str | None = None) -> bool:
    """Whether ``directory`` holds a finished fetch of ``spec``.

    Args:
        directory: The model directory.
        spec: The catalog entry; its sha256 must match the marker's.
        dtype: When given, the stored weight dtype must also match.

    Returns:
        True when the marker matches and the model files are present.
    """
    marker = read_marker(directory)
    if not marker or marker.get("sha256") != spec.sha256:
        return False
    if dtype is not None and marker.get("dtype") != dtype:
        return False
    return all((Path(directory) / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))


def served_model_name(name_or_path: str | os.PathLike) -> str:
    """The name clients ask a worker for when it serves `name_or_path`: a directory's own name,
    a catalog model's catalog spelling (``smollm2-135m-instruct`` -> ``SmolLM2-135M-Instruct``,
    the name clients default to), else the text as given."""
    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    if path.is_dir():
        return path.resolve().name
    try:
        return get_spec(text).name
    except UnknownModelError:
        return text


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """Turn a model reference into a local model directory.

    Args:
        name_or_path: Either a local directory with a ``config.json`` (HF/MLX layout), or a
            catalog name (e.g. ``"SmolLM2-135M-Instruct"``) that has been fetched.

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
    try:
        spec = get_spec(text)
    except UnknownModelError:
        spec = None
    if spec is not None:
        directory = model_dir(spec.name)
        if is_complete(directory, spec):
            return directory.resolve()
        raise ModelNotFetchedError(
            f"model {spec.name!r} is not fetched yet (looked in {directory}); "
            f"run `flashfleet models fetch {spec.name}` first"
        )
    raise ModelNotFetchedError(
        f"{text!r} is neither a local model directory (with config.json) nor a known model name. "
        f"Known models: {', '.join(known_names())}; fetch one with `flashfleet models fetch NAME`"
    )
