"""Engine dataclasses -> protos -> SDK types: the KV-memory and prompt-cache fields get through."""
from __future__ import annotations

from flashfleet.types import GenerationStats as SDKStats
from worker.convert import load_proto, model_info, stats_proto
from worker.engine.types import EngineLoad, GenerationStats, ModelDescription


def test_cached_tokens_and_preemptions_reach_the_sdk():
    proto = stats_proto(GenerationStats(prompt_tokens=40, generated_tokens=5, cached_tokens=32, preemptions=2))
    assert (proto.cached_tokens, proto.preemptions) == (32, 2)
    sdk = SDKStats.from_proto(proto)
    assert (sdk.prompt_tokens, sdk.cached_tokens, sdk.preemptions) == (40, 32, 2)


def test_load_proto_carries_budget_free_and_prompt_cache_bytes():
    load = EngineLoad(active_sessions=1, capacity=4, kv_cache_bytes=300, kv_budget_bytes=1000, prompt_cache_bytes=500)
    proto = load_proto(load)
    assert (proto.kv_cache_bytes, proto.kv_budget_bytes, proto.prompt_cache_bytes) == (300, 1000, 500)
    assert proto.kv_free_bytes == load.kv_free_bytes == 700
    over = load_proto(EngineLoad(active_sessions=1, capacity=4, kv_cache_bytes=1200, kv_budget_bytes=1000))
    assert over.kv_free_bytes == 0


def test_model_info_reports_target_plus_draft_kv_bytes_per_token():
    m = ModelDescription(name="m", max_context_tokens=64, draft="d", draft_mode="dflash",
                         kv_bytes_per_token=28672, draft_kv_bytes_per_token=4096)
    assert model_info(m).kv_bytes_per_token == 28672 + 4096
    assert model_info(ModelDescription(name="m", max_context_tokens=64)).kv_bytes_per_token == 0


def test_load_proto_carries_sessions_profile_and_machine():
    from worker.engine.profile import DecodeCostEntry, SessionSnapshot

    load = EngineLoad(active_sessions=1, capacity=4, kv_cache_bytes=10, kv_budget_bytes=100,
                      sessions=(SessionSnapshot("r", 300, 3000, 25.0, 1.5, 200),),
                      decode_profile=(DecodeCostEntry(2, 512, 0.02, 7),), prefill_seconds_per_token=1e-4)
    proto = load_proto(load, "M4 Pro", 273e9)
    (s,) = proto.sessions
    assert (s.request_id, s.context_tokens, s.kv_bytes, s.remaining_tokens) == ("r", 300, 3000, 200)
    assert (s.tokens_per_s, s.speculative_speedup) == (25.0, 1.5)
    (c,) = proto.decode_profile
    assert (c.batch_size, c.context_tokens, c.seconds, c.samples) == (2, 512, 0.02, 7)
    assert proto.chip == "M4 Pro" and proto.peak_memory_bandwidth_bytes_per_s == 273e9
    assert proto.prefill_seconds_per_token == 1e-4
    assert load_proto(load).peak_memory_bandwidth_bytes_per_s == 0  # unknown
