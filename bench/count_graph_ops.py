"""Operations in the graph of one DFlash cycle's pieces, counted before they run.

On a launch-bound GPU (small models on the H200: docs/benchmarks.md, h200-costs.md) a forward
costs about its number of kernels times the launch cost, so the operations a cycle adds around
the model's own forward matter as much as bytes. This builds, without evaluating, the graph of

    forward      the target's forward of B tokens over mlx-lm's KVCache (argmax of the last row)
    verify       the cycle's verify: B tokens over the padded cache, taps captured, argmax of
                 every row (worker/spec/dflash.py)
    verify-bool  the same with boolean masks (how it was before `additive_mask`)
    step         a plain decode step: one token over the padded cache, taps captured
    draft        the draft's block of B over its padded context cache, with B pending taps
    verify-fused, step-fused
                 verify and step again after `worker.fusion.fuse_projections` (one matmul for
                 q/k/v and one for gate/up per layer, as the worker loads its models)

exports each with `mx.export_to_dot` and counts its primitive nodes: `ops` are all of them,
`views` those that usually launch nothing (broadcast, reshape, transpose, slice, ...; an
approximation: a view that must be copied later shows up as a Copy). Which primitives appear
depends on the device of the default stream: on the CPU attention is decomposed into matmul,
softmax and friends, on a GPU it is one fused node (plus, with a boolean mask on CUDA, the
conversion MLX adds per layer). Random weights are enough (the graph does not depend on them):

    python bench/count_graph_ops.py --target MODEL_OR_CONFIG_DIR [--random-weights] \\
        [--block 16] [--context 256] [--draft-layers 3] [--taps 4] [--json-out F]
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Primitives that reshape or re-stride without a kernel of their own (in MLX's CPU and GPU backends).
VIEW_OPS = frozenset({"Broadcast", "BroadcastAxes", "Reshape", "Transpose", "Slice", "ExpandDims",
                      "Squeeze", "AsStrided", "Flatten", "Unflatten", "StopGradient", "Depends"})


def count_ops(*outputs) -> collections.Counter:
    """Primitive name -> number of nodes in the unevaluated graph behind `outputs` (mx.arrays)."""
    import mlx.core as mx

    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        text = Path(f.name).read_text()
    return collections.Counter(re.findall(r'\[label ="([A-Za-z0-9_]+)', text))


def summarize(ops: collections.Counter) -> dict:
    """{'ops', 'views', 'kernels' (ops - views), 'top': the 6 commonest non-view primitives}."""
    views = sum(n for name, n in ops.items() if name in VIEW_OPS)
    total = sum(ops.values())
    top = [(name, n) for name, n in ops.most_common() if name not in VIEW_OPS][:6]
    return dict(ops=total, views=views, kernels=total - views, top=top)


def main(argv=None) -> int:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from bench.bench_dflash import load_model
    from worker.capture import HiddenCapture, target_layers
    from worker.models.dflash import PaddedKVCache, default_target_layer_ids, takes_additive_masks
    from worker.models.dflash_checkpoint import init_dflash_draft
    from worker.spec.dflash import make_target_cache

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--random-weights", action="store_true", help="the target's config with random weights")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--block", type=int, default=16, help="tokens per verify / draft block (>= 2)")
    ap.add_argument("--context", type=int, default=256, help="tokens already in the KV caches")
    ap.add_argument("--draft-layers", type=int, default=3)
    ap.add_argument("--taps", type=int, default=4, help="target layers the draft reads")
    ap.add_argument("--json-out")
    a = ap.parse_args(argv)
    if a.block < 2 or a.context < 1 or a.draft_layers < 1 or a.taps < 1:
        ap.error("--block >= 2, --context, --draft-layers and --taps >= 1")

    model = load_model(a.target, a.random_weights, getattr(mx, a.dtype), tokenizer=False)[0]
    n_layers = len(target_layers(model))
    if a.taps > max(1, n_layers - 3):
        ap.error(f"--taps: at most {max(1, n_layers - 3)} for this {n_layers}-layer target")
    taps_ids = default_target_layer_ids(n_layers, a.taps)
    draft = init_dflash_draft(model, num_layers=a.draft_layers, block_size=a.block,
                              target_layer_ids=taps_ids, seed=0, dtype=getattr(mx, a.dtype))
    capture = HiddenCapture(model, taps_ids)
    context = mx.array([list(range(100, 100 + a.context))], dtype=mx.uint32)
    block = mx.array([[5] * a.block], dtype=mx.uint32)

    mlx_cache, padded = make_prompt_cache(model), make_target_cache(model)
    for cache in (mlx_cache, padded):
        mx.eval(model(context, cache=cache), [c.state for c in cache])
    draft_cache = draft.make_cache()
    with capture:
        mx.eval(model(context, cache=make_prompt_cache(model)))
    ctx_taps = capture.hidden()
    draft.extend_context(ctx_taps, draft_cache)
    mx.eval(ctx_taps, [c.state for c in draft_cache])
    pending = ctx_taps[:, -a.block:]

    def verify(x, cache):
        with capture:
            logits = model(x, cache=cache)
        return [mx.argmax(logits[0], axis=-1), capture.hidden()]

    def counted(outputs: list, cache: list, n: int) -> collections.Counter:
        # Count, then run it: the next graph must not include this one's cache updates.
        ops = count_ops(*outputs)
        mx.eval(outputs, [c.state for c in cache])
        for c in cache:
            c.trim(n)
        return ops

    # One forward of each first, so the caches have grown to their next bucket (growing adds a Full
    # and a Concatenate per layer, which the cycles between buckets do not pay).
    counted(verify(block, padded), padded, a.block)
    counted([model(block, cache=mlx_cache)], mlx_cache, a.block)
    graphs = {}
    graphs["forward"] = counted([mx.argmax(model(block, cache=mlx_cache)[:, -1], axis=-1)], mlx_cache, a.block)
    graphs["verify"] = counted(verify(block, padded), padded, a.block)
    PaddedKVCache.additive = False
    try:
        graphs["verify-bool"] = counted(verify(block, padded), padded, a.block)
    finally:
        PaddedKVCache.additive = True
    graphs["step"] = counted(verify(block[:, :1], padded), padded, 1)
    graphs["draft"] = counted([draft.draft_tokens(draft(block, pending, draft_cache)[0])], draft_cache, 0)
    from worker.fusion import fuse_projections

    fused_groups = fuse_projections(model)  # last: it changes the model in place
    graphs["verify-fused"] = counted(verify(block, padded), padded, a.block)
    graphs["step-fused"] = counted(verify(block[:, :1], padded), padded, 1)

    print(f"target {a.target}{' (random weights)' if a.random_weights else ''} {a.dtype}, {n_layers} layers; "
          f"block {a.block}; context {a.context}; draft {a.draft_layers} layers, taps {taps_ids}; "
          f"additive masks {'yes' if takes_additive_masks(model) else 'no (not in ADDITIVE_MASK_MODELS)'}; "
          f"fused projection groups {fused_groups}; "
          f"device {mx.default_device()}; mlx {mx.__version__}")
    print(f"{'graph':12s} {'ops':>6s} {'views':>6s} {'kernels':>8s}  commonest kernels")
    rows = {}
    for name, ops in graphs.items():
        s = rows[name] = summarize(ops)
        top = ", ".join(f"{k} {n}" for k, n in s["top"])
        print(f"{name:12s} {s['ops']:6d} {s['views']:6d} {s['kernels']:8d}  {top}")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(dict(target=a.target, block=a.block, context=a.context,
                                                    device=str(mx.default_device()), rows=rows,
                                                    ops={k: dict(v) for k, v in graphs.items()}), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
