"""Where a verify's extra time goes: the target's forward at B = 1 and B tokens, whole and with parts
taken out, timed as a DFlash cycle sees it.

`bench_layer_ops.py` times each operation alone, many independent copies per graph; summed, they
explain 1.6 ms of a B = 16 forward's 5.4 ms over B = 1 on the H200 (fifteenth session). This
times whole forwards instead, each variant at B = 1 and B:

    full        the target's forward over the padded KV cache (`PaddedKVCache`), additive mask
    taps        full, capturing 4 layers' hidden states as a DFlash verify does (`HiddenCapture`)
    taps-ahead  taps, each tapped layer's output queued (`mx.async_eval`) as soon as it is built,
                so the device runs the first layers while Python builds the rest (`HiddenCapture`
                `queue`; a verify's graph takes 2.6-3.0 ms to build on the H200, sixteenth session)
    compiled    full as one `mx.compile`d graph (`worker.compiled_forward.CompiledTarget`: traced
                once per shape, replayed from C++, elementwise chains fused)
    compiled-taps  compiled, capturing the taps as `taps` does
    no-mask     the same, no mask (B > 1 attends over the padded buffer unmasked: wrong output,
                the cost of building and applying the mask)
    exact       mlx-lm's own `KVCache` ("causal" mask, exact key length, constant here because
                each forward is trimmed back)
    no-attn     every layer's attention taken out (no projections, rope, cache or attention)
    no-mlp      every layer's MLP taken out
    norms+head  both taken out: embedding, norms, residuals and the LM head

and in three ways:

    synced   one forward per evaluation, waited for (a cycle's verify: one sync per cycle), ms
    queued   `--reps` forwards evaluated as one graph, per forward (launches overlap the GPU's work)
    build    the Python time to build one forward's graph, not evaluated, ms

The output of an ablated forward is meaningless; only its time is read. Weights do not change
times, so a config directory with `--random-weights` is enough:

    python bench/bench_verify_ablation.py --target MODEL_DIR [--block 16] [--context 256] \
        [--reps 20] [--rounds 3] [--no-fuse] [--json-out FILE]

Rounds alternate the variants' order; the table gives each cell's median round.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = ("full", "taps", "taps-ahead", "compiled", "compiled-taps", "no-mask", "exact", "no-attn", "no-mlp", "norms+head")


class _Skip:
    """Stands in for a layer's attention or MLP: returns its input (the residual then doubles it)."""

    def __call__(self, x, *args, **kwargs):
        return x


def _set_parts(layers, attn, mlp) -> None:
    for layer, a, m in zip(layers, attn, mlp):
        # Module.__setattr__ keeps Modules as dict items and other values as attributes, removing
        # the other kind: so both the swap and the restore take effect.
        layer.self_attn, layer.mlp = a, m


def variant_forward(model, variant: str, B: int, context: int):
    """(forward, restore): `forward()` builds one forward of B tokens over a KV cache holding
    `context` positions in `variant`'s form (module docstring) and returns its argmax ids (B,)
    uint32 (with "taps": and the taps, (1, B, 4 * D)), the cache trimmed back to `context`; `restore()` puts the model's parts back."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from worker.capture import HiddenCapture, target_layers
    from worker.compiled_forward import CompiledTarget
    from worker.spec.dflash import make_target_cache
    from worker.training.defaults import default_target_layer_ids

    layers = target_layers(model)
    attn, mlp = [layer.self_attn for layer in layers], [layer.mlp for layer in layers]
    cache = make_prompt_cache(model) if variant == "exact" else make_target_cache(model)
    mx.eval(model(mx.array([list(range(100, 100 + context))], dtype=mx.uint32), cache=cache))
    mx.eval([c.state for c in cache])
    if variant == "no-mask":
        for c in cache:
            c.make_mask = lambda *a, **k: None  # noqa: E731 - instance attribute: this cache only
    skip = _Skip()
    if variant in ("no-attn", "norms+head"):
        _set_parts(layers, [skip] * len(layers), mlp)
    if variant in ("no-mlp", "norms+head"):
        _set_parts(layers, [layer.self_attn for layer in layers], [skip] * len(layers))
    tokens = mx.array([[5] * B], dtype=mx.uint32)
    capture = (HiddenCapture(model, default_target_layer_ids(len(layers), 4), queue=variant == "taps-ahead")
               if variant.endswith(("taps", "taps-ahead")) else None)
    compiled = CompiledTarget(model, capture) if variant.startswith("compiled") else None

    def forward():
        if compiled is not None:
            logits, taps = compiled(tokens, cache)
            y = mx.argmax(logits[0], axis=-1)
            y = y if taps is None else (y, taps)
        elif capture is None:
            y = mx.argmax(model(tokens, cache=cache)[0], axis=-1)
        else:
            with capture:
                y = mx.argmax(model(tokens, cache=cache)[0], axis=-1)
            y = (y, capture.hidden())
        for c in cache:
            c.trim(B)
        return y

    return forward, lambda: _set_parts(layers, attn, mlp)


def time_cell(forward, reps: int) -> dict:
    """{"synced", "queued", "build"} ms per forward (module docstring), after two warm-up runs."""
    import mlx.core as mx

    for _ in range(2):
        mx.eval(forward())
    synced = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(forward())
        synced.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    mx.eval([forward() for _ in range(reps)])
    queued = (time.perf_counter() - t0) / reps
    t0 = time.perf_counter()
    built = [forward() for _ in range(reps)]
    build = (time.perf_counter() - t0) / reps
    mx.eval(built)
    return {"synced": statistics.median(synced) * 1e3, "queued": queued * 1e3, "build": build * 1e3}


def main(argv=None) -> int:
    import mlx.core as mx

    from bench.bench_dflash import load_model
    from worker.fusion import fuse_projections

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--random-weights", action="store_true", help="the target's config with random weights")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--block", type=int, default=16, help="the verify's block size B (compared with 1)")
    ap.add_argument("--context", type=int, default=256, help="positions already in the KV cache")
    ap.add_argument("--reps", type=int, default=20, help="forwards per cell")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; the table shows the median")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--no-fuse", action="store_true", help="keep q/k/v and gate/up as separate matmuls")
    ap.add_argument("--json-out")
    a = ap.parse_args(argv)
    if a.block < 2:
        ap.error("--block: 2 or more (it is compared with B = 1)")
    if a.context < 1 or a.reps < 1 or a.rounds < 1:
        ap.error("--context, --reps and --rounds: at least 1 each")

    model = load_model(a.target, a.random_weights, getattr(mx, a.dtype), tokenizer=False)[0]
    fused = 0 if a.no_fuse else fuse_projections(model)
    blocks = (1, a.block)
    cells = [(v, B) for v in a.variants for B in blocks]
    runs = {cell: [] for cell in cells}
    for r in range(a.rounds):
        for v, B in (reversed(cells) if r % 2 else cells):
            forward, restore = variant_forward(model, v, B, a.context)
            try:
                runs[(v, B)].append(time_cell(forward, a.reps))
            finally:
                restore()
    med = {cell: {k: statistics.median(t[k] for t in ts) for k in ("synced", "queued", "build")}
           for cell, ts in runs.items()}
    B = a.block
    print(f"target {a.target}{' (random weights)' if a.random_weights else ''} {a.dtype}; context {a.context}; "
          f"fused projection groups {fused}; {a.reps} forwards per cell, median of {a.rounds} rounds; "
          f"device {mx.default_device()}; mlx {mx.__version__}")
    print(f"{'variant':11s} {'synced B=1':>10s} {f'B={B}':>7s} {'extra':>6s}  {'queued B=1':>10s} {f'B={B}':>7s} "
          f"{'extra':>6s}  {'build B=1':>9s} {f'B={B}':>6s}   (ms per forward)")
    rows = []
    for v in a.variants:
        one, blk = med[(v, 1)], med[(v, B)]
        print(f"{v:11s} {one['synced']:10.2f} {blk['synced']:7.2f} {blk['synced'] - one['synced']:6.2f}  "
              f"{one['queued']:10.2f} {blk['queued']:7.2f} {blk['queued'] - one['queued']:6.2f}  "
              f"{one['build']:9.2f} {blk['build']:6.2f}")
        rows.append(dict(variant=v, b1=one, block=blk, rounds_b1=runs[(v, 1)], rounds_block=runs[(v, B)]))
    if "full" in a.variants:
        full = med[("full", B)]["synced"] - med[("full", 1)]["synced"]
        for v in a.variants:
            if v != "full":
                gone = full - (med[(v, B)]["synced"] - med[(v, 1)]["synced"])
                print(f"taking out {v}: the synced B={B} extra falls by {gone:.2f} of {full:.2f} ms")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(dict(target=a.target, block=B, context=a.context, reps=a.reps,
                                                    rounds=a.rounds, fused_groups=fused,
                                                    device=str(mx.default_device()), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
