"""What a DFlash draft forward costs per draft shape (layers x MLP width), side by side in one run.

For each shape a random draft for the target is built (as `flashfleet draft train` would make
it; optionally MLX-quantized like the shipped drafts) and one draft forward is timed alone after
a warm-up, exactly as `bench_dflash.per_cycle_alone` times it (B-1 drafts, one new context
position, argmax, one sync). Rounds repeat the shapes in turn so drift hits every shape alike;
the table gives the median and the range. Weights do not change the time, so random weights and
a config-only target directory are enough:

    python bench/bench_draft_shape.py --target MODEL_OR_CONFIG_DIR --random-weights \
        [--shapes 3x256 3x1024 4x1024] [--quantize-bits 4] [--block 16] [--reps 30] [--rounds 3]

Why: on the H200 a small draft is bound by kernel launches more than by bytes, so a wider MLP
should cost about nothing per cycle while a layer more costs its kernels; this measures it before
a training session spends its minutes on a bigger draft (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_shape(text: str) -> tuple[int, int]:
    """'3x1024' -> (3 layers, MLP width 1024)."""
    try:
        layers, width = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a shape is LAYERSxWIDTH, e.g. 3x1024") from None
    if layers < 1 or width < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: layers and width must be >= 1")
    return layers, width


def main(argv=None) -> int:
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    from bench.bench_dflash import load_model, per_cycle_alone
    from worker.capture import target_layers
    from worker.models.dflash import default_target_layer_ids
    from worker.models.dflash_checkpoint import init_dflash_draft, quantize_dflash_draft

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="model or config-only directory")
    ap.add_argument("--random-weights", action="store_true", help="the target's config with random weights")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--shapes", type=parse_shape, nargs="+", default=[(3, 256), (3, 1024), (4, 1024)],
                    metavar="LxI", help="draft shapes, LAYERSxMLP_WIDTH (default 3x256 3x1024 4x1024)")
    ap.add_argument("--num-taps", type=int, default=4)
    ap.add_argument("--quantize-bits", type=int, default=None, choices=(4, 8), help="as the shipped drafts: 4")
    ap.add_argument("--block", type=int, default=16, help="block size B (B-1 drafts per forward)")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens already in the caches")
    ap.add_argument("--reps", type=int, default=30, help="forwards per timing")
    ap.add_argument("--rounds", type=int, default=3, help="timings per shape, shapes in turn")
    a = ap.parse_args(argv)
    if a.block < 2 or a.context < 2 or a.reps < 1 or a.rounds < 1 or a.num_taps < 1:
        ap.error("--block and --context at least 2; --reps, --rounds and --num-taps at least 1")

    dtype = getattr(mx, a.dtype)
    target = load_model(a.target, a.random_weights, dtype, tokenizer=False)[0]
    taps = default_target_layer_ids(len(target_layers(target)), a.num_taps)
    drafts = {}
    for layers, width in a.shapes:
        d = init_dflash_draft(target, num_layers=layers, block_size=a.block, target_layer_ids=taps,
                              intermediate_size=width, seed=0, dtype=dtype)
        if a.quantize_bits:
            quantize_dflash_draft(d, a.quantize_bits)
        mx.eval(d.parameters())
        drafts[f"{layers}x{width}"] = d
    prompt = np.random.default_rng(0).integers(0, 1000, a.context).tolist()
    times: dict[str, list[float]] = {k: [] for k in drafts}
    verify = []
    for _ in range(a.rounds):
        for name, d in drafts.items():
            d_s, v_s = per_cycle_alone(target, d, prompt, a.block, a.reps)
            times[name].append(d_s * 1e3)
            verify.append(v_s * 1e3)
    print(f"target {a.target}{' (random weights)' if a.random_weights else ''} {a.dtype}; {mx.default_device()}; "
          f"B={a.block}, context {a.context}, taps {taps}, "
          f"{f'{a.quantize_bits}-bit drafts' if a.quantize_bits else 'unquantized drafts'}; "
          f"{a.rounds} rounds x {a.reps} forwards; verify of B tokens {statistics.median(verify):.2f} ms (median)")
    base = statistics.median(next(iter(times.values())))
    print("| draft (layers x MLP) | parameters | draft ms (median) | range | vs first |")
    print("|---|---|---|---|---|")
    for name, d in drafts.items():
        # Packed uint32 words of a quantized layer hold 32 / bits weights each; scales/biases are overhead.
        n = sum(v.size * (32 // a.quantize_bits if a.quantize_bits and v.dtype == mx.uint32 else 1)
                for k, v in tree_flatten(d.parameters()) if not k.endswith(("scales", "biases")))
        t = times[name]
        print(f"| {name} | {n / 1e6:.3g} M | {statistics.median(t):.2f} | {min(t):.2f}-{max(t):.2f} | "
              f"{statistics.median(t) / base:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
