"""What verifying K candidate blocks in one target forward costs, against one block.

The other half of bench/bench_branch_gain.py's question (that one measures what K candidate
blocks would add to tau): a batch of K rows of B tokens, every row at the same positions over
the same cached prefix, through the target's forward compiled as the worker's verify is
(`worker.compiled_forward`: offset as an array, a fixed-size KV buffer with an additive mask),
the prefix's buffers broadcast to K rows inside the trace. Beside it, one row of K x B tokens
(a linear verify of the same token count). Each forward is timed synced (graph replay, device
work, the wait), after a warm-up, the median of --rounds rounds of --reps forwards:

    python bench/bench_batched_verify.py --target MODEL_OR_CONFIG_DIR [--random-weights] \
        [--ks 1 2 4 8] [--block 16] [--contexts 256 1024] [--reps 20] [--rounds 3]

A batched verify pays when tau(K) / tau(1) > cost(K) / cost(1). Weights do not change the
times, so a config directory with random weights is enough.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    import mlx.core as mx
    import numpy as np

    from bench.bench_dflash import load_model
    from worker.compiled_forward import _OffsetCache
    from worker.fusion import fuse_projections
    from worker.spec.dflash import make_target_cache

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--random-weights", action="store_true", help="the target's config with random weights")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8], help="candidate blocks per verify")
    ap.add_argument("--block", type=int, default=16, help="tokens per candidate block")
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024], help="cached prompt tokens")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args(argv)
    if min(a.ks) < 1 or a.block < 1 or min(a.contexts) < 2 or a.reps < 1 or a.rounds < 1:
        ap.error("--ks, --block, --reps, --rounds: at least 1; --contexts: at least 2")

    target = load_model(a.target, a.random_weights, getattr(mx, a.dtype), tokenizer=False)[0]
    fused = fuse_projections(target)

    def forward(tokens, offset, keys, values):
        K = tokens.shape[0]
        caches = [_OffsetCache(mx.broadcast_to(k, (K, *k.shape[1:])) if K > 1 else k,
                               mx.broadcast_to(v, (K, *v.shape[1:])) if K > 1 else v, offset)
                  for k, v in zip(keys, values)]
        logits = target(tokens, cache=caches)
        return mx.argmax(logits, axis=-1), [c.keys for c in caches]

    fwd = mx.compile(forward)
    rng = np.random.default_rng(0)
    rows = []
    for ctx in a.contexts:
        cache = make_target_cache(target)
        mx.eval(target(mx.array([rng.integers(0, 1000, ctx).tolist()], dtype=mx.uint32), cache=cache))
        for c in cache:
            c.reserve(max(a.ks) * a.block)
        keys, values = [c.keys for c in cache], [c.values for c in cache]
        offset = mx.array(ctx, dtype=mx.int32)
        shapes = [(k, 1, a.block) for k in a.ks] + [(k, k * a.block, 0) for k in a.ks if k > 1]
        times = {s: [] for s in shapes}
        for r in range(a.rounds):
            for s in (shapes[::-1] if r % 2 else shapes):
                K, n = (s[0], a.block) if s[2] else (1, s[1])
                x = mx.array(rng.integers(0, 1000, (K, n)).tolist(), dtype=mx.uint32)
                mx.eval(fwd(x, offset, keys, values))  # warm-up: the trace and its kernels
                t0 = time.perf_counter()
                for _ in range(a.reps):
                    mx.eval(fwd(x, offset, keys, values))
                times[s].append((time.perf_counter() - t0) / a.reps * 1e3)
        base = statistics.median(times[(1, 1, a.block)])
        for s, got in times.items():
            K, what = s[0], (f"{s[0]} x {a.block}" if s[2] else f"1 x {s[1]}")
            rows.append(dict(context=ctx, shape=what, tokens=K * a.block, ms=statistics.median(got),
                             ms_range=[min(got), max(got)], x_one_block=statistics.median(got) / base))
    print(f"target {a.target}{' (random weights)' if a.random_weights else ''} {a.dtype}; fused projection groups "
          f"{fused}; {a.rounds} round(s) of {a.reps}; device {mx.default_device()}; mlx {mx.__version__}")
    print(f"{'context':>7} {'rows x tokens':>14} {'tokens':>6} {'ms':>7} {'x one block':>12} {'range ms':>13}")
    for r in rows:
        lo, hi = r["ms_range"]
        print(f"{r['context']:>7} {r['shape']:>14} {r['tokens']:>6} {r['ms']:7.2f} {r['x_one_block']:12.2f} "
              f"{f'{lo:.2f}-{hi:.2f}':>13}")
    if a.json_out:
        a.json_out.write_text(json.dumps(dict(argv=sys.argv[1:] if argv is None else list(argv),
                                              device=str(mx.default_device()), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
