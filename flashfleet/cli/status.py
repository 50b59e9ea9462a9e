"""`flashfleet status`: the workers of a running cluster, their models and drafts, load and heartbeat age."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flashfleet.cli._common import add_connection_args, credentials
from flashfleet.config import ConfigError
from flashfleet.errors import FlashfleetError
from flashfleet.types import DECODE_MODE_NAMES


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="flashfleet status", description=__doc__)
    add_connection_args(p)
    a = p.parse_args(argv)
    from flashfleet.client import Client

    try:
        with Client(a.address, credentials=credentials(a.config)) as client:
            status = client.cluster_status()
    except (FlashfleetError, ConfigError) as e:
        print(f"flashfleet status: {e}", file=sys.stderr)
        return 1
    print(f"{'worker':<14} {'address':<22} {'models':<32} {'draft':<24} {'sessions':>9} {'KV MiB':>8} "
          f"{'served':>7} {'heartbeat':>10}")
    for w in status.workers:
        models = ",".join(m.name for m in w.models)
        drafts = ",".join(f"{Path(m.draft).name} ({DECODE_MODE_NAMES.get(m.draft_mode, m.draft_mode)})" for m in w.models if m.draft) or "-"
        print(f"{w.worker_id:<14} {w.address:<22} {models:<32} {drafts:<24} {w.active_sessions:>4}/{w.capacity:<4} "
              f"{w.kv_cache_bytes / 2**20:>8.1f} {w.served_requests:>7} {w.heartbeat_age_s:>9.1f}s")
    print(f"{len(status.workers)} worker(s), {status.sessions} session(s) with affinity")
    return 0
