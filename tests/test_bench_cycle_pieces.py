"""bench/bench_cycle_pieces.py's cycle on a tiny target: every order (overlap, overlap1,
pipelined, split, and the engine's own loop both ways) and every row count run the same verdicts
and time every piece. The draft's proposals are the target's own continuation (every block
accepted in full), so a mode that kept the wrong context, offsets or first token would show in the
tokens per cycle."""
import sys
from pathlib import Path

import pytest

from tests.test_compiled_draft import _OracleProposals
from tests.test_dflash import PROMPT, TARGETS
from worker.compiled_draft import shared_compiled_draft
from worker.models.dflash_checkpoint import init_dflash_draft
from worker.sampling import greedy
from worker.spec import plain

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_cycle_pieces import PIECES, run_cycles  # noqa: E402

CYCLES, B = 12, 8


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_every_order_runs_the_same_cycles(name, monkeypatch):
    target = TARGETS[name]()
    draft = init_dflash_draft(target, num_layers=2, block_size=B, seed=7)
    draft.bind(target)
    ref = [t for s in plain.generate(PROMPT, CYCLES * B + 2 * B, greedy, set(), model=target) for t in s.tokens]
    oracle = _OracleProposals(shared_compiled_draft(draft), len(PROMPT), ref)
    monkeypatch.setattr("worker.compiled_draft.shared_compiled_draft", lambda d: oracle)
    monkeypatch.setattr("worker.spec.dflash.shared_compiled_draft", lambda d: oracle)
    runs = {}
    for mode in ("overlap", "overlap1", "pipelined", "split", "engine", "engine_serial"):
        for rows, keep0 in ((1, False), (3, False), (3, True)):
            if not (keep0 and mode.startswith("engine")):
                runs[mode, rows, keep0] = run_cycles(target, draft, PROMPT, rows, CYCLES, mode, keep0)
    for (mode, rows, keep0), out in runs.items():
        assert len(out["cycle"]) == CYCLES and all(len(out[p]) == CYCLES for p in PIECES)
        assert all(c > 0 for c in out["cycle"])
        assert out["tokens"] == [B] * CYCLES, (mode, rows, keep0)  # every block accepted, bonus included
    assert oracle.queued > 0  # the overlap orders queued their drafts through `queue`
