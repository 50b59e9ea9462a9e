"""Test harness: runs a real coordinator and workers (real gRPC on loopback) on an asyncio loop
in a background thread, so tests can drive them with the blocking SDK."""
from __future__ import annotations

import asyncio
import time
import threading
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from coordinator.config import CoordinatorConfig
from coordinator.server import RunningCoordinator, start_coordinator
from worker.metrics import WorkerMetrics
from worker.server import RunningWorker, start_worker


class LoopThread:
    """An asyncio event loop on a daemon thread; run() executes a coroutine there."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-loop", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@dataclass
class Cluster:
    loop: LoopThread
    coordinator: RunningCoordinator
    workers: list[RunningWorker] = field(default_factory=list)
    worker_metrics: list[WorkerMetrics] = field(default_factory=list)
    coordinator_registry: CollectorRegistry | None = None  # the coordinator's Prometheus metrics

    @property
    def address(self) -> str:
        return self.coordinator.address

    join_token: str | None = None  # what add_worker's workers send by default

    def add_worker(self, engine, worker_id: str, wait: bool = True, join_token: str | None = None) -> RunningWorker:
        """Starts a worker that registers with the coordinator (with `join_token`, else the
        cluster's), waiting for its registration unless `wait` is False."""
        registry = CollectorRegistry()
        metrics = WorkerMetrics(registry, engine)
        w = self.loop.run(start_worker(engine, worker_id, coordinator=self.address,
                                       metrics=metrics, join_token=join_token or self.join_token))
        if wait:
            self.loop.run(asyncio.wait_for(w.registered.wait(), 10))
        self.workers.append(w)
        self.worker_metrics.append(metrics)
        return w

    def close(self) -> None:
        for w in self.workers:
            try:
                self.loop.run(w.stop(grace_s=0.5))
            except Exception:
                pass
        self.loop.run(self.coordinator.stop(grace_s=0.5))
        self.loop.close()


def start_cluster(engines: dict, **config) -> Cluster:
    """Starts a coordinator on a free port and one worker per (worker_id -> engine); `config`
    holds CoordinatorConfig fields (with `join_token`, the workers send and require it)."""
    loop = LoopThread()
    cfg = CoordinatorConfig(port=0, **config)
    registry = CollectorRegistry()
    coordinator = loop.run(start_coordinator(cfg, registry))
    cluster = Cluster(loop, coordinator, coordinator_registry=registry, join_token=cfg.join_token)
    for worker_id, engine in engines.items():
        cluster.add_worker(engine, worker_id)
    return cluster


def run_request(engine, request, timeout_s: float = 120.0):
    """Submits `request` to an engine and waits for it: returns (token ids, DoneEvent); raises
    the error of an ErrorEvent."""
    import queue

    from worker.engine.types import DoneEvent, TokenEvent

    events: queue.Queue = queue.Queue()
    engine.submit(request, events.put)
    tokens: list[int] = []
    while True:
        ev = events.get(timeout=timeout_s)
        if isinstance(ev, TokenEvent):
            tokens.extend(ev.token_ids)
        elif isinstance(ev, DoneEvent):
            return tokens, ev
        else:
            raise ev.error


def wait_until(pred, timeout: float = 5.0) -> bool:
    """Polls `pred` every 20 ms until it is true (True) or `timeout` seconds pass (False)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return False
