"""worker/engine/warm.py: a worker warms every batch size x DFlash block size at load, within
its time budget, says so in its startup log, and decodes the same afterwards."""
from __future__ import annotations

import itertools
import logging

import pytest

import worker.__main__ as cli
from harness import run_request
from worker.config import EngineConfig
from worker.engine.thread import Engine
from worker.engine.types import GenerationRequest
from worker.engine.warm import plan, warm_shapes


def test_plan_covers_every_batch_size_and_block_smallest_first():
    assert plan([2, 1], [1, 4, 2], dflash=True) == [
        ("plain", 1, 1), ("dflash", 1, 1), ("dflash", 1, 2), ("dflash", 1, 4),
        ("plain", 2, 1), ("dflash", 2, 1), ("dflash", 2, 2), ("dflash", 2, 4)]
    assert plan([1, 2, 3], [1, 16], dflash=False) == [("plain", 1, 1), ("plain", 2, 1), ("plain", 3, 1)]


def test_engine_warms_every_shape_and_logs_it(tiny_models, dflash_dir, caplog):
    """Capacity 3 with a block-4 draft: batch sizes 1-3 x (a plain step + blocks 1, 2, 4)."""
    cfg = EngineConfig(model_path=tiny_models.llama, draft_path=dflash_dir, capacity=3)
    with caplog.at_level(logging.INFO, logger="worker.engine.thread"):
        with Engine(cfg) as engine:
            prompt = tuple(engine.encode_prompt("Warm shapes", None))
            plain, _ = run_request(engine, GenerationRequest("p", prompt, 20, mode="plain"))
            spec, done = run_request(engine, GenerationRequest("d", prompt, 20, mode="dflash"))
    assert spec == plain and done.stats.cycles > 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warm-up:")]
    assert len(lines) == 1 and lines[0].startswith("warm-up: 12 of 12 batched shapes (batch sizes 1-3 x plain "
                                                   "and DFlash blocks 1,2,4) in "), lines


def test_warm_shapes_stops_at_its_budget_and_zero_warms_none(tiny_models, dflash_dir):
    from worker.config import EngineConfig as Cfg
    from worker.engine.load import load_models
    from worker.capture import HiddenCapture

    m = load_models(Cfg(model_path=tiny_models.llama, draft_path=dflash_dir), "dflash")
    capture = HiddenCapture(m.target, m.draft.target_layer_ids)
    ticks = itertools.count()  # one second a reading: the budget of 2.5 s allows two shapes
    report = warm_shapes(m, capture, [1, 2], [1, 2, 4], 2.5, clock=lambda: float(next(ticks)))
    assert report.warmed == (("plain", 1, 1), ("dflash", 1, 1)) and report.planned == 8
    none = warm_shapes(m, capture, [1, 2], [1, 2, 4], 0.0)
    assert none.warmed == () and none.planned == 0


def test_warmup_shapes_budget_is_checked():
    with pytest.raises(ValueError, match="warmup_shapes_s must be >= 0"):
        EngineConfig(model_path=".", warmup_shapes_s=-1)
    with pytest.raises(SystemExit):
        cli.parse_args(["--model", "x", "--warmup-shapes-s", "nan"])
    assert cli.parse_args(["--model", "x"]).warmup_shapes_s == 60.0
