"""Coordinator tunables, with units in their names. Built once (CLI / cluster config), passed down."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from coordinator.kv_transfer import METHODS
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
        migration: when and where a running session moves (coordinator/migration.py).
        migration_method: how it moves: "kv" copies its KV state to the destination while it
            goes on decoding (coordinator/kv_transfer.py), falling back to "reprefill" when the
            copy fails; "reprefill" has the destination prefill prompt + output.
        http_port: port of the OpenAI-compatible HTTP API on `host` (coordinator/openai_api.py;
            0 = a free port, None = no HTTP API).
        api_keys: keys clients must send (`authorization: Bearer <key>` metadata, the HTTP
            API's Authorization header; flashfleet/auth.py); empty = none required.
        admin_keys: those of `api_keys` with the `admin` role: the operator's calls (DrainWorker,
            MoveSession, PutApiKey, DeleteApiKey) refuse any other key with PERMISSION_DENIED.
            Both seed the fleet's state, whose keys (PutApiKey adds more) the guards check.
        join_token: the secret workers must send to register and heartbeat, which the
            coordinator also sends on every call to a worker (None = none required).
        state: where the fleet's state lives: "memory" (the default: this coordinator alone) or
            "etcd" (shared with other coordinators, coordinator/state/etcd.py).
        etcd_endpoints: the etcd members for state "etcd" ("host:port" or "http://host:port").
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
    migration_method: str = "kv"
    http_port: int | None = None
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    admin_keys: tuple[str, ...] = field(default=(), repr=False)
    join_token: str | None = field(default=None, repr=False)
    state: str = "memory"
    etcd_endpoints: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        from flashfleet.config import state_problem

        problem = state_problem(self.state, self.etcd_endpoints)
        if problem:
            raise ValueError(f"CoordinatorConfig: {problem}")
        if not set(self.admin_keys) <= set(self.api_keys):
            raise ValueError("CoordinatorConfig.admin_keys must be among api_keys")
        if self.migration_method not in METHODS:
            raise ValueError(f"CoordinatorConfig.migration_method must be one of {METHODS}, "
                             f"got {self.migration_method!r}")


def settings_problems(lease_ttl_s: float, heartbeat_interval_s: float, route_attempts: int,
                      max_queued: int, queue_timeout_s: float, migrate_min_remaining_tokens: int,
                      shutdown_grace_s: float) -> list[str]:
    """What is wrong with a set of coordinator settings, one message per bad value, each naming
    the setting (as in the cluster config; the CLI flag is the same name with dashes). Empty
    when all are usable.

    Why each bound: a heartbeat interval of 0 is a busy loop on every worker; a NaN or infinite
    lease never expires, so a dead worker keeps getting requests; the lease must outlast at
    least one heartbeat.
    """
    bad = []

    def need(ok: bool, key: str, value, rule: str) -> None:
        if not ok:
            bad.append(f"{key} must be {rule}, got {value!r}")

    need(math.isfinite(heartbeat_interval_s) and heartbeat_interval_s > 0, "heartbeat_interval_s",
         heartbeat_interval_s, "a finite number of seconds > 0")
    need(math.isfinite(lease_ttl_s) and lease_ttl_s > 0, "lease_ttl_s", lease_ttl_s,
         "a finite number of seconds > 0")
    if not bad and lease_ttl_s <= heartbeat_interval_s:
        bad.append(f"lease_ttl_s ({lease_ttl_s!r}) must be longer than heartbeat_interval_s "
                   f"({heartbeat_interval_s!r}): a lease shorter than a heartbeat expires while "
                   "the worker is healthy")
    need(route_attempts >= 1, "route_attempts", route_attempts, ">= 1")
    need(max_queued >= 0, "max_queued", max_queued, ">= 0")
    need(queue_timeout_s >= 0, "queue_timeout_s", queue_timeout_s, "a number of seconds >= 0")
    need(migrate_min_remaining_tokens >= 1, "migrate_min_remaining_tokens",
         migrate_min_remaining_tokens, ">= 1")
    need(math.isfinite(shutdown_grace_s) and shutdown_grace_s >= 0, "shutdown_grace_s",
         shutdown_grace_s, "a finite number of seconds >= 0")
    return bad


def migration_problems(cooldown_s: float, link_bandwidth_gbps: float, hysteresis: float,
                       min_speedup: float, min_saving_s: float = 1.0) -> list[str]:
    """What is wrong with the migration policy's settings (keys as in the cluster config), one
    message per bad value; empty when all are usable (`MigrationPolicy` would accept them)."""
    bad = []
    for key, value, ok, rule in (
            ("migrate_cooldown_s", cooldown_s, cooldown_s >= 0, "a number of seconds >= 0"),
            ("migrate_link_bandwidth_gbps", link_bandwidth_gbps, link_bandwidth_gbps > 0, "a number of Gb/s > 0"),
            ("migrate_hysteresis", hysteresis, hysteresis >= 0, "a number >= 0"),
            ("migrate_min_speedup", min_speedup, min_speedup >= 1, "a number >= 1"),
            ("migrate_min_saving_s", min_saving_s, min_saving_s >= 0, "a number of seconds >= 0")):
        if not (math.isfinite(value) and ok):
            bad.append(f"{key} must be {rule}, got {value!r}")
    return bad
