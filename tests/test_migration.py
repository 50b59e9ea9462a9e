"""Session migration (coordinator/migration.py): when the policy moves a session, and a real
migration through the cluster (SDK -> coordinator -> two MLX workers over loopback gRPC) that
loses and repeats no token: both sessions end with the greedy output they would have had
unmigrated, one of them on the other worker, and the stats and metrics say so."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest

from coordinator.migration import MigrationPolicy, StreamProgress
from flashfleet import Client
from flashfleet.v1 import common_pb2
from harness import run_request, start_cluster
from worker.config import EngineConfig
from worker.engine.thread import Engine
from worker.engine.types import GenerationRequest


@dataclass
class FakeWorker:
    worker_id: str
    in_flight: int = 0
    capacity: int = 2
    models: tuple = ("m",)
    unreachable: bool = False

    def serves(self, model, mode=common_pb2.DECODE_MODE_AUTO):
        return model in self.models


def _req(**kw):
    return common_pb2.GenerateRequest(model="m", prompt="p", **kw)


def test_policy_moves_a_shared_session_to_an_idle_worker_only():
    p = MigrationPolicy(min_remaining_tokens=10, cooldown_s=5.0)
    src, idle, busy = FakeWorker("a", in_flight=2), FakeWorker("b"), FakeWorker("c", in_flight=1)
    workers = [src, idle, busy]
    assert p.target(_req(max_tokens=100), src, 5, workers, None, 0.0) is idle
    # alone on its worker: nothing to gain
    assert p.target(_req(max_tokens=100), FakeWorker("a", in_flight=1), 5, workers, None, 0.0) is None
    assert p.target(_req(max_tokens=100), src, 0, workers, None, 0.0) is None  # nothing streamed yet
    assert p.target(_req(max_tokens=100), src, 95, workers, None, 0.0) is None  # 5 left < 10
    assert p.target(_req(max_tokens=100), src, 5, [src, busy], None, 0.0) is None  # nobody idle
    assert p.target(_req(max_tokens=100), src, 5, workers, 1.0, 3.0) is None  # moved 2 s ago
    assert p.target(_req(max_tokens=100), src, 5, workers, 1.0, 7.0) is idle
    assert p.target(_req(max_tokens=100, temperature=0.8, seed=3), src, 5, workers, None, 0.0) is None
    assert p.target(_req(max_tokens=100, temperature=0.8), src, 5, workers, None, 0.0) is idle
    assert p.target(_req(), src, 5, workers, None, 0.0) is idle  # budget unset: the worker's default (256)
    assert p.target(_req(), src, 250, workers, None, 0.0) is None
    gone = FakeWorker("e", unreachable=True)  # idle only because its calls fail
    assert p.target(_req(max_tokens=100), src, 5, [src, gone], None, 0.0) is None
    other_model = FakeWorker("d", models=("other",))
    assert p.target(_req(max_tokens=100), src, 5, [src, other_model], None, 0.0) is None
    assert MigrationPolicy(enabled=False).target(_req(max_tokens=100), src, 5, workers, None, 0.0) is None
    with pytest.raises(ValueError):
        MigrationPolicy(min_remaining_tokens=0)


def test_progress_builds_the_resume_request_and_the_requests_stats():
    prog = StreamProgress(clock=lambda: 10.0)
    prog.add(common_pb2.Chunk(text="Hel", token_ids=[1, 2]))
    prog.add(common_pb2.Chunk(text="", token_ids=[3]))
    prog.add(common_pb2.Chunk(text="lo", token_ids=[4]))
    req = _req(max_tokens=50, request_id="r1")
    resumed = prog.resume_request(req)
    assert list(resumed.resume_token_ids) == [1, 2, 3, 4] and resumed.resume_text == "Hello"
    assert resumed.max_tokens == 50 and resumed.request_id == "r1" and not req.resume_token_ids
    prog.moved()
    prog.add(common_pb2.Chunk(text="!", token_ids=[5]))
    stats = common_pb2.GenerationStats(prompt_tokens=7 + 4, generated_tokens=1)
    prog.finish_stats(stats)  # the last worker prefilled 7 prompt + 4 resumed tokens, generated 1
    assert (stats.prompt_tokens, stats.generated_tokens, stats.migrations) == (7, 5, 1)
    assert prog.moved_s == 10.0


PROMPTS = ["The river flows", "Once upon a time", "Dzień dobry", "def f(x):"]
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def two_workers(tiny_models):
    engines = {w: Engine(EngineConfig(model_path=tiny_models.llama, model_name="tiny-llama", capacity=3))
               for w in ("w1", "w2")}
    policy = MigrationPolicy(min_remaining_tokens=8, cooldown_s=60.0, check_interval_s=0.0)
    cluster = start_cluster(engines, migration=policy)
    yield cluster, engines
    cluster.close()


def _reference(engine, prompt):
    ids = tuple(engine.encode_prompt(prompt, None))
    tokens, done = run_request(engine, GenerationRequest(f"ref-{prompt}", ids, MAX_TOKENS, mode="plain"))
    return ids, tokens, done


def test_a_shared_session_moves_to_the_idle_worker_without_losing_a_token(two_workers):
    cluster, engines = two_workers
    refs = {p: _reference(engines["w1"], p) for p in PROMPTS}
    long = [p for p in PROMPTS if len(refs[p][1]) == MAX_TOKENS]  # no early EOS: room to migrate
    assert len(long) >= 2, "the tiny model ended every prompt early; pick other prompts"
    first, second = long[:2]
    results, errors = {}, []

    def run(prompt):
        try:
            with Client(cluster.address) as client:
                results[prompt] = client.complete("tiny-llama", prompt=prompt, max_tokens=MAX_TOKENS,
                                                  mode="plain", session_id="user-1")
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    # Both requests of one session go to the session's worker (affinity); the second arrives while
    # the first streams, so that worker runs two and the other none: the policy moves one of them.
    a = threading.Thread(target=run, args=(first,))
    a.start()
    affinity = cluster.coordinator.servicer.affinity
    deadline = time.monotonic() + 30
    while affinity.lookup("user-1") is None and time.monotonic() < deadline and a.is_alive():
        time.sleep(0.002)  # bound at the first token
    live = {w.worker_id: w for w in cluster.coordinator.registry.live()}
    src = live.get(affinity.lookup("user-1"))
    assert src is not None and src.in_flight == 1, "the first request is not streaming"
    dest = ({"w1", "w2"} - {src.worker_id}).pop()
    b = threading.Thread(target=run, args=(second,))
    b.start()
    a.join(120)
    b.join(120)
    assert not errors, errors
    for prompt in (first, second):
        done = results[prompt]
        ids, ref, ref_done = refs[prompt]
        assert done.token_ids == ref, prompt  # nothing lost, nothing repeated, same greedy tokens
        assert done.text == engines["w1"]._encode_tokenizer.decode(ref)
        assert done.finish_reason == "length"
        assert done.stats.generated_tokens == MAX_TOKENS and done.stats.prompt_tokens == len(ids)
    moved = [p for p in (first, second) if results[p].stats.migrations]
    assert len(moved) == 1, {p: (r.worker_id, r.stats.migrations) for p, r in results.items()}
    assert results[moved[0]].worker_id == dest and results[moved[0]].stats.migrations == 1
    stayed = ({first, second} - set(moved)).pop()
    assert results[stayed].worker_id == src.worker_id and results[stayed].stats.migrations == 0
    m = cluster.coordinator.metrics.migrations
    assert m.labels(model="tiny-llama", outcome="ok")._value.get() == 1
    # The source worker counts the moved request as migrated, not as cancelled by a client.
    src_metrics = cluster.worker_metrics[[w.worker_id for w in cluster.workers].index(src.worker_id)]
    outcomes = {o: src_metrics.requests.labels(model="tiny-llama", outcome=o)._value.get()
                for o in ("migrated", "cancelled")}
    assert outcomes == {"migrated": 1, "cancelled": 0}, outcomes
    assert all(w.in_flight == 0 for w in cluster.coordinator.registry.live())  # every slot released
    assert sum(w.served_requests for w in cluster.coordinator.registry.live()) == 2  # each request once


def test_clients_cannot_send_resume_fields(two_workers):
    cluster, _ = two_workers
    import grpc

    from flashfleet.v1 import coordinator_pb2_grpc
    with grpc.insecure_channel(cluster.address) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        req = common_pb2.GenerateRequest(model="tiny-llama", prompt="hi", max_tokens=4, resume_token_ids=[1, 2])
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "set by the coordinator" in e.value.details()


def test_a_refusing_destination_leaves_the_stream_where_it_was(tiny_models):
    """The chosen idle worker refuses the resumed request (RESOURCE_EXHAUSTED): the source call was
    never cancelled, so the stream goes on there without a lost or repeated token."""
    from fakes import FakeEngine

    from worker.engine.types import Overloaded

    engines = {"good": FakeEngine(token_delay_s=0.01), "full": FakeEngine(refuse=Overloaded)}
    cluster = start_cluster(engines, migration=MigrationPolicy(min_remaining_tokens=4, cooldown_s=60.0,
                                                               check_interval_s=0.0))
    try:
        results = {}

        def run(name, prompt):
            with Client(cluster.address) as client:
                results[name] = client.complete("fake-model", prompt=prompt, max_tokens=60, session_id="s")

        a = threading.Thread(target=run, args=("a", "ab"))
        a.start()
        affinity = cluster.coordinator.servicer.affinity
        deadline = time.monotonic() + 30
        while affinity.lookup("s") is None and time.monotonic() < deadline:
            time.sleep(0.002)
        run("b", "cd")  # shares "good" with a; "full" looks idle but refuses
        a.join(60)
        for name, prompt in (("a", "ab"), ("b", "cd")):
            base = sum(ord(c) % 100 for c in prompt)
            assert results[name].token_ids == [(base + i) % 100 for i in range(60)], name
            assert results[name].worker_id == "good" and results[name].stats.generated_tokens == 60
            assert results[name].stats.migrations == 0
        m = cluster.coordinator.metrics.migrations
        assert m.labels(model="fake-model", outcome="aborted")._value.get() >= 1
        assert m.labels(model="fake-model", outcome="ok")._value.get() == 0
        assert not any(r.resume_tokens for r in engines["good"].submitted)  # never resumed
        assert all(w.in_flight == 0 for w in cluster.coordinator.registry.live())
    finally:
        cluster.close()


def test_coordinator_flags_and_cluster_config_set_the_policy(tmp_path):
    import coordinator.__main__ as cli
    from flashfleet.config import ConfigError, load_cluster_config

    assert cli.parse_args([]).migrate is True and cli.parse_args([]).migrate_min_remaining_tokens == 64
    assert cli.parse_args([]).max_queued == 64 and cli.parse_args([]).queue_timeout_s == 30.0
    for bad in (["--max-queued", "-1"], ["--queue-timeout-s", "nan"]):
        with pytest.raises(SystemExit) as e:
            cli.parse_args(bad)
        assert e.value.code == 2
    assert cli.parse_args(["--no-migration"]).migrate is False
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["--migrate-min-remaining-tokens", "0"])
    assert e.value.code == 2
    toml = tmp_path / "c.toml"
    toml.write_text('[coordinator]\nmigrate = false\nmigrate_min_remaining_tokens = 9\nmax_queued = 5\n'
                    'queue_timeout_s = 2.5\n'
                    '[[models]]\nname = "SmolLM2-135M-Instruct"\n[[workers]]\nid = "a"\nmodel = "SmolLM2-135M-Instruct"\n')
    a = cli.parse_args(["--config", str(toml)])
    assert a.migrate is False and a.migrate_min_remaining_tokens == 9
    assert a.max_queued == 5 and a.queue_timeout_s == 2.5
    toml.write_text(toml.read_text().replace("= 9", "= 0"))
    with pytest.raises(ConfigError, match="migrate_min_remaining_tokens"):
        load_cluster_config(toml)
