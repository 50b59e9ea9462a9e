"""Prometheus metrics of the coordinator: prefix `flashfleet_coordinator_`, base units, `_total`
on counters, bounded labels (model, worker id, outcome), never a request or session id. Each
process builds one CoordinatorMetrics on its own registry.

Series of a model (retries, migrations by reason and outcome) are created at zero the first time a
request for it is routed, so rate() and increase() have a baseline before the first retry or
migration.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from coordinator.migration import REASONS

QUEUE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0)
ROUTED_OUTCOMES = ("ok", "cancelled", "error", "invalid", "deadline", "no_worker", "overloaded")
# moved; refused by the destination, stayed put; resumed elsewhere after its worker failed; could not be
MIGRATION_OUTCOMES = ("ok", "aborted", "failover", "failover_failed")
# How the destination got the session's state: a copy of its KV cache (coordinator/kv_transfer.py),
# or recomputation (it re-prefilled prompt + output).
MIGRATION_METHODS = ("kv", "reprefill")
MIGRATION_BYTES_BUCKETS = (1e5, 1e6, 1e7, 3e7, 1e8, 3e8, 1e9, 3e9)
MIGRATION_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class CoordinatorMetrics:
    """Declarations of every coordinator metric.

    Args:
        registry: where to register (tests pass a fresh CollectorRegistry).
    """

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self.routed = Counter(
            "flashfleet_coordinator_requests", "Generate requests by serving worker and outcome "
            f"({', '.join(ROUTED_OUTCOMES)}); worker is empty when none was chosen.",
            ["model", "worker", "outcome"], registry=registry)
        self.queue = Histogram(
            "flashfleet_coordinator_queue_seconds", "Time from a request's arrival until its call "
            "to the serving worker starts (routing and earlier failed attempts).", ["model"], buckets=QUEUE_BUCKETS_S,
            registry=registry)
        self.retries = Counter(
            "flashfleet_coordinator_retries", "Requests re-routed to another worker before their "
            "first token.", ["model"], registry=registry)
        self.queued = Gauge(
            "flashfleet_coordinator_queued_requests", "Requests waiting for a free worker slot "
            "(every worker serving their model is at capacity).", registry=registry)
        self.rpc_lag = Gauge(
            "flashfleet_coordinator_rpc_lag_seconds", "How long the coordinator takes to answer an RPC, "
            "measured on itself (coordinator/overload.py); above 0.5 s new requests wait.", registry=registry)
        self.workers = Gauge(
            "flashfleet_coordinator_workers", "Workers with a live lease.", registry=registry)
        self.subscriptions = Gauge(
            "flashfleet_coordinator_worker_subscriptions", "Workers whose tokens reach this coordinator "
            "on an open subscription (docs/operations.md, 'How tokens cross'); the others' on each call.",
            registry=registry)
        self.worker_up = Gauge(
            "flashfleet_coordinator_worker_up", "1 while the worker holds a live lease, 0 after "
            "its lease expired.", ["worker"], registry=registry)
        self.worker_heartbeat_age = Gauge(
            "flashfleet_coordinator_worker_heartbeat_age_seconds", "Seconds since the worker's "
            "last heartbeat.", ["worker"], registry=registry)
        self.lease_expiries = Counter(
            "flashfleet_coordinator_lease_expiries", "Workers removed because their heartbeats "
            "stopped.", registry=registry)
        self.migrations = Counter(
            "flashfleet_coordinator_migrations", "Session migrations between workers by reason "
            f"({', '.join(REASONS)}), outcome ({', '.join(MIGRATION_OUTCOMES)}) and method.",
            ["model", "reason", "outcome", "method"], registry=registry)
        self.migration_bytes = Histogram(
            "flashfleet_coordinator_migration_bytes", "Bytes of session state sent between workers "
            "by a successful migration (0 for a re-prefill).", ["model", "reason", "method"],
            buckets=MIGRATION_BYTES_BUCKETS, registry=registry)
        self.migration_pause = Histogram(
            "flashfleet_coordinator_migration_pause_seconds", "Time a migrated stream sent its client "
            "nothing because of the move.", ["model", "reason", "method"], buckets=MIGRATION_SECONDS_BUCKETS,
            registry=registry)
        self.migration_seconds = Histogram(
            "flashfleet_coordinator_migration_seconds", "Time from the decision to move a stream until "
            "the destination streamed it.", ["model", "reason", "method"], buckets=MIGRATION_SECONDS_BUCKETS,
            registry=registry)
        self.draining = Gauge(
            "flashfleet_coordinator_worker_draining", "1 while an operator drains the worker "
            "(DrainWorker): it gets no new requests and its sessions move away.", ["worker"], registry=registry)
        self._models: set[str] = set()

    def observe_queue(self, model: str, seconds: float) -> None:
        """Records a routed request's queueing time in seconds (and creates its model's series)."""
        if model not in self._models:
            self._models.add(model)
            self.retries.labels(model=model)
            for reason in REASONS:
                for method in MIGRATION_METHODS:
                    for outcome in (("failover", "failover_failed") if reason == "failure" else ("ok", "aborted")):
                        self.migrations.labels(model=model, reason=reason, outcome=outcome, method=method)
                    for h in (self.migration_bytes, self.migration_pause, self.migration_seconds):
                        h.labels(model=model, reason=reason, method=method)
        self.queue.labels(model=model).observe(seconds)

    def observe_migration(self, model: str, outcome: str, reason: str, method: str, bytes_moved: int,
                          pause_s: float | None, total_s: float | None) -> None:
        """Counts one migration attempt; a successful one (outcome ok or failover) also observes
        its bytes moved and, when given, its pause and total seconds."""
        self.migrations.labels(model=model, reason=reason, outcome=outcome, method=method).inc()
        if outcome not in ("ok", "failover"):
            return
        self.migration_bytes.labels(model=model, reason=reason, method=method).observe(bytes_moved)
        if pause_s is not None:
            self.migration_pause.labels(model=model, reason=reason, method=method).observe(pause_s)
        if total_s is not None:
            self.migration_seconds.labels(model=model, reason=reason, method=method).observe(total_s)
