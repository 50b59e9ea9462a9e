"""Prometheus metrics of the coordinator: prefix `flashfleet_coordinator_`, base units, `_total`
on counters, bounded labels (model, worker id, outcome), never a request or session id. Each
process builds one CoordinatorMetrics on its own registry.

Series of a model (retries, migrations by outcome) are created at zero the first time a request
for it is routed, so rate() and increase() have a baseline before the first retry or migration.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

QUEUE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0)
ROUTED_OUTCOMES = ("ok", "cancelled", "error", "invalid", "deadline", "no_worker", "overloaded")
# moved; refused by the destination, stayed put; resumed elsewhere after its worker failed; could not be
MIGRATION_OUTCOMES = ("ok", "aborted", "failover", "failover_failed")


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
        self.workers = Gauge(
            "flashfleet_coordinator_workers", "Workers with a live lease.", registry=registry)
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
            "flashfleet_coordinator_migrations", "Session migrations between workers by outcome "
            f"({', '.join(MIGRATION_OUTCOMES)}).", ["model", "outcome"], registry=registry)
        self._models: set[str] = set()

    def observe_queue(self, model: str, seconds: float) -> None:
        """Records a routed request's queueing time in seconds (and creates its model's series)."""
        if model not in self._models:
            self._models.add(model)
            self.retries.labels(model=model)
            for outcome in MIGRATION_OUTCOMES:
                self.migrations.labels(model=model, outcome=outcome)
        self.queue.labels(model=model).observe(seconds)
