"""Decoding modes: which decoding generator serves a request, and what it needs loaded.

`MODES` is the one table the engine consults; it never branches on the method itself. A new method
plugs in by writing its generator (the `worker.spec.base` contract), a start function below that
builds its caches and calls it, and an entry in `MODES`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from worker.compiled_draft import compiled_draft_pays
from worker.config import EngineConfig
from worker.engine.types import GenerationRequest, InvalidRequest
from worker.spec import draft_model, plain
from worker.spec.cost_model import AdaptiveBlockPolicy, CostMemory
from worker.spec.cross_tokenizer import start_uag
from worker.small_gemm import uses_small_gemm
from worker.spec.dflash import default_branches, dflash_generate, make_target_cache
from worker.spec.base import Sampler, Step


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
        cost_memory: DFlash cycle costs shared by this worker's sessions (`CostMemory`).
    """

    target: nn.Module
    tokenizer: Any
    eos_ids: frozenset[int]
    draft: nn.Module | None = None
    draft_kind: str = ""
    draft_tokenizer: Any = None
    cost_memory: CostMemory = field(default_factory=CostMemory)


# Builds one session's decoding generator and returns it with every cache it writes (the engine
# reports their nbytes). Runs on the engine thread.
StartFn = Callable[[LoadedModels, EngineConfig, GenerationRequest, Sampler], tuple[Iterator[Step], list[Any]]]


@dataclass(frozen=True)
class Mode:
    """One decoding method.

    Attributes:
        start: builds the session's generator and caches.
        needs_draft: the draft kind that must be loaded ("" = none).
    """

    start: StartFn
    needs_draft: str = ""


def start_plain(m: LoadedModels, cfg: EngineConfig, req: GenerationRequest, sampler: Sampler):
    """Plain decoding with the target (`worker.spec.plain`)."""
    # mlx-lm's cache, op by op: compiling plain steps measured no gain on the H200 (their graph
    # building already overlaps the previous step; docs/benchmarks.md, seventeenth session).
    cache = make_prompt_cache(m.target)
    steps = plain.generate(list(req.prompt_tokens), req.max_tokens, sampler, m.eos_ids,
                           model=m.target, cache=cache, prefill_step_tokens=cfg.prefill_step_tokens)
    return steps, cache


def candidate_rows(cfg: EngineConfig, target) -> int:
    """Candidate blocks per DFlash verify of `target` under `cfg`: `cfg.branches`, or the
    device's default (`default_branches`, which depends on whether the target's linears run
    `worker.small_gemm`) when it is None."""
    if cfg.branches is not None:
        return cfg.branches
    return default_branches(small_gemm=uses_small_gemm(target))


def start_dflash(m: LoadedModels, cfg: EngineConfig, req: GenerationRequest, sampler: Sampler):
    """DFlash block-diffusion speculative decoding (`worker.spec.dflash`)."""
    cache, draft_cache = make_target_cache(m.target), m.draft.make_cache()
    # Cycles timed apart only feed the metrics' draft/verify split, and cost a sync: only with
    # spec_timing_sync (the policy learns from the other cycles).
    policy = (AdaptiveBlockPolicy(cfg.block_size or m.draft.block_size, time_every=8 if cfg.spec_timing_sync else 0,
                                  memory=m.cost_memory, context_tokens=len(req.prompt_tokens))
              if cfg.adaptive_block_size else None)
    steps = dflash_generate(
        list(req.prompt_tokens), req.max_tokens, sampler, m.eos_ids, target=m.target,
        draft=m.draft, block_size=cfg.block_size, policy=policy, target_cache=cache,
        draft_cache=draft_cache, prefill_step_tokens=cfg.prefill_step_tokens,
        time_every=1 if cfg.spec_timing_sync else 0, compile_target=cfg.compile_forward,
        compile_draft=cfg.compile_forward and compiled_draft_pays(),
        branches=candidate_rows(cfg, m.target))
    return steps, cache + draft_cache


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
    """Draft-model speculative decoding (`worker.spec.draft_model`). Padded caches keep the verify's
    key length fixed for 256 positions (MLX's CUDA build compiles a kernel per new length)."""
    cache, draft_cache = make_target_cache(m.target), make_target_cache(m.draft)
    steps = draft_model.generate(
        list(req.prompt_tokens), req.max_tokens, sampler, m.eos_ids,
        model=m.target, draft_model=m.draft, num_draft_tokens=cfg.num_draft_tokens,
        cache=cache, draft_cache=draft_cache, prefill_step_tokens=cfg.prefill_step_tokens,
        time_split=cfg.spec_timing_sync,
    )
    return steps, cache + draft_cache


MODES: dict[str, Mode | None] = {
    "plain": Mode(start_plain),
    "draft": Mode(start_draft, needs_draft="draft"),
    "dflash": Mode(start_dflash, needs_draft="dflash"),
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
