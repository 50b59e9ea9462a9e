"""Coordinator tunables, with units in their names. Built once (CLI / cluster config), passed down."""
from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.migration import MigrationPolicy


@dataclass(frozen=True)
class CoordinatorConfig:
    """Attributes:
        host, port: where the coordinator listens (port 0 picks a free one).
        lease_ttl_s: a worker with no heartbeat for this long leaves the registry.
        heartbeat_interval_s: how often workers are told to send heartbeats.
        route_attempts: workers tried for one request before its first token (>= 1).
        retry_initial_wait_s, retry_max_wait_s: exponential backoff (with jitter) between tries.
        session_ttl_s: a session's worker affinity is forgotten after this long unused.
        max_queued: requests that may wait for a free slot while every worker serving their
            model is full (coordinator/admission.py); one more is RESOURCE_EXHAUSTED at once.
        queue_timeout_s: longest such wait, seconds (the client's deadline may end it sooner).
        shutdown_grace_s: in-flight RPCs get this long to finish on shutdown (25 s: under the
            30 s systemd allows a stop, deploy/systemd).
        migration: when a running session moves to an idle worker (coordinator/migration.py).
    """

    host: str = "127.0.0.1"
    port: int = 50051
    lease_ttl_s: float = 10.0
    heartbeat_interval_s: float = 2.0
    route_attempts: int = 3
    retry_initial_wait_s: float = 0.05
    retry_max_wait_s: float = 1.0
    session_ttl_s: float = 3600.0
    max_queued: int = 64
    queue_timeout_s: float = 30.0
    shutdown_grace_s: float = 25.0
    migration: MigrationPolicy = field(default_factory=MigrationPolicy)
