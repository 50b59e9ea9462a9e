"""bench/bench_block_cost.py on a tiny random-weight target: a table with every block size, and
bad arguments rejected with one line (exit 2) before any timing."""
import json

import mlx.core as mx
from mlx_lm import load

from worker.models.dflash_checkpoint import init_dflash_draft, save_dflash_draft

from bench_scripts import run_bench


def _run(*args):
    return run_bench("bench_block_cost.py", *args)


def test_bench_block_cost_table_and_bad_arguments(tmp_path, tiny_models):
    target, _ = load(str(tiny_models.llama))
    draft = init_dflash_draft(target, num_layers=1, block_size=8, seed=3, dtype=mx.float32)
    save_dflash_draft(draft, tmp_path / "draft")
    model = ["--target", tiny_models.llama, "--random-weights", "--dtype", "float32"]
    base = [*model, "--dflash-draft", tmp_path / "draft"]

    ok = _run(*base, "--blocks", 1, 2, 8, "--reps", 2, "--context", 16, "--json-out", tmp_path / "cost.json")
    assert ok.returncode == 0, ok.stderr
    rows = [line.split() for line in ok.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "2", "8"]
    assert float(rows[0][1]) == 0.0 and all(float(r[2]) > 0 for r in rows)  # no draft at B = 1
    assert float(rows[0][4]) == 1.0  # the plain step is the unit
    assert (tmp_path / "cost.json").is_file()
    assert "fused projection groups 4" in ok.stdout  # as a worker loads the target

    # Rounds: each size timed that often, the median and range reported; --no-fuse keeps the layers.
    ok = _run(*base, "--blocks", 1, 4, "--reps", 1, "--rounds", 3, "--context", 16, "--no-fuse",
              "--json-out", tmp_path / "r.json")
    assert ok.returncode == 0, ok.stderr
    assert "fused projection groups 0" in ok.stdout
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    for r in rows.values():
        cycles = sorted(d + v for d, v in r["rounds"])
        assert len(cycles) == 3 and r["cycle_range_ms"] == [cycles[0], cycles[-1]]
        assert abs(r["cycle_ms"] - cycles[1]) < 1e-9

    for bad, flag in [(["--blocks", 0, 1], "--blocks"), (["--blocks", 2, 4], "--blocks"),
                      (["--blocks", 1, 16], "--blocks"), (["--context", 1], "--context"), (["--reps", 0], "--reps"),
                      (["--rounds", 0], "--rounds")]:
        r = _run(*base, *bad)
        assert r.returncode == 2 and flag in r.stderr and "Traceback" not in r.stderr, (bad, r.stderr)

    # A draft that taps a layer the target does not have: one line naming it, exit 2.
    import shutil
    shutil.copytree(tmp_path / "draft", tmp_path / "other")
    cfg = json.loads((tmp_path / "other" / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [99]
    (tmp_path / "other" / "config.json").write_text(json.dumps(cfg))
    r = _run(*base[:-1], tmp_path / "other", "--blocks", 1, 2)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "99" in r.stderr, r.stderr
