"""bench/bench_dflash.py end to end on a tiny random-weight target with a random DFlash draft:
the table has every method and corpus, greedy DFlash equals plain decoding, `--rounds` gives a
median speedup with its range and one tok/s per round in the JSON, and a bad --rounds is one
line (exit 2)."""
import json
import statistics

import mlx.core as mx
import pytest

from tiny_models import CASES_DIR

from bench_scripts import run_bench


def _run(*args):
    return run_bench("bench_dflash.py", *args, timeout=600)


def test_rounds_table_and_json(tmp_path, tiny_models):
    base = ["--target", tiny_models.llama, "--dflash-random-layers", 1, "--block-size", 4, "--max-tokens", 12,
            "--prompts", 1, "--max-prompt-tokens", 24, "--reps", 1, "--cases", CASES_DIR, "--dtype", "float32"]
    r = _run(*base, "--rounds", 3, "--json-out", tmp_path / "b.json")
    assert r.returncode == 0, r.stderr
    assert "3 rounds: tok/s is the median" in r.stdout
    rows = [line.split() for line in r.stdout.splitlines() if line[:5].strip() in ("code", "en", "pl")]
    assert {row[0] for row in rows} == {"code", "en", "pl"} and len(rows) == 3 * 3  # 3 methods each
    # Every round measures every method once per corpus; the first round in the listed order.
    done = [line.split(None, 1)[1].rsplit(" done", 1)[0].strip() for line in r.stderr.splitlines()
            if line.strip().startswith("code") and line.rstrip().endswith(" done")]
    listed = ["plain mlx-lm", "ours plain", "ours dflash random x1"]
    assert len(done) == 9 and done[:3] == listed and all(sorted(done[i:i + 3]) == sorted(listed) for i in (3, 6))

    data = json.loads((tmp_path / "b.json").read_text())
    by = {(res["method"], res["corpus"]): res for res in data["results"]}
    for (method, corpus), res in by.items():
        tps = res["rounds_tps"]
        assert len(tps) == 3 and all(t > 0 for t in tps) and res["tps"] == pytest.approx(statistics.median(tps))
        paired = [m / p for m, p in zip(tps, by["plain mlx-lm", corpus]["rounds_tps"])]
        assert res["speedup"] == pytest.approx(statistics.median(paired))  # median of paired ratios
        assert res["speedup_range"] == pytest.approx([min(paired), max(paired)])
        if method != "plain mlx-lm":  # greedy DFlash and our plain loop reproduce plain greedy output
            assert res["same"] == res["n"] == 1, res
        # Cycles per block size cover every counted cycle of our methods (B = 4, shrinking near
        # max_tokens; 1 = a plain step); mlx-lm's cycles carry none.
        blocks = {int(k): v for k, v in res["blocks"].items()}
        if method == "plain mlx-lm":
            assert blocks == {}
        else:
            assert sum(blocks.values()) == res["cycles"] and set(blocks) <= {1, 2, 3, 4}, res
            assert (set(blocks) == {1}) == (method == "ours plain")

    bad = _run(*base, "--rounds", 0)
    assert bad.returncode == 2 and "--rounds: at least 1" in bad.stderr and "Traceback" not in bad.stderr


def test_policy_variants_run_side_by_side(tiny_models):
    base = ["--target", tiny_models.llama, "--dflash-random-layers", 1, "--block-size", 4, "--max-tokens", 10,
            "--prompts", 1, "--max-prompt-tokens", 24, "--reps", 1, "--cases", CASES_DIR, "--dtype", "float32"]
    r = _run(*base, "--adaptive", "--policy", "0.95:8", "0.9:8:0:1.5")
    assert r.returncode == 0, r.stderr
    names = {line[6:35].strip() for line in r.stdout.splitlines() if line.startswith("code ")}
    assert {"ours dflash random x1", "ours dflash random  adaptive", "random x1 pol 0.95:8",
            "random x1 pol 0.9:8:0:1.5"} <= names, names
    chosen = [line for line in r.stdout.splitlines() if line.startswith("blocks code ")]
    assert len(chosen) == 3 and all("cycles per block size" in line and "(plain " in line for line in chosen)
    for line in r.stdout.splitlines():  # lossless under every policy
        if line.startswith("code ") and ("dflash" in line or " pol " in line):
            assert line.rstrip().endswith("1/1"), line
    for bad in ("1.5:8", "0.9", "0.9:0", "0.9:8:x", "0.9:8:0:-1"):
        b = _run(*base, "--policy", bad)
        assert b.returncode == 2 and f"--policy {bad}: expected" in b.stderr, (bad, b.stderr)


def test_fused_rows_run_beside_the_unfused(tmp_path, tiny_models):
    r = _run("--target", tiny_models.llama, "--dflash-random-layers", 1, "--block-size", 4, "--max-tokens", 10,
             "--prompts", 1, "--max-prompt-tokens", 24, "--reps", 1, "--cases", CASES_DIR, "--dtype", "float32",
             "--fuse", "--queue-taps", "--compile", "--compile-draft", "--serial", "--branches", 2,
             "--json-out", tmp_path / "f.json")
    assert r.returncode == 0, r.stderr
    groups = int(r.stdout.split("fused: ", 1)[1].split()[0])
    assert groups > 0
    rows = {line[6:35].strip(): line for line in r.stdout.splitlines() if line.startswith("code ")}
    names = ("ours plain fused", "ours dflash random x1 fused", "ours dflash random queued",
             "ours plain compiled", "ours dflash random compiled", "ours dflash r compiled+draft",
             "ours dflash r compiled+d ser", "ours dflash random rows2", "ours dflash random rows2 ser")
    assert set(names) <= set(rows), rows
    for name in names:
        # fused decoding, with the verify's taps queued as built, and compiled, is still lossless
        assert rows[name].rstrip().endswith("1/1"), rows[name]
    assert "ours dflash random x1 fused per cycle (B=4)" in r.stdout
    assert "ours dflash random compiled per cycle (B=4)" in r.stdout
    assert "ours dflash r compiled+draft per cycle (B=4)" in r.stdout
    costs = json.loads((tmp_path / "f.json").read_text())["cycle_cost"]
    assert costs["ours dflash random x1 fused"]["verify_s"] > 0
    bad = _run("--target", tiny_models.llama, "--dflash-random-layers", 1, "--queue-taps")
    assert bad.returncode == 2 and "--queue-taps: its rows run on the fused target" in bad.stderr
    bad = _run("--target", tiny_models.llama, "--dflash-random-layers", 1, "--compile")
    assert bad.returncode == 2 and "--compile: its rows run on the fused target" in bad.stderr
    bad = _run("--target", tiny_models.llama, "--dflash-random-layers", 1, "--fuse", "--compile-draft")
    assert bad.returncode == 2 and "--compile-draft: its rows compile the verify as well" in bad.stderr
    bad = _run("--target", tiny_models.llama, "--dflash-random-layers", 1, "--fuse", "--compile", "--serial")
    assert bad.returncode == 2 and "--serial: the serial order is an alternative for the compiled draft" in bad.stderr


def test_only_keeps_the_named_methods_and_the_plain_rows_they_divide_by(tiny_models):
    base = ["--target", tiny_models.llama, "--dflash-random-layers", 1, "--block-size", 4, "--max-tokens", 10,
            "--prompts", 1, "--max-prompt-tokens", 24, "--reps", 1, "--cases", CASES_DIR, "--dtype", "float32",
            "--fuse", "--compile", "--adaptive"]
    r = _run(*base, "--only", "random compiled", "adapt compiled")
    assert r.returncode == 0, r.stderr
    names = {line[6:35].strip() for line in r.stdout.splitlines() if line.startswith("code ")}
    # the fixed-block compiled row's cycle-cost line divides by "ours plain compiled": kept too
    assert names == {"plain mlx-lm", "ours dflash random compiled", "ours plain compiled",
                     "random x1 adapt compiled"}, names
    assert "ours dflash random compiled per cycle (B=4)" in r.stdout
    bad = _run(*base, "--only", "no such method")
    assert bad.returncode == 2 and "--only no such method: no method's name contains it" in bad.stderr


def test_small_gemm_rows_need_the_compiled_draft_and_cuda(tiny_models):
    import mlx.core as mx

    base = ["--target", tiny_models.llama, "--dflash-random-layers", 1, "--cases", CASES_DIR, "--small-gemm"]
    bad = _run(*base)
    assert bad.returncode == 2 and "--small-gemm: its rows are the compiled-draft methods" in bad.stderr
    if not mx.cuda.is_available():
        bad = _run(*base, "--fuse", "--compile", "--compile-draft")
        assert bad.returncode == 2 and "--small-gemm: needs MLX's CUDA backend" in bad.stderr
        assert "Traceback" not in bad.stderr


def test_small_kernel_rows_time_their_cycle_parts_as_they_run(tmp_path, tiny_models, monkeypatch, capsys):
    """On the CPU, with small_gemm left out and the attention kernel replaced by MLX's own (taking
    the tiny model's head dim): the ' sg' and ' sg a' fixed-block rows get cycle-cost lines, and
    the ' sg a' line's parts are timed with the mark on (the kernel is called while they are)."""
    from mlx_lm import load

    import bench.bench_dflash as bd
    import worker.small_attention as sa
    import worker.small_gemm as sg
    from worker.models.dflash_checkpoint import init_dflash_draft, save_dflash_draft

    target, _ = load(str(tiny_models.llama))
    save_dflash_draft(init_dflash_draft(target, num_layers=1, block_size=4), tmp_path / "draft")
    monkeypatch.setattr(sg, "available", lambda: True)
    monkeypatch.setattr(sg, "use_small_gemm", lambda model: 0)
    monkeypatch.setattr(sa, "available", lambda: True)
    monkeypatch.setattr(sa, "applies", lambda *a, **kw: True)
    calls, marks = [], []
    timing = {"on": False}
    real_alone = bd.per_cycle_alone

    def kernel(q, k, v, scale, mask=None, n_splits=1):
        calls.append(timing["on"])
        B, H = q.shape[:2]
        rep = H // k.shape[1]
        k, v = (mx.repeat(mx.broadcast_to(a, (B, *a.shape[1:])), rep, axis=1) for a in (k, v))
        return sa._mlx_sdpa(q, k, v, scale=scale, mask=mask)

    def alone(*a, **kw):
        marks.append(sa.uses_small_attention(a[0]))  # the verify's model while its parts are timed
        timing["on"] = True
        try:
            return real_alone(*a, **kw)
        finally:
            timing["on"] = False
    monkeypatch.setattr(sa, "small_attention", kernel)
    monkeypatch.setattr(bd, "per_cycle_alone", alone)
    rc = bd.main(["--target", str(tiny_models.llama), "--dflash-draft", str(tmp_path / "draft"), "--max-tokens", "8",
                  "--prompts", "1", "--max-prompt-tokens", "24", "--reps", "1", "--cases", str(CASES_DIR),
                  "--dtype", "float32", "--fuse", "--compile", "--compile-draft", "--small-gemm",
                  "--small-attention", "--only", "sg"])
    out = capsys.readouterr().out
    assert rc in (0, None), out
    lines = [line for line in out.splitlines() if " per cycle (B=4)" in line]
    assert any(" sg per cycle" in line for line in lines) and any(" sg a per cycle" in line for line in lines), out
    assert all("ratio" in line for line in lines)
    assert True in calls  # the ' sg a' line's parts ran through the (replaced) kernel
    assert sorted(marks) == [False, True]  # the ' sg' line's parts without the mark, ' sg a''s with it
