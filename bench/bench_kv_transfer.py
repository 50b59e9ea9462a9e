"""How long a session move takes: KV transfer against re-prefill, per context length.

This process runs a coordinator; two worker processes (`python -m worker`) serve the same model
(real gRPC on loopback; each pinned to its own core with `taskset` where it can be; prompt caches
off, so a re-prefill recomputes everything). Per context length (prompt tokens) and per method,
one greedy request streams from one worker and is moved to the other once `--after` tokens have
reached the client (coordinator/migration.py, with a policy that always moves it once). Printed
per context: the move's pause (last token forwarded from the source to the destination's first
message), its total time (from the start of the move: for "kv" the start of the transfer, which
runs while the source keeps streaming), the KV bytes moved, the ratio re-prefill / KV of each,
and whether both methods' outputs are equal.

    python bench/bench_kv_transfer.py --model ~/.cache/flashfleet/models/SmolLM2-135M-Instruct \\
        [--contexts 1024 4096] [--max-tokens 48] [--json-out F]

Prompts: English text from bench/prompts/enwiki_en.jsonl, repeated and cut to each length.
Contexts past the model's own limit need `--max-context-tokens` (it is passed to the workers).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.migration import Decision  # noqa: E402

CASES = Path(__file__).resolve().parent / "prompts"


class MoveOnce:
    """A migration policy that moves every request once, to the other idle worker, after `after`
    tokens have been sent (a failed attempt is not retried)."""

    enabled = True
    check_interval_s = 0.0
    min_remaining_tokens = 1

    def __init__(self, after: int):
        self.after = after
        self.tried: set[str] = set()

    def decide(self, request, source, sent_tokens, workers, moved_s, now_s, left_worker=None, left_s=None,
               left_gain=0.0, left_timings=None):
        if sent_tokens < self.after or request.request_id in self.tried:
            return None
        idle = [w for w in workers if w.worker_id != source.worker_id and w.in_flight == 0]
        if not idle:
            return None
        self.tried.add(request.request_id)
        return Decision(idle[0], "manual")


def context_prompt(tokenizer, text: str, n: int) -> str:
    """Text of about n tokens: `text` repeated, cut at n tokens."""
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(text + "\n\n", add_special_tokens=False)
    return tokenizer.decode(ids[:n])


async def one(address: str, model: str, prompt: str, max_tokens: int):
    """Streams one greedy request; returns (token ids, final stats)."""
    from flashfleet import AsyncClient

    ids, last = [], None
    async with AsyncClient(address) as client:
        async for chunk in client.generate(model, prompt, max_tokens=max_tokens, mode="plain", timeout_s=1800):
            ids.extend(chunk.token_ids)
            last = chunk
    return ids, last.stats


async def main_async(a) -> int:
    import dataclasses
    import os
    import shutil
    import subprocess

    from mlx_lm.utils import load_tokenizer
    from prometheus_client import CollectorRegistry

    from coordinator.config import CoordinatorConfig
    from coordinator.server import start_coordinator
    from worker.training.data import read_prompt_files

    text = "\n\n".join(c.text for c in read_prompt_files([a.cases / "enwiki_en.jsonl"], 64)[:16])
    tokenizer = load_tokenizer(a.model)
    name = "bench-model"
    coord = await start_coordinator(CoordinatorConfig(port=0), CollectorRegistry())
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pin = shutil.which("taskset") is not None and len(cores) >= 2 and not a.no_pin
    procs = []
    for i in range(2):
        cmd = [sys.executable, "-m", "worker", "--model", str(a.model), "--model-name", name, "--capacity", "2",
               "--coordinator", coord.address, "--worker-id", f"w{i}", "--port", "0", "--log-level", "WARNING",
               "--prompt-cache-entries", "0"]
        if a.max_context_tokens:
            cmd += ["--max-context-tokens", str(a.max_context_tokens)]
        procs.append(subprocess.Popen((["taskset", "-c", str(cores[i])] if pin else []) + cmd,
                                      cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL))
    rows = []
    try:
        deadline = time.monotonic() + 600
        while len(coord.registry.live()) < 2:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError("the two workers did not register (see their stderr above)")
            await asyncio.sleep(0.2)
        svc = coord.servicer
        for n in a.contexts:
            prompt = context_prompt(tokenizer, text, n)
            row = {"context": n}
            outputs = {}
            for method in ("kv", "reprefill"):
                svc.config = dataclasses.replace(svc.config, migration=MoveOnce(a.after), migration_method=method)
                svc.moves.clear()
                ids, stats = await one(coord.address, name, prompt, a.max_tokens)
                moved = [m for m in svc.moves if m.outcome == "ok"]
                if len(moved) != 1 or moved[0].method != method:
                    raise RuntimeError(f"context {n}, {method}: the request did not move by {method}: {list(svc.moves)}")
                m = moved[0]
                row[method] = {"pause_s": m.pause_s, "total_s": m.total_s, "bytes": m.bytes_moved,
                               "prompt_tokens": stats.prompt_tokens, "transferred_tokens": stats.transferred_tokens}
                outputs[method] = ids
                print(f"  context {n} {method}: pause {m.pause_s:.3f} s, total {m.total_s:.3f} s, "
                      f"{m.bytes_moved / 1e6:.1f} MB", file=sys.stderr, flush=True)
            row["same_output"] = outputs["kv"] == outputs["reprefill"]
            rows.append(row)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                await asyncio.to_thread(p.wait, 30)
            except subprocess.TimeoutExpired:
                p.kill()
        await coord.stop(grace_s=1.0)

    where = f"pinned to cores {cores[0]} and {cores[1]}" if pin else "not pinned"
    print(f"\nmodel {a.model}  max_tokens {a.max_tokens}  moved after {a.after} tokens  "
          f"2 worker processes ({where}), loopback gRPC")
    print(f"{'context':>8s} {'KV MB':>7s} {'kv pause s':>11s} {'reprefill pause s':>18s} {'pause ratio':>12s} "
          f"{'kv total s':>11s} {'reprefill total s':>18s} {'total ratio':>12s}  same output")
    for r in rows:
        kv, rp = r["kv"], r["reprefill"]
        print(f"{r['context']:8d} {kv['bytes'] / 1e6:7.1f} {kv['pause_s']:11.3f} {rp['pause_s']:18.3f} "
              f"{rp['pause_s'] / kv['pause_s']:11.1f}x {kv['total_s']:11.3f} {rp['total_s']:18.3f} "
              f"{rp['total_s'] / kv['total_s']:11.1f}x  {'yes' if r['same_output'] else 'NO'}")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["same_output"] for r in rows) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path, help="local HF/MLX model directory")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--after", type=int, default=8, help="tokens sent before the move")
    ap.add_argument("--max-context-tokens", type=int, default=None,
                    help="the workers' context limit (for contexts past the model's own)")
    ap.add_argument("--cases", type=Path, default=CASES)
    ap.add_argument("--no-pin", action="store_true", help="do not pin each worker process to its own core")
    ap.add_argument("--json-out")
    a = ap.parse_args(argv)
    if a.max_tokens < a.after + 8 or a.after < 1 or min(a.contexts) < 16:
        ap.error("--after >= 1, --max-tokens >= --after + 8, contexts >= 16 tokens")
    if not (a.model / "config.json").exists():
        ap.error(f"--model {a.model}: no config.json there (a local model directory)")
    return asyncio.run(main_async(a))


if __name__ == "__main__":
    sys.exit(main())
