"""The whole path SDK -> coordinator -> worker -> MLX engine over real gRPC on loopback, with tiny
random-weight models of real architectures (fast on a CPU)."""
from __future__ import annotations

import time

import mlx.core as mx
import pytest

from flashfleet import Client
from flashfleet.errors import InvalidArgument, ModelNotFound
from harness import start_cluster
from worker.config import EngineConfig
from worker.engine.thread import Engine


def greedy_reference(model_dir, prompt_tokens, n):
    """Plain greedy decoding with mlx-lm's own generate_step (the baseline), the model loaded as
    the workers load it (`worker.loading.load_target`: their compute dtype; same process, same BLAS)."""
    from mlx_lm.generate import generate_step

    from worker.loading import load_target
    model, _ = load_target(model_dir)
    out = []
    for tok, _ in generate_step(mx.array(prompt_tokens), model, max_tokens=n):
        out.append(int(tok))
    return out


@pytest.fixture(scope="module")
def mlx_cluster(tiny_models):
    llama = tiny_models.llama
    engines = {
        "plain-1": Engine(EngineConfig(model_path=llama, model_name="tiny-llama", capacity=3)),
        "spec-2": Engine(EngineConfig(model_path=llama, model_name="tiny-llama", capacity=3,
                                      draft_path=tiny_models.llama_near, num_draft_tokens=3)),
    }
    cluster = start_cluster(engines)
    yield cluster, engines
    cluster.close()


def test_greedy_through_cluster_equals_mlx_lm(mlx_cluster, tiny_models):
    cluster, engines = mlx_cluster
    prompt = "The river flows"
    ids = engines["plain-1"].encode_prompt(prompt, None)
    want = greedy_reference(tiny_models.llama, ids, 24)
    with Client(cluster.address) as client:
        for mode in ("plain", "draft"):
            seen = set()
            for _ in range(4):  # plain: either worker, whichever the router picks
                done = client.complete("tiny-llama", prompt=prompt, max_tokens=24, mode=mode)
                seen.add(done.worker_id)
                n = len(done.token_ids)
                assert done.token_ids == want[:n], (mode, done.worker_id)
                if done.finish_reason == "length":
                    assert n == 24
            if mode == "draft":
                assert seen == {"spec-2"}


def test_draft_mode_routes_to_the_worker_with_a_draft_and_reports_acceptance(mlx_cluster):
    cluster, _ = mlx_cluster
    with Client(cluster.address) as client:
        for _ in range(3):
            done = client.complete("tiny-llama", prompt="A long road", max_tokens=20, mode="draft")
            assert done.worker_id == "spec-2"
            s = done.stats
            assert s.mode == "draft" and s.cycles > 0 and s.drafted_tokens > 0
            assert 1.0 <= s.acceptance_length <= 4.0  # k=3: at most 3 accepted + the bonus
            assert s.acceptance_length == pytest.approx((s.accepted_tokens + s.cycles) / s.cycles)
            assert sum(s.accepted_per_position) == s.accepted_tokens


def test_seeded_sampling_reproducible_through_cluster(mlx_cluster):
    cluster, _ = mlx_cluster
    with Client(cluster.address) as client:
        a = client.complete("tiny-llama", prompt="Once", max_tokens=16, temperature=1.0,
                            top_p=0.9, seed=7, mode="plain", session_id="seed-a")
        b = client.complete("tiny-llama", prompt="Once", max_tokens=16, temperature=1.0,
                            top_p=0.9, seed=7, mode="plain", session_id="seed-b")
        c = client.complete("tiny-llama", prompt="Once", max_tokens=16, temperature=1.0,
                            top_p=0.9, seed=8, mode="plain")
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_engine_validation_reaches_the_client(mlx_cluster, tiny_models):
    cluster, _ = mlx_cluster
    ctx = tiny_models.max_position_embeddings
    with Client(cluster.address) as client:
        with pytest.raises(InvalidArgument, match="context|max_tokens"):
            client.complete("tiny-llama", prompt="hi", max_tokens=ctx + 10)
        with pytest.raises(InvalidArgument, match="context|prompt"):
            client.complete("tiny-llama", prompt="word " * (ctx * 2), max_tokens=4)
        with pytest.raises(ModelNotFound, match=r"mode 'dflash' \(modes served for it: draft, plain\)"):
            client.complete("tiny-llama", prompt="hi", max_tokens=4, mode="dflash")
        assert client.complete("tiny-llama", prompt="still serving", max_tokens=3).token_ids


def test_cancel_mid_stream_frees_mlx_worker(mlx_cluster):
    cluster, engines = mlx_cluster
    with Client(cluster.address) as client:
        stream = client.generate("tiny-llama", prompt="Tell me", max_tokens=400, mode="plain")
        next(stream)
        stream.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(e.load().active_sessions for e in engines.values()):
        time.sleep(0.05)
    assert all(e.load().active_sessions == 0 for e in engines.values())


def test_worker_metrics_match_final_stats(mlx_cluster):
    cluster, _ = mlx_cluster
    idx = [w.worker_id for w in cluster.workers].index("spec-2")
    m = cluster.worker_metrics[idx]
    before = {k: c.labels(model="tiny-llama", method="draft")._value.get()
              for k, c in (("drafted", m.drafted), ("accepted", m.accepted), ("cycles", m.cycles))}
    with Client(cluster.address) as client:
        done = client.complete("tiny-llama", prompt="Metrics", max_tokens=12, mode="draft")
    s = done.stats
    after = {k: c.labels(model="tiny-llama", method="draft")._value.get()
             for k, c in (("drafted", m.drafted), ("accepted", m.accepted), ("cycles", m.cycles))}
    assert after["drafted"] - before["drafted"] == s.drafted_tokens
    assert after["accepted"] - before["accepted"] == s.accepted_tokens
    assert after["cycles"] - before["cycles"] == s.cycles


def test_cancelled_request_is_counted_once_with_its_tokens(mlx_cluster):
    cluster, _ = mlx_cluster

    def totals():
        return (sum(m.requests.labels(model="tiny-llama", outcome="cancelled")._value.get()
                    for m in cluster.worker_metrics),
                sum(m.generated_tokens.labels(model="tiny-llama")._value.get()
                    for m in cluster.worker_metrics))

    before_n, before_tokens = totals()
    with Client(cluster.address) as client:
        stream = client.generate("tiny-llama", prompt="Go on", max_tokens=400, mode="plain")
        first = next(stream)
        stream.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and totals()[0] == before_n:
        time.sleep(0.05)
    time.sleep(0.2)  # a double count would show up by now
    n, tokens = totals()
    assert n == before_n + 1
    assert tokens >= before_tokens + len(first.token_ids)
