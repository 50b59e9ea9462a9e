"""Configuration of one worker's engine, built once (CLI + environment) and passed down."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EngineConfig:
    """What the engine loads and how it decodes.

    Attributes:
        kv_budget_bytes: most bytes the KV caches may hold (running sessions, prefills, the
            prompt cache); None derives it from the device (`worker.engine.budget`).
        prompt_cache_entries: finished turns whose KV caches stay for prefix reuse (0: none).
        model_path: local model directory (config.json, *.safetensors, tokenizer files) that
            `mlx_lm.load` reads; never a hub id (workers have no hub access).
        model_name: name the worker serves the model under ("" = the directory's name).
        draft_path: local directory of a draft, or None for no draft: a same-tokenizer causal
            LM (classic draft-model speculative decoding) or a DFlash checkpoint (config.json with
            `dflash_config`), told apart by `draft_kind`.
        draft_kind: "draft", "dflash" or "uag" (a draft with another tokenizer); "" detects it
            from the draft's config.json and tokenizer files.
        block_size: DFlash block size B (last token + B-1 drafted); None takes the checkpoint's.
        adaptive_block_size: the DFlash batch's block size for each iteration comes from the
            batch's acceptance and measured iteration costs (worker/engine/block_policy.py),
            down to plain steps when speculation stops paying. On by default; False keeps the
            block size fixed (benchmarks of the raw cycle).
        num_draft_tokens: draft tokens proposed per speculative cycle (k), >= 1.
        capacity: most sessions admitted at once (running or queued), >= 1; running sessions are
            decoded together, one batched forward per iteration, within the KV budget.
        prefill_step_tokens: prompt tokens per prefill forward (chunked prefill), >= 1.
        max_context_tokens: context limit override in tokens; None takes the model's
            `max_position_embeddings` from config.json.
        warmup: run a few tokens through each loaded model before reporting ready, then the
            batched forwards of every batch size up to `capacity` and every DFlash block size
            (worker/engine/warm.py), so no session waits on a kernel compile.
        warmup_shapes_s: most seconds the warm-up of batched shapes may take (the shapes left
            are met cold by the first sessions that need them); 0 warms none, >= 0.
        fuse_projections: after loading, compute each decoder layer's q/k/v projections with one
            matmul and its MLP's gate/up with one (worker/fusion.py): the same outputs to float
            rounding with three fewer kernels a layer, which is what a launch-bound GPU pays for.
            On by default; False keeps mlx-lm's layers as loaded.
        small_gemm: on MLX's CUDA backend, the models' linear layers run their calls of 1-64
            rows (a verify's tokens, a biased one-token projection) as one JIT-compiled
            tensor-core kernel each instead of cuBLASLt (worker/small_gemm.py): on the H200 a
            16-token verify of the 1.5B target took 29% less time on two of three machines (4%
            on the third; docs/benchmarks.md, "Small matmuls in one kernel"). Equal to
            cuBLAS's result up to rounding. Ignored elsewhere (CPU, Metal). On by default.
    """

    model_path: Path
    model_name: str = ""
    draft_path: Path | None = None
    draft_kind: str = ""
    block_size: int | None = None
    adaptive_block_size: bool = True
    num_draft_tokens: int = 3
    capacity: int = 8
    prefill_step_tokens: int = 512
    max_context_tokens: int | None = None
    warmup: bool = True
    warmup_shapes_s: float = 60.0
    fuse_projections: bool = True
    small_gemm: bool = True
    kv_budget_bytes: int | None = None
    prompt_cache_entries: int = 8

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_path", Path(self.model_path))
        if self.draft_path is not None:
            object.__setattr__(self, "draft_path", Path(self.draft_path))
        if self.kv_budget_bytes is not None and self.kv_budget_bytes < 1:
            raise ValueError(f"EngineConfig.kv_budget_bytes must be >= 1, got {self.kv_budget_bytes}")
        if not self.warmup_shapes_s >= 0:
            raise ValueError(f"EngineConfig.warmup_shapes_s must be >= 0, got {self.warmup_shapes_s}")
        if self.prompt_cache_entries < 0:
            raise ValueError(f"EngineConfig.prompt_cache_entries must be >= 0, got {self.prompt_cache_entries}")
        for name in ("num_draft_tokens", "capacity", "prefill_step_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.draft_kind not in ("", "draft", "dflash", "uag"):
            raise ValueError("EngineConfig.draft_kind must be '', 'draft', 'dflash' or 'uag', "
                             f"got {self.draft_kind!r}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"EngineConfig.block_size must be >= 1, got {self.block_size}")
        if self.max_context_tokens is not None and self.max_context_tokens < 2:
            raise ValueError(f"EngineConfig.max_context_tokens must be >= 2, got {self.max_context_tokens}")

    @property
    def served_name(self) -> str:
        """The model name clients use: `model_name`, or the model directory's name."""
        return self.model_name or self.model_path.name
