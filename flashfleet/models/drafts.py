"""DFlash drafts that ship inside the package, one per catalog model that has one.

Layout (package data, installed with the package)::

    flashfleet/drafts/
        SmolLM2-135M-Instruct/        the catalog name of the target it was trained for
            config.json               z-lab layout: block_size, dflash_config.target_layer_ids,
            model.safetensors           dflash_config.mask_token_id (optionally `quantization`)
            TRAINING.md  training_card.json

Everywhere a draft is given (``flashfleet up --draft``, ``flashfleet worker --draft``, a cluster
config's ``[[models]] draft``), the keyword ``dflash`` means "the shipped DFlash draft for this
worker's model" (:func:`resolve_draft_arg`). ``$FLASHFLEET_DRAFTS_DIR`` replaces the packaged
directory (for tests, or to try drafts before they are packaged).

Nothing here imports MLX: the draft is only located; the worker loads it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .cache import read_marker
from .catalog import (CATALOG, UnknownModelError, close_match_hint, get_spec, is_catalog_name, known_names,
                      split_quantized_name)

__all__ = [
    "DFLASH_KEYWORD",
    "DRAFTS_ENV",
    "NoShippedDraftError",
    "drafts_root",
    "is_dflash_draft_dir",
    "is_dflash_keyword",
    "package_drafts_root",
    "resolve_draft_arg",
    "shipped_draft_dir",
    "shipped_drafts",
]

DFLASH_KEYWORD = "dflash"
DRAFTS_ENV = "FLASHFLEET_DRAFTS_DIR"


class NoShippedDraftError(LookupError):
    """``--draft dflash`` for a model that has no shipped DFlash draft."""


def package_drafts_root() -> Path:
    """The drafts directory inside the installed package (``flashfleet/drafts``; may not exist)."""
    return Path(__file__).resolve().parent.parent / "drafts"


def drafts_root() -> Path:
    """Where shipped drafts are looked up: ``$FLASHFLEET_DRAFTS_DIR`` when set, else the package's."""
    override = os.environ.get(DRAFTS_ENV)
    return Path(override).expanduser() if override else package_drafts_root()


def is_dflash_draft_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a DFlash draft directory: a config.json with ``dflash_config`` (or the
    ``DFlashDraftModel`` architecture) and at least one ``*.safetensors`` file."""
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(config, dict):
        return False
    dflash = "dflash_config" in config or "DFlashDraftModel" in (config.get("architectures") or ())
    return dflash and any(path.glob("*.safetensors"))


def shipped_drafts() -> dict[str, Path]:
    """Catalog models that have a shipped DFlash draft.

    Returns:
        ``{catalog name: draft directory}`` in catalog order (default model first); a directory
        under :func:`drafts_root` counts when it is named after a catalog model (any case) and
        holds a DFlash draft (:func:`is_dflash_draft_dir`).
    """
    root = drafts_root()
    try:
        entries = {entry.name.lower(): entry for entry in root.iterdir() if entry.is_dir()}
    except OSError:  # no drafts directory (none shipped yet)
        return {}
    found = {}
    for name in known_names():
        entry = entries.get(name.lower())
        if entry is not None and is_dflash_draft_dir(entry):
            found[name] = entry
    return found


def _catalog_name(model: str | os.PathLike) -> str | None:
    """The catalog name ``model`` refers to: a catalog name (any case) or its quantized copy's
    (``X-4bit`` -> ``X``), or a model directory whose fetch marker, or else whose own name, is a
    catalog model's; None otherwise."""
    text = os.fspath(model)
    path = Path(text).expanduser()
    if path.is_dir():
        marker = read_marker(path) or {}
        spec = next((s for s in CATALOG.values() if s.sha256 == marker.get("sha256")), None)
        if spec is not None:
            return spec.name
        text = path.resolve().name
    try:
        return get_spec(split_quantized_name(text)[0]).name
    except UnknownModelError:
        return None


def shipped_draft_dir(model: str | os.PathLike) -> Path | None:
    """The shipped DFlash draft for a target model.

    Args:
        model: A catalog name (case-insensitive, as :func:`~flashfleet.models.get_spec`) or a
            quantized copy's name (``SmolLM2-135M-Instruct-4bit``: the draft binds the quantized
            target's embedding and head), or a model directory that is a fetched catalog model
            or copy (its ``flashfleet-model.json``) or is named after one
            (e.g. ``~/models/SmolLM2-135M-Instruct``).

    Returns:
        The draft directory, or None when the model is not a catalog model or has no shipped draft.
    """
    name = _catalog_name(model)
    return shipped_drafts().get(name) if name else None


def is_dflash_keyword(draft: str | None) -> bool:
    """Whether a ``--draft`` value is the keyword ``dflash`` (any case)."""
    return draft is not None and draft.strip().lower() == DFLASH_KEYWORD


def resolve_draft_arg(draft: str | None, model: str | os.PathLike, *aliases: str | None) -> str | None:
    """A ``--draft`` value with the keyword ``dflash`` replaced by the shipped draft's directory.

    Args:
        draft: The value as given: None, a name or directory (returned unchanged), or ``dflash``.
        model: The worker's target model (``--model``: catalog name or model directory).
        aliases: Further names of the same target tried when ``model`` is not recognised, e.g.
            the served ``--model-name`` of a model loaded from an arbitrary directory.

    Returns:
        ``draft`` unchanged, or the shipped draft's directory as a string.

    Raises:
        NoShippedDraftError: ``dflash`` for a model without a shipped draft; the one-line message
            names the models that have one.
    """
    if not is_dflash_keyword(draft):
        return draft
    for candidate in (model, *aliases):
        if candidate:
            found = shipped_draft_dir(candidate)
            if found is not None:
                return str(found)
    have = ", ".join(shipped_drafts()) or "none yet"
    name = os.fspath(model)
    if not Path(name).is_dir() and not is_catalog_name(name):
        raise NoShippedDraftError(
            f"unknown model {name!r}{close_match_hint(name)}"
            + f"; catalog models: {', '.join(CATALOG)}; models with a shipped DFlash draft: {have}"
        )
    raise NoShippedDraftError(
        f"draft 'dflash': no DFlash draft ships for model {name!r}; "
        f"models with a shipped DFlash draft: {have}"
    )
