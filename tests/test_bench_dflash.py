"""bench/bench_dflash.py end to end on the tiny llama with a random DFlash draft: a row per corpus
and method, greedy outputs of ours equal plain mlx-lm's, `--rounds` gives a median speedup with
its range and one tok/s per round in the JSON, and a bad argument is one line (exit 2)."""
import json
import statistics

import pytest

from bench_scripts import run_bench
from tiny_models import CASES_DIR

METHODS = ("plain mlx-lm", "ours plain", "ours dflash random x1")


def test_table_and_json(tmp_path, tiny_models):
    base = ["--target", tiny_models.llama, "--dflash-random-layers", 1, "--block-size", 4, "--max-tokens", 12,
            "--prompts", 1, "--max-prompt-tokens", 24, "--cases", CASES_DIR, "--dtype", "float32"]
    r = run_bench("bench_dflash.py", *base, "--rounds", 2, "--json-out", tmp_path / "b.json", timeout=600)
    assert r.returncode == 0, r.stderr
    assert "2 rounds: tok/s is the median" in r.stdout
    rows = [line for line in r.stdout.splitlines() if line[:6].strip() in ("code", "en", "pl")]
    assert sorted((line[:6].strip(), line[7:35].strip()) for line in rows) == sorted(
        (c, m) for c in ("code", "en", "pl") for m in METHODS)

    data = json.loads((tmp_path / "b.json").read_text())
    assert data["block_size"] == 4 and data["rounds"] == 2
    by = {(res["method"], res["corpus"]): res for res in data["results"]}
    assert set(by) == {(m, c) for c in ("code", "en", "pl") for m in METHODS}
    for (method, corpus), res in by.items():
        tps = res["rounds_tps"]
        assert len(tps) == 2 and all(t > 0 for t in tps) and res["tps"] == pytest.approx(statistics.median(tps))
        paired = [m / p for m, p in zip(tps, by["plain mlx-lm", corpus]["rounds_tps"])]
        assert res["speedup"] == pytest.approx(statistics.median(paired))
        assert res["speedup_range"] == pytest.approx([min(paired), max(paired)])
        assert res["same"] == res["n"] == 1, res  # float32 on the CPU: every greedy output is mlx-lm's
        if "dflash" in method:
            assert 1.0 <= res["tau"] <= 4.0
        else:
            assert res["tau"] is None


def test_bad_arguments_are_one_line(tiny_models):
    for args, msg in ((["--rounds", 0], "--rounds: at least 1"), (["--max-tokens", 1], "--max-tokens: at least 2")):
        r = run_bench("bench_dflash.py", "--target", tiny_models.llama, "--cases", CASES_DIR, *args)
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr
