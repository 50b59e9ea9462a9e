"""bench/bench_batched_verify.py end to end on a tiny random-weight target: a row per context and
shape (K candidate blocks batched, and the same tokens as one row), times that are positive, and
one block's ratio to itself exactly 1."""
import json

from bench_scripts import run_bench


def test_table_and_json(tmp_path, tiny_models):
    r = run_bench("bench_batched_verify.py", "--target", tiny_models.qwen2, "--ks", 1, 2, 4, "--block", 4,
                  "--contexts", 8, 20, "--reps", 2, "--rounds", 2, "--dtype", "float32",
                  "--json-out", tmp_path / "b.json", timeout=300)
    assert r.returncode == 0, r.stderr
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert [(x["context"], x["shape"]) for x in rows] == [
        (c, s) for c in (8, 20) for s in ("1 x 4", "2 x 4", "4 x 4", "1 x 8", "1 x 16")]
    assert all(x["ms"] > 0 for x in rows)
    assert [x["x_one_block"] for x in rows if x["shape"] == "1 x 4"] == [1.0, 1.0]
    assert "   20          4 x 4     16" in r.stdout
    bad = run_bench("bench_batched_verify.py", "--target", tiny_models.qwen2, "--ks", 0)
    assert bad.returncode == 2 and "--ks, --block, --reps, --rounds: at least 1" in bad.stderr
