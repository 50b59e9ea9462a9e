"""bench/bench_concurrency.py on a tiny random-weight model: every system answers at every
concurrency (a cluster of processes, mlx-lm's batch_generate and its server), the table has one row
per (system, sessions) with positive tok/s, the ratios follow from the rows, and bad arguments
exit 2 with one line."""
import json

import pytest

from bench_scripts import ROOT, run_bench
from tiny_models import CASES_DIR

SYSTEMS = ("ours", "ours-plain", "mlx-lm-batch", "mlx-lm-server")


def _rows(stdout: str) -> list[list[str]]:
    """Cells of the results table's data rows."""
    return [[c.strip() for c in line.split("|")[1:-1]] for line in stdout.splitlines()
            if line.startswith("| ") and line.split("|")[1].strip() in SYSTEMS]


def test_every_system_at_every_concurrency(tmp_path, tiny_models):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x): return x * {i}"}) + "\n"
                               for i in range(3)))
    out = tmp_path / "out.json"
    r = run_bench("bench_concurrency.py", "--model", tiny_models.llama, "--prompts", prompts,
                  "--sessions", "1,2", "--max-tokens", 4, "--systems", ",".join(SYSTEMS),
                  "--json", out, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "warning" not in r.stderr, r.stderr  # every system saw the same prompt tokens
    rows = _rows(r.stdout)
    assert [(row[0], int(row[1])) for row in rows] == [(s, n) for s in SYSTEMS for n in (1, 2)]
    for row in rows:
        n, tokens, agg, mean, low = int(row[1]), int(row[2]), float(row[5]), float(row[6]), float(row[7])
        assert 0 < tokens <= 4 * n and agg > 0 and mean >= low > 0, row
    levels = json.loads(out.read_text())
    assert len(levels) == len(rows)
    by = {(lv["system"], len(lv["sessions"])): lv["aggregate_tps"] for lv in levels}
    ratio_rows = [line for line in r.stdout.split("Aggregate tok/s ratios:")[1].splitlines()
                  if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert len(ratio_rows) == 2
    want = by[("ours", 2)] / by[("mlx-lm-batch", 2)]
    assert ratio_rows[1].split("|")[2].strip() == f"{want:.2f}x"


def test_bad_arguments_exit_2(tiny_models):
    for bad in (["--sessions", "0"], ["--sessions", "a"], ["--systems", "vllm"],
                ["--max-tokens", "0"], ["--prompts", "missing.jsonl"],
                ["--model", "no-such-model"]):
        r = run_bench("bench_concurrency.py", "--model", tiny_models.llama, *bad, timeout=60)
        assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.strip(), (bad, r.stderr)


def test_heldout_prompts_are_the_split_of_the_corpus():
    """The shipped prompt file holds the held-out rows `flashfleet draft train` keeps out of the
    code corpus (checked where the corpus is at hand)."""
    from worker.training.data import read_prompt_files, split_heldout

    shipped = [r.text for r in read_prompt_files([ROOT / "bench" / "prompts" / "humaneval_heldout.jsonl"])]
    assert len(shipped) == 8
    corpus = CASES_DIR / "humaneval.jsonl"
    if not corpus.exists():
        pytest.skip("the HumanEval corpus is not beside this checkout")
    held = split_heldout(read_prompt_files([corpus], max_per_file=450), 8, 0.1)[1]
    assert shipped == [r.text for r in held]


def test_mlx_lm_server_gets_a_copy_in_the_workers_dtype(tmp_path, tiny_models):
    """A bfloat16-stored model is served to mlx-lm's server as a float32 copy (the dtype the
    workers compute in here, conftest.py), with the same weights; a float32 one is served as is."""
    import sys

    import mlx.core as mx
    import numpy as np
    from mlx_lm import load
    from mlx.utils import tree_flatten
    from mlx_lm.utils import save_model

    sys.path.insert(0, str(ROOT / "bench"))
    from bench_concurrency import copy_in_worker_dtype

    assert copy_in_worker_dtype(tiny_models.llama, tmp_path / "unused") == tiny_models.llama
    model, _ = load(str(tiny_models.llama))
    model.set_dtype(mx.bfloat16)
    stored = tmp_path / "bf16"
    save_model(stored, model)
    for f in tiny_models.llama.iterdir():
        if not f.name.endswith(".safetensors") and f.is_file():
            (stored / f.name).write_bytes(f.read_bytes())
    served = copy_in_worker_dtype(stored, tmp_path / "served")
    assert served == tmp_path / "served" and (served / "config.json").exists()
    copy, _ = load(str(served))
    want = dict(tree_flatten(model.parameters()))
    for name, p in tree_flatten(copy.parameters()):
        assert p.dtype == mx.float32, name
        np.testing.assert_array_equal(np.array(p), np.array(want[name].astype(mx.float32)))


def test_mlx_lm_server_runs_with_the_workers_blas(tiny_models):
    """mlx-lm's server process gets the environment `flashfleet up` gives its workers (OpenBLAS
    preloaded on a Linux CPU), also where this process was started without it (as pytest is):
    the same BLAS on both sides of the comparison."""
    import sys

    from flashfleet.blas import openblas_env
    from flashfleet.cli.up import worker_env

    sys.path.insert(0, str(ROOT / "bench"))
    from bench_concurrency import MlxServer

    server = MlxServer(tiny_models.llama, 1)
    server.log.close()
    assert server.env == worker_env()
    preload = openblas_env()
    if preload is not None:  # a Linux CPU with OpenBLAS installed, LD_PRELOAD not set here
        assert server.env["LD_PRELOAD"] == preload["LD_PRELOAD"]
