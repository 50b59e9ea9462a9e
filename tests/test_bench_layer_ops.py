"""bench/bench_layer_ops.py on tiny random-weight targets: a row per operation with positive
times at both block sizes, the fused projections timed by default (the unfused ones with
--no-fuse), JSON written, the KV cache back at the context after every timed cell, and bad
arguments rejected with one line (exit 2)."""
import json
import sys

import mlx.core as mx

from bench_scripts import ROOT, run_bench
sys.path.insert(0, str(ROOT))


def test_table_json_fusion_and_bad_arguments(tmp_path, tiny_models):
    base = ["--target", tiny_models.qwen2, "--random-weights", "--dtype", "float32", "--block", 4,
            "--context", 8, "--reps", 2, "--rounds", 2]
    ok = run_bench("bench_layer_ops.py", *base, "--json-out", tmp_path / "f.json")
    assert ok.returncode == 0, ok.stderr
    data = json.loads((tmp_path / "f.json").read_text())
    ops = [r["op"] for r in data["rows"]]
    assert data["fused_groups"] == 4 and data["block"] == 4
    assert [o.split()[1] for o in ops if o.startswith("linear")] == [
        "self_attn.qkv_proj_fused", "self_attn.o_proj", "mlp.gate_up_proj_fused", "mlp.down_proj"]
    assert {"rms_norm", "rope", "attention", "mlp", "layer", "head", "forward"} <= set(ops)
    assert all(r["us_b1"] > 0 and r["us_block"] > 0 and len(r["rounds_block"]) == 2 for r in data["rows"])
    # B = 4 at context 8 attends over the padded buffer (256 keys), B = 1 over the exact 9.
    sdpa = next(r for r in data["rows"] if r["op"].startswith("sdpa padded"))
    assert "(9 keys)" in sdpa["op"] and "(256 keys)" in sdpa["op_block"]
    assert "whole forward" in ok.stdout and "layers + head timed alone" in ok.stdout

    plain = run_bench("bench_layer_ops.py", *base, "--no-fuse", "--json-out", tmp_path / "u.json")
    assert plain.returncode == 0, plain.stderr
    data = json.loads((tmp_path / "u.json").read_text())
    assert data["fused_groups"] == 0
    assert sum(r["op"].startswith("linear") for r in data["rows"]) == 7  # q, k, v, o, gate, up, down

    for bad, says in ((["--block", 1], "--block: 2 or more"), (["--reps", 0], "at least 1 each"),
                      (["--rounds", 0], "at least 1 each"), (["--context", 0], "at least 1 each")):
        r = run_bench("bench_layer_ops.py", "--target", tiny_models.qwen2, "--random-weights", *bad)
        assert r.returncode == 2 and "Traceback" not in r.stderr and says in r.stderr, (bad, r.stderr)


def test_timed_cells_leave_the_cache_at_the_context(tiny_models):
    from bench.bench_dflash import load_model
    from bench.bench_layer_ops import layer_ops, time_op

    model = load_model(str(tiny_models.llama), True, mx.float32, tokenizer=False)[0]
    for B in (1, 3):
        ops, cache = layer_ops(model, B, 5)
        for name, _, fn in ops:
            assert time_op(fn, 2) > 0, name
            # Every cache a cell touches (layer 0's by attention and layer, all by forward) is back at 5.
            assert {c.offset for c in cache} == {5}, name


def test_sdpa_unfused_equals_the_fused_kernel():
    """The unfused attention the benchmark times computes what MLX's kernel does: grouped heads,
    with an additive mask that hides padded keys and the block's future, and without a mask."""
    from bench.bench_layer_ops import sdpa_unfused
    from worker.models.dflash import additive_mask
    from mlx_lm.models.base import create_causal_mask

    mx.random.seed(0)
    q = mx.random.normal((1, 6, 4, 16))
    k, v = mx.random.normal((1, 2, 12, 16)), mx.random.normal((1, 2, 12, 16))
    mask = additive_mask(mx.pad(create_causal_mask(4, 5), [(0, 0), (0, 3)]), mx.float32)  # 9 keys used
    boolean = mx.pad(create_causal_mask(4, 5), [(0, 0), (0, 3)])
    for m in (mask, None, boolean):
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=m)
        got = sdpa_unfused(q, k, v, 0.25, m)
        assert got.shape == want.shape and mx.allclose(got, want, atol=1e-5).item()
    # The padded keys carry no weight: changing them changes nothing.
    v2 = mx.concatenate([v[:, :, :9], 100 + v[:, :, 9:]], axis=2)
    assert mx.allclose(sdpa_unfused(q, k, v2, 0.25, mask), sdpa_unfused(q, k, v, 0.25, mask), atol=1e-5).item()
