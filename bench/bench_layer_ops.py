"""Where a verify's time goes: each operation of a decoder layer and the head, alone, B = 1 vs B.

On the lent H200 a B = 16 verify of the 1.5B target costs about 1.7 plain steps (9.7 against 5.9 ms,
docs/benchmarks.md, fourteenth session) although both graphs hold about 400 kernel-launching
operations (`bench/count_graph_ops.py`): some operations cost more with 16 rows than with one. This times, for one decoder layer of the target (its own modules, over the padded KV cache a
DFlash verify uses, `--context` positions in it) and for the head, every piece alone:

    linear NAME    each projection of the layer (fused ones too: `worker/fusion.py`, on unless
                   --no-fuse), input (1, B, in)
    rms_norm       `mx.fast.rms_norm` of (1, B, D) (two a layer; the head has its own)
    rope           the layer's RoPE on the queries (1, H, B, head_dim) at the context's offset
    sdpa padded    `mx.fast.scaled_dot_product_attention` as the verify calls it: keys of the
                   padded buffer (a multiple of 256) with its additive mask; at B = 1 the exact
                   keys and no mask (a plain step)
    sdpa causal    the same over exactly context + B keys with mask "causal" (mlx-lm's KVCache)
    sdpa unfused   the padded cell as matmul, mask add, softmax, matmul (`sdpa_unfused`): five
                   kernels that need no attention kernel compiled per key length
    attention      the layer's whole attention module (projections, RoPE, cache update, sdpa)
    mlp            the layer's whole MLP
    layer          the whole decoder layer
    head           final norm, LM head and argmax of every row
    forward        the whole target over the padded cache (B tokens, argmax of every row)

Each cell is `--reps` copies of the operation in one graph, evaluated at once (so each copy is a
launch, as in a forward), divided by reps; `--rounds` rounds alternate the order of B and op, and
the table gives the median round. `per fwd` is how often a forward runs the operation; the last
column is what B costs over B = 1 in one forward (per-call difference x per fwd, ms): the rows
that explain a verify's extra time. Random weights are enough (times do not depend on values):

    python bench/bench_layer_ops.py --target MODEL_OR_CONFIG_DIR [--random-weights] \\
        [--block 16] [--context 256] [--reps 50] [--rounds 5] [--no-fuse] [--json-out F]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WARMUP = 2  # evaluations of each cell before its clock starts (kernel compiles, allocation)


def time_op(fn, reps: int) -> float:
    """Wall time of one call of `fn` (it returns mx.arrays), us: `reps` calls in one graph,
    evaluated together, divided by reps."""
    import mlx.core as mx

    for _ in range(WARMUP):
        mx.eval(fn())
    t0 = time.perf_counter()
    mx.eval([fn() for _ in range(reps)])
    return (time.perf_counter() - t0) / reps * 1e6


def sdpa_unfused(q, k, v, scale: float, mask):
    """Attention as plain operations: softmax(q k^T * scale + mask) v, grouped-query heads shared.

    q: (1, H, B, hd); k, v: (1, Hkv, L, hd) with H a multiple of Hkv; mask: None, additive (B, L)
    in q's dtype, or boolean (B, L), True where visible. Returns (1, H, B, hd), what
    `mx.fast.scaled_dot_product_attention` returns for the same inputs (softmax in float32,
    `precise`)."""
    import mlx.core as mx

    _, H, B, hd = q.shape
    Hkv = k.shape[1]
    qg = (q * scale).reshape(1, Hkv, H // Hkv, B, hd)  # each kv head's query heads together
    s = qg @ k[:, :, None].swapaxes(-1, -2)  # (1, Hkv, H/Hkv, B, L)
    if mask is not None:
        s = mx.where(mask, s, -mx.inf) if mask.dtype == mx.bool_ else s + mask
    return (mx.softmax(s, axis=-1, precise=True) @ v[:, :, None]).reshape(1, H, B, hd)


def layer_ops(model, B: int, context: int) -> tuple[list[tuple[str, int, object]], list]:
    """([(name, calls per forward, fn)] for every timed operation at block size B, the KV cache).

    Each fn builds its operation on fresh inputs of the right shape (bf16/f32 as the model's
    weights) and leaves the KV cache it touches (the returned one: a fresh padded cache holding
    `context` positions) at `context` positions again (trimmed)."""
    import mlx.core as mx
    import mlx.nn as nn

    from worker.capture import target_head_fn, target_hidden_size, target_layers
    from worker.spec.dflash import make_target_cache

    layers = target_layers(model)
    n = len(layers)
    layer = layers[0]
    attn = layer.self_attn
    D = target_hidden_size(model)
    dtype = layer.input_layernorm.weight.dtype
    H, Hkv = attn.n_heads, attn.n_kv_heads
    q_norm = getattr(attn, "q_norm", None)  # qwen3 keeps no head_dim, but normalises each head
    hd = getattr(attn, "head_dim", None) or (q_norm.weight.shape[0] if q_norm is not None else D // H)
    cache = make_target_cache(model)
    mx.eval(model(mx.array([list(range(100, 100 + context))], dtype=mx.uint32), cache=cache))
    lc = cache[0]  # layer 0's cache, holding the context's keys and values
    mask = lc.make_mask(B)  # what the model builds once per forward (None at B = 1)
    x = mx.random.normal((1, B, D)).astype(dtype)
    q = mx.random.normal((1, H, B, hd)).astype(dtype)
    L_pad = lc.key_length(B) if B > 1 else context + B
    k_pad = mx.random.normal((1, Hkv, L_pad, hd)).astype(dtype)
    k_exact = mx.random.normal((1, Hkv, context + B, hd)).astype(dtype)
    norm_w = layer.input_layernorm.weight
    eps = getattr(layer.input_layernorm, "eps", 1e-6)
    mx.eval(x, q, k_pad, k_exact)

    def trimmed(f, caches):
        def run():
            y = f()
            for c in caches:
                c.trim(B)
            return y
        return run

    ops = []
    linears = [(name, m) for name, m in layer.named_modules() if type(m) in (nn.Linear, nn.QuantizedLinear)]
    # In the order a forward runs them: attention's input projections, its output, then the MLP's.
    linears.sort(key=lambda nm: (nm[0].startswith("mlp"), nm[0].endswith(("o_proj", "down_proj")), nm[0]))
    for name, m in linears:
        d_in = m.weight.shape[1] * 32 // m.bits if type(m) is nn.QuantizedLinear else m.weight.shape[1]
        xi = mx.random.normal((1, B, d_in)).astype(dtype)
        ops.append((f"linear {name} {d_in}->{m.weight.shape[0]}", n, lambda m=m, xi=xi: m(xi)))
    ops += [
        ("rms_norm", 2 * n, lambda: mx.fast.rms_norm(x, norm_w, eps)),
        ("rope", 2 * n, lambda: attn.rope(q, offset=context)),
        (f"sdpa padded ({L_pad} keys)", n, lambda: mx.fast.scaled_dot_product_attention(
            q, k_pad, k_pad, scale=hd ** -0.5, mask=mask)),
        (f"sdpa causal ({context + B} keys)", 0, lambda: mx.fast.scaled_dot_product_attention(
            q, k_exact, k_exact, scale=hd ** -0.5, mask="causal" if B > 1 else None)),
        (f"sdpa unfused ({L_pad} keys)", 0, lambda: sdpa_unfused(q, k_pad, k_pad, hd ** -0.5, mask)),
        ("attention", n, trimmed(lambda: attn(layer.input_layernorm(x), mask, lc), [lc])),
        ("mlp", n, lambda: layer.mlp(x)),
        ("layer", n, trimmed(lambda: layer(x, mask, lc), [lc])),
    ]
    head, final_norm = target_head_fn(model), model.model.norm if hasattr(model, "model") else None
    ops.append(("head", 1, lambda: mx.argmax(head(final_norm(x) if final_norm else x), axis=-1)))
    tokens = mx.array([[5] * B], dtype=mx.uint32)
    ops.append(("forward", 1, trimmed(lambda: mx.argmax(model(tokens, cache=cache)[0], axis=-1), cache)))
    return ops, cache


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
    ap.add_argument("--reps", type=int, default=50, help="copies of an operation per timed graph")
    ap.add_argument("--rounds", type=int, default=5, help="rounds; the table shows the median")
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
    ops = {B: layer_ops(model, B, a.context)[0] for B in blocks}
    names = [name for name, _, _ in ops[blocks[0]]]
    runs = {B: {name: [] for name, _, _ in ops[B]} for B in blocks}
    for r in range(a.rounds):
        order = [(B, i) for i in range(len(names)) for B in blocks]
        for B, i in (reversed(order) if r % 2 else order):
            name, _, fn = ops[B][i]
            runs[B][name].append(time_op(fn, a.reps))
    print(f"target {a.target}{' (random weights)' if a.random_weights else ''} {a.dtype}; context {a.context}; "
          f"fused projection groups {fused}; {a.reps} copies per cell, median of {a.rounds} rounds; "
          f"device {mx.default_device()}; mlx {mx.__version__}")
    B = a.block
    print(f"{'operation':44s} {'B=1 us':>9s} {f'B={B} us':>9s} {'ratio':>6s} {'per fwd':>7s} "
          f"{f'B={B} extra ms/fwd':>16s}")
    rows, extra = [], 0.0
    for (name, count, _), (name_b, _, _) in zip(ops[1], ops[B]):
        t1, tb = statistics.median(runs[1][name]), statistics.median(runs[B][name_b])
        label = name if name == name_b else f"{name} | {name_b.split('(')[-1].rstrip(')')}"
        add = (tb - t1) * count / 1e3
        if name not in ("attention", "mlp", "layer", "forward"):  # parts of the layer and head, not wholes
            extra += add
        rows.append(dict(op=name, op_block=name_b, per_forward=count, us_b1=t1, us_block=tb,
                         rounds_b1=runs[1][name], rounds_block=runs[B][name_b]))
        print(f"{label[:44]:44s} {t1:9.1f} {tb:9.1f} {tb / t1:6.2f} {count:7d} {add:16.2f}")
    per = {row["op"]: row for row in rows}
    n_layers = per["layer"]["per_forward"]
    for b, key in ((1, "us_b1"), (B, "us_block")):
        built = (n_layers * per["layer"][key] + per["head"][key]) / 1e3
        print(f"B={b}: forward {per['forward'][key] / 1e3:.2f} ms; {n_layers} layers + head timed alone "
              f"{built:.2f} ms")
    print(f"B={B} over B=1 in one forward, the parts summed: {extra:.2f} ms "
          f"(whole forward: {(per['forward']['us_block'] - per['forward']['us_b1']) / 1e3:.2f} ms)")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(dict(target=a.target, block=B, context=a.context,
                                                    reps=a.reps, rounds=a.rounds, fused_groups=fused,
                                                    device=str(mx.default_device()), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
