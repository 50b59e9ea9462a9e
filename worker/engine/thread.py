"""The engine: one named daemon thread that owns every piece of MLX work on a worker.

Modelled on mlx-lm's server (`mlx_lm/server.py`: one generation thread fed by a queue, which also
loads the model) and smg's MLX servicer (one named daemon thread, events handed back through a
callback), with a command queue instead of shared locks around the model.
"""
from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

import mlx.core as mx
from mlx_lm.utils import load_tokenizer

from flashfleet.tool_calls import detect_format
from worker.config import EngineConfig
from worker.detokenize import TextAssembler
from worker.engine.grammar import RowGrammar
from worker.engine.penalties import RowPenalties
from worker.engine.modes import MODES, LoadedModels, Mode, draft_kind_of, resolve_mode
from worker.models.dflash_checkpoint import DraftCheckpointError
from worker.engine.block_policy import BatchBlockPolicy
from worker.engine.budget import default_kv_budget_bytes
from worker.engine.load import draft_label, load_models, read_model_config
from worker.engine.profile import DecodeProfile, LoadBoard, SessionRates, scheduler_sessions
from worker.engine.scheduler import BATCHED_MODES, Scheduler
from worker.engine.intake import Intake
from worker.engine.transfer import SessionTransfer
from worker.engine.warm import WarmReport, warm_shapes
from worker.engine.session import Session, new_stats
from worker.engine.types import (
    DoneEvent,
    Draining,
    EmitFn,
    EngineLoad,
    ErrorEvent,
    GenerationRequest,
    InvalidRequest,
    ModelDescription,
    Overloaded,
    SamplingParams,
    TokenEvent,
)
from worker.loading import DTYPES, compute_dtype
from worker.metrics import model_footprint  # observability: bytes a decode step reads
from worker.sampling import sampler_for

log = logging.getLogger(__name__)

THREAD_NAME = "flashfleet-engine"


@dataclass(frozen=True)
class Submit:
    """Start a validated request in `mode` (a key of the mode table)."""

    request: GenerationRequest
    mode: str
    emit: EmitFn
    received_s: float
    grammar: Any = None  # the request's grammar matcher (worker/engine/grammar.py), or None


@dataclass(frozen=True)
class Abort:
    """Cancel a request; it ends with DoneEvent("cancelled") unless it already ended."""

    request_id: str


@dataclass(frozen=True)
class Shutdown:
    """Cancel every session, free the models and end the thread."""


@dataclass(frozen=True)
class Call:
    """Run fn(models, scheduler) on the engine thread; its result or exception goes to `future`."""

    fn: Callable[[LoadedModels, Scheduler], Any]
    future: Future


Command = Submit | Abort | Shutdown | Call


class Engine:
    """Runs decoding sessions for one model (plus an optional draft) on one MLX thread.

    Concurrency model:
      - The engine thread (named "flashfleet-engine", a daemon) loads the models, warms them up,
        runs every session and frees the models at the end. No other thread touches MLX.
      - Callers (the gRPC servicer) talk to it only through a command queue: `submit` and
        `abort` put `Submit` / `Abort`, `close` puts `Shutdown`, and the KV-transfer API
        `transfer` (worker/engine/transfer.py) puts `Call`s. None of them waits for MLX.
      - Sessions are data held by one `Scheduler` (worker/engine/scheduler.py, docs/engine.md):
        each pass of the thread's loop drains the queue, then runs one scheduler iteration (a
        prefill chunk, one batched forward per decoding method, one step of each session whose
        method has no batched path), detokenizes the new tokens and calls each request's `emit`
        on the engine thread. A session that fails ends with an `ErrorEvent`; the others go on.
      - One lock, `_lock`, guards the admission set (request ids admitted and not yet ended) and
        the accepting flag. It is held for a few set operations, never across MLX work or
        callbacks, so `submit` can answer Overloaded / Draining synchronously. Capacity is
        released before a session's final event is emitted, so a client may resubmit at once.
      - `encode_prompt` and the checks of `submit` run on the caller's thread
        (worker/engine/intake.py), with a tokenizer instance of their own (the engine thread
        decodes with another); encoding is serialized by a lock of its own.

    Args:
        config: what to load and how to decode.
        modes: the decoding-mode table (default `worker.engine.modes.MODES`); tests inject
            extra modes here.
        clock: monotonic clock in seconds, for request statistics.
        load_timeout_s: longest wait for loading and warm-up, seconds (None = no limit).
        profile: where the engine thread records its measured decode and prefill times for the
            coordinator's migration policy (default: a new `DecodeProfile`); tests inject one.

    The constructor reads the model configs, starts the thread and blocks until the models are
    loaded and warm.

    Raises:
        FileNotFoundError: a model directory or its config.json is missing (or, from the
            engine thread, its weights).
        DraftCheckpointError: a DFlash draft checkpoint that cannot be loaded for this target
            (`worker.models.dflash_checkpoint`).
        ValueError: the model's context length is unknown (set max_context_tokens).
        RuntimeError: loading or warm-up failed on the engine thread (the cause is chained), or
            took longer than load_timeout_s.

    Usage:
        with Engine(config) as engine:
            engine.submit(request, emit)
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        modes: Mapping[str, Mode | None] = MODES,
        clock: Callable[[], float] = time.perf_counter,
        load_timeout_s: float | None = None,
        profile: DecodeProfile | None = None,
    ):
        self.config = config
        self._modes = dict(modes)
        self._clock = clock
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._admitted: set[str] = set()
        self._accepting = False
        self._closed = False
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._scheduler: Scheduler | None = None  # the engine thread's
        self._bytes_per_position: dict[str, int] = {}  # the scheduler's, set once it is made
        # Published by the engine thread for load(): sessions' KV bytes, the prompt cache's, the budget.
        self._kv_bytes = self._prompt_cache_bytes = self._kv_budget = 0
        # Measured speed for the coordinator's migration policy (worker/engine/profile.py).
        self._profile = profile if profile is not None else DecodeProfile()
        self._rates = SessionRates()
        self._board = LoadBoard()

        model_cfg = read_model_config(config.model_path, "model")
        draft_cfg = (read_model_config(config.draft_path, "draft model")
                     if config.draft_path is not None else None)
        model_cfg = {**model_cfg.get("text_config", {}), **model_cfg}  # multimodal configs nest these
        context = config.max_context_tokens or model_cfg.get("max_position_embeddings")
        if not context:
            raise ValueError(
                f"{config.model_path / 'config.json'} has no max_position_embeddings; "
                "set EngineConfig.max_context_tokens"
            )
        self._vocab_size: int | None = model_cfg.get("vocab_size")
        self._draft_kind = "" if draft_cfg is None else config.draft_kind or draft_kind_of(
            draft_cfg, config.draft_path, config.model_path)
        # Weights and KV bytes per token from config.json and file sizes, the KV in the dtype the
        # worker computes in; once loaded, the target's and a DFlash draft's KV bytes are those
        # the caches take (`_measured_kv`).
        kv_item = compute_dtype(DTYPES.get(str(model_cfg.get("torch_dtype")))).size
        target_fp = model_footprint(config.model_path, kv_item)
        draft_fp = model_footprint(config.draft_path, kv_item) if config.draft_path is not None else None
        self._model = ModelDescription(
            name=config.served_name,
            max_context_tokens=int(context),
            draft=draft_label(config.draft_path) if config.draft_path is not None else "",
            draft_mode=self._draft_kind,
            weights_bytes=target_fp.weights_bytes,
            kv_bytes_per_token=target_fp.kv_bytes_per_token,
            draft_weights_bytes=draft_fp.weights_bytes if draft_fp else 0,
            draft_kv_bytes_per_token=draft_fp.kv_bytes_per_token if draft_fp else 0,
            num_draft_tokens=self._draft_tokens_per_cycle(config, draft_cfg) if draft_fp else 0,
        )
        self._encode_tokenizer = load_tokenizer(config.model_path)  # the callers' (the engine thread has its own)
        self._model = replace(self._model, tool_call_format=detect_format(
            getattr(self._encode_tokenizer, "chat_template", None)))
        self._intake = Intake(self._encode_tokenizer, self._model, self._vocab_size, self._draft_kind, self._modes)
        # Session migration's KV transfer (export, import), run through `_call`.
        self.transfer = SessionTransfer(self._call, clock, self._vocab_size)

        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()
        if not self._ready.wait(load_timeout_s):
            self.close(timeout_s=0)
            raise RuntimeError(f"engine did not load {config.model_path} within {load_timeout_s} s")
        if self._startup_error is not None:
            self._thread.join()
            if isinstance(self._startup_error, (DraftCheckpointError, FileNotFoundError)):
                raise self._startup_error  # a user error (e.g. a model directory without weights): say it plainly
            raise RuntimeError(f"engine failed to start: {self._startup_error}") from self._startup_error
        self._model = self._measured_kv(self._model, self._bytes_per_position)

    @staticmethod
    def _measured_kv(model: ModelDescription, per_position: Mapping[str, int]) -> ModelDescription:
        """`model` with the KV bytes per token the loaded caches take (`Scheduler.bytes_per_position`,
        the numbers the KV budget counts with): the target's plain bytes, and a DFlash draft's
        share of its mode's; a classic or cross-tokenizer draft keeps its estimate."""
        if "plain" not in per_position:
            return model
        plain = per_position["plain"]
        draft = per_position["dflash"] - plain if "dflash" in per_position else model.draft_kv_bytes_per_token
        return replace(model, kv_bytes_per_token=plain, draft_kv_bytes_per_token=draft)

    # ----- lifecycle -------------------------------------------------------------------------

    def close(self, timeout_s: float | None = None) -> None:
        """Stops accepting, cancels running sessions (DoneEvent "cancelled"), frees the models
        and joins the thread. Idempotent.

        Args:
            timeout_s: longest wait for the thread, seconds (None = no limit).
        """
        with self._lock:
            self._accepting = False
            first = not self._closed
            self._closed = True
            if first:
                self._commands.put(Shutdown())
        if threading.current_thread() is not self._thread:  # close() from an emit callback
            self._thread.join(timeout_s)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        """True while the engine thread runs (health: the worker is live)."""
        return self._thread.is_alive()

    @property
    def ready(self) -> bool:
        """True once loaded and warm, until close() (health: the worker serves)."""
        return self._accepting and self.alive

    # ----- EngineProtocol --------------------------------------------------------------------

    @property
    def model(self) -> ModelDescription:
        """Name, context limit and draft of the served model."""
        return self._model

    def _draft_tokens_per_cycle(self, config: EngineConfig, draft_cfg: Mapping) -> int:
        """k for the model info and the per-position metrics: a DFlash block drafts B - 1 tokens
        (the configured B, else the checkpoint's); other drafts `num_draft_tokens`."""
        if self._draft_kind == "dflash":
            return (config.block_size or draft_cfg.get("block_size") or 16) - 1
        return config.num_draft_tokens

    def encode_prompt(self, prompt: str | None, messages: list[dict] | None,
                      tools: list[dict] | None = None) -> list[int]:
        """Prompt token ids of raw text or of chat messages (and tools) rendered with the model's
        chat template (`Intake.encode_prompt`, worker/engine/intake.py: arguments and errors)."""
        return self._intake.encode_prompt(prompt, messages, tools)

    def submit(self, request: GenerationRequest, emit: EmitFn) -> None:
        """Validates a request and queues it for the engine thread; never waits for MLX.

        The request then gets TokenEvents and one DoneEvent or ErrorEvent through `emit`, called
        on the engine thread.

        Raises:
            Draining: closing or closed.
            InvalidRequest: empty or duplicate request_id, empty prompt, token ids outside the
                vocabulary, max_tokens < 1 (< 0 with prompt_logprobs), prompt + max_tokens beyond the context, bad sampling
                parameters, an empty stop string, a mode this worker cannot serve, or resume
                tokens that are not fewer than max_tokens, hold an EOS or do not match
                resume_text (session migration, `GenerationRequest.resume_tokens`).
            Overloaded: `capacity` sessions are admitted already.
        """
        if not self._accepting:
            raise Draining("engine is not serving (starting or shutting down)")
        mode = self._intake.validate(request, self._scheduler)
        grammar = self._intake.grammar(request)
        with self._lock:
            if not self._accepting:
                raise Draining("engine is shutting down")
            if request.request_id in self._admitted:
                raise InvalidRequest(f"request_id {request.request_id!r} is already running")
            if len(self._admitted) >= self.config.capacity:
                raise Overloaded(f"worker at capacity ({self.config.capacity} sessions)")
            self._admitted.add(request.request_id)
            self._commands.put(Submit(request, mode, emit, self._clock(), grammar))

    def abort(self, request_id: str) -> bool:
        """Cancels a request: it ends with DoneEvent("cancelled") unless it ended first. Any
        imported state staged for it (`transfer.reserve_import`) is dropped too.

        Returns:
            False when no such request is admitted.
        """
        with self._lock:
            known = request_id in self._admitted
        self._commands.put(Abort(request_id))
        return known

    # ----- engine-thread calls (the KV-transfer API, `transfer`) ------------------------------

    def _call(self, fn: Callable[[LoadedModels, Scheduler], Any]) -> Future:
        """Queues fn(models, scheduler) for the engine thread; a Future of its result (of
        `Draining` while the engine is not serving)."""
        future: Future = Future()
        with self._lock:
            if not self._accepting:
                future.set_exception(Draining("engine is not serving (starting or shutting down)"))
                return future
            self._commands.put(Call(fn, future))
        return future

    def load(self) -> EngineLoad:
        """Admitted sessions, capacity, bytes held by running sessions' KV caches and by the prompt
        cache, the KV budget, and what the engine measured of its sessions and its speed
        (worker/engine/profile.py)."""
        with self._lock:
            active = len(self._admitted)
        return EngineLoad(active_sessions=active, capacity=self.config.capacity,
                          kv_cache_bytes=self._kv_bytes, kv_budget_bytes=self._kv_budget,
                          prompt_cache_bytes=self._prompt_cache_bytes, sessions=self._board.sessions,
                          decode_profile=tuple(self._profile.snapshot()),
                          prefill_seconds_per_token=self._profile.prefill_seconds_per_token,
                          kv_layers=self._board.kv_layers)

    # ----- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            models = load_models(self.config, self._draft_kind)
            sched = self._scheduler = self._make_scheduler(models)
            self._bytes_per_position = dict(sched.bytes_per_position)
            self.transfer.loaded(self.config, models.draft_kind, sched)
            if self.config.warmup:
                self._warmup(models, sched)
            self._board.kv_layers = sched.kv_layers
            self._publish(sched)  # the budget is known before the first request
        except BaseException as e:  # re-raised by the constructor
            self._startup_error = e
            self._scheduler = None
            self._free()
            self._ready.set()
            return
        try:
            with self._lock:
                self._accepting = not self._closed
            self._ready.set()
            while self._handle_commands(models, sched, block=sched.idle):
                sched.iterate()
                self._publish(sched)
        except BaseException:
            log.exception("engine thread crashed")
            raise
        finally:
            with self._lock:
                self._accepting = False
            sched = self._scheduler
            if sched is not None:
                for s in sched.sessions():
                    sched.cancel(s.request.request_id)
                    self._end_cancelled(s)
            self._cancel_queued()
            if sched is not None:
                sched.imports.clear()
            self._scheduler = None
            del models, sched
            self._free()

    def _make_scheduler(self, models: LoadedModels) -> Scheduler:
        cfg = self.config
        budget = cfg.kv_budget_bytes or default_kv_budget_bytes()
        block = cfg.block_size or (models.draft.block_size if models.draft_kind == "dflash" else 1)
        sched = Scheduler(models, block_size=block, adaptive=cfg.adaptive_block_size,
                          prefill_step_tokens=cfg.prefill_step_tokens, kv_budget_bytes=budget,
                          prompt_cache_entries=cfg.prompt_cache_entries, release=self._release,
                          clock=self._clock, profile=self._profile)
        log.info("KV budget %.1f MB (%d bytes a position plain%s); prompt cache %d entries",
                 budget / 1e6, sched.bytes_per_position["plain"],
                 f", {sched.bytes_per_position['dflash']} DFlash" if "dflash" in sched.bytes_per_position else "",
                 cfg.prompt_cache_entries)
        return sched

    def _warmup(self, m: LoadedModels, sched: Scheduler) -> None:
        """Runs a few tokens of every batched mode this worker serves, greedy and sampled, one and
        two sessions at a time, and the loaded draft's own mode, so the first requests do not pay
        for lazy initialization and compilation."""
        modes = [k for k in dict.fromkeys(("plain", resolve_mode("auto", m.draft_kind, self._modes)))]
        n = 0
        for key in modes:
            for temperature in (0.0, 1.0):
                for _ in range(2):
                    n += 1
                    req = GenerationRequest(f"warmup-{n}", (0, 1, 2, 3), self.config.num_draft_tokens + 2,
                                            SamplingParams(temperature=temperature, seed=0))
                    self._start_session(m, sched, Submit(req, key, lambda e: None, self._clock()))
        while not sched.idle:
            sched.iterate()
        gpu = mx.default_device().type == mx.DeviceType.gpu
        report = self._warm_shapes(m, sched)
        sched.reset_measurements()
        if report.costs:  # what the block policy weighs, for an operator reading why it speculates or not
            first = report.costs[0][1]
            log.info("DFlash iteration at batch size 1, %d positions, by block size: %s", first,
                     ", ".join(f"{L}: {s * 1000:.1f} ms" for B, c, L, s in report.costs if B == 1 and c == first))
        if sched.policy is not None and gpu:
            # A GPU's policy starts from the compiled shapes' costs (the first context bucket):
            # probing each block size there would take a short answer's every iteration. A CPU's
            # probes (small blocks, a few iterations a bucket) cost little; it measures as it serves.
            for B, context, L, seconds in report.costs:
                sched.policy.seed(B, context, L, seconds)
        self._profile.reset()
        mx.clear_cache()

    def _warm_shapes(self, m: LoadedModels, sched: Scheduler) -> WarmReport:
        """Every batch size up to capacity x every DFlash block size, within the configured time
        (worker/engine/warm.py); logged, as startup time."""
        blocks = BatchBlockPolicy(sched.block_size).candidates if m.draft_kind == "dflash" else [1]
        sizes = range(1, self.config.capacity + 1)
        report = warm_shapes(m, sched.capture, sizes, blocks, self.config.warmup_shapes_s, self._clock)
        log.info("warm-up: %d of %d batched shapes (batch sizes 1-%d x %s) in %.1f s (budget %g s)%s",
                 len(report.warmed), report.planned, self.config.capacity,
                 "plain" if m.draft_kind != "dflash" else "plain and DFlash blocks " + ",".join(map(str, blocks)),
                 report.seconds, self.config.warmup_shapes_s,
                 "" if len(report.warmed) == report.planned else
                 "; the rest compile when first met (raise --warmup-shapes-s to warm them)")
        return report

    def _handle_commands(self, m: LoadedModels, sched: Scheduler, block: bool) -> bool:
        """Drains the command queue (waiting for one command when `block`); False on Shutdown."""
        try:  # staged imports expire even while no session runs
            cmd = self._commands.get(block=block, timeout=sched.imports.next_expiry_in() if block else None)
        except queue.Empty:
            return True
        while True:
            if isinstance(cmd, Shutdown):
                return False
            if isinstance(cmd, Submit):
                self._start_session(m, sched, cmd)
            elif isinstance(cmd, Abort):
                sched.imports.drop_request(cmd.request_id)
                s = sched.cancel(cmd.request_id)
                if s is not None:
                    self._end_cancelled(s)
            elif isinstance(cmd, Call):
                if cmd.future.set_running_or_notify_cancel():
                    try:
                        cmd.future.set_result(cmd.fn(m, sched))
                    except Exception as e:
                        cmd.future.set_exception(e)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _start_session(self, m: LoadedModels, sched: Scheduler, cmd: Submit) -> None:
        req = cmd.request
        try:
            text = TextAssembler(m.tokenizer, req.stop)
            due = ""
            if req.resume_tokens:  # a migrated session: its output so far becomes context (checked in submit)
                due = text.resume(req.resume_tokens, req.resume_text)
                # Its prompt's log-probabilities went out with the previous worker's first chunk.
                req = replace(req, prompt_tokens=req.prompt_tokens + req.resume_tokens,
                              max_tokens=req.max_tokens - len(req.resume_tokens), resume_tokens=(),
                              resume_text="", prompt_logprobs=-1)
            sampler = sampler_for(req.sampling)
            grammar = None
            if cmd.grammar is not None:
                grammar = RowGrammar(cmd.grammar, self._vocab_size or len(m.tokenizer.vocab), m.eos_ids)
                grammar.advance(cmd.request.resume_tokens)  # a migrated session's output so far
            penalties = None
            if req.sampling.penalized:  # its prompt, then a migrated session's output so far
                penalties = RowPenalties(req.sampling, cmd.request.prompt_tokens,
                                         self._vocab_size or len(m.tokenizer.vocab))
                penalties.advance(cmd.request.resume_tokens)
            if req.import_id and cmd.mode not in BATCHED_MODES:  # its own generator prefills
                sched.imports.drop(req.import_id)
            if cmd.mode in BATCHED_MODES:
                s = Session(req, cmd.emit, iter(()), [], text, m.eos_ids, cmd.received_s,
                            new_stats(req, cmd.mode))
                sched.add(s, cmd.mode, sampler, grammar, penalties)
            else:
                steps, caches = self._modes[cmd.mode].start(m, self.config, req, sampler)
                s = Session(req, cmd.emit, steps, caches, text, m.eos_ids, cmd.received_s,
                            new_stats(req, cmd.mode))
                sched.add_generator(s)
        except Exception as e:
            log.exception("request %s failed to start", req.request_id)
            sched.imports.drop(req.import_id)
            self._release(req.request_id)
            _safe_emit(cmd.emit, ErrorEvent(req.request_id, e))
            return
        if due:  # text the previous worker held back (an incomplete character, a stop-string prefix)
            _safe_emit(cmd.emit, TokenEvent(req.request_id, (), due))

    def _end_cancelled(self, s: Session) -> None:
        """Releases a cancelled session's capacity, then emits DoneEvent("cancelled")."""
        self._release(s.request.request_id)
        _safe_emit(s.emit, s.done_event("cancelled", self._clock()))

    def _cancel_queued(self) -> None:
        """After Shutdown: requests admitted but never started end as cancelled."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, Submit):
                self._release(cmd.request.request_id)
                done = DoneEvent(cmd.request.request_id, "cancelled", new_stats(cmd.request, cmd.mode))
                _safe_emit(cmd.emit, done)
            elif isinstance(cmd, Call) and cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(Draining("engine shut down"))

    def _release(self, request_id: str) -> None:
        with self._lock:
            self._admitted.discard(request_id)

    def _publish(self, sched: Scheduler) -> None:
        self._kv_bytes = sched.kv_bytes()
        self._prompt_cache_bytes = sched.prompt_cache.nbytes
        self._kv_budget = sched.budget
        now = self._clock()
        if self._board.due(now) or (sched.idle and self._board.sessions):  # idle: the loop blocks next
            self._board.publish(scheduler_sessions(sched, self._rates, now))

    def _free(self) -> None:
        """Drops MLX buffers and this thread's streams. MLX requires `clear_streams` before a
        thread that used it exits, or the process may abort at exit (ml-explore/mlx PR #3395)."""
        self._kv_bytes = 0
        gc.collect()
        mx.clear_cache()
        mx.clear_streams()


def _safe_emit(emit: EmitFn, event: Any) -> None:
    """Calls a request's callback; its failure is logged and never stops the engine."""
    try:
        emit(event)
    except Exception:
        log.exception("emit failed for %s", getattr(event, "request_id", "?"))

