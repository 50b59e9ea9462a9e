"""bench/bench_cuda_graphs.py on a tiny target with a random DFlash draft (MLX's CPU build, where
the CUDA-graph variables change nothing): one table row per setting and pass, each with its own
plain mlx-lm tok/s, speedups and the fixed-block cycle's costs; the child's environment carries
the setting's variables; a failed run is one line and the exit status says no run succeeded; --pool makes a row per
setting from the kept JSON."""
import json

from mlx_lm import load

from bench_scripts import run_bench
from tiny_models import CASES_DIR
from worker.models.dflash_checkpoint import init_dflash_draft, save_dflash_draft


def test_one_row_per_setting_and_pass(tmp_path, tiny_models):
    target, _ = load(str(tiny_models.llama))
    save_dflash_draft(init_dflash_draft(target, num_layers=1, block_size=4, seed=3), tmp_path / "draft")
    r = run_bench("bench_cuda_graphs.py", "--target", tiny_models.llama, "--dflash-draft", tmp_path / "draft",
                  "--cases", CASES_DIR, "--prompts", 1, "--max-tokens", 8, "--dtype", "float32",
                  "--settings", "default", "nographs", "--passes", 2, "--out-dir", tmp_path / "runs", timeout=900)
    assert r.returncode == 0, r.stderr + r.stdout
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and not line.startswith("| setting")]
    assert [row.split("|")[1].strip() for row in rows] == ["default_1", "nographs_1", "default_2", "nographs_2"]
    for row in rows:
        cells = [c.strip() for c in row.split("|")[1:-1]]
        plain = [float(x) for x in cells[2].split("/")]
        assert len(plain) == 3 and all(x > 0 for x in plain)  # code/en/pl measured
        assert all(float(x) > 0 for x in cells[5].split(" (")[0].split("/"))  # adapt compiled speedups
        draft_ms, verify_ms = (float(x) for x in cells[7].split(" + "))
        assert draft_ms > 0 and verify_ms > 0
    assert "MLX_USE_CUDA_GRAPHS=0" in rows[1] and "(MLX's own)" in rows[0]
    rec = json.loads((tmp_path / "runs" / "graphs_nographs_1.json").read_text())
    assert "--only" in rec["argv"] and {x["method"] for x in rec["results"]} >= {"plain mlx-lm", "ours plain fused"}

    pooled = run_bench("bench_cuda_graphs.py", "--pool", tmp_path / "runs", timeout=120)
    assert pooled.returncode == 0, pooled.stderr + pooled.stdout
    prow = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in pooled.stdout.splitlines() if line.startswith("| ") and not line.startswith("| setting")}
    assert set(prow) == {"default", "nographs"} and all(cells[1] == "2" for cells in prow.values())
    assert all(float(cells[6]) > 0 and float(cells[7]) > 0 for cells in prow.values())  # tok/s
    assert run_bench("bench_cuda_graphs.py", "--pool", tmp_path / "bad", timeout=120).returncode == 1

    bad = run_bench("bench_cuda_graphs.py", "--target", tmp_path / "missing", "--dflash-draft", tmp_path / "draft",
                    "--settings", "default", "--out-dir", tmp_path / "bad", timeout=300)
    assert bad.returncode == 1 and "default: failed: " in bad.stdout and "0 runs" in bad.stdout
