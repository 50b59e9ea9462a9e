"""A target forward of B tokens, queued back to back vs synchronised after each, side by side.

A plain generation loop queues step n+1 while the device runs step n (`mx.async_eval`), so the
host's graph building and kernel launches overlap the device's work; a speculative cycle must
read its verdict back before it can build the next cycle, so it pays a host sync per cycle.
For each B this times `steps` forwards of B tokens over a `--context`-token KV cache (trimmed
back after each, so every forward sees the same cache length) in both ways:

    queued  every forward's argmax is queued with mx.async_eval, one sync at the end
    synced  mx.eval after every forward (what a verify inside a DFlash cycle waits for)

`queued` B = 1 is a plain decoding step as mlx-lm's loop runs it; queued B = 16 against it is
what a verify would cost if the host never waited; `synced` - `queued` is the price of the sync.
On a launch-bound GPU (small models on the H200, docs/benchmarks.md) the gap is the host work
that a cycle cannot hide. Weights do not change the times, so `--random-weights` is enough.

`--caches` times the same forwards over other KV caches, side by side in one run (each cell
alternates the order): `mlx` is mlx-lm's `KVCache` (exact key length, the "causal" mask);
`padded` is the `PaddedKVCache` a DFlash verify uses (key length per 256 positions, an additive
mask made once per forward); `padded-bool` the same with the boolean mask it used before, which
MLX's CUDA attention converts in every layer. `--taps N` captures N target layers as a verify
does (`HiddenCapture`, layers spread as a draft's taps):

    python bench/bench_forward_queue.py --target MODEL_OR_CONFIG_DIR [--random-weights] \
        [--blocks 1 2 4 8 16] [--context 256] [--steps 60] [--rounds 1] \
        [--caches mlx padded padded-bool] [--taps 4]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WARMUP = 5  # forwards before the clock starts (kernel compiles, buffer allocation)


CACHES = ("mlx", "padded", "padded-bool")


def make_cache(model, kind: str) -> list:
    """An empty prompt cache of `kind` (one of CACHES) for `model`."""
    from mlx_lm.models.cache import make_prompt_cache

    from worker.spec.dflash import make_target_cache

    return make_prompt_cache(model) if kind == "mlx" else make_target_cache(model)


def time_forwards(model, cache, B: int, steps: int, synced: bool, capture=None,
                  additive: bool = True) -> float:
    """Mean wall time of one forward of B tokens, ms, over `steps` forwards after `WARMUP`.

    Args:
        model: an mlx-lm model; cache: its prompt cache, already holding the context (every
            layer trimmable); each forward's B positions are trimmed off again.
        synced: mx.eval after each forward; else each is queued with mx.async_eval and the
            host syncs once at the end.
        capture: a `worker.capture.HiddenCapture` to record taps with (they are evaluated with
            the argmax, as a verify's are), or None.
        additive: `PaddedKVCache.additive` while timing (False: boolean masks).
    """
    import mlx.core as mx

    from worker.models.dflash import PaddedKVCache

    x = mx.array([[5] * B], dtype=mx.uint32)
    outs, t0 = [], 0.0
    was, PaddedKVCache.additive = PaddedKVCache.additive, additive
    try:
        for i in range(WARMUP + steps):
            if i == WARMUP:
                mx.eval(outs)
                outs, t0 = [], time.perf_counter()
            if capture is None:
                y = mx.argmax(model(x, cache=cache)[:, -1], axis=-1)
            else:
                with capture:
                    logits = model(x, cache=cache)
                y = [mx.argmax(logits[0], axis=-1), capture.hidden()]
            for c in cache:
                c.trim(B)
            if synced:
                mx.eval(y)
            else:
                mx.async_eval(y)
                outs.append(y)
        mx.eval(outs)
    finally:
        PaddedKVCache.additive = was
    return (time.perf_counter() - t0) / steps * 1e3


def main(argv=None) -> int:
    import mlx.core as mx

    from bench.bench_dflash import load_model
    from worker.capture import HiddenCapture, target_layers
    from worker.models.dflash import default_target_layer_ids, takes_additive_masks

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--random-weights", action="store_true", help="the target's config with random weights")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--context", type=int, default=256, help="tokens already in the KV cache")
    ap.add_argument("--steps", type=int, default=60, help="timed forwards per cell")
    ap.add_argument("--rounds", type=int, default=1, help="measure every block size this many times (noise)")
    ap.add_argument("--caches", nargs="+", default=["mlx"], choices=CACHES,
                    help="KV caches to time side by side (default: mlx-lm's KVCache only)")
    ap.add_argument("--taps", type=int, default=0,
                    help="capture this many target layers per forward, as a DFlash verify does")
    ap.add_argument("--json-out")
    a = ap.parse_args(argv)
    if min(a.blocks) < 1:
        ap.error("--blocks: sizes >= 1")
    if a.context < 1 or a.steps < 1 or a.rounds < 1:
        ap.error("--context, --steps and --rounds: at least 1 each")
    if a.taps < 0:
        ap.error("--taps: 0 or more")

    model = load_model(a.target, a.random_weights, getattr(mx, a.dtype), tokenizer=False)[0]
    n_layers = len(target_layers(model))
    if a.taps > max(1, n_layers - 3):
        ap.error(f"--taps: at most {max(1, n_layers - 3)} for this {n_layers}-layer target")
    capture = HiddenCapture(model, default_target_layer_ids(n_layers, a.taps)) if a.taps else None
    caches = {}
    for kind in dict.fromkeys(a.caches):
        try:
            cache = make_cache(model, kind)
        except ValueError as e:  # a cache of some layer cannot be trimmed
            print(f"bench_forward_queue: {kind}: {e}", file=sys.stderr)
            return 2
        if not all(c.is_trimmable() for c in cache):
            print("bench_forward_queue: the target's cache cannot be trimmed", file=sys.stderr)
            return 2
        mx.eval(model(mx.array([list(range(100, 100 + a.context))], dtype=mx.uint32), cache=cache))
        mx.eval([c.state for c in cache])
        caches[kind] = cache
    print(f"target {a.target}{' (random weights)' if a.random_weights else ''} {a.dtype}; context {a.context}; "
          f"{a.steps} forwards per cell; taps {a.taps}; padded masks "
          f"{'additive' if takes_additive_masks(model) else 'boolean (not in ADDITIVE_MASK_MODELS)'}; "
          f"device {mx.default_device()}; mlx {mx.__version__}")
    print("  B  round  cache        queued ms  synced ms  sync cost ms")
    rows = []
    for r in range(a.rounds):
        for B in a.blocks:
            cells = [(kind, synced) for kind in caches for synced in (False, True)]
            if r % 2:  # alternate the order inside a cell between rounds
                cells.reverse()
            ms = {}
            for kind, synced in cells:
                ms[kind, synced] = time_forwards(model, caches[kind], B, a.steps, synced, capture,
                                                 additive=kind != "padded-bool")
            for kind in caches:
                q, s = ms[kind, False], ms[kind, True]
                rows.append(dict(B=B, round=r, cache=kind, queued_ms=q, synced_ms=s))
                print(f"{B:3d}  {r:5d}  {kind:11s}  {q:9.2f}  {s:9.2f}  {s - q:12.2f}", flush=True)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(dict(target=a.target, context=a.context, steps=a.steps,
                                                    taps=a.taps, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
