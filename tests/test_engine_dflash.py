"""A worker serving a DFlash draft: the engine detects the checkpoint, routes mode "dflash" to
it, and its greedy output equals plain greedy output (through the engine and the cluster)."""
from __future__ import annotations

import pytest

from flashfleet import Client
from flashfleet.errors import ModelNotFound
from flashfleet.v1 import common_pb2
from harness import run_request, start_cluster
from worker.config import EngineConfig
from worker.engine.thread import Engine
from worker.engine.types import GenerationRequest


@pytest.mark.parametrize("adaptive", [False, True])
def test_engine_detects_dflash_and_matches_plain(tiny_models, dflash_dir, adaptive):
    """Mode "auto" on a worker with a DFlash draft is DFlash, with a fixed or an adaptive block
    size, and its greedy output equals plain greedy."""
    cfg = EngineConfig(model_path=tiny_models.llama, draft_path=dflash_dir, adaptive_block_size=adaptive)
    with Engine(cfg) as engine:
        assert engine.model.draft_mode == "dflash"
        prompt = tuple(engine.encode_prompt("Speculation pays when", None))
        plain, _ = run_request(engine, GenerationRequest("p", prompt, 23, mode="plain"))
        spec, done = run_request(engine, GenerationRequest("d", prompt, 23, mode="auto"))
        assert spec == plain
        s = done.stats
        assert s.mode == "dflash" and s.cycles > 0
        assert sum(s.accepted_per_position) == s.accepted_tokens
        if not adaptive:
            assert s.drafted_tokens >= s.cycles  # block size 4: up to 3 drafts per cycle


def test_cluster_routes_dflash_requests_to_the_dflash_worker(tiny_models, dflash_dir):
    engines = {
        "plain": Engine(EngineConfig(model_path=tiny_models.llama, model_name="tiny")),
        "dflash": Engine(EngineConfig(model_path=tiny_models.llama, model_name="tiny",
                                      draft_path=dflash_dir)),
    }
    c = start_cluster(engines)
    try:
        with Client(c.address) as client:
            plain = client.complete("tiny", prompt="Blocks of tokens", max_tokens=17, mode="plain")
            for _ in range(3):
                d = client.complete("tiny", prompt="Blocks of tokens", max_tokens=17, mode="dflash")
                assert d.worker_id == "dflash" and d.stats.mode == "dflash"
                assert d.token_ids == plain.token_ids
            with pytest.raises(ModelNotFound, match=r"mode 'draft' \(modes served for it: dflash, plain\)"):
                client.complete("tiny", prompt="x", max_tokens=2, mode="draft")
            models = client.list_models()
            assert models[0].info.name == "tiny"
            assert sorted(models[0].worker_ids) == ["dflash", "plain"]
            assert list(models[0].modes) == [common_pb2.DECODE_MODE_PLAIN,
                                             common_pb2.DECODE_MODE_DFLASH]
    finally:
        c.close()


def test_model_info_names_a_shipped_draft_and_its_block(tiny_models, dflash_dir, tmp_path, monkeypatch):
    """A shipped draft's directory is named after its target, so the worker calls it
    `flashfleet/drafts/NAME`; a DFlash draft drafts block size - 1 tokens a cycle (the metrics'
    per-position series), whatever --num-draft-tokens says."""
    import shutil

    root = tmp_path / "drafts"
    shipped = root / "tiny"
    shutil.copytree(dflash_dir, shipped)
    monkeypatch.setenv("FLASHFLEET_DRAFTS_DIR", str(root))
    with Engine(EngineConfig(model_path=tiny_models.llama, model_name="tiny", draft_path=shipped)) as engine:
        assert engine.model.draft == "flashfleet/drafts/tiny" and engine.model.num_draft_tokens == 3
    with Engine(EngineConfig(model_path=tiny_models.llama, draft_path=dflash_dir, block_size=2)) as engine:
        assert engine.model.draft == "tiny-dflash" and engine.model.num_draft_tokens == 1
