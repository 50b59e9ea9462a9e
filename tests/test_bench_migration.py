"""bench/bench_migration.py end to end on a tiny random-weight model: two worker processes, the
table has both settings, migration on moves the shared session, every output equals the
unmigrated one (exit 0), and bad arguments are one line (exit 2)."""
import json

from bench_scripts import run_bench
from tiny_models import CASES_DIR


def test_table_json_and_bad_arguments(tmp_path, tiny_models):
    r = run_bench("bench_migration.py", "--model", tiny_models.llama, "--max-tokens", 160, "--rounds", 1,
                  "--cases", CASES_DIR, "--json-out", tmp_path / "m.json", timeout=600)
    assert r.returncode == 0, r.stderr
    assert "every output equal to the same request's with migration off: yes" in r.stdout
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines() if line.split()[:1] in (["off"], ["on"])}
    assert set(rows) == {"off", "on"}
    data = json.loads((tmp_path / "m.json").read_text())
    assert data["off"]["migrations"] == 0 and data["on"]["migrations"] == 1, data
    assert len(data["on"]["pause_s"]) == 1 and data["same_outputs"] is True
    assert "Traceback" not in r.stderr
    bad = run_bench("bench_migration.py", "--model", tmp_path, "--rounds", 1)
    assert bad.returncode == 2 and "no config.json there" in bad.stderr and "Traceback" not in bad.stderr
