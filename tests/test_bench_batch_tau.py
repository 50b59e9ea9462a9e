"""bench/bench_batch_tau.py on the tiny random-weight llama and its DFlash draft: a row per prompt,
the batched runs' draft blocks equal to one sequence's, every output plain greedy."""
from __future__ import annotations

import json

from bench_scripts import run_bench


def test_a_row_per_prompt_with_the_same_drafts(tiny_models, dflash_dir, tmp_path):
    out = tmp_path / "rows.json"
    r = run_bench("bench_batch_tau.py", "--model", tiny_models.llama, "--draft", dflash_dir,
                  "--prompts", "2", "--max-tokens", "12", "--json", out)
    assert r.returncode == 0, r.stderr
    assert "| prompt | tokens |" in r.stdout
    rows = json.loads(out.read_text())
    assert [row["prompt"] for row in rows] == [0, 1]
    for row in rows:
        assert row["one"]["iterations"] >= 3
        assert row["batch1"] == row["one"]  # a batch of one is one sequence
        same, n = row["batchN"]["same_blocks"]
        assert n >= 3 and same == n
        assert row["batchN"]["equals_plain"]
