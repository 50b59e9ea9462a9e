"""`python -m coordinator --port 50051`: runs a coordinator (flashfleet up starts one for you)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import re
import sys

from coordinator.config import CoordinatorConfig, migration_problems, settings_problems
from flashfleet.cli import prog_name
from flashfleet.config import tcp_port

# Built-in defaults; a --config file's values come before them, command-line flags before both.
DEFAULTS = {"host": "127.0.0.1", "port": 50051, "lease_ttl_s": 10.0, "heartbeat_interval_s": 2.0,
            "route_attempts": 3, "max_queued": 64, "queue_timeout_s": 30.0, "log_level": "INFO", "migrate": True,
            "migrate_min_remaining_tokens": 64, "shutdown_grace_s": 25.0, "migrate_cooldown_s": 5.0,
            "migrate_link_bandwidth_gbps": 1.0, "migrate_hysteresis": 1.5, "migrate_min_speedup": 1.1,
            "migrate_min_saving_s": 1.0,
            "migrate_method": "kv", "state": "memory"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parses the command line, filling options it leaves unset from --config's [coordinator]
    table, then from DEFAULTS.

    Raises:
        flashfleet.config.ConfigError: an unreadable or invalid config file.
    """
    p = argparse.ArgumentParser(prog=prog_name("coordinator"), description=__doc__)
    p.add_argument("--config", default=None, help="cluster config file (TOML, see "
                   "deploy/cluster.toml); flags override its values")
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1; 0.0.0.0 "
                   "for a LAN)")
    p.add_argument("--port", type=tcp_port, default=None, help="gRPC port (default 50051; 0 = any "
                   "free port)")
    p.add_argument("--metrics-port", type=tcp_port, default=None,
                   help="Prometheus /metrics port (omit or 0: no endpoint)")
    p.add_argument("--http-port", type=tcp_port, default=None,
                   help="port of the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
                   "/v1/models) on --host (omit or 0: no HTTP API)")
    p.add_argument("--lease-ttl-s", type=float, default=None, help="default 10")
    p.add_argument("--heartbeat-interval-s", type=float, default=None, help="default 2")
    p.add_argument("--route-attempts", type=int, default=None, help="default 3")
    p.add_argument("--max-queued", type=int, default=None, help="requests that may wait for a free "
                   "worker slot while every worker serving their model is full (default 64; 0: refuse "
                   "them at once with RESOURCE_EXHAUSTED)")
    p.add_argument("--queue-timeout-s", type=float, default=None,
                   help="longest wait for a slot, seconds (default 30)")
    p.add_argument("--no-migration", dest="migrate", action="store_const", const=False, default=None,
                   help="never move a running session on the policy's own account (default: move it to a "
                   "worker predicted faster by more than the move costs, or off a worker short of KV memory; "
                   "coordinator/migration.py); drains and `flashfleet move` still move sessions")
    p.add_argument("--migrate-min-remaining-tokens", type=int, default=None,
                   help="tokens of max_tokens a session must have left to be moved for speed (default 64)")
    p.add_argument("--migrate-cooldown-s", type=float, default=None,
                   help="a moved session stays put, and does not return to the worker it left, for this "
                   "long (default 5)")
    p.add_argument("--migrate-link-bandwidth-gbps", type=float, default=None,
                   help="network between workers, Gb/s: a move of b bytes of KV costs b over it (default 1)")
    p.add_argument("--migrate-hysteresis", type=float, default=None,
                   help="a speed move needs a predicted saving of this many times its cost (default 1.5)")
    p.add_argument("--migrate-min-speedup", type=float, default=None,
                   help="... and a destination predicting this many times the source's tokens/s (default 1.1)")
    p.add_argument("--migrate-min-saving-s", type=float, default=None,
                   help="... and a predicted saving of at least this many seconds (default 1)")
    p.add_argument("--migrate-method", choices=("kv", "reprefill"), default=None,
                   help="how a session moves: kv (default) copies its KV cache to the destination while "
                   "it decodes on, falling back to reprefill when the copy fails; reprefill has the "
                   "destination prefill prompt + output (coordinator/kv_transfer.py)")
    p.add_argument("--shutdown-grace-s", type=float, default=None,
                   help="on SIGTERM, how long running streams may finish before they are cut, "
                   "seconds (default 25: under the 30 s systemd and launchd allow a stop)")
    p.add_argument("--api-keys-file", default=None,
                   help="file of API keys clients must send, one a line as '<key>' or '<key> admin' "
                   "(admin keys may also drain workers and move sessions), # comments (also env "
                   "FLASHFLEET_COORDINATOR_API_KEYS, comma-separated; none: no key required)")
    p.add_argument("--join-token-file", default=None,
                   help="file holding the token workers must send to register (also env "
                   "FLASHFLEET_JOIN_TOKEN; none: any worker may register)")
    p.add_argument("--state", choices=("memory", "etcd"), default=None,
                   help="where the fleet's state lives: memory (default: this coordinator alone) or etcd "
                   "(shared by several coordinators, all active; needs --etcd-endpoints)")
    p.add_argument("--etcd-endpoints", default=None,
                   help="comma-separated etcd members for --state etcd, e.g. "
                   "http://10.0.0.11:2379,http://10.0.0.12:2379,http://10.0.0.13:2379")
    p.add_argument("--log-level", default=None)
    a = p.parse_args(argv)
    if a.config:
        from flashfleet.config import load_cluster_config

        cfg = load_cluster_config(a.config)
        if cfg.tls is not None:
            cfg.tls.read()  # unreadable or non-PEM files are reported before start-up
        a.tls = cfg.tls
        for key, value in cfg.coordinator_settings().items():
            if getattr(a, key) is None:
                setattr(a, key, value)
    for key, value in DEFAULTS.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    bad = settings_problems(a.lease_ttl_s, a.heartbeat_interval_s, a.route_attempts, a.max_queued,
                            a.queue_timeout_s, a.migrate_min_remaining_tokens, a.shutdown_grace_s)
    bad += migration_problems(a.migrate_cooldown_s, a.migrate_link_bandwidth_gbps, a.migrate_hysteresis,
                              a.migrate_min_speedup, a.migrate_min_saving_s)
    from flashfleet.config import state_problem

    a.etcd_endpoints = tuple(e.strip() for e in (a.etcd_endpoints or "").split(",") if e.strip())
    problem = state_problem(a.state, a.etcd_endpoints)
    if problem:
        bad.append(problem)
    if bad:  # named as flags: a value from --config passes the file's own check first
        p.error(re.sub(r"\b([a-z]+(?:_[a-z]+)+)\b", lambda m: "--" + m[1].replace("_", "-"), bad[0]))
    return a


def main(argv: list[str] | None = None) -> int:
    """`python -m coordinator`: parses flags, then serves until SIGINT/SIGTERM.

    Returns:
        The exit status: 0 after a clean shutdown, 1 when the server could not start (e.g. the
        port is in use), 2 for an invalid --config file or an unreadable secrets file (argparse exits with 2 itself for bad
        flags or settings).
    """
    from flashfleet.config import ConfigError
    from flashfleet.malloc import return_large_buffers

    return_large_buffers()  # large HTTP bodies must not leave the heap at its high-water mark
    try:
        a = parse_args(argv)
    except ConfigError as e:
        print(f"coordinator: {e}", file=sys.stderr)
        return 2
    from flashfleet.auth import load_api_keys, load_join_token

    try:  # the secrets themselves are never printed or logged
        api_keys, join_token = load_api_keys(a.api_keys_file), load_join_token(a.join_token_file)
    except (OSError, ValueError) as e:
        print(f"coordinator: cannot read a secrets file: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=a.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from coordinator.migration import MigrationPolicy
    from coordinator.server import serve
    config = CoordinatorConfig(host=a.host, port=a.port, lease_ttl_s=a.lease_ttl_s,
                               heartbeat_interval_s=a.heartbeat_interval_s,
                               route_attempts=a.route_attempts, max_queued=a.max_queued,
                               queue_timeout_s=a.queue_timeout_s, shutdown_grace_s=a.shutdown_grace_s,
                               migration=MigrationPolicy(enabled=a.migrate,
                                                         min_remaining_tokens=a.migrate_min_remaining_tokens,
                                                         cooldown_s=a.migrate_cooldown_s,
                                                         link_bandwidth_bytes_per_s=a.migrate_link_bandwidth_gbps * 1e9 / 8,
                                                         hysteresis=a.migrate_hysteresis,
                                                         min_speedup=a.migrate_min_speedup,
                                                         min_saving_s=a.migrate_min_saving_s),
                               migration_method=a.migrate_method,
                               http_port=a.http_port or None, api_keys=tuple(api_keys),
                               admin_keys=tuple(k for k, role in api_keys.items() if role == "admin"),
                               join_token=join_token, state=a.state, etcd_endpoints=a.etcd_endpoints)
    try:
        asyncio.run(serve(config, a.metrics_port or None, getattr(a, "tls", None)))
    except RuntimeError as e:
        print(f"coordinator: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
