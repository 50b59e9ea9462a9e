"""bench/bench_cycle_pieces.py's cycle on a tiny target: the four orders (overlap, overlap1,
pipelined, split) and every row count run the same verdicts, and every piece is timed."""
import sys
from pathlib import Path

import pytest

from tests.test_dflash import PROMPT, TARGETS
from worker.models.dflash_checkpoint import init_dflash_draft

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_cycle_pieces import PIECES, run_cycles  # noqa: E402


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_every_order_runs_the_same_cycles(name):
    target = TARGETS[name]()
    draft = init_dflash_draft(target, num_layers=2, block_size=8, seed=7)
    draft.bind(target)
    runs = {(mode, rows, keep0): run_cycles(target, draft, PROMPT, rows, 12, mode, keep0)
            for mode in ("overlap", "overlap1", "pipelined", "split") for rows, keep0 in ((1, False), (3, False), (3, True))}
    for mode in ("engine", "engine_serial"):
        for rows in (1, 3):
            runs[mode, rows, False] = run_cycles(target, draft, PROMPT, rows, 12, mode, False)
    for (mode, rows, keep0), out in runs.items():
        assert len(out["cycle"]) == len(out["tokens"]) == 12
        assert all(len(out[p]) == 12 for p in PIECES)
        assert all(c > 0 for c in out["cycle"]) and all(1 <= t <= 8 for t in out["tokens"])
        # the order of the work changes nothing the target decides
        assert out["tokens"] == runs["pipelined", rows, keep0]["tokens"], (mode, rows, keep0)
    assert runs["overlap", 3, True]["tokens"] == runs["overlap", 1, False]["tokens"]  # row 0 = the one block
