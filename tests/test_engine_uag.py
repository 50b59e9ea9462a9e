"""A worker serving a draft with another tokenizer: the engine detects it as a cross-tokenizer
("uag") draft, and its greedy output through the engine and the cluster equals plain greedy."""
from __future__ import annotations

import pytest

from flashfleet import Client
from harness import run_request, start_cluster
from tiny_models import build_model_dir, model_config
from worker.config import EngineConfig
from worker.engine.thread import Engine
from worker.engine.types import GenerationRequest

TEXTS = ["Zażółć gęślą jaźń 🙂 i", "def f(x):\n\t  return  x"]


@pytest.fixture(scope="module")
def spm_draft_dir(tiny_models, tmp_path_factory):
    """A tiny llama with the SentencePiece-style byte-fallback tokenizer (the targets use BPE)."""
    from transformers import AutoTokenizer
    vocab = len(AutoTokenizer.from_pretrained(str(tiny_models.spm_tokenizer)))
    cfg = model_config("llama", vocab, 2, layers=1, max_position_embeddings=512)
    return build_model_dir(tmp_path_factory.mktemp("uag") / "spm_draft", cfg,
                           tiny_models.spm_tokenizer, seed=11)


def test_engine_detects_cross_tokenizer_draft_and_matches_plain(tiny_models, spm_draft_dir):
    with Engine(EngineConfig(model_path=tiny_models.qwen2, draft_path=spm_draft_dir)) as engine:
        assert engine.model.draft_mode == "uag"
        for i, text in enumerate(TEXTS):
            prompt = tuple(engine.encode_prompt(text, None))
            plain, _ = run_request(engine, GenerationRequest(f"p{i}", prompt, 21, mode="plain"))
            spec, done = run_request(engine, GenerationRequest(f"u{i}", prompt, 21, mode="auto"))
            assert spec == plain, text
            assert done.stats.mode == "uag"


def test_same_tokenizer_draft_stays_classic(tiny_models):
    with Engine(EngineConfig(model_path=tiny_models.llama, draft_path=tiny_models.llama_draft,
                             warmup=False)) as engine:
        assert engine.model.draft_mode == "draft"


def test_cluster_routes_uag_requests(tiny_models, spm_draft_dir):
    c = start_cluster({"uag": Engine(EngineConfig(model_path=tiny_models.qwen2, model_name="q",
                                                  draft_path=spm_draft_dir))})
    try:
        with Client(c.address) as client:
            plain = client.complete("q", prompt=TEXTS[0], max_tokens=15, mode="plain")
            uag = client.complete("q", prompt=TEXTS[0], max_tokens=15, mode="uag")
        assert uag.token_ids == plain.token_ids and uag.stats.mode == "uag"
        assert uag.text == plain.text
    finally:
        c.close()
