"""bench/bench_batch_step.py on the tiny random-weight llama and draft: a row per batch size with
positive times for every column."""
from __future__ import annotations

from bench_scripts import run_bench


def test_a_row_per_batch_size(tiny_models, dflash_dir):
    r = run_bench("bench_batch_step.py", "--model", tiny_models.llama, "--draft", dflash_dir,
                  "--batch", "1,3", "--context", "20", "--reps", "2", "--rounds", "1")
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split("|")[1].strip() for row in rows] == ["1", "3"]
    for row in rows:
        cells = [float(c) for c in row.strip("|").split("|")[1:]]
        assert len(cells) == 6 and all(c > 0 for c in cells)


def test_kernels_compares_layer_variants(tiny_models, dflash_dir):
    """On a CPU: layers as loaded and fused (small_gemm is CUDA only), plain and DFlash."""
    r = run_bench("bench_batch_step.py", "--model", tiny_models.llama, "--draft", dflash_dir, "--kernels",
                  "--block", "4", "--batch", "1,3", "--context", "20", "--reps", "2", "--rounds", "1")
    assert r.returncode == 0, r.stderr
    rows = [line.strip("|").split("|") for line in r.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [(c[0].strip(), c[1].strip()) for c in rows] == [
        ("1", "as loaded"), ("1", "fused"), ("3", "as loaded"), ("3", "fused")]
    for c in rows:
        plain, ratio, dflash, dratio = (float(x) for x in c[2:6])
        assert plain > 0 and dflash > 0 and ratio > 0 and dratio > 0
        if c[1].strip() == "as loaded":
            assert ratio == dratio == 1.0
