"""Prometheus metrics of the coordinator (prefix flashfleet_coordinator_, base units, no
per-request labels). Each process builds one CoordinatorMetrics on its own registry."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

QUEUE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class CoordinatorMetrics:
    """Declarations of every coordinator metric.

    Args:
        registry: where to register (tests pass a fresh CollectorRegistry).
    """

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self.routed = Counter(
            "flashfleet_coordinator_requests", "Generate requests by serving worker and outcome "
            "(ok, cancelled, error, no_worker, overloaded).", ["model", "worker", "outcome"],
            registry=registry)
        self.queue = Histogram(
            "flashfleet_coordinator_queue_seconds", "Time from a request's arrival to its first "
            "message from a worker, retries included.", ["model"], buckets=QUEUE_BUCKETS_S,
            registry=registry)
        self.retries = Counter(
            "flashfleet_coordinator_retries", "Requests re-routed to another worker before their "
            "first token.", ["model"], registry=registry)
        self.workers = Gauge(
            "flashfleet_coordinator_workers", "Workers with a live lease.", registry=registry)
        self.worker_up = Gauge(
            "flashfleet_coordinator_worker_up", "1 while the worker holds a live lease.",
            ["worker"], registry=registry)
        self.worker_heartbeat_age = Gauge(
            "flashfleet_coordinator_worker_heartbeat_age_seconds", "Seconds since the worker's "
            "last heartbeat.", ["worker"], registry=registry)
        self.lease_expiries = Counter(
            "flashfleet_coordinator_lease_expiries", "Workers removed because their heartbeats "
            "stopped.", registry=registry)
        self.migrations = Counter(
            "flashfleet_coordinator_migrations", "Session migrations between workers by outcome.",
            ["model", "outcome"], registry=registry)

    def observe_queue(self, model: str, seconds: float) -> None:
        self.queue.labels(model=model).observe(seconds)
