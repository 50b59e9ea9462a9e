"""One batched decode step of the worker's engine against mlx-lm's, at several batch sizes.

Per batch size B (rows holding `--context` tokens each), the mean milliseconds of:
  - ours plain     `worker.engine.batch.plain_step` on the engine's row caches (per-row lengths)
  - mlx-lm         the same forward on mlx-lm's `BatchKVCache` + argmax (what `batch_generate` runs)
  - build          of ours plain: the host's time to build the step's graph, before evaluation
  - dflash L=1/L=2 `dflash_cycle` with the model's DFlash draft at block size 1 (a plain step that
                   keeps the draft's context) and 2 (a draft forward + a 2-token verify), when
                   `--draft` is given
all in one process, interleaved over `--rounds` rounds (median), with OpenBLAS preloaded on a
Linux CPU as workers run. It measures the engine's step alone: the gap between this and a
cluster's throughput is scheduling and streaming.

`--kernels` measures instead what the worker's load-time layer changes do to these batched
forwards: per batch size, the plain step and (with `--draft`) a DFlash iteration at block
`--block`, on copies of the target with its layers as loaded, with fused projections
(`worker/fusion.py`), and fused with small_gemm (`worker/small_gemm.py`, CUDA only).

Usage:
  python bench/bench_batch_step.py --model SmolLM2-135M-Instruct --draft dflash --batch 1,4,8
  python bench/bench_batch_step.py --model DIR --draft DRAFT --batch 1,8,16 --kernels --block 16
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _time(fn, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1000


def measure(model_dir: Path, draft_dir: Path | None, batches: list[int], context: int, reps: int,
            rounds: int) -> list[dict]:
    """Rows of the table: {"batch", "ours", "mlx_lm", "build", "dflash_1", "dflash_2"} in ms."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from worker.caches.rows import RowKVCache, make_row_caches
    from worker.capture import HiddenCapture
    from worker.engine.batch import Batch, Row, choose, dflash_cycle, plain_step
    from worker.loading import load_target
    from worker.models.dflash_checkpoint import load_dflash_draft
    from worker.sampling import greedy

    model, _ = load_target(model_dir)
    draft = load_dflash_draft(draft_dir, model) if draft_dir else None
    capture = HiddenCapture(model, draft.target_layer_ids) if draft else None
    prompt = lambda B: mx.full((B, context), 5, mx.uint32)  # noqa: E731
    rows = []
    for B in batches:
        ours = Batch(make_row_caches(model, B), rows=[Row(greedy, context + 1, 5) for _ in range(B)])
        model(prompt(B), cache=ours.target)
        theirs = [BatchKVCache([0] * B) for _ in range(len(model.layers))]
        model(prompt(B), cache=theirs)
        spec = None
        if draft is not None:
            spec = Batch(make_row_caches(model, B), [RowKVCache(B) for _ in draft.layers], pending_len=[0] * B,
                         rows=[Row(greedy, context + 1, 5) for _ in range(B)])
            model(prompt(B), cache=spec.target)
        mx.eval([c.state for c in ours.target + theirs + (spec.caches if spec else [])])
        y = mx.zeros((B, 1), mx.uint32)

        def mlx_step():
            out = mx.argmax(model(y, cache=theirs)[:, -1:], -1)
            mx.eval(out)
            out.tolist()

        def build():
            ours.reserve(1)
            x = mx.array([[r.last] for r in ours.rows], dtype=mx.uint32)
            t0 = time.perf_counter()
            out = choose(model(x, cache=ours.target)[:, -1:, :], ours.rows)
            built = time.perf_counter() - t0
            mx.eval(out)
            return built * 1000

        steps = {"ours": lambda: plain_step(model, ours), "mlx_lm": mlx_step}
        if spec is not None:
            steps["dflash_1"] = lambda: dflash_cycle(model, draft, capture, spec, 1)
            steps["dflash_2"] = lambda: dflash_cycle(model, draft, capture, spec, 2)
        for fn in steps.values():  # warm-up
            fn()
        samples: dict[str, list[float]] = {k: [] for k in [*steps, "build"]}
        for _ in range(rounds):
            for name, fn in steps.items():
                samples[name].append(_time(fn, reps))
            samples["build"].append(statistics.mean(build() for _ in range(reps)))
        rows.append({"batch": B, **{k: statistics.median(v) for k, v in samples.items()}})
    return rows


def measure_kernels(model_dir: Path, draft_dir: Path | None, batches: list[int], context: int, reps: int,
                    rounds: int, block: int) -> list[dict]:
    """Rows {"batch", "variant", "plain", "dflash"} in ms: the engine's plain step and DFlash
    iteration at block `block` (rows of `context` positions, rolled back after each iteration,
    its pending taps dropped) on target copies with the worker's load-time layer changes
    (`variants`), interleaved over `rounds` rounds of `reps` (median)."""

    from worker import small_gemm
    from worker.capture import HiddenCapture
    from worker.engine.batch import dflash_cycle, plain_step
    from worker.engine.warm import dummy_batch
    from worker.fusion import fuse_projections
    from worker.loading import load_target
    from worker.models.dflash_checkpoint import load_dflash_draft

    variants = ["as loaded", "fused"] + (["fused + small_gemm"] if small_gemm.available() else [])
    models = {}
    for v in variants:
        model, _ = load_target(model_dir)
        if v != "as loaded":
            fuse_projections(model)
        draft = load_dflash_draft(draft_dir, model) if draft_dir else None
        if v == "fused + small_gemm":
            small_gemm.use_small_gemm(model)
            if draft is not None:
                small_gemm.use_small_gemm(draft)
        models[v] = (model, draft, HiddenCapture(model, draft.target_layer_ids) if draft else None)
    rows = []
    for B in batches:
        steps = {}
        for v, (model, draft, capture) in models.items():
            plain = dummy_batch(model, B, context)
            steps[(v, "plain")] = lambda m=model, b=plain: plain_step(m, b)
            if draft is not None:
                spec = dummy_batch(model, B, context, draft, capture)

                def cycle(m=model, d=draft, c=capture, b=spec):
                    dflash_cycle(m, d, c, b, block)
                    for cache in b.caches:  # back to the context: every iteration alike
                        cache.set_lengths([context] * B)
                    b.pending, b.pending_len = None, [0] * B
                steps[(v, "dflash")] = cycle
        for fn in steps.values():  # warm-up
            fn()
        samples: dict = {k: [] for k in steps}
        for _ in range(rounds):
            for k, fn in steps.items():
                samples[k].append(_time(fn, reps))
        for v in models:
            rows.append({"batch": B, "variant": v, "plain": statistics.median(samples[(v, "plain")]),
                         "dflash": statistics.median(samples[(v, "dflash")]) if (v, "dflash") in samples else None})
    return rows


def format_kernels(rows: list[dict], block: int) -> str:
    base = {r["batch"]: r for r in rows if r["variant"] == "as loaded"}
    lines = [f"| batch | layers | plain ms | x as loaded | DFlash L={block} ms | x as loaded |", "|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        b = base[r["batch"]]
        d = "-" if r["dflash"] is None else f"{r['dflash']:.2f} | {r['dflash'] / b['dflash']:.2f}"
        lines.append(f"| {r['batch']} | {r['variant']} | {r['plain']:.2f} | {r['plain'] / b['plain']:.2f} | "
                     + (d if r["dflash"] is not None else "- | -") + " |")
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    cols = [c for c in ("ours", "mlx_lm", "build", "dflash_1", "dflash_2") if c in rows[0]]
    head = "| batch | " + " | ".join(f"{c} ms" for c in cols) + " | ours / mlx-lm |"
    lines = [head, "|---:|" + "---:|" * (len(cols) + 1)]
    for r in rows:
        lines.append(f"| {r['batch']} | " + " | ".join(f"{r[c]:.1f}" for c in cols)
                     + f" | {r['ours'] / r['mlx_lm']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="catalog name or model directory")
    p.add_argument("--draft", default=None, help="a DFlash draft directory, or 'dflash' for the shipped one")
    p.add_argument("--batch", default="1,4,8", help="batch sizes, comma-separated")
    p.add_argument("--context", type=int, default=300, help="tokens each row holds")
    p.add_argument("--reps", type=int, default=10, help="steps per timing")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    p.add_argument("--kernels", action="store_true",
                   help="compare the target's layers as loaded, fused, and fused with small_gemm (CUDA)")
    p.add_argument("--block", type=int, default=16, help="DFlash block size of --kernels")
    a = p.parse_args(argv)
    from flashfleet.blas import restart_with_openblas
    from flashfleet.models import resolve_model

    restart_with_openblas()  # on a Linux CPU, the BLAS a worker computes with
    from flashfleet.models.drafts import resolve_draft_arg

    model_dir = Path(resolve_model(a.model))
    draft = resolve_draft_arg(a.draft, a.model)
    if a.kernels:
        import mlx.core as mx

        rows = measure_kernels(model_dir, Path(draft) if draft else None, [int(b) for b in a.batch.split(",")],
                               a.context, a.reps, a.rounds, a.block)
        print(f"model {model_dir}; device {mx.default_device()}; context {a.context}; {a.reps} steps x "
              f"{a.rounds} rounds (median)")
        print(format_kernels(rows, a.block))
        return 0
    rows = measure(model_dir, Path(draft) if draft else None, [int(b) for b in a.batch.split(",")],
                   a.context, a.reps, a.rounds)
    print(f"model {model_dir}; context {a.context}; {a.reps} steps x {a.rounds} rounds (median)")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
