"""`flashfleet drain WORKER_ID`: stop routing new requests to a worker, move its running sessions
to other workers (coordinator/migration.py), then make it leave. Sends the API key in env
FLASHFLEET_API_KEY; a coordinator with API keys needs an admin key for it (flashfleet/auth.py)."""
from __future__ import annotations

import argparse
import sys

from flashfleet.cli._common import add_connection_args, credentials, explain
from flashfleet.config import ConfigError
from flashfleet.errors import FlashfleetError


def main(argv: list[str]) -> int:
    """`flashfleet drain WORKER_ID`: prints one line per progress change of the drain ("w1:
    draining, 2 session(s) left, 1 moved") until the worker has left.

    Returns:
        The exit status: 0 once the worker left, 1 on an error (printed to stderr: unknown worker,
        no other worker for its sessions, a missing API key, ...).
    """
    p = argparse.ArgumentParser(prog="flashfleet drain", description="Stop routing new requests to a "
                                "worker, move its running sessions to other workers, then make it leave "
                                "(deregister and exit).")
    p.add_argument("worker_id")
    p.add_argument("--timeout-s", type=float, default=600.0, help="give up after this long (default 600)")
    add_connection_args(p)
    a = p.parse_args(argv)
    from flashfleet.client import Client

    try:
        with Client(a.address, credentials=credentials(a.config)) as client:
            for step in client.drain_worker(a.worker_id, timeout_s=a.timeout_s):
                print(f"{step.worker_id}: {step.state}, {step.sessions_left} session(s) left, "
                      f"{step.moved} moved", flush=True)
    except (FlashfleetError, ConfigError) as e:
        print(f"flashfleet drain: {explain(e, a.address)}", file=sys.stderr)
        return 1
    return 0
