"""What one DFlash cycle costs per block size, against a plain decoding step, side by side.

For each block size B: one draft forward (B-1 drafts, one new context position) and one target
verify forward of B tokens (taps captured), each timed alone after a warm-up, as
`bench_dflash.per_cycle_alone` does; B = 1 is the plain step. The break-even tau of a block
size is cycle time / plain step: speculation pays only above it (Leviathan et al. 2023, §3.5).
Weights do not change these times, so a config directory with random weights is enough:

    python bench/bench_block_cost.py --target MODEL_OR_CONFIG_DIR --dflash-draft DRAFT_DIR \
        [--random-weights] [--blocks 1 2 4 8 16] [--context 256] [--reps 20] [--rounds 1] [--no-fuse]

The target's projections are fused as a worker loads them (`worker/fusion.py`; `--no-fuse` keeps
mlx-lm's layers). With `--rounds N` every block size is timed N times, the sizes' order reversed
every other round (a drifting machine then biases no size), and the table gives the median round
and the range.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    import mlx.core as mx
    import numpy as np

    from bench.bench_dflash import load_model, per_cycle_alone
    from worker.fusion import fuse_projections
    from worker.models.dflash_checkpoint import DraftCheckpointError, DraftMismatch, load_dflash_draft

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--dflash-draft", required=True)
    ap.add_argument("--random-weights", action="store_true", help="the target's config with random weights")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--context", type=int, default=256, help="prompt tokens already in the caches")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=1, help="time every block size this many times (median)")
    ap.add_argument("--no-fuse", action="store_true", help="keep q/k/v and gate/up as separate matmuls")
    ap.add_argument("--json-out")
    a = ap.parse_args(argv)
    if min(a.blocks) < 1 or 1 not in a.blocks or len(set(a.blocks)) != len(a.blocks):
        ap.error("--blocks: distinct sizes >= 1, including 1 (the plain step every cycle is compared with)")
    if a.context < 2:
        ap.error("--context: at least 2 tokens")
    if a.reps < 1 or a.rounds < 1:
        ap.error("--reps and --rounds: at least 1")

    target = load_model(a.target, a.random_weights, getattr(mx, a.dtype), tokenizer=False)[0]
    fused = 0 if a.no_fuse else fuse_projections(target)
    try:
        draft = load_dflash_draft(a.dflash_draft, target)
    except (DraftCheckpointError, DraftMismatch) as e:
        print(f"bench_block_cost: {e}", file=sys.stderr)
        return 2
    if max(a.blocks) > draft.block_size:
        ap.error(f"--blocks: at most the draft's block size, {draft.block_size}")
    prompt = np.random.default_rng(0).integers(0, 1000, a.context).tolist()
    runs = {B: [] for B in a.blocks}  # (draft ms, verify ms) per round
    for r in range(a.rounds):
        for B in (a.blocks[::-1] if r % 2 else a.blocks):
            d_s, v_s = per_cycle_alone(target, draft, prompt, B, a.reps)
            runs[B].append((d_s * 1e3 if B > 1 else 0.0, v_s * 1e3))
    rows = {}
    for B, got in runs.items():
        cycles = [d + v for d, v in got]
        rows[B] = dict(draft_ms=statistics.median(d for d, _ in got), verify_ms=statistics.median(v for _, v in got),
                       cycle_ms=statistics.median(cycles), cycle_range_ms=[min(cycles), max(cycles)], rounds=got)
    plain = rows[1]["cycle_ms"]
    print(f"target {a.target}{' (random weights)' if a.random_weights else ''} {a.dtype}; draft {a.dflash_draft}; "
          f"context {a.context}; fused projection groups {fused}; {a.rounds} round(s) of {a.reps}; "
          f"device {mx.default_device()}; mlx {mx.__version__}")
    print(f"{'B':>3} {'draft ms':>9} {'verify ms':>10} {'cycle ms':>9} {'x plain':>8} {'cycle range ms':>15}"
          "  (x plain = break-even tau)")
    for B, r in rows.items():
        lo, hi = r["cycle_range_ms"]
        print(f"{B:>3} {r['draft_ms']:9.2f} {r['verify_ms']:10.2f} {r['cycle_ms']:9.2f} "
              f"{r['cycle_ms'] / plain:8.2f} {f'{lo:.2f}-{hi:.2f}':>15}")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(dict(argv=list(argv) if argv is not None else sys.argv[1:], device=str(mx.default_device()), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
