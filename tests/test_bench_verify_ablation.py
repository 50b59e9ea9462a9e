"""bench/bench_verify_ablation.py on tiny random-weight targets: every variant timed at both block
sizes in three ways, the model's own parts back after each cell (its output unchanged), the
cache back at the context, the ablations really taking parts out, JSON written, and bad arguments rejected with one line (exit 2)."""
import json
import sys

import mlx.core as mx

from bench_scripts import ROOT, run_bench
sys.path.insert(0, str(ROOT))


def test_table_json_and_bad_arguments(tmp_path, tiny_models):
    ok = run_bench("bench_verify_ablation.py", "--target", tiny_models.qwen2, "--random-weights", "--dtype",
                   "float32", "--block", 4, "--context", 8, "--reps", 2, "--rounds", 2, "--json-out", tmp_path / "a.json")
    assert ok.returncode == 0, ok.stderr
    data = json.loads((tmp_path / "a.json").read_text())
    assert [r["variant"] for r in data["rows"]] == ["full", "taps", "taps-ahead", "compiled", "compiled-taps", "no-mask", "exact",
                                                   "no-attn", "no-mlp", "norms+head"]
    for r in data["rows"]:
        assert len(r["rounds_b1"]) == len(r["rounds_block"]) == 2
        assert all(r[k][t] > 0 for k in ("b1", "block") for t in ("synced", "queued", "build")), r
    assert "taking out no-attn: the synced B=4 extra falls by" in ok.stdout
    for bad, says in ((["--block", 1], "--block: 2 or more"), (["--reps", 0], "at least 1 each"),
                      (["--variants", "bogus"], "invalid choice")):
        r = run_bench("bench_verify_ablation.py", "--target", tiny_models.qwen2, "--random-weights", *bad)
        assert r.returncode == 2 and "Traceback" not in r.stderr and says in r.stderr, (bad, r.stderr)


def test_variants_take_parts_out_and_restore_them(tiny_models):
    from bench.bench_dflash import load_model
    from bench.bench_verify_ablation import VARIANTS, variant_forward

    model = load_model(str(tiny_models.llama), True, mx.float32, tokenizer=False)[0]
    x = mx.array([[3, 1, 4, 1, 5]], dtype=mx.uint32)
    before = model(x)
    logits, ids, tapped = {}, {}, {}
    for v in VARIANTS:
        forward, restore = variant_forward(model, v, 3, 6)
        y = forward()
        mx.eval(y)
        if v.endswith("taps") or v == "taps-ahead":
            y, tapped[v] = y
            assert tapped[v].shape[:2] == (1, 3) and tapped[v].shape[2] % model.args.hidden_size == 0
        assert y.shape == (3,) and y.dtype == mx.uint32, v
        ids[v] = y
        if v.startswith("compiled"):  # a replayed trace calls no Python: compare what it returns
            assert mx.array_equal(forward() if v == "compiled" else forward()[0], y).item(), v
            restore()
            continue
        layers = model.model.layers
        assert all(type(l.self_attn).__name__ == "_Skip" for l in layers) == (v in ("no-attn", "norms+head")), v
        assert all(type(l.mlp).__name__ == "_Skip" for l in layers) == (v in ("no-mlp", "norms+head")), v
        # Its cache is back at the context after each forward: the logits of the same block again.
        logits[v] = [forward_logits(model, forward) for _ in range(2)]
        assert mx.array_equal(*logits[v]).item(), v
        restore()
        assert mx.allclose(model(x), before).item(), v  # the model is whole again
    full = logits["full"][0]
    assert mx.allclose(logits["exact"][0], full, atol=1e-4).item()
    assert mx.allclose(logits["taps"][0], full, atol=1e-4).item()
    assert mx.array_equal(logits["taps-ahead"][0], logits["taps"][0]).item()  # queueing changes no value  # the same attention, mlx-lm's cache
    assert mx.array_equal(ids["compiled"], ids["full"]).item()  # the same forward, compiled
    assert mx.array_equal(ids["compiled-taps"], ids["taps"]).item()
    assert mx.allclose(tapped["compiled-taps"], tapped["taps"], atol=1e-4).item()
    for v in ("no-mask", "no-attn", "no-mlp", "norms+head"):
        assert not mx.allclose(logits[v][0], full, atol=1e-4).item(), v


def forward_logits(model, forward):
    """The logits behind `forward`'s argmax: the closure's model call, caught by wrapping __call__."""
    import mlx.core as mx

    seen = []
    cls = type(model)
    call = cls.__call__
    cls.__call__ = lambda self, *a, **k: seen.append(call(self, *a, **k)) or seen[-1]
    try:
        forward()
    finally:
        cls.__call__ = call
    mx.eval(seen[0])
    return seen[0]
