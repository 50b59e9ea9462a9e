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
from worker.engine.block_policy import Acceptance, BatchBlockPolicy
from worker.engine.warm import CONTEXT, plan, warm_shapes


def test_plan_covers_every_batch_size_and_block_smallest_first():
    assert plan([2, 1], [1, 4, 2], dflash=True) == [
        ("plain", 1, 1), ("dflash", 1, 1), ("dflash", 1, 2), ("dflash", 1, 4),
        ("plain", 2, 1), ("dflash", 2, 1), ("dflash", 2, 2), ("dflash", 2, 4)]
    assert plan([1, 2, 3], [1, 16], dflash=False) == [("plain", 1, 1), ("plain", 2, 1), ("plain", 3, 1)]


def test_a_seeded_policy_serves_without_probing():
    """Costs measured at warm-up (`seed`) let the first iteration in a bucket take the block that
    pays: a long block where a verify costs about a plain step (a GPU), a plain step where the cost
    grows with the block (a CPU). Unseeded, the same bucket first measures a plain step."""
    rows = [Acceptance.known(0.9) for _ in range(2)]
    flat, linear = BatchBlockPolicy(16), BatchBlockPolicy(16)
    for L in (1, 2, 4, 8, 16):
        flat.seed(2, 300, L, 0.010 + 0.0002 * L)
        linear.seed(2, 300, L, 0.010 * L)
    assert flat.choose(rows, 300, 64) == 16
    assert linear.choose([Acceptance.known(0.3)] * 2, 300, 64) == 1
    assert BatchBlockPolicy(16).choose(rows, 300, 64) == 1  # unseeded: it measures a plain step first
    flat.observe(2, 300, 16, 0.012)  # after a seed, the bucket's first real iteration counts
    assert flat.cost(2, 300, 16) == pytest.approx(0.012)


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


def test_the_engine_block_policy_starts_from_the_warm_up_costs_on_a_gpu(tiny_models, dflash_dir, caplog):
    """The startup log gives batch size 1's DFlash costs by block size. On a GPU every warmed
    DFlash shape has a cost in the block policy before the first request; on a CPU the policy
    measures as it serves (no cost before)."""
    import mlx.core as mx

    cfg = EngineConfig(model_path=tiny_models.llama, draft_path=dflash_dir, capacity=2)
    with caplog.at_level(logging.INFO, logger="worker.engine.thread"):
        with Engine(cfg) as engine:
            policy = engine._scheduler.policy  # idle: read only
            costs = {(B, L): policy.cost(B, CONTEXT, L) for B in (1, 2) for L in (1, 2, 4)}
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("DFlash iteration")]
    assert len(lines) == 1 and lines[0].startswith("DFlash iteration at batch size 1, ")
    assert all(f"{L}: " in lines[0] for L in (1, 2, 4)), lines
    if mx.default_device().type == mx.DeviceType.gpu:
        assert all(c is not None and c > 0 for c in costs.values()), costs
    else:
        assert all(c is None for c in costs.values()), costs


def test_warm_shapes_stops_at_its_budget_and_zero_warms_none(tiny_models, dflash_dir):
    from worker.config import EngineConfig as Cfg
    from worker.engine.load import load_models
    from worker.capture import HiddenCapture

    m = load_models(Cfg(model_path=tiny_models.llama, draft_path=dflash_dir), "dflash")
    capture = HiddenCapture(m.target, m.draft.target_layer_ids)
    ticks = itertools.count()  # one second a reading: the budget of 2.5 s allows two shapes
    report = warm_shapes(m, capture, [1, 2], [1, 2, 4], 2.5, clock=lambda: float(next(ticks)))
    assert report.warmed == (("plain", 1, 1), ("dflash", 1, 1)) and report.planned == 8
    assert [c[:3] for c in report.costs] == [(1, report.costs[0][1], 1)] and report.costs[0][3] > 0
    none = warm_shapes(m, capture, [1, 2], [1, 2, 4], 0.0)
    assert none.warmed == () and none.planned == 0 and none.costs == ()


def test_warmup_shapes_budget_is_checked():
    with pytest.raises(ValueError, match="warmup_shapes_s must be >= 0"):
        EngineConfig(model_path=".", warmup_shapes_s=-1)
    with pytest.raises(SystemExit):
        cli.parse_args(["--model", "x", "--warmup-shapes-s", "nan"])
    assert cli.parse_args(["--model", "x"]).warmup_shapes_s == 60.0
