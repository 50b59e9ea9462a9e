"""`flashfleet move REQUEST_ID [--to WORKER_ID]`: move one running request to another worker
(coordinator/migration.py). Sends the API key in env FLASHFLEET_API_KEY; a coordinator with API
keys needs an admin key for it (flashfleet/auth.py)."""
from __future__ import annotations

import argparse
import sys

from flashfleet.cli._common import add_connection_args, credentials, explain
from flashfleet.config import ConfigError
from flashfleet.errors import FlashfleetError


def main(argv: list[str]) -> int:
    """`flashfleet move REQUEST_ID [--to WORKER_ID]`: prints "REQUEST_ID: FROM -> TO" once the
    request streams from its new worker.

    Returns:
        The exit status: 0 once moved, 1 on an error (printed to stderr).
    """
    p = argparse.ArgumentParser(prog="flashfleet move", description="Move one running request to another "
                                "worker (default: the one the coordinator predicts fastest for it).")
    p.add_argument("request_id")
    p.add_argument("--to", dest="to_worker_id", default="", help="destination worker id")
    p.add_argument("--timeout-s", type=float, default=60.0, help="give up after this long (default 60)")
    add_connection_args(p)
    a = p.parse_args(argv)
    from flashfleet.client import Client

    try:
        with Client(a.address, credentials=credentials(a.config)) as client:
            done = client.move_session(a.request_id, a.to_worker_id, timeout_s=a.timeout_s)
    except (FlashfleetError, ConfigError) as e:
        print(f"flashfleet move: {explain(e, a.address)}", file=sys.stderr)
        return 1
    print(f"{done.request_id}: {done.from_worker_id} -> {done.to_worker_id}")
    return 0
