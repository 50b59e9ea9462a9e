"""worker.small_attention against MLX's own attention on CUDA: error and time per call.

Two tables (CUDA only; docs/benchmarks.md, "Attention in one kernel"):
1. error: the largest deviation from a float32 reference (the same formula in float32 on the
   same inputs), over the reference's largest magnitude, for MLX's
   `mx.fast.scaled_dot_product_attention` (cuDNN for masked calls of 2+ queries) and for
   `small_attention` with its keys split as `splits` proposes (one block a query below 1,024
   keys), per (dtype, rows, queries, keys, heads); `ok` when ours is within 1.5x of MLX's own
   deviation or under 2e-3.
2. per call: a compiled chain of `--calls` dependent attention calls (each output is the next
   query, as a forward's layers depend on each other), host = time until `mx.async_eval`
   returned, total = until the results were ready, both per call, median of `--rounds`; for
   MLX's attention, `small_attention` in one block a query (`n_splits=1`, the worker's path)
   and with long contexts' keys split over blocks and merged (`splits` column: the policy
   `worker.small_attention.splits` proposes).

    python3 bench/bench_small_attention.py [--calls 28] [--rounds 5] [--json-out F]

The compiled verify as the worker runs it (cuBLAS / small_gemm / small_gemm + small_attention,
on three copies of a real target): `bench/bench_small_gemm.py --attention`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (rows, queries, keys, query heads, KV heads, head dim): the 1.5B target's verify (12/2 heads,
# 128) at 1 and 4 rows and three contexts, a one-token step, 64 queries, and the 0.5B's 14/2 x 64
CASES = [(1, 16, 272, 12, 2, 128), (1, 16, 1040, 12, 2, 128), (1, 16, 2064, 12, 2, 128),
         (1, 16, 4112, 12, 2, 128), (1, 16, 8208, 12, 2, 128), (4, 16, 1040, 12, 2, 128),
         (4, 16, 4112, 12, 2, 128), (1, 1, 1040, 12, 2, 128), (1, 1, 4112, 12, 2, 128),
         (1, 64, 1040, 12, 2, 128), (1, 16, 1040, 14, 2, 64)]


def _inputs(mx, B, L, S, H, Hkv, D, dtype):
    q = mx.random.normal((B, L, H, D)).astype(dtype).transpose(0, 2, 1, 3)  # as mlx-lm makes it
    k = mx.random.normal((1, Hkv, S, D)).astype(dtype)
    v = mx.random.normal((1, Hkv, S, D)).astype(dtype)
    visible = mx.arange(S)[None, :] <= (S - L + mx.arange(L))[:, None]  # the verify's causal tail
    mask = mx.where(visible, 0.0, float("-inf")).astype(dtype)
    return q, k, v, mask


def error_rows(cases, dtypes) -> list[dict]:
    import mlx.core as mx

    from worker.small_attention import small_attention, splits

    out = []
    for dt in dtypes:
        for B, L, S, H, Hkv, D in cases:
            q, k, v, mask = _inputs(mx, B, L, S, H, Hkv, D, dt)
            scale = D ** -0.5
            f = [a.astype(mx.float32) for a in (q, k, v, mask)]
            kf = mx.repeat(mx.broadcast_to(f[1], (B, Hkv, S, D)), H // Hkv, axis=1)
            vf = mx.repeat(mx.broadcast_to(f[2], (B, Hkv, S, D)), H // Hkv, axis=1)
            ref = mx.softmax(f[0] @ kf.transpose(0, 1, 3, 2) * scale + f[3], axis=-1) @ vf
            kb = mx.broadcast_to(k, (B, Hkv, S, D))
            vb = mx.broadcast_to(v, (B, Hkv, S, D))
            lib = mx.fast.scaled_dot_product_attention(q, kb, vb, scale=scale, mask=mask)
            ours = small_attention(q, k, v, scale, mask, n_splits=splits(B * Hkv * L, S))
            top = mx.abs(ref).max().item()
            e_lib = (mx.abs(lib.astype(mx.float32) - ref).max().item()) / top
            e_ours = (mx.abs(ours.astype(mx.float32) - ref).max().item()) / top
            out.append(dict(dtype=str(dt).split(".")[-1], rows=B, queries=L, keys=S, heads=H, kv_heads=Hkv,
                            head_dim=D, mlx=e_lib, small=e_ours, ok=e_ours <= max(1.5 * e_lib, 2e-3)))
    return out


def per_call_rows(cases, calls: int, rounds: int) -> list[dict]:
    import mlx.core as mx

    from worker.small_attention import small_attention, splits

    out = []
    for B, L, S, H, Hkv, D in cases:
        q, k, v, mask = _inputs(mx, B, L, S, H, Hkv, D, mx.bfloat16)
        kb, vb = mx.broadcast_to(k, (B, Hkv, S, D)), mx.broadcast_to(v, (B, Hkv, S, D))
        scale = D ** -0.5

        def chain_mlx(x):
            for _ in range(calls):
                x = mx.fast.scaled_dot_product_attention(x, kb, vb, scale=scale, mask=mask)
            return x

        def chain_small(x, n_splits):
            for _ in range(calls):
                x = small_attention(x, k, v, scale, mask, n_splits=n_splits)
            return x
        fns = {"mlx": mx.compile(chain_mlx), "one": mx.compile(lambda x: chain_small(x, 1)),
               "split": mx.compile(lambda x: chain_small(x, splits(B * Hkv * L, S)))}
        times = {n: ([], []) for n in fns}
        for r in range(rounds + 1):  # round 0 warms up (traces, kernel compiles)
            for name in (list(fns) if r % 2 else list(fns)[::-1]):
                t0 = time.perf_counter()
                y = fns[name](q)
                mx.async_eval(y)
                t1 = time.perf_counter()
                mx.eval(y)
                t2 = time.perf_counter()
                if r:
                    times[name][0].append((t1 - t0) / calls * 1e6)
                    times[name][1].append((t2 - t0) / calls * 1e6)
        out.append(dict(rows=B, queries=L, keys=S, heads=H, kv_heads=Hkv, head_dim=D, splits=splits(B * Hkv * L, S),
                        **{f"{n}_{w}_us": statistics.median(times[n][i]) for n in fns
                           for i, w in enumerate(("host", "total"))}))
    return out


def main(argv=None) -> int:
    import mlx.core as mx

    from worker.small_attention import available

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=28, help="dependent calls a compiled chain")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--skip", nargs="*", default=[], choices=["error", "call"])
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args(argv)
    if not available():
        print("bench_small_attention: needs MLX's CUDA backend (and FLASHFLEET_SMALL_ATTENTION not 0)",
              file=sys.stderr)
        return 2
    if min(a.calls, a.rounds) < 1:
        ap.error("--calls and --rounds >= 1")
    mx.random.seed(0)
    result = dict(device=str(mx.default_device()), mlx=mx.__version__)
    print(f"device {mx.default_device()}; mlx {mx.__version__}")
    if "error" not in a.skip:
        rows = result["error"] = error_rows(CASES, [mx.bfloat16, mx.float16])
        print("\nerror against float32 (max abs / max |ref|)")
        print(f"{'dtype':>8} {'rows':>4} {'L':>3} {'keys':>5} {'heads':>7} {'D':>4} {'mlx':>9} {'small':>9} ok")
        for r in rows:
            print(f"{r['dtype']:>8} {r['rows']:>4} {r['queries']:>3} {r['keys']:>5} "
                  f"{r['heads']:>3}/{r['kv_heads']:<3} {r['head_dim']:>4} {r['mlx']:9.2e} {r['small']:9.2e} "
                  f"{'ok' if r['ok'] else 'NO'}")
        print(f"all ok: {all(r['ok'] for r in rows)}")
    if "call" not in a.skip:
        rows = result["per_call"] = per_call_rows(CASES, a.calls, a.rounds)
        print(f"\nper call (a compiled chain of {a.calls} dependent calls, bf16, median of {a.rounds}): us")
        print(f"{'rows':>4} {'L':>3} {'keys':>5} {'heads':>7} {'D':>4} {'mlx host':>9} {'total':>7} "
              f"{'one host':>9} {'total':>7} {'splits':>6} {'host':>6} {'total':>7}")
        for r in rows:
            print(f"{r['rows']:>4} {r['queries']:>3} {r['keys']:>5} {r['heads']:>3}/{r['kv_heads']:<3} "
                  f"{r['head_dim']:>4} {r['mlx_host_us']:9.1f} {r['mlx_total_us']:7.1f} "
                  f"{r['one_host_us']:9.1f} {r['one_total_us']:7.1f} {r['splits']:>6} "
                  f"{r['split_host_us']:6.1f} {r['split_total_us']:7.1f}")
    if a.json_out:
        a.json_out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
