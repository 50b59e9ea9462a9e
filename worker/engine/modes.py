"""Decoding modes: which decoding generator serves a request, and what it needs loaded.

`MODES` is the one table the engine consults. Plain decoding and DFlash run as rows of the
scheduler's batches (`worker.engine.scheduler.BATCHED_MODES`): their entries name no start
function. A method without a batched path plugs in by writing its generator (the
`worker.decoding.base` contract), a start function below that builds its caches and calls it, and an
entry in `MODES`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

import mlx.nn as nn

from worker.config import EngineConfig
from worker.engine.types import GenerationRequest, InvalidRequest
from worker.decoding import draft_model
from worker.decoding.cross_tokenizer import start_uag
from worker.caches.padded import make_target_cache
from worker.decoding.base import Sampler, Step


@dataclass
class LoadedModels:
    """What the engine thread loaded; owned by that thread.

    Attributes:
        target: the served mlx-lm model.
        tokenizer: its tokenizer (mlx-lm `TokenizerWrapper`), used for detokenizing.
        eos_ids: token ids that end a generation.
        draft: the draft model, or None.
        draft_kind: the kind of `draft` ("" when none, else a key of `MODES`, e.g. "draft").
        draft_tokenizer: the draft's own tokenizer (cross-tokenizer "uag" drafts only).
    """

    target: nn.Module
    tokenizer: Any
    eos_ids: frozenset[int]
    draft: nn.Module | None = None
    draft_kind: str = ""
    draft_tokenizer: Any = None


# Builds one session's decoding generator and returns it with every cache it writes (the engine
# reports their nbytes). Runs on the engine thread.
StartFn = Callable[[LoadedModels, EngineConfig, GenerationRequest, Sampler], tuple[Iterator[Step], list[Any]]]


@dataclass(frozen=True)
class Mode:
    """One decoding method.

    Attributes:
        start: builds the session's generator and caches; None for a method the scheduler
            batches (`worker.engine.scheduler.BATCHED_MODES`).
        needs_draft: the draft kind that must be loaded ("" = none).
    """

    start: Optional[StartFn]
    needs_draft: str = ""


def draft_kind_of(draft_config: Mapping[str, Any], draft_dir: Path, target_dir: Path) -> str:
    """The kind of a draft directory: "dflash" for a DFlash checkpoint (its config.json has
    `dflash_config` or the DFlashDraftModel architecture); "draft" for a causal LM with the
    target's tokenizer (same tokenizer.json, or same vocab file); "uag" for a causal LM with
    another tokenizer (cross-tokenizer drafting, Universal Assisted Generation)."""
    if "dflash_config" in draft_config or "DFlashDraftModel" in draft_config.get("architectures", ()):
        return "dflash"
    for name in ("tokenizer.json", "tokenizer.model", "vocab.json"):
        a, b = Path(draft_dir) / name, Path(target_dir) / name
        if a.exists() or b.exists():
            same = a.exists() and b.exists() and a.read_bytes() == b.read_bytes()
            return "draft" if same else "uag"
    return "draft"


def start_draft(m: LoadedModels, cfg: EngineConfig, req: GenerationRequest, sampler: Sampler):
    """Draft-model speculative decoding (`worker.decoding.draft_model`). Padded caches keep the verify's
    key length fixed for 256 positions (MLX's CUDA build compiles a kernel per new length)."""
    cache, draft_cache = make_target_cache(m.target), make_target_cache(m.draft)
    steps = draft_model.generate(
        list(req.prompt_tokens), req.max_tokens, sampler, m.eos_ids,
        model=m.target, draft_model=m.draft, num_draft_tokens=cfg.num_draft_tokens,
        cache=cache, draft_cache=draft_cache, prefill_step_tokens=cfg.prefill_step_tokens,
    )
    return steps, cache + draft_cache


MODES: dict[str, Mode | None] = {
    "plain": Mode(None),
    "draft": Mode(start_draft, needs_draft="draft"),
    "dflash": Mode(None, needs_draft="dflash"),
    "uag": Mode(start_uag, needs_draft="uag"),
}

AUTO = "auto"


def resolve_mode(requested: str, draft_kind: str, modes: Mapping[str, Mode | None] = MODES) -> str:
    """Maps a request's mode to a key of `modes` this worker can serve. Pure Python, any thread.

    "auto" is the loaded draft's mode when there is one, else "plain".

    Args:
        requested: the request's mode ("auto" or a key of `modes`).
        draft_kind: the loaded draft's kind ("" when none).
        modes: the mode table.

    Returns:
        A key of `modes` whose entry is not None and whose draft is loaded.

    Raises:
        InvalidRequest: unknown mode, a mode not built on this worker, or one whose draft is not
            loaded.
    """
    if requested == AUTO:
        return draft_kind if draft_kind and modes.get(draft_kind) is not None else "plain"
    if requested not in modes:
        known = ", ".join(repr(k) for k in (AUTO, *modes))
        raise InvalidRequest(f"unknown mode {requested!r}; expected one of {known}")
    mode = modes[requested]
    if mode is None:
        raise InvalidRequest(f"mode {requested!r} is not loaded on this worker")
    if mode.needs_draft and mode.needs_draft != draft_kind:
        have = f"a {draft_kind!r} draft" if draft_kind else "no draft model"
        raise InvalidRequest(
            f"mode {requested!r} needs a {mode.needs_draft!r} draft model; this worker has {have} loaded"
        )
    return requested
