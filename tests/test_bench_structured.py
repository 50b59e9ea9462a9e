"""bench/bench_structured.py on the tiny random-weight llama and DFlash draft: a free and a
json_schema row per mode and session count, with tokens and positive rates."""
from __future__ import annotations

from bench_scripts import run_bench


def test_rows_per_mode_sessions_and_kind(tiny_models, dflash_dir):
    r = run_bench("bench_structured.py", "--model", tiny_models.llama, "--draft", dflash_dir,
                  "--sessions", "1,2", "--max-tokens", "8")
    assert r.returncode == 0, r.stderr
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in r.stdout.splitlines()
            if line.startswith("| plain") or line.startswith("| dflash")]
    assert [(m, n, k) for m, n, k, *_ in rows] == [(m, n, k) for m in ("plain", "dflash") for n in ("1", "2")
                                                   for k in ("free", "json_schema")]
    for mode, n, kind, tokens, wall, rate, decode, ratio, tau in rows:
        assert 0 < int(tokens) <= 8 * int(n) and float(wall) > 0 and float(rate) > 0 and float(decode) > 0
        assert (ratio != "") == (kind == "json_schema")
