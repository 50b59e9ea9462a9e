"""`flashfleet status`: the workers of a running cluster, their models and drafts, load and heartbeat age."""
from __future__ import annotations

import argparse
import sys

from flashfleet.cli._common import add_connection_args, credentials, explain
from flashfleet.config import ConfigError
from flashfleet.errors import FlashfleetError
from flashfleet.types import DECODE_MODE_NAMES


def kv_used_budget(used_bytes: int, budget_bytes: int) -> str:
    """"12.3 / 800 MiB": KV bytes in use over the budget (MiB; the budget "-" when 0, unknown)."""
    budget = f"{budget_bytes / 2**20:.0f}" if budget_bytes else "-"
    return f"{used_bytes / 2**20:.1f} / {budget} MiB"


def main(argv: list[str]) -> int:
    """Prints one row per worker (sessions / capacity, running sessions' KV cache / KV budget in
    MiB ("-" for a budget the worker does not report), its prompt cache in MiB, requests served,
    heartbeat age in seconds, live or unreachable) and the count of sessions with affinity.

    Returns:
        The exit status: 0, or 1 on an SDK or config error (printed to stderr).
    """
    p = argparse.ArgumentParser(prog="flashfleet status", description=__doc__)
    add_connection_args(p)
    a = p.parse_args(argv)
    from flashfleet.client import Client

    try:
        with Client(a.address, credentials=credentials(a.config)) as client:
            status = client.cluster_status()
    except (FlashfleetError, ConfigError) as e:
        print(f"flashfleet status: {explain(e, a.address)}", file=sys.stderr)
        return 1
    head = ["worker", "address", "models", "draft", "sessions", "KV used / budget", "prompt cache", "served",
            "heartbeat", "state"]
    rows = []
    for w in status.workers:
        # the worker's label: a directory's name, or flashfleet/drafts/NAME for a shipped draft
        drafts = ",".join(f"{m.draft} ({DECODE_MODE_NAMES.get(m.draft_mode, m.draft_mode)})"
                          for m in w.models if m.draft) or "-"
        rows.append([w.worker_id, w.address, ",".join(m.name for m in w.models), drafts,
                     f"{w.active_sessions}/{w.capacity}", kv_used_budget(w.kv_cache_bytes, w.kv_budget_bytes),
                     f"{w.prompt_cache_bytes / 2**20:.1f} MiB", str(w.served_requests),
                     f"{w.heartbeat_age_s:.1f}s",
                     # unreachable: a call failed UNAVAILABLE since its last heartbeat; routing passes it over
                     "unreachable" if w.unreachable else "draining" if w.draining else "live"])
    # Columns as wide as their widest cell; text left-aligned, numbers right-aligned.
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print(" ".join(c.ljust(n) if i < 4 else c.rjust(n) for i, (c, n) in enumerate(zip(r, widths))).rstrip())
    print(f"{len(status.workers)} worker(s), {status.sessions} session(s) with affinity")
    return 0
