"""What session migration buys: two sessions on one worker while another worker is idle.

This process runs a coordinator; two worker processes (`python -m worker`) serve the same model,
each pinned to its own CPU core with `taskset` where it can be, as two Macs each have their own
chip (real gRPC on loopback). Per round and per setting (migration off, then on), one
user's two greedy requests share a session_id, so session affinity puts both on one worker; the
second starts once the first streams. Off, the two share that worker's engine (it runs its
sessions in turn) to the end; on, the coordinator moves one to the idle worker
(coordinator/migration.py). Printed per setting: the wall time until both requests finished,
each request's client-side decode speed (tokens after the first / seconds from the first to the
last), the pause the move cost the moved request (its longest gap between two chunks), the
migrations, and whether every output equals the same request's output with migration off.

    python bench/bench_migration.py --model ~/.cache/flashfleet/models/SmolLM2-135M-Instruct \\
        [--max-tokens 64] [--rounds 2] [--json-out F]

Prompts: the first held-out rows of bench/prompts' humaneval and enwiki_en (as `flashfleet draft
train` splits them), raw text. Workers inherit the environment (set LD_PRELOAD to OpenBLAS for
the CPU's speed).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = Path(__file__).resolve().parent / "prompts"


async def one_request(address: str, model: str, prompt: str, max_tokens: int, started: asyncio.Event):
    """Streams one greedy request; returns (token ids, text, chunk arrival times, stats, worker)."""
    from flashfleet import AsyncClient

    ids, text, times, last = [], [], [], None
    async with AsyncClient(address) as client:
        async for chunk in client.generate(model, prompt, max_tokens=max_tokens, mode="plain",
                                           session_id="bench-user"):
            times.append(time.perf_counter())
            ids.extend(chunk.token_ids)
            text.append(chunk.text)
            if chunk.token_ids:
                started.set()
            last = chunk
    return ids, "".join(text), times, last.stats, getattr(last, "worker_id", "")


async def run_pair(address: str, model: str, prompts: list[str], max_tokens: int):
    """The two requests of one user: the second once the first has streamed a token."""
    first_started, second_started = asyncio.Event(), asyncio.Event()
    t0 = time.perf_counter()
    a = asyncio.create_task(one_request(address, model, prompts[0], max_tokens, first_started))
    await asyncio.wait_for(first_started.wait(), 600)
    b = asyncio.create_task(one_request(address, model, prompts[1], max_tokens, second_started))
    results = await asyncio.gather(a, b)
    return time.perf_counter() - t0, results


async def main_async(a) -> int:
    import dataclasses
    import os
    import shutil
    import subprocess

    from prometheus_client import CollectorRegistry

    from coordinator.config import CoordinatorConfig
    from coordinator.migration import MigrationPolicy
    from coordinator.server import start_coordinator
    from worker.training.data import read_prompt_files, split_heldout

    prompts = []
    for f in ("humaneval.jsonl", "enwiki_en.jsonl"):
        prompts.append(split_heldout(read_prompt_files([a.cases / f], 450), 8, 0.1)[1][0].text)
    name = "bench-model"
    coord = await start_coordinator(CoordinatorConfig(port=0), CollectorRegistry())
    # One process per worker, each on its own core where it can be pinned: as on two Macs, a
    # worker's speed does not depend on what the other one runs.
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pin = shutil.which("taskset") is not None and len(cores) >= 2 and not a.no_pin
    procs = []
    for i in range(2):
        cmd = [sys.executable, "-m", "worker", "--model", str(a.model), "--model-name", name, "--capacity", "2",
               "--coordinator", coord.address, "--worker-id", f"w{i}", "--port", "0", "--log-level", "WARNING"]
        procs.append(subprocess.Popen((["taskset", "-c", str(cores[i])] if pin else []) + cmd,
                                      cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL))
    rows, outputs = {}, {}
    try:
        deadline = time.monotonic() + 600
        while len(coord.registry.live()) < 2:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError("the two workers did not register (see their stderr above)")
            await asyncio.sleep(0.2)
        for r in range(a.rounds):
            for setting in ("off", "on"):
                coord.servicer.config = dataclasses.replace(
                    coord.servicer.config, migration=MigrationPolicy(enabled=setting == "on", min_remaining_tokens=8))
                wall, results = await run_pair(coord.address, name, prompts, a.max_tokens)
                row = rows.setdefault(setting, dict(wall_s=[], tps=[], pause_s=[], migrations=0, workers=set()))
                row["wall_s"].append(wall)
                for i, (ids, text, times, stats, worker) in enumerate(results):
                    row["tps"].append((len(ids) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0)
                    row["migrations"] += stats.migrations
                    row["workers"].add(worker)
                    if stats.migrations:
                        row["pause_s"].append(max(b - t for t, b in zip(times, times[1:])))
                    outputs.setdefault((setting, i), []).append((ids, text))
                print(f"  round {r} migration {setting}: {wall:.2f} s", file=sys.stderr, flush=True)
    finally:
        for p in procs:
            p.terminate()  # they deregister: this loop must keep serving the coordinator meanwhile
        for p in procs:
            try:
                await asyncio.to_thread(p.wait, 30)
            except subprocess.TimeoutExpired:
                p.kill()
        await coord.stop(grace_s=1.0)

    same = all(out == outputs[("off", i)][k] for (setting, i), outs in outputs.items()
               for k, out in enumerate(outs))
    where = f"pinned to cores {cores[0]} and {cores[1]}" if pin else "not pinned"
    print(f"\nmodel {a.model}  max_tokens {a.max_tokens}  rounds {a.rounds}  2 worker processes ({where}), "
          f"2 requests of one session")
    print(f"{'migration':10s} {'wall s (median)':>16s} {'request tok/s (median)':>23s} {'migrations':>11s} "
          f"{'pause s (max)':>14s}  workers used")
    for setting in ("off", "on"):
        row = rows[setting]
        pause = f"{max(row['pause_s']):.2f}" if row["pause_s"] else "-"
        print(f"{setting:10s} {statistics.median(row['wall_s']):16.2f} {statistics.median(row['tps']):23.2f} "
              f"{row['migrations']:11d} {pause:>14s}  {', '.join(sorted(row['workers']))}")
    speedup = statistics.median(rows["off"]["wall_s"]) / statistics.median(rows["on"]["wall_s"])
    print(f"wall time off / on: {speedup:.2f}x; every output equal to the same request's with migration off: "
          f"{'yes' if same else 'NO'}")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(
            {k: {**v, "workers": sorted(v["workers"])} for k, v in rows.items()} | {"same_outputs": same}, indent=1))
    return 0 if same else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path, help="local HF/MLX model directory")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cases", type=Path, default=CASES)
    ap.add_argument("--no-pin", action="store_true", help="do not pin each worker process to its own core")
    ap.add_argument("--json-out")
    a = ap.parse_args(argv)
    if a.max_tokens < 16 or a.rounds < 1:
        ap.error("--max-tokens >= 16 (room to move a session) and --rounds >= 1")
    if not (a.model / "config.json").exists():
        ap.error(f"--model {a.model}: no config.json there (a local model directory)")
    return asyncio.run(main_async(a))


if __name__ == "__main__":
    sys.exit(main())
