"""bench/bench_generation.py on a tiny random-weight target: one table row per compact_at setting,
identical greedy answers across settings, and bad arguments rejected with one line (exit 2)."""
import json

from bench_scripts import run_bench


def _run(*args):
    return run_bench("bench_generation.py", *args)


def test_bench_generation_table_and_bad_arguments(tmp_path, tiny_models):
    cases = tmp_path / "cases"
    cases.mkdir()
    (cases / "code.jsonl").write_text("".join(json.dumps({"prompt": f"def f{i}(x): return x * {i}"}) + "\n"
                                              for i in range(6)))
    base = ["--target", tiny_models.llama, "--cases", cases, "--prompts", 6, "--batch-size", 3,
            "--max-new-tokens", 20]
    ok = _run(*base, "--compact-at", 2, 0)
    assert ok.returncode == 0, ok.stderr
    rows = [line.split("|")[1:-1] for line in ok.stdout.splitlines() if line.startswith("| ") and "compact" not in line]
    assert [r[0].strip() for r in rows] == ["2", "0"]
    assert all(r[-1].strip() == "True" for r in rows) and rows[0][4].strip() == "1.00x"
    assert all(int(r[1]) > 0 for r in rows)

    for bad in (["--prompts", 0], ["--batch-size", 0], ["--cases", tmp_path / "none"]):
        r = _run(*base, *bad)
        assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.strip(), (bad, r.stderr)
