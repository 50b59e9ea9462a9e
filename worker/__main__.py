"""`python -m worker --model NAME_OR_DIR --coordinator HOST:PORT`: runs one worker.

Loads the target (and optional draft) on the engine thread, serves the Worker API, registers with
the coordinator and heartbeats until SIGINT/SIGTERM; then drains (NOT_SERVING, deregister, finish
in-flight RPCs for up to --drain-timeout seconds) and frees the engine. A model that cannot be
found or loaded is a clear error and a non-zero exit code. If the engine thread dies, the worker
leaves the fleet (`worker.server.RunningWorker.leave_after_engine_death`) and exits with status
70 (`worker.watchdog.ENGINE_DIED_EXIT`), so systemd, launchd or `flashfleet up` restart it. On
Linux with OpenBLAS found (pip's scipy-openblas32 or Debian's) it first starts itself again with OpenBLAS preloaded
(`flashfleet.blas`; set FLASHFLEET_OPENBLAS=0, or LD_PRELOAD yourself, to keep the process as
started).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import socket
import sys
import time
from pathlib import Path

from flashfleet.cli import INVOKED_AS, prog_name
from flashfleet.config import tcp_port

# Built-in defaults; a --config file's values come before them, command-line flags before both.
DEFAULTS = {"model_name": "", "num_draft_tokens": 3, "capacity": 8, "host": "127.0.0.1",
            "port": 0, "log_level": "INFO", "drain_timeout_s": 25.0, "prompt_cache_entries": 8,
            "orphan_grace_s": 30.0, "warmup_shapes_s": 60.0}
MODEL_SETTINGS = ("model", "model_name", "draft", "num_draft_tokens", "max_context_tokens")


def parse_args(argv):
    """Parses the command line, filling options it leaves unset from --config's entry for this
    worker (found by --worker-id, else by hostname), then from DEFAULTS.

    The draft keyword `dflash` (flag or config) becomes the directory of the DFlash draft
    shipped for the model (flashfleet/models/drafts.py).

    Raises:
        flashfleet.config.ConfigError: an unreadable or invalid config file, or no entry for
            this worker in it.
        flashfleet.models.NoShippedDraftError: draft `dflash` for a model without a shipped draft.
    """
    p = argparse.ArgumentParser(prog=prog_name("worker"), description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="cluster config file (TOML, see "
                   "deploy/cluster.toml); flags override its values")
    p.add_argument("--model", default=None, help="model name (flashfleet models list) or local "
                   "HF/MLX model directory (required without --config)")
    p.add_argument("--model-name", default=None, help="name clients use (default: --model's name)")
    p.add_argument("--draft", default=None, help="draft (name or directory): a same-tokenizer "
                   "causal LM, or a DFlash checkpoint (detected from its config.json); 'dflash': "
                   "the DFlash draft shipped for --model (flashfleet models list)")
    p.add_argument("--num-draft-tokens", type=int, default=None, help="default 3")
    p.add_argument("--block-size", type=int, default=None,
                   help="DFlash block size (default: the draft checkpoint's)")
    p.add_argument("--fixed-block-size", dest="adaptive_block_size", action="store_false",
                   help="DFlash always drafts full blocks (default: each cycle's block size comes from "
                   "measured costs, down to plain decoding when speculation stops paying)")
    p.add_argument("--adaptive-block-size", dest="adaptive_block_size", action="store_true",
                   help=argparse.SUPPRESS)  # the default; kept for old command lines
    p.set_defaults(adaptive_block_size=True)
    p.add_argument("--no-fuse-projections", dest="fuse_projections", action="store_false",
                   help="keep mlx-lm's layers as loaded (default: one matmul for each layer's q/k/v "
                   "and one for its gate/up: the same outputs to float rounding, fewer GPU kernels)")
    p.add_argument("--no-small-gemm", dest="small_gemm", action="store_false",
                   help="CUDA only: keep cuBLAS for linear layers of a few rows (default: one tensor-core "
                   "kernel a call, worker/small_gemm.py; the same outputs to rounding, less host time; "
                   "FLASHFLEET_SMALL_GEMM=0 in the environment turns it off too)")
    p.add_argument("--capacity", type=int, default=None,
                   help="sessions admitted at once, decoded together in one batch (default 8)")
    p.add_argument("--prompt-cache-entries", type=int, default=None,
                   help="finished turns whose KV caches stay for follow-up prompts that extend them "
                   "(default 8; 0: none), within the KV budget")
    p.add_argument("--max-context-tokens", type=int, default=None)
    p.add_argument("--warmup-shapes-s", type=float, default=None,
                   help="most seconds the start may spend running the batched forwards of every batch "
                   "size up to --capacity and every DFlash block size, so no request waits on a kernel "
                   "compile (default 60; 0: none; the startup log says how many it warmed)")
    p.add_argument("--coordinator", default=None, help="coordinator host:port (omit: standalone); several, "
                   "comma-separated: the worker registers with each, or, when they share the fleet's state "
                   "in etcd, with one, moving its heartbeats to the next when that one stops answering")
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=tcp_port, default=None, help="gRPC port (default 0 = any free port)")
    p.add_argument("--advertise-host", default=None, help="host the coordinator and other workers dial")
    p.add_argument("--worker-id", default=None, help="id in the fleet (default: hostname)")
    p.add_argument("--metrics-port", type=tcp_port, default=None,
                   help="Prometheus /metrics port (omit or 0: no endpoint)")
    p.add_argument("--chip", default=None, help="Apple chip for the peak-bandwidth table, e.g. "
                   "'M4 Pro' (default: detected on macOS)")
    p.add_argument("--peak-memory-bandwidth-gbs", type=float, default=None,
                   help="peak memory bandwidth in GB/s (default: from the chip table)")
    p.add_argument("--kv-cache-limit-bytes", type=int, default=None, help="most bytes the KV "
                   "caches may hold: running sessions and the prompt cache (default: the device's "
                   "usable memory less 20%% and the loaded weights)")
    p.add_argument("--drain-timeout", dest="drain_timeout_s", type=float, default=None,
                   help="seconds in-flight requests get to finish after SIGINT/SIGTERM before they "
                   "are cut off (default 25: under the 30 s systemd allows a stop)")
    p.add_argument("--orphan-grace", dest="orphan_grace_s", type=float, default=None,
                   help="seconds a session whose coordinator vanished (no cancel) keeps decoding for its "
                   "client to resume through another coordinator (default 30; 0: none)")
    p.add_argument("--join-token-file", default=None,
                   help="file holding the coordinator's join token (also env FLASHFLEET_JOIN_TOKEN): "
                   "sent to register, and required of every caller of this worker")
    p.add_argument("--log-level", default=None)
    a = p.parse_args(argv)
    if a.config:
        from flashfleet.config import load_cluster_config

        cfg = load_cluster_config(a.config)
        if cfg.tls is not None:
            cfg.tls.read()  # unreadable or non-PEM files are reported before loading weights
        a.tls = cfg.tls
        settings = cfg.worker_settings(cfg.worker(a.worker_id))
        if a.model:  # another model than the entry's: none of the entry's model settings apply
            for key in MODEL_SETTINGS:
                settings.pop(key)
        for key, value in settings.items():
            if getattr(a, key) is None:
                setattr(a, key, value)
    for key, value in DEFAULTS.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.worker_id is None:
        a.worker_id = socket.gethostname()
    if not a.model:
        p.error("--model is required (or --config FILE with an entry for this worker)")
    from flashfleet.models.drafts import resolve_draft_arg

    a.draft = resolve_draft_arg(a.draft, a.model, a.model_name)
    if a.prompt_cache_entries < 0:
        p.error(f"--prompt-cache-entries must be >= 0, got {a.prompt_cache_entries}")
    if not (math.isfinite(a.drain_timeout_s) and a.drain_timeout_s >= 0):
        p.error(f"--drain-timeout must be a finite number of seconds >= 0, got {a.drain_timeout_s}")
    if not (math.isfinite(a.orphan_grace_s) and a.orphan_grace_s >= 0):
        p.error(f"--orphan-grace must be a finite number of seconds >= 0, got {a.orphan_grace_s}")
    if not (math.isfinite(a.warmup_shapes_s) and a.warmup_shapes_s >= 0):
        p.error(f"--warmup-shapes-s must be a finite number of seconds >= 0, got {a.warmup_shapes_s}")
    for key in ("peak_memory_bandwidth_gbs", "kv_cache_limit_bytes", "max_context_tokens"):
        value = getattr(a, key)
        if value is not None and not (math.isfinite(value) and value > 0):
            p.error(f"--{key.replace('_', '-')} must be > 0, got {value}")
    return a


def build_engine(a):
    """Resolves model directories and loads the engine (blocking; weights load here).

    Raises:
        FileNotFoundError: a model name that is not fetched or a directory that does not exist.
    """
    from flashfleet.models import resolve_model, served_model_name
    from worker.config import EngineConfig
    from worker.engine.thread import Engine

    model_dir = resolve_model(a.model)
    draft_dir = resolve_model(a.draft) if a.draft else None
    name = a.model_name or served_model_name(a.model)
    config = EngineConfig(model_path=model_dir, model_name=name, draft_path=draft_dir,
                          num_draft_tokens=a.num_draft_tokens, capacity=a.capacity,
                          block_size=a.block_size, adaptive_block_size=a.adaptive_block_size,
                          max_context_tokens=a.max_context_tokens, fuse_projections=a.fuse_projections,
                          small_gemm=a.small_gemm, kv_budget_bytes=a.kv_cache_limit_bytes,
                          prompt_cache_entries=a.prompt_cache_entries, warmup_shapes_s=a.warmup_shapes_s)
    return Engine(config)


async def serve(a, engine) -> int:
    """Serves `engine` with the parsed options `a` (metrics endpoint, gRPC server, registration)
    until SIGINT/SIGTERM or the coordinator's drain asks it to leave
    (`RunningWorker.leave_requested`), then drains for up to `a.drain_timeout_s` seconds
    (`RunningWorker.stop`, which also closes the engine); or until the engine thread dies and
    the worker has left the fleet (`RunningWorker.left`).

    Returns:
        The process's exit status: 0 after a drain, `worker.watchdog.ENGINE_DIED_EXIT` (70)
        when the engine thread died.

    Raises:
        RuntimeError: the gRPC port or the metrics port could not be bound (`start_worker`,
            `flashfleet.metrics_http.serve_metrics`).
    """
    from prometheus_client import CollectorRegistry

    from flashfleet.metrics_http import serve_metrics

    from worker.metrics import MachineInfo, WorkerMetrics
    from worker.server import start_worker
    from worker.watchdog import ENGINE_DIED_EXIT

    registry = CollectorRegistry()
    machine = MachineInfo.detect(a.chip, a.peak_memory_bandwidth_gbs)
    metrics = WorkerMetrics(registry, engine, machine)
    if getattr(a, "load_seconds", None) is not None:
        metrics.model_load_seconds.labels(model=engine.model.name).set(a.load_seconds)
    if a.metrics_port:
        serve_metrics(a.metrics_port, a.host, registry)
    running = await start_worker(engine, a.worker_id, a.host, a.port, a.coordinator,
                                 a.advertise_host, metrics, getattr(a, "tls", None),
                                 join_token=getattr(a, "join_token", None), orphan_grace_s=a.orphan_grace_s)
    m = engine.model
    kinds = {"draft": "draft model", "dflash": "DFlash draft", "uag": "cross-tokenizer draft"}
    draft = f" with {kinds.get(m.draft_mode, m.draft_mode + ' draft')} {m.draft}" if m.draft else ""
    print(f"worker {a.worker_id} serving {m.name}{draft} on {running.advertise_address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(running.left.wait()),
             asyncio.ensure_future(running.leave_requested.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    log = logging.getLogger("flashfleet.worker")
    if not running.left.is_set():
        log.info("worker %s draining (up to %.0f s for in-flight requests)", a.worker_id, a.drain_timeout_s)
        await running.stop(grace_s=a.drain_timeout_s)
    if running.engine_died:
        log.error("worker %s exits with status %d: its engine thread died", a.worker_id, ENGINE_DIED_EXIT)
        return ENGINE_DIED_EXIT
    return 0


def _restart_with_openblas(argv: list[str] | None) -> None:
    """Replaces this process by the same command with OpenBLAS preloaded, where
    `flashfleet.blas.openblas_env` says it applies (a library is preloaded at process start only).

    Only a process that is the worker restarts: `python -m worker` (argv None) or the `flashfleet`
    console script, never a caller of `main([...])` inside another program; the command line is
    the process's own (`sys.orig_argv`: interpreter flags kept, no working directory put first on
    the import path), and a restarted process never restarts again (INVOKED_AS marks it: a loader
    that drops LD_PRELOAD, as glibc does for a privileged executable, cannot make it loop)."""
    from flashfleet.blas import openblas_env

    if os.environ.get(INVOKED_AS) or not (argv is None or Path(sys.argv[0]).name == "flashfleet"):
        return
    env = openblas_env()
    if env is not None:
        env[INVOKED_AS] = prog_name("worker")
        os.execve(sys.executable, list(sys.orig_argv), env)


def _warn_without_openblas() -> None:
    """On a CPU (a GPU needs no BLAS): logs which OpenBLAS the process preloads, or
    `flashfleet.blas.openblas_hint` when none."""
    import mlx.core as mx

    from flashfleet.blas import openblas_hint

    if mx.default_device() != mx.cpu:
        return
    hint = openblas_hint()
    log = logging.getLogger("flashfleet.worker")
    if hint is not None:
        log.warning("%s", hint)
    elif "openblas" in os.environ.get("LD_PRELOAD", "").lower():
        log.info("BLAS: OpenBLAS preloaded (%s)", os.environ["LD_PRELOAD"].split(":")[0])


def main(argv: list[str] | None = None) -> int:
    """`python -m worker`: parses flags, loads the engine, serves until SIGINT/SIGTERM.

    Returns:
        The exit status: 0 after a clean drain, 2 for a bad config, draft keyword, or a model
        that cannot be found or loaded, 1 when the server could not start (e.g. the port is in
        use), 70 when the engine thread died (`serve`); argparse exits with 2 itself for bad
        flags.
    """
    from flashfleet.config import ConfigError
    from flashfleet.models.drafts import NoShippedDraftError

    _restart_with_openblas(argv)
    from flashfleet.malloc import return_large_buffers

    return_large_buffers()  # exported and imported KV state must not leave the heap at its high-water mark
    try:
        a = parse_args(argv)
    except (ConfigError, NoShippedDraftError) as e:
        print(f"worker: {e}", file=sys.stderr)
        return 2
    from flashfleet.auth import load_join_token

    try:  # before the weights load; the token itself is never printed or logged
        a.join_token = load_join_token(a.join_token_file)
    except (OSError, ValueError) as e:
        print(f"worker: cannot read the join token file: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=a.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    _warn_without_openblas()
    try:
        started = time.perf_counter()
        engine = build_engine(a)
        a.load_seconds = time.perf_counter() - started
    except (OSError, ValueError, RuntimeError) as e:  # missing or not a model directory, bad config or weights
        print(f"worker: cannot start: {e}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(serve(a, engine))
    except RuntimeError as e:
        print(f"worker: {e}", file=sys.stderr)
        engine.close()
        return 1


if __name__ == "__main__":
    sys.exit(main())
