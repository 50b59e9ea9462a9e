"""bench/count_graph_ops.py: the counter counts a known graph, the script prints the graphs of
a cycle's pieces (and the verify and step fused) on a tiny random-weight target (each with kernels), writes JSON, leaves the
class-wide mask switch as it was, and rejects bad arguments with one line (exit 2)."""
import json
import sys

import mlx.core as mx

from bench_scripts import ROOT, run_bench
sys.path.insert(0, str(ROOT))


def test_count_ops_counts_a_known_graph():
    from bench.count_graph_ops import count_ops, summarize

    a = mx.ones((4, 4))
    mx.eval(a)
    ops = count_ops(mx.exp(a) + mx.exp(a).T)
    assert ops["Exp"] == 2 and ops["Add"] == 1 and ops["Transpose"] == 1
    s = summarize(ops)
    assert s["kernels"] == s["ops"] - s["views"] and s["views"] >= 1 and ("Exp", 2) in s["top"]


def test_table_json_and_bad_arguments(tmp_path, tiny_models):
    base = ["--target", tiny_models.llama, "--random-weights", "--dtype", "float32"]
    ok = run_bench("count_graph_ops.py", *base, "--block", 4, "--context", 8, "--draft-layers", 1,
                   "--taps", 1, "--json-out", tmp_path / "g.json")
    assert ok.returncode == 0, ok.stderr
    data = json.loads((tmp_path / "g.json").read_text())
    assert list(data["rows"]) == ["forward", "verify", "verify-bool", "step", "draft", "verify-fused", "step-fused"]
    assert all(r["kernels"] > 0 and r["ops"] >= r["kernels"] for r in data["rows"].values())
    # one draft layer has fewer operations than the 2-layer target's verify
    assert data["rows"]["draft"]["ops"] < data["rows"]["verify"]["ops"]
    assert "additive masks yes" in ok.stdout
    # Fusing q/k/v and gate/up takes 3 matmuls out of each of the 2 layers (llama has no biases).
    rows, ops = data["rows"], data["ops"]
    assert "fused projection groups 4" in ok.stdout
    for g in ("verify", "step"):
        assert rows[g]["kernels"] - rows[g + "-fused"]["kernels"] == 6, (g, rows[g], rows[g + "-fused"])
        assert ops[g]["Matmul"] - ops[g + "-fused"]["Matmul"] == 6
    for bad, says in ((["--block", 1], "--block >= 2"), (["--taps", 9], "--taps: at most")):
        r = run_bench("count_graph_ops.py", *base, *bad)
        assert r.returncode == 2 and "Traceback" not in r.stderr and says in r.stderr, (bad, r.stderr)
