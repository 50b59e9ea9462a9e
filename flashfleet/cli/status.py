"""`flashfleet status`: the workers of a running cluster, their models, load and heartbeat age."""
from __future__ import annotations

import argparse
import sys

from flashfleet.errors import FlashfleetError


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="flashfleet status", description=__doc__)
    p.add_argument("--address", default="127.0.0.1:50051", help="coordinator host:port")
    a = p.parse_args(argv)
    from flashfleet.client import Client

    try:
        with Client(a.address) as client:
            status = client.cluster_status()
    except FlashfleetError as e:
        print(f"flashfleet status: {e}", file=sys.stderr)
        return 1
    print(f"{'worker':<14} {'address':<22} {'models':<32} {'sessions':>9} {'KV MiB':>8} "
          f"{'served':>7} {'heartbeat':>10}")
    for w in status.workers:
        models = ",".join(m.name for m in w.models)
        print(f"{w.worker_id:<14} {w.address:<22} {models:<32} {w.active_sessions:>4}/{w.capacity:<4} "
              f"{w.kv_cache_bytes / 2**20:>8.1f} {w.served_requests:>7} {w.heartbeat_age_s:>9.1f}s")
    print(f"{len(status.workers)} worker(s), {status.sessions} session(s) with affinity")
    return 0
