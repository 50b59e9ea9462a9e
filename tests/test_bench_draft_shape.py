"""bench/bench_draft_shape.py on a tiny random-weight target: one table row per draft shape with
its parameter count, and bad arguments rejected with one line (exit 2) before any timing."""

from bench_scripts import run_bench


def _run(*args):
    return run_bench("bench_draft_shape.py", *args)


def test_bench_draft_shape_table_and_bad_arguments(tiny_models):
    base = ["--target", tiny_models.llama, "--random-weights", "--dtype", "float32", "--block", 4, "--context", 8,
            "--reps", 1, "--rounds", 2, "--num-taps", 2]

    ok = _run(*base, "--shapes", "1x32", "1x128", "2x32")
    assert ok.returncode == 0, ok.stderr
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in ok.stdout.splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    assert [r[0] for r in rows] == ["1x32", "1x128", "2x32"]
    params = [float(r[1].split()[0]) for r in rows]
    assert params[1] > params[0] and params[2] > params[0]  # a wider MLP, a layer more: more weights
    assert all(float(r[2]) > 0 for r in rows) and rows[0][4] == "1.00x"

    for bad, flag in [(["--shapes", "3"], "--shapes"), (["--shapes", "0x64"], "--shapes"),
                      (["--block", 1], "--block"), (["--reps", 0], "--reps")]:
        r = _run(*base, *bad)
        assert r.returncode == 2 and flag in r.stderr and "Traceback" not in r.stderr, (bad, r.stderr)
