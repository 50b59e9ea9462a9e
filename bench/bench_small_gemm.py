"""worker.small_gemm against MLX's own matmuls (cuBLASLt), on CUDA: exactness, per-call cost, forwards.

Three tables, one process, the two paths side by side:

1. error: for the target's linear shapes (and a few odd ones) and row counts 1..64, the largest
   deviation of each path from a float32 reference, over the reference's largest magnitude;
   `ok` when small_gemm's is at most twice cuBLAS's plus 1e-3.
2. per call: --calls independent calls of one shape in one graph; `host us` the time to build
   and hand them over (`mx.async_eval` returns), `total us` until they are done, per call.
3. forward: the target's forward as the batched engine runs it (fused projections, row KV caches
   of --context positions, K rows of L tokens, argmax per row) on two copies of the target, one
   with its linears on small_gemm; synced ms per forward and the host's hand-over ms, median of
   --rounds interleaved rounds of --reps.

    python bench/bench_small_gemm.py --target MODEL_OR_CONFIG_DIR [--random-weights] \
        [--context 256] [--reps 30] [--rounds 5] [--calls 56] [--json-out F]

Needs MLX's CUDA backend (exits 2 with one line elsewhere).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def error_rows(shapes, rows_list, dtypes) -> list[dict]:
    """Deviation of cuBLAS and small_gemm from a float32 reference, per (dtype, N, K, bias, rows)."""
    import mlx.core as mx

    from worker.small_gemm import small_gemm

    out = []
    for dt in dtypes:
        for N, K, bias in shapes:
            w = (mx.random.normal((N, K)) * K ** -0.5).astype(dt)
            b = mx.random.normal((N,)).astype(dt) if bias else None
            for M in rows_list:
                x = mx.random.normal((M, K)).astype(dt)
                ref = x.astype(mx.float32) @ w.astype(mx.float32).T
                mine = small_gemm(x, w, b)
                lib = x @ w.T if b is None else mx.addmm(b, x, w.T)
                if b is not None:
                    ref = ref + b.astype(mx.float32)
                scale = mx.abs(ref).max()
                e_lib = (mx.abs(lib.astype(mx.float32) - ref).max() / scale).item()
                e_mine = (mx.abs(mine.astype(mx.float32) - ref).max() / scale).item()
                out.append(dict(dtype=str(dt).split(".")[-1], N=N, K=K, bias=bias, rows=M, cublas=e_lib,
                                small=e_mine, ok=e_mine <= 2 * e_lib + 1e-3))
    return out


def per_call_rows(shapes, rows_list, calls: int, reps: int) -> list[dict]:
    """Host and total microseconds per call of each path, `calls` independent calls a graph."""
    import mlx.core as mx

    from worker.small_gemm import small_gemm

    out = []
    for N, K, bias in shapes:
        w = (mx.random.normal((N, K)) * K ** -0.5).astype(mx.bfloat16)
        b = mx.random.normal((N,)).astype(mx.bfloat16) if bias else None
        for M in rows_list:
            xs = [mx.random.normal((M, K)).astype(mx.bfloat16) for _ in range(calls)]
            mx.eval(w, xs, *([] if b is None else [b]))
            paths = {"cublas": (lambda x: x @ w.T) if b is None else (lambda x: mx.addmm(b, x, w.T)),
                     "small": lambda x: small_gemm(x, w, b)}
            got = {p: ([], []) for p in paths}
            for r in range(reps + 1):  # the first round warms up (kernel compiles)
                for p, fn in paths.items():
                    t0 = time.perf_counter()
                    ys = [fn(x) for x in xs]
                    mx.async_eval(ys)
                    t1 = time.perf_counter()
                    mx.eval(ys)
                    t2 = time.perf_counter()
                    if r:
                        got[p][0].append((t1 - t0) / calls * 1e6)
                        got[p][1].append((t2 - t0) / calls * 1e6)
            row = dict(N=N, K=K, bias=bias, rows=M)
            for p, (host, total) in got.items():
                row[f"{p}_host_us"], row[f"{p}_total_us"] = statistics.median(host), statistics.median(total)
            out.append(row)
    return out


def forward_rows(path: str, random_weights: bool, context: int, shapes, reps: int, rounds: int) -> list[dict]:
    """Synced and hand-over ms per target forward on two target copies (cuBLAS, small_gemm): K rows
    of L tokens over row caches (`worker.caches.rows`) holding `context` positions a row,
    rolled back after every forward, as the batched engine verifies."""
    import mlx.core as mx
    import numpy as np

    from bench.bench_dflash import load_model
    from worker.caches.rows import RowKVCache, make_row_caches
    from worker.fusion import fuse_projections
    from worker.small_gemm import use_small_gemm

    rng = np.random.default_rng(0)
    prompt = mx.array([rng.integers(0, 1000, context).tolist()], dtype=mx.uint32)
    setups, weights = {}, None
    names = ("cublas", "small")
    for name in names:
        model = load_model(path, random_weights, mx.bfloat16, tokenizer=False)[0]
        if random_weights:  # the same random weights in both copies
            weights = weights or model.parameters()
            model.update(weights)
        fuse_projections(model)
        if name != "cublas":
            print(f"small gemm: {use_small_gemm(model)} linears", flush=True)
        one = make_row_caches(model, 1)
        mx.eval(model(prompt, cache=one))
        rows = {}
        for K, L in shapes:
            caches = [RowKVCache(0) for _ in one]
            for c, o in zip(caches, one):
                for _ in range(K):
                    c.extend(o)
                c.reserve(L)
            mx.eval([c.state for c in caches])
            rows[K, L] = caches
        setups[name] = (model, rows)

    def forward(model, caches, x):
        y = mx.argmax(model(x, cache=caches), axis=-1)
        for c in caches:  # roll back: the next forward writes the same positions
            c.set_lengths([context] * x.shape[0])
        return y

    times = {(name, s): ([], []) for name in setups for s in shapes}
    agree = {}
    for r in range(rounds + 1):  # round 0 warms up: kernels
        for s in (shapes if r % 2 else shapes[::-1]):
            K, L = s
            x = mx.array(rng.integers(0, 1000, (K, L)).tolist(), dtype=mx.uint32)
            outs = {}
            for name in (names if r % 2 else names[::-1]):
                model, rows = setups[name]
                caches = rows[s]
                outs[name] = forward(model, caches, x)
                mx.eval(outs[name])
                t_host = t_all = 0.0
                for _ in range(reps):
                    t0 = time.perf_counter()
                    y = forward(model, caches, x)
                    mx.async_eval(y)
                    t1 = time.perf_counter()
                    mx.eval(y)
                    t_host, t_all = t_host + t1 - t0, t_all + time.perf_counter() - t0
                if r:
                    times[name, s][0].append(t_host / reps * 1e3)
                    times[name, s][1].append(t_all / reps * 1e3)
            a = np.array(outs["cublas"])
            agree.setdefault(s, []).append(float((a == np.array(outs["small"])).mean()))
    out = []
    for s in shapes:
        base = statistics.median(times["cublas", s][1])
        for name in setups:
            host, total = times[name, s]
            out.append(dict(rows=s[0], tokens=s[1], path=name, ms=statistics.median(total),
                            ms_range=[min(total), max(total)], host_ms=statistics.median(host),
                            x_cublas=statistics.median(total) / base, argmax_agree=min(agree[s])))
    return out


def main(argv=None) -> int:
    import mlx.core as mx

    from worker.small_gemm import available

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="mlx-lm model directory (or a config dir with --random-weights)")
    ap.add_argument("--random-weights", action="store_true")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=56, help="calls per graph in the per-call table")
    ap.add_argument("--skip", nargs="*", default=[], choices=["error", "call", "forward"])
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args(argv)
    if not available():
        print("bench_small_gemm: needs MLX's CUDA backend (and FLASHFLEET_SMALL_GEMM not 0)", file=sys.stderr)
        return 2
    if a.context < 2 or min(a.reps, a.rounds, a.calls) < 1:
        ap.error("--context >= 2; --reps, --rounds, --calls >= 1")
    mx.random.seed(0)
    config = json.loads((Path(a.target) / "config.json").read_text())
    D, F = config["hidden_size"], config["intermediate_size"]
    hd = config.get("head_dim") or D // config["num_attention_heads"]
    qkv = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * hd
    layer_shapes = [(qkv, D, True), (D, D, False), (2 * F, D, False), (D, F, False)]
    result = dict(device=str(mx.default_device()), mlx=mx.__version__, target=a.target)
    print(f"target {a.target}; device {mx.default_device()}; mlx {mx.__version__}; shapes (N, K, bias) {layer_shapes}")
    if "error" not in a.skip:
        rows = result["error"] = error_rows(layer_shapes + [(8, 64, True), (40, 576, False)], [1, 3, 16, 17, 64],
                                            [mx.bfloat16, mx.float16])
        print("\nerror against float32 (max abs / max |ref|)")
        print(f"{'dtype':>8} {'N':>6} {'K':>5} {'bias':>4} {'rows':>4} {'cublas':>9} {'small':>9} ok")
        for r in rows:
            print(f"{r['dtype']:>8} {r['N']:>6} {r['K']:>5} {int(r['bias']):>4} {r['rows']:>4} "
                  f"{r['cublas']:9.2e} {r['small']:9.2e} {'ok' if r['ok'] else 'NO'}")
        print(f"all ok: {all(r['ok'] for r in rows)}")
    if "call" not in a.skip:
        rows = result["per_call"] = per_call_rows(layer_shapes, [1, 16, 64], a.calls, a.rounds)
        print(f"\nper call ({a.calls} calls a graph, median of {a.rounds}): us")
        print(f"{'N':>6} {'K':>5} {'bias':>4} {'rows':>4} {'cublas host':>11} {'total':>7} {'small host':>10} {'total':>7}")
        for r in rows:
            print(f"{r['N']:>6} {r['K']:>5} {int(r['bias']):>4} {r['rows']:>4} {r['cublas_host_us']:11.1f} "
                  f"{r['cublas_total_us']:7.1f} {r['small_host_us']:10.1f} {r['small_total_us']:7.1f}")
    if "forward" not in a.skip:
        shapes = [(1, 1), (1, 16), (4, 16)]
        rows = result["forward"] = forward_rows(a.target, a.random_weights, a.context, shapes, a.reps, a.rounds)
        print(f"\nforward (row caches, context {a.context}, median of {a.rounds} rounds of {a.reps}): ms")
        print(f"{'rows':>4} {'tokens':>6} {'path':>7} {'ms':>7} {'host ms':>8} {'x cublas':>9} {'range':>13} argmax agree")
        for r in rows:
            lo, hi = r["ms_range"]
            print(f"{r['rows']:>4} {r['tokens']:>6} {r['path']:>7} {r['ms']:7.2f} {r['host_ms']:8.2f} "
                  f"{r['x_cublas']:9.2f} {f'{lo:.2f}-{hi:.2f}':>13} {r['argmax_agree']:.3f}")
    if a.json_out:
        a.json_out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
