"""Builds, starts and stops the coordinator's gRPC server (public + registry APIs, standard health
checking and reflection), its OpenAI-compatible HTTP API and its Prometheus endpoint."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import uuid
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from flashfleet.metrics_http import serve_metrics

from coordinator.config import CoordinatorConfig
from coordinator.metrics import CoordinatorMetrics
from coordinator.registry import Registry
from coordinator.routing import SessionAffinity
from coordinator.servicer import CoordinatorServicer, RegistryServicer, WorkerPool
from coordinator.state import FleetState, MemoryState
from flashfleet.auth import (BAD_JOIN_TOKEN, JOIN_TOKEN_HEADER, RequireApiKey, RequireSecret, access_summary,
                             access_warnings, is_loopback)
from flashfleet.bad_messages import RejectUndecodable
from flashfleet.transport import SERVER_OPTIONS, add_port
from flashfleet.v1 import coordinator_pb2, coordinator_pb2_grpc, worker_pb2, worker_pb2_grpc

log = logging.getLogger("flashfleet.coordinator")
SERVICE_NAMES = (
    coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name,
    worker_pb2.DESCRIPTOR.services_by_name["Registry"].full_name,
)
# The operator's calls: with API keys configured, only an admin key may make them.
ADMIN_METHODS = tuple(f"/{SERVICE_NAMES[0]}/{m}" for m in ("DrainWorker", "MoveSession", "PutApiKey", "DeleteApiKey"))


@dataclass
class RunningCoordinator:
    """A started coordinator: its server, bound port and the objects tests inspect."""

    server: grpc.aio.Server
    port: int
    registry: Registry
    servicer: CoordinatorServicer
    state: FleetState
    health: health.aio.HealthServicer
    metrics: CoordinatorMetrics
    _expiry_task: asyncio.Task
    _pool: WorkerPool
    _owner_task: asyncio.Task | None = None  # decides moves for other coordinators' streams (shared state)
    _lag_task: asyncio.Task | None = None  # probes how late it answers RPCs (coordinator/overload.py)
    http_port: int | None = None  # the OpenAI-compatible HTTP API's port (None: not served)
    _http_runner: object = None  # its aiohttp AppRunner
    http_scheme: str = "http"  # "https" (mutual TLS) when the coordinator serves TLS

    @property
    def address(self) -> str:
        """"127.0.0.1:<port>": where a client on this host dials the coordinator."""
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str | None:
        """"http://127.0.0.1:<http_port>" (https with TLS): the HTTP API's base URL on this host
        (None: not served)."""
        return None if self.http_port is None else f"{self.http_scheme}://127.0.0.1:{self.http_port}"

    async def stop(self, grace_s: float = 5.0) -> None:
        """Flips health to NOT_SERVING, freezes lease expiry, lets in-flight RPCs finish for
        `grace_s` seconds (then cancels them), stops the HTTP API (its open requests get the
        config's shutdown_grace_s) and closes the worker channels."""
        await self.health.enter_graceful_shutdown()
        self._expiry_task.cancel()
        for task in (self._owner_task, self._lag_task):
            if task is not None:
                task.cancel()
        self.registry.freeze()  # heartbeats are refused from here: no lease may expire for it
        stopping = [self.server.stop(grace_s)]
        if self._http_runner is not None:
            stopping.append(self._http_runner.cleanup())
        await asyncio.gather(*stopping)
        await self._pool.close()
        await self.state.close()
        self.servicer.fleet.rpc_lag.close()


async def start_coordinator(config: CoordinatorConfig,
                            metrics_registry: CollectorRegistry | None = None,
                            tls=None) -> RunningCoordinator:
    """Starts the coordinator on config.host:config.port (0 = a free port).

    With `config.http_port` set, also serves the OpenAI-compatible HTTP API on config.host
    (coordinator/openai_api.py). With `config.api_keys`, the Coordinator service and the HTTP API
    refuse callers without one of them (UNAUTHENTICATED / 401), and the operator's calls
    (ADMIN_METHODS) callers without one of `config.admin_keys` (PERMISSION_DENIED); the keys are
    seeded into the fleet's state, which also holds those added by PutApiKey (shared by every
    coordinator over etcd), and the guards read it at every call; with `config.join_token`, the
    Registry service refuses workers without it (flashfleet/auth.py). Also starts the lease-expiry loop (every min(1, lease_ttl_s / 4) seconds), which updates
    the worker gauges.

    With `config.state` "etcd", the fleet's state is shared through etcd with the other
    coordinators using the same endpoints (coordinator/state/etcd.py); otherwise it is this
    process's (coordinator/state/memory.py).

    Args:
        metrics_registry: where the metrics are registered (default: a fresh CollectorRegistry).
        tls: flashfleet.config.TLSConfig to serve and dial workers over mutual TLS (None:
            plaintext).

    Raises:
        RuntimeError: the port (or the HTTP API's) could not be bound, or etcd could not be reached.
        flashfleet.config.ConfigError: unreadable or non-PEM TLS files (`add_port`).
    """
    log.info(access_summary(config.api_keys, config.join_token, tls is not None))
    for warning in access_warnings(is_loopback(config.host), config.api_keys, config.join_token, tls is not None):
        log.warning("the coordinator listens on %s with %s", config.host, warning)
    metrics = CoordinatorMetrics(metrics_registry or CollectorRegistry())
    pool = WorkerPool(tls, config.join_token)
    affinity = SessionAffinity(config.session_ttl_s)

    def on_remove(rec, reason: str):
        if reason == "expired" and state.owns(rec.worker_id):  # counted once, by its owner
            log.warning("worker %s lease expired (no heartbeat for %.1f s)", rec.worker_id,
                        config.lease_ttl_s)
            metrics.lease_expiries.inc()
        metrics.worker_up.labels(worker=rec.worker_id).set(0)
        if rec.draining:
            metrics.draining.labels(worker=rec.worker_id).set(0)
        try:  # a heartbeat age of a worker that left would stay frozen at its last value
            metrics.worker_heartbeat_age.remove(rec.worker_id)
        except KeyError:
            pass
        affinity.forget_worker(rec.worker_id)
        with contextlib.suppress(RuntimeError):  # after the registry's own call, not inside it
            asyncio.get_running_loop().call_soon(unsubscribe_if_gone, rec.address)

    def unsubscribe_if_gone(address: str):
        if not any(w.address == address for w in registry.live()):  # no worker took its address since
            pool.unsubscribe(address)

    coordinator_id = f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
    if config.state == "etcd":
        from coordinator.state.etcd import EtcdState
        from coordinator.state.etcd_client import EtcdUnavailable

        registry = Registry(config.lease_ttl_s, on_remove=on_remove, expires=False)  # etcd's leases decide
        state = EtcdState(coordinator_id, registry, affinity, config.etcd_endpoints, config.lease_ttl_s,
                          config.session_ttl_s)
        try:
            await state.start()
        except EtcdUnavailable as e:
            await state.close()
            raise RuntimeError(f"cannot reach etcd: {e}") from None
    else:
        registry = Registry(config.lease_ttl_s, on_remove=on_remove)
        state = MemoryState(coordinator_id, registry, affinity)
    servicer = CoordinatorServicer(config, state, pool, metrics=metrics)
    state.on_worker_change = servicer.admission.notify  # a worker registered through another coordinator
    try:  # the keys file seeds the shared keys: it stays the source of the keys it names
        await state.seed_api_keys({k: "admin" if k in config.admin_keys else "client" for k in config.api_keys})
    except ConnectionError as e:
        await state.close()
        raise RuntimeError(f"cannot write the API keys to etcd: {e}") from None
    if state.shared and len(state.api_keys) > len(config.api_keys):
        log.info("access control: %d API keys in the fleet's state", len(state.api_keys))
    # Keys may be added later (PutApiKey): the guard reads the state's keys at every call.
    guards = [RequireApiKey(SERVICE_NAMES[:1], ADMIN_METHODS, state.api_keys)]
    if config.join_token:
        guards.append(RequireSecret(SERVICE_NAMES[1:], JOIN_TOKEN_HEADER, (config.join_token,), BAD_JOIN_TOKEN))
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[*guards, RejectUndecodable()])
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server)
    worker_pb2_grpc.add_RegistryServicer_to_server(
        RegistryServicer(config, state, pool, servicer.admission), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(SERVICE_NAMES + (health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    try:  # a failure from here leaves nothing running: the state's watch and leases stop too
        port = add_port(server, f"{config.host}:{config.port}", tls)
        if port == 0:
            raise RuntimeError(f"could not bind {config.host}:{config.port} (in use?)")
        servicer.fleet.rpc_lag.attach(server)
        registry.grace = lambda: servicer.fleet.rpc_lag.lag_s  # a heartbeat still in line is no silence
        http_runner = http_port = None
        if config.http_port is not None:  # before the gRPC server starts: a failure here leaves nothing to stop
            from coordinator.openai_api import start_http

            http_runner, http_port = await start_http(servicer, config.host, config.http_port,
                                                      config.shutdown_grace_s,
                                                      tls.server_ssl_context() if tls is not None else None,
                                                      state.api_keys)
    except BaseException:
        servicer.fleet.rpc_lag.close()
        await state.close()
        raise
    await server.start()
    for name in SERVICE_NAMES + ("",):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def expire_loop():
        while True:
            await asyncio.sleep(min(1.0, config.lease_ttl_s / 4))
            live = registry.live()  # expires stale leases
            metrics.workers.set(len(live))
            for w in live:
                metrics.worker_up.labels(worker=w.worker_id).set(1)
                metrics.draining.labels(worker=w.worker_id).set(1 if w.draining else 0)
                metrics.worker_heartbeat_age.labels(worker=w.worker_id).set(registry.heartbeat_age_s(w))

    loop = asyncio.get_running_loop()
    task = loop.create_task(expire_loop())
    owner_task = loop.create_task(servicer.fleet.decide_for_others_loop()) if state.shared else None
    lag_task = loop.create_task(servicer.fleet.rpc_lag.run())
    return RunningCoordinator(server, port, registry, servicer, state, health_servicer, metrics, task, pool,
                              owner_task, lag_task, http_port, http_runner, "https" if tls is not None else "http")


async def serve(config: CoordinatorConfig, metrics_port: int | None = None, tls=None) -> None:
    """Runs the coordinator until SIGINT/SIGTERM, then shuts down gracefully
    (`RunningCoordinator.stop` with `config.shutdown_grace_s`).

    Args:
        config: the coordinator's settings.
        metrics_port: port of the Prometheus /metrics endpoint (bound on config.host), or None.
        tls: flashfleet.config.TLSConfig for mutual TLS, or None for plaintext.

    Raises:
        RuntimeError: the gRPC port or the metrics port could not be bound (see
            `start_coordinator`, `flashfleet.metrics_http.serve_metrics`).
        flashfleet.config.ConfigError: unreadable or non-PEM TLS files.
    """
    registry = CollectorRegistry()
    if metrics_port is not None:  # before the gRPC port: a failure here leaves nothing to stop
        serve_metrics(metrics_port, config.host, registry)
        log.info("metrics on http://%s:%d/metrics", config.host, metrics_port)
    running = await start_coordinator(config, registry, tls)
    log.info("coordinator listening on %s:%d", config.host, running.port)
    if running.http_port is not None:
        log.info("OpenAI-compatible HTTP API on %s://%s:%d/v1", running.http_scheme, config.host, running.http_port)
    print(f"coordinator ready on {config.host}:{running.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("coordinator shutting down")
    await running.stop(config.shutdown_grace_s)
