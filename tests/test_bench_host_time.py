"""bench/bench_host_time.py on a tiny target and draft it builds itself: a row per (mode, rows,
path) whose parts add up, one stream message per row and iteration, a profile, and the
first-request table."""
from __future__ import annotations

import json

from bench_scripts import run_bench


def test_rows_parts_and_profile(tmp_path):
    out = tmp_path / "rows.json"
    r = run_bench("bench_host_time.py", "--rows", "1,2", "--max-tokens", "24", "--block", "4",
                  "--paths", "engine,grpc", "--profile", "5", "--first-request", "--json", out, timeout=600)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(x["mode"], x["rows"], x["path"]) for x in rows] == [
        (m, n, p) for p in ("engine", "grpc") for m in ("plain", "dflash") for n in (1, 2)]
    for x in rows:
        assert x["iterations"] > 5 and x["loop"] > 0 and x["sync"] > 0 and x["build"] > 0
        assert 0 < x["host"] < x["loop"] and x["build"] < x["host"]
        assert 0 < x["detok"] <= x["emit"] < x["host"]
        assert x["tok_per_it"] >= x["rows"]  # every row commits a token or more an iteration
        if x["path"] == "grpc":
            assert abs(x["msg_per_row_it"] - 1) < 0.05 and x["gap"] > 0  # one message a row and iteration
    assert r.stdout.count("(cProfile, own time)") == 8
    assert [(x["mode"], x["rows"], x["run"]) for x in data["first_request"]] == [
        (m, n, k) for m in ("plain", "dflash") for n in (1, 2) for k in (1, 2, 3)]
    assert all(x["loop"] > 0 for x in data["first_request"])
