"""MLX's CUDA-graph settings against decode speed: plain mlx-lm, ours plain and DFlash side by side
under each setting.

MLX's CUDA backend records each evaluated kernel into a CUDA graph and launches the graph once it
holds MLX_MAX_OPS_PER_BUFFER kernels or MLX_MAX_MB_PER_BUFFER megabytes of arrays (defaults chosen
per GPU generation, mlx/backend/cuda/device.cpp `get_graph_limits`); MLX_USE_CUDA_GRAPHS=0 launches
every kernel directly. A decode step of the 1.5B target is ~400 kernels and the GPU waits on
launches more than on bytes (docs/benchmarks.md), so how kernels reach the GPU may matter more than
what they compute. MLX reads these variables once per process, so each setting runs
`bench/bench_dflash.py` in its own process, with the same target, draft and prompts; `--passes N`
runs the whole list N times (a setting's spread over passes is the machine's drift). Every row's
speedups are against plain mlx-lm measured in that same process, under that same setting.

    python bench/bench_cuda_graphs.py --target MODEL_DIR --dflash-draft DRAFT_DIR \\
        [--settings default ops100 ops200 nographs] [--passes 2] [--prompts 3] [--out-dir DIR]
    python bench/bench_cuda_graphs.py --pool DIR [DIR ...]   # pool runs kept by --out-dir

Columns: plain mlx-lm tok/s per corpus (code/en/pl); "ours plain fused" (the worker's plain path),
"DFlash compiled" (fixed block) and "adapt compiled" (the worker's DFlash path: fused, compiled,
the cost model choosing each block size) as speedups over that plain mlx-lm, per corpus; then the
fixed-block cycle's milliseconds in the runs, and its draft and verify forwards and a plain step
timed alone. On MLX's CPU build the variables do nothing: every setting is the same program (a
control for the spread). Prints one table; --out-dir keeps each run's JSON and output.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> environment; "default" leaves MLX's own choice for the GPU.
SETTINGS = {
    "default": {},
    "ops40": {"MLX_MAX_OPS_PER_BUFFER": "40", "MLX_MAX_MB_PER_BUFFER": "1000"},
    "ops100": {"MLX_MAX_OPS_PER_BUFFER": "100", "MLX_MAX_MB_PER_BUFFER": "1000"},
    "ops200": {"MLX_MAX_OPS_PER_BUFFER": "200", "MLX_MAX_MB_PER_BUFFER": "8000"},
    "nographs": {"MLX_USE_CUDA_GRAPHS": "0"},
}
CORPORA = ("code", "en", "pl")


def run_setting(name: str, args, out_dir: Path, tag: str) -> dict:
    """Runs bench_dflash.py once under setting `name`; returns its JSON record, or
    {"error": text} when the run failed or timed out."""
    js, log = out_dir / f"graphs_{tag}.json", out_dir / f"graphs_{tag}.txt"
    cmd = [sys.executable, str(ROOT / "bench" / "bench_dflash.py"), "--target", args.target,
           "--dflash-draft", args.dflash_draft, "--max-tokens", str(args.max_tokens),
           "--prompts", str(args.prompts), "--rounds", "1", "--cases", str(args.cases),
           "--fuse", "--compile", "--adaptive", "--only", "plain fused", "compiled", "--json-out", str(js)]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_MAX_", "MLX_USE_CUDA_GRAPHS"))}
    env.update(SETTINGS[name])
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    log.write_text(r.stdout + "\n" + "\n".join(l for l in r.stderr.splitlines() if not l.endswith(" done")))
    if r.returncode != 0 or not js.exists():
        return {"error": (r.stderr.strip().splitlines() or ["exit %d" % r.returncode])[-1][:200]}
    return json.loads(js.read_text())


def summarize(record: dict) -> dict:
    """One table row's numbers from bench_dflash's JSON: tok/s and speedups per corpus, and the
    fixed-block compiled cycle's costs in ms."""
    by = {(r["method"], r["corpus"]): r for r in record["results"]}
    methods = {m for m, _ in by}

    compiled = [m for m in methods if m.endswith(" compiled") and "plain" not in m]
    adapt = next((m for m in compiled if "adapt" in m), None)
    fixed = next((m for m in compiled if "adapt" not in m), None)
    row = {"plain": [by.get(("plain mlx-lm", c), {}).get("tps") for c in CORPORA]}
    for key, m in (("fused", "ours plain fused"), ("fixed", fixed), ("adapt", adapt)):
        row[key] = [by.get((m, c), {}).get("speedup") for c in CORPORA]
        row[key + "_tau"] = [by.get((m, c), {}).get("tau") for c in CORPORA]
    cost = record.get("cycle_cost", {}).get(fixed, {})
    row["cycle_ms"] = [cost.get(k, float("nan")) * 1e3 for k in ("per_cycle_s", "draft_s", "verify_s", "plain_step_s")]
    return row


def pool(dirs: list[Path]) -> int:
    """Prints one row per setting over every run's JSON (graphs_*.json) in `dirs`: runs, the mean
    (min-max) over runs of the plain step and the fixed-block cycle in ms and of the geometric
    mean over corpora of the fixed-block and adaptive speedups, and tok/s of DFlash adaptive and
    plain mlx-lm averaged over corpora and runs. Returns 1 when no JSON was found."""
    import math
    import statistics as st

    runs: dict[str, list[tuple[dict, dict]]] = {}
    for f in sorted(f for d in dirs for f in Path(d).glob("graphs_*.json")):
        name = re.sub(r"_\d+$", "", f.stem.removeprefix("graphs_"))  # default_2 -> default
        rec = json.loads(f.read_text())
        runs.setdefault(name, []).append((rec, summarize(rec)))
    if not runs:
        print(f"--pool: no graphs_*.json in {', '.join(map(str, dirs))}")
        return 1

    def spread(xs) -> str:
        return f"{st.mean(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"

    def gmean(xs) -> float:
        return math.exp(st.mean(math.log(x) for x in xs))

    def tps(recs, pick) -> float:
        return st.mean(r["tps"] for rec in recs for r in rec["results"] if pick(r["method"]))

    print("| setting | runs | plain step ms | cycle ms | fixed-block speedup, geomean of corpora "
          "| adaptive speedup | DFlash adaptive tok/s | plain mlx-lm tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, rs in runs.items():
        recs, rows = [r for r, _ in rs], [s for _, s in rs]
        print(f"| {name} | {len(rs)} | {spread([s['cycle_ms'][3] for s in rows])} | "
              f"{spread([s['cycle_ms'][0] for s in rows])} | {spread([gmean(s['fixed']) for s in rows])} | "
              f"{spread([gmean(s['adapt']) for s in rows])} | "
              f"{tps(recs, lambda m: 'adapt' in m and m.endswith(' compiled')):.1f} | "
              f"{tps(recs, lambda m: m == 'plain mlx-lm'):.1f} |")
    return 0


def fmt(vals, spec: str) -> str:
    return "/".join("-" if v is None else format(v, spec) for v in vals)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="mlx-lm model directory")
    p.add_argument("--dflash-draft", help="DFlash draft directory")
    p.add_argument("--pool", nargs="+", type=Path, default=None, metavar="DIR",
                   help="run nothing: pool the runs kept in these --out-dir directories, a row per setting")
    p.add_argument("--settings", nargs="+", default=["default", "ops100", "ops200", "nographs"],
                   choices=sorted(SETTINGS))
    p.add_argument("--passes", type=int, default=1, help="times the whole list of settings runs")
    p.add_argument("--prompts", type=int, default=3, help="prompts per corpus")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--cases", type=Path, default=ROOT / "bench" / "prompts")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None)
    p.add_argument("--timeout", type=int, default=240, help="seconds per run")
    p.add_argument("--out-dir", type=Path, default=None, help="keep each run's JSON and output here")
    args = p.parse_args(argv)
    if args.pool:
        return pool(args.pool)
    if not (args.target and args.dflash_draft):
        p.error("--target and --dflash-draft are required (or --pool DIR)")
    if args.passes < 1:
        p.error("--passes: at least 1")
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="cuda_graphs_"))
    out_dir.mkdir(parents=True, exist_ok=True)

    rows = []
    for n in range(args.passes):
        for name in args.settings:
            tag = name if args.passes == 1 else f"{name}_{n + 1}"
            rec = run_setting(name, args, out_dir, tag)
            env = " ".join(f"{k}={v}" for k, v in SETTINGS[name].items()) or "(MLX's own)"
            if "error" in rec:
                print(f"{tag}: failed: {rec['error']}", flush=True)
                continue
            rows.append((tag, env, rec.get("device", "?"), summarize(rec)))
            print(f"{tag}: done ({env})", flush=True)

    print(f"\n{len(rows)} runs; speedups against plain mlx-lm in the same process; corpora {'/'.join(CORPORA)}")
    print("| setting | env | plain mlx-lm tok/s | ours plain fused | DFlash compiled (tau) | adapt compiled (tau) "
          "| cycle ms in runs | draft + verify alone ms | plain step ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for tag, env, _, r in rows:
        c = r["cycle_ms"]
        print(f"| {tag} | {env} | {fmt(r['plain'], '.1f')} | {fmt(r['fused'], '.2f')} | "
              f"{fmt(r['fixed'], '.2f')} ({fmt(r['fixed_tau'], '.2f')}) | {fmt(r['adapt'], '.2f')} "
              f"({fmt(r['adapt_tau'], '.2f')}) | {c[0]:.2f} | {c[1]:.2f} + {c[2]:.2f} | {c[3]:.2f} |")
    if rows:
        print(f"device: {rows[0][2]}; runs' JSON and output in {out_dir}")
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
