"""bench/bench_grammar.py on the tiny model's byte-level BPE tokenizer: llguidance's row compiles
every schema asked for and has positive times; a library that is not installed is named as such."""
from __future__ import annotations

import importlib.util

from bench_scripts import run_bench


def test_a_row_per_installed_library(tiny_models):
    r = run_bench("bench_grammar.py", "--tokenizer", tiny_models.llama, "--schemas", "3",
                  "--libraries", "llguidance,no-such-library")
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split()[1:] for line in r.stdout.splitlines()[2:] if line.strip()}
    assert importlib.util.find_spec("llguidance") is not None
    compile_median, compile_max, mean, p50, p99, done = rows["llguidance"]
    assert done == "3/3"
    assert all(float(x) > 0 for x in (compile_median, compile_max, mean, p50, p99))
    assert rows["no-such-library"] == ["not", "installed"]
