"""bench/bench_kv_transfer.py end to end on a tiny random-weight model: two worker processes, one
move per method and context, a table row per context with both methods' pauses, equal outputs
(exit 0), and bad arguments are one line (exit 2)."""
import json

from bench_scripts import run_bench
from tiny_models import CASES_DIR


def test_table_json_and_bad_arguments(tmp_path, tiny_models):
    r = run_bench("bench_kv_transfer.py", "--model", tiny_models.llama, "--contexts", 64, 256, "--max-tokens", 160,
                  "--cases", CASES_DIR, "--json-out", tmp_path / "k.json", timeout=600)
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line.split()[:1] in (["64"], ["256"])]
    assert [row[0] for row in rows] == ["64", "256"] and all(row[-1] == "yes" for row in rows), r.stdout
    data = json.loads((tmp_path / "k.json").read_text())
    for row in data:
        assert row["kv"]["bytes"] > 0 and row["reprefill"]["bytes"] == 0
        assert row["kv"]["transferred_tokens"] > 0 and row["reprefill"]["transferred_tokens"] == 0
        assert 0 < row["kv"]["pause_s"] <= row["kv"]["total_s"] and row["same_output"] is True
    assert data[1]["kv"]["bytes"] > data[0]["kv"]["bytes"]  # a longer context moves more
    assert "Traceback" not in r.stderr
    bad = run_bench("bench_kv_transfer.py", "--model", tmp_path)
    assert bad.returncode == 2 and "no config.json there" in bad.stderr and "Traceback" not in bad.stderr
