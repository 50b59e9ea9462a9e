"""What a worker loads: the target, its draft, and the per-layer changes made once at load
(fused projections, CUDA's small-matmul kernel). Runs on the engine thread."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from worker import small_gemm
from worker.config import EngineConfig
from worker.engine.modes import LoadedModels
from worker.fusion import fuse_projections
from worker.loading import load_target
from worker.models.dflash_checkpoint import load_dflash_draft

log = logging.getLogger(__name__)


def load_models(cfg: EngineConfig, draft_kind: str) -> LoadedModels:
    """Loads the target and its draft (`draft_kind`: "", "draft", "dflash" or "uag") in the
    worker's compute dtype, then fuses projections and swaps in small_gemm where configured.

    Raises:
        FileNotFoundError: a model directory without weights.
        DraftCheckpointError: a DFlash checkpoint that does not fit the target.
    """
    target, tokenizer = load_target(cfg.model_path)
    draft = draft_tokenizer = None
    if draft_kind == "dflash":  # borrows the target's embedding and head
        draft = load_dflash_draft(cfg.draft_path, target)
    elif cfg.draft_path is not None:
        draft, draft_tokenizer = load_target(cfg.draft_path)
        if draft_kind == "draft" and draft_tokenizer.vocab_size != tokenizer.vocab_size:
            log.warning("draft %s has vocabulary %d, target %d: acceptance may suffer",
                        cfg.draft_path, draft_tokenizer.vocab_size, tokenizer.vocab_size)
    if cfg.fuse_projections:  # before any forward; a DFlash draft has its own layer class
        groups = fuse_projections(target)
        if draft is not None and draft_kind != "dflash":
            groups += fuse_projections(draft)
        log.info("fused %d projection groups (q/k/v, gate/up) into one matmul each", groups)
    if cfg.small_gemm and small_gemm.available():  # after fusion: the fused linears too
        swapped = sum(small_gemm.use_small_gemm(m) for m in (target, draft) if m is not None)
        if swapped:
            log.info("small gemm: %d linear layers run calls of up to %d rows as one CUDA kernel each",
                     swapped, small_gemm.MAX_ROWS)
        else:
            log.info("small gemm: no linear layer it can take (it needs unquantized bf16/fp16 weights); "
                     "cuBLAS runs them")
    return LoadedModels(target, tokenizer, frozenset(tokenizer.eos_token_ids), draft, draft_kind,
                        draft_tokenizer=draft_tokenizer)


def read_model_config(path: Path, what: str) -> dict:
    """Reads `path/config.json`.

    Raises:
        FileNotFoundError: the directory or its config.json is missing.
        ValueError: config.json is not a JSON object (the message names the file).
    """
    if not path.is_dir():
        raise FileNotFoundError(f"{what} directory {path} does not exist")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{what} directory {path} has no config.json (not an mlx-lm model directory)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{what} {cfg_file} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{what} {cfg_file} must hold a JSON object, got {type(cfg).__name__}")
    return cfg


def draft_label(path: Path) -> str:
    """The draft's name in model info and metrics: its directory's name, or for a draft shipped
    with the package (named after its target) `flashfleet/drafts/NAME`, so it does not read as
    the target itself."""
    from flashfleet.models.drafts import drafts_root, package_drafts_root

    shipped = {r.resolve() for r in (drafts_root(), package_drafts_root())}
    return f"flashfleet/drafts/{path.name}" if path.resolve().parent in shipped else path.name
