"""`python -m worker --model NAME_OR_DIR --coordinator HOST:PORT`: runs one worker.

Loads the target (and optional draft) on the engine thread, serves the Worker API, registers with
the coordinator and heartbeats until SIGINT/SIGTERM; then drains (NOT_SERVING, deregister, finish
in-flight RPCs) and frees the engine. A model that cannot be found or loaded is a clear error and
a non-zero exit code.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m worker", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="model name (flashfleet models list) or local "
                   "HF/MLX model directory")
    p.add_argument("--model-name", default="", help="name clients use (default: --model's name)")
    p.add_argument("--draft", default=None, help="same-tokenizer draft model (name or directory)")
    p.add_argument("--num-draft-tokens", type=int, default=3)
    p.add_argument("--capacity", type=int, default=4, help="sessions admitted at once")
    p.add_argument("--max-context-tokens", type=int, default=None)
    p.add_argument("--coordinator", default=None, help="coordinator host:port (omit: standalone)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0 = any free port)")
    p.add_argument("--advertise-host", default=None, help="host the coordinator dials")
    p.add_argument("--worker-id", default=socket.gethostname())
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def build_engine(a):
    """Resolves model directories and loads the engine (blocking; weights load here).

    Raises:
        FileNotFoundError: a model name that is not fetched or a directory that does not exist.
    """
    from flashfleet.models import resolve_model
    from worker.config import EngineConfig
    from worker.engine.thread import Engine

    model_dir = resolve_model(a.model)
    draft_dir = resolve_model(a.draft) if a.draft else None
    name = a.model_name or (a.model if "/" not in a.model else model_dir.name)
    config = EngineConfig(model_path=model_dir, model_name=name, draft_path=draft_dir,
                          num_draft_tokens=a.num_draft_tokens, capacity=a.capacity,
                          max_context_tokens=a.max_context_tokens)
    return Engine(config)


async def serve(a, engine) -> None:
    from prometheus_client import CollectorRegistry, start_http_server

    from worker.metrics import WorkerMetrics
    from worker.server import start_worker

    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, engine)
    metrics.model_info.info({"model": engine.model.name, "draft": engine.model.draft,
                             "draft_mode": engine.model.draft_mode,
                             "max_context_tokens": str(engine.model.max_context_tokens)})
    if a.metrics_port is not None:
        start_http_server(a.metrics_port, addr=a.host, registry=registry)
    running = await start_worker(engine, a.worker_id, a.host, a.port, a.coordinator,
                                 a.advertise_host, metrics)
    print(f"worker {a.worker_id} serving {engine.model.name} on {running.advertise_address}",
          flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logging.getLogger("flashfleet.worker").info("worker %s shutting down", a.worker_id)
    await running.stop(grace_s=5.0)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=a.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        engine = build_engine(a)
    except (FileNotFoundError, ValueError) as e:
        print(f"worker: cannot start: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(a, engine))
    except RuntimeError as e:
        print(f"worker: {e}", file=sys.stderr)
        engine.close()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
