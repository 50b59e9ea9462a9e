"""bench/bench_forward_queue.py on a tiny random-weight target: one row per block size and round
with positive times, JSON written, the KV cache back at the context length after every cell,
and bad arguments rejected with one line (exit 2)."""
import json
import sys

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from bench_scripts import ROOT, run_bench
sys.path.insert(0, str(ROOT))


def _run(*args):
    return run_bench("bench_forward_queue.py", *args)


def test_table_json_and_bad_arguments(tmp_path, tiny_models):
    base = ["--target", tiny_models.llama, "--random-weights", "--dtype", "float32"]
    ok = _run(*base, "--blocks", 1, 4, "--steps", 3, "--rounds", 2, "--context", 8,
              "--json-out", tmp_path / "q.json")
    assert ok.returncode == 0, ok.stderr
    rows = [line.split() for line in ok.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [(r[0], r[1], r[2]) for r in rows] == [("1", "0", "mlx"), ("4", "0", "mlx"),
                                                  ("1", "1", "mlx"), ("4", "1", "mlx")]
    assert all(float(r[3]) > 0 and float(r[4]) > 0 for r in rows)
    data = json.loads((tmp_path / "q.json").read_text())
    assert [r["B"] for r in data["rows"]] == [1, 4, 1, 4] and data["context"] == 8

    # Three caches side by side, with taps captured as a verify does: a row per cache and cell.
    ok = _run(*base, "--blocks", 4, "--steps", 2, "--context", 8, "--caches", "mlx", "padded",
              "padded-bool", "--taps", 1, "--json-out", tmp_path / "c.json")
    assert ok.returncode == 0, ok.stderr
    data = json.loads((tmp_path / "c.json").read_text())
    assert [r["cache"] for r in data["rows"]] == ["mlx", "padded", "padded-bool"] and data["taps"] == 1
    assert all(r["queued_ms"] > 0 and r["synced_ms"] > 0 for r in data["rows"])

    for bad, says in ((["--blocks", 0], "--blocks: sizes >= 1"), (["--steps", 0], "at least 1 each"),
                      (["--rounds", 0], "at least 1 each"), (["--context", 0], "at least 1 each"),
                      (["--taps", 99], "--taps: at most"), (["--caches", "nope"], "invalid choice")):
        r = _run(*base, *bad)
        assert r.returncode == 2 and "Traceback" not in r.stderr and says in r.stderr, (bad, r.stderr)


def test_time_forwards_leaves_the_cache_at_the_context(tiny_models):
    from bench.bench_dflash import load_model
    from bench.bench_forward_queue import make_cache, time_forwards
    from worker.capture import HiddenCapture
    from worker.models.dflash import PaddedKVCache

    model = load_model(str(tiny_models.llama), True, mx.float32, tokenizer=False)[0]
    for cache in (make_prompt_cache(model), make_cache(model, "padded")):
        mx.eval(model(mx.array([[1, 2, 3, 4, 5]]), cache=cache))
        for synced in (False, True):
            assert time_forwards(model, cache, 3, 2, synced) > 0
            assert {c.offset for c in cache} == {5}
    # With taps, and with boolean masks for a while: the class default is back afterwards.
    capture = HiddenCapture(model, [0, 1])
    assert time_forwards(model, cache, 3, 2, True, capture, additive=False) > 0
    assert PaddedKVCache.additive is True and {c.offset for c in cache} == {5}
    assert capture.layers[0] is not None and type(capture.layers[0]).__name__ != "_Tap"
