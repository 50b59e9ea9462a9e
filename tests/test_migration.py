"""Session migration (coordinator/migration.py) through a real cluster: a long session on a slowed
MLX worker moves to a fast one (SDK -> coordinator -> two MLX workers over loopback gRPC) without
losing or repeating a token; operators drain workers and move sessions through gRPC and the CLI.
The policy itself is tested on simulated fleets in tests/test_placement.py."""
from __future__ import annotations

import threading
import time

import pytest

from coordinator.migration import MigrationPolicy, StreamProgress
from flashfleet import Client
from fakes import SlowProfile
from flashfleet.v1 import common_pb2
from harness import run_request, start_cluster, wait_until
from worker.config import EngineConfig
from worker.engine.thread import Engine
from worker.engine.types import GenerationRequest


def test_progress_builds_the_resume_request_and_the_requests_stats():
    prog = StreamProgress(clock=lambda: 10.0)
    prog.add(common_pb2.Chunk(text="Hel", token_ids=[1, 2]))
    prog.add(common_pb2.Chunk(text="", token_ids=[3]))
    prog.add(common_pb2.Chunk(text="lo", token_ids=[4]))
    req = common_pb2.GenerateRequest(model="m", prompt="p", max_tokens=50, request_id="r1")
    resumed = prog.resume_request(req)
    assert list(resumed.resume_token_ids) == [1, 2, 3, 4] and resumed.resume_text == "Hello"
    assert resumed.max_tokens == 50 and resumed.request_id == "r1" and not req.resume_token_ids
    prog.moved()
    prog.add(common_pb2.Chunk(text="!", token_ids=[5]))
    # The last worker imported 10 of its 7 prompt + 4 resumed positions and prefilled 1; it
    # generated 1 token.
    stats = common_pb2.GenerationStats(prompt_tokens=7 + 4, generated_tokens=1, transferred_tokens=10,
                                       cached_tokens=9)
    prog.finish_stats(stats)
    assert (stats.prompt_tokens, stats.generated_tokens, stats.migrations) == (7, 5, 1)
    assert (stats.transferred_tokens, stats.cached_tokens) == (7, 7)  # the prompt's share
    few = common_pb2.GenerationStats(prompt_tokens=7 + 4, generated_tokens=1, cached_tokens=5)
    prog.finish_stats(few)
    assert few.cached_tokens == 5  # inside the prompt: as the worker counted it
    assert prog.moved_s == 10.0


PROMPTS = ["The river flows", "Once upon a time", "Dzień dobry", "def f(x):"]
MAX_TOKENS = 300
SLOWDOWN = 4.0


@pytest.fixture(scope="module")
def fast_and_slow(tiny_models):
    """Two workers of the tiny llama, "slow" made SLOWDOWN times slower by an injected profile."""
    engines = {}
    for wid, profile in (("fast", None), ("slow", SlowProfile(SLOWDOWN))):
        engines[wid] = Engine(EngineConfig(model_path=tiny_models.llama, model_name="tiny-llama", capacity=3),
                              profile=profile)
    policy = MigrationPolicy(min_remaining_tokens=8, cooldown_s=60.0, check_interval_s=0.0)
    cluster = start_cluster(engines, migration=policy, heartbeat_interval_s=0.1)
    yield cluster, engines
    cluster.close()


def _reference(engine, prompt, max_tokens=MAX_TOKENS):
    ids = tuple(engine.encode_prompt(prompt, None))
    tokens, done = run_request(engine, GenerationRequest(f"ref-{prompt}", ids, max_tokens, mode="plain"))
    return ids, tokens, done


def test_a_long_session_on_a_slow_worker_moves_to_the_fast_one_without_losing_a_token(fast_and_slow):
    cluster, engines = fast_and_slow
    refs = {p: _reference(engines["fast"], p) for p in PROMPTS}  # also gives "fast" its measured profile
    long = [p for p in PROMPTS if len(refs[p][1]) == MAX_TOKENS]  # no early EOS: room to migrate
    assert long, "the tiny model ended every prompt early; pick other prompts"
    prompt = long[0]
    cluster.coordinator.servicer.affinity.bind("user-1", "slow")  # the session's earlier turns were there
    with Client(cluster.address) as client:
        done = client.complete("tiny-llama", prompt=prompt, max_tokens=MAX_TOKENS, mode="plain", session_id="user-1")
    ids, ref, _ = refs[prompt]
    assert done.token_ids == ref  # nothing lost, nothing repeated, the same greedy tokens
    assert done.text == engines["fast"]._encode_tokenizer.decode(ref)
    assert done.stats.generated_tokens == MAX_TOKENS and done.stats.prompt_tokens == len(ids)
    assert done.worker_id == "fast" and done.stats.migrations == 1, (done.worker_id, done.stats.migrations)
    assert done.served_by == ("slow", "fast")  # the workers that served it, in order
    m = cluster.coordinator.metrics
    assert m.migrations.labels(model="tiny-llama", reason="speed", outcome="ok", method="kv")._value.get() == 1
    assert m.migration_pause.labels(model="tiny-llama", reason="speed", method="kv")._sum.get() > 0
    # The slow worker's heartbeats carry its measured profile: SLOWDOWN times the fast one's.
    live = {w.worker_id: w for w in cluster.coordinator.registry.live()}
    slow_t, fast_t = (cluster.coordinator.servicer.config.migration.seconds_per_iteration(live[w], 1, 256)
                      for w in ("slow", "fast"))
    assert slow_t > 2 * fast_t, (slow_t, fast_t)
    assert all(w.in_flight == 0 for w in live.values())


def test_a_seeded_sample_continues_exactly_after_a_resume(fast_and_slow):
    """Why seeded samples may move (coordinator/migration.py): a batched worker draws each token
    with its position's key, so prompt + the first k tokens, resumed, gives the rest unchanged."""
    from worker.engine.types import SamplingParams

    _, engines = fast_and_slow
    engine = engines["fast"]
    ids = tuple(engine.encode_prompt(PROMPTS[0], None))
    sampling = SamplingParams(temperature=1.0, seed=1234)
    full, _ = run_request(engine, GenerationRequest("seeded-full", ids, 40, sampling, mode="plain"))
    k = 15
    rest, _ = run_request(engine, GenerationRequest("seeded-resumed", ids, 40, sampling, mode="plain",
                                                    resume_tokens=tuple(full[:k]),
                                                    resume_text=engine._encode_tokenizer.decode(full[:k])))
    assert len(full) == 40 and full[k:] == rest


def _fake_cluster(**config):
    from fakes import FakeEngine

    engines = {w: FakeEngine(token_delay_s=0.01, seconds_per_iteration=0.01) for w in ("w1", "w2")}
    policy = MigrationPolicy(enabled=False, check_interval_s=0.0)  # only operators move sessions here
    return start_cluster(engines, migration=policy, heartbeat_interval_s=0.05, **config), engines


def _stream_in_background(cluster, results, name, prompt, max_tokens=150, **kw):
    def run():
        with Client(cluster.address, api_key=kw.pop("api_key", None)) as client:
            results[name] = client.complete("fake-model", prompt=prompt, max_tokens=max_tokens, request_id=name,
                                            session_id="s", **kw)
    t = threading.Thread(target=run)
    t.start()
    return t


def _expected(prompt, n):
    base = sum(ord(c) % 100 for c in prompt)
    return [(base + i) % 100 for i in range(n)]


def test_drain_moves_every_session_then_the_worker_leaves():
    cluster, _ = _fake_cluster()
    try:
        cluster.coordinator.servicer.affinity.bind("s", "w1")
        results = {}
        threads = [_stream_in_background(cluster, results, f"r{i}", f"p{i}") for i in range(3)]
        w1 = cluster.coordinator.registry.get("w1")
        assert wait_until(lambda: w1.in_flight == 3, 10)
        with Client(cluster.address) as client:
            steps = list(client.drain_worker("w1", timeout_s=30))
        for t in threads:
            t.join(30)
        assert steps[0].state == "draining" and steps[-1].state == "left", steps
        assert steps[-1].moved == 3 and steps[-1].sessions_left == 0
        for i in range(3):
            r = results[f"r{i}"]
            assert r.token_ids == _expected(f"p{i}", 150) and r.worker_id == "w2" and r.stats.migrations == 1
        assert cluster.coordinator.registry.get("w1") is None
        assert cluster.workers[0].leave_requested.is_set()  # told to exit cleanly
        m = cluster.coordinator.metrics
        assert m.migrations.labels(model="fake-model", reason="drain", outcome="ok", method="reprefill")._value.get() == 3
        with Client(cluster.address) as client:  # new requests go to the worker left
            assert client.complete("fake-model", prompt="x", max_tokens=3).worker_id == "w2"
    finally:
        cluster.close()


def test_drain_and_move_errors():
    from flashfleet.errors import FailedPrecondition, FlashfleetError, ModelNotFound

    cluster, _ = _fake_cluster()
    try:
        cluster.coordinator.servicer.affinity.bind("s", "w1")
        results = {}
        t = _stream_in_background(cluster, results, "long", "ab", max_tokens=300)
        assert wait_until(lambda: "long" in cluster.coordinator.servicer._streams, 10)
        with Client(cluster.address) as client:
            with pytest.raises(ModelNotFound, match="no live worker 'nope'"):
                list(client.drain_worker("nope"))
            with pytest.raises(ModelNotFound, match="no request 'nope'"):
                client.move_session("nope")
            with pytest.raises(ModelNotFound, match="no live worker 'w9'"):
                client.move_session("long", "w9")
            with pytest.raises(FailedPrecondition, match="already serves"):
                client.move_session("long", "w1")
            moved = client.move_session("long", "w2")
            assert (moved.from_worker_id, moved.to_worker_id) == ("w1", "w2")
            w1 = cluster.coordinator.registry.get("w1")
            w1.in_flight = w1.capacity  # full: nowhere to go
            with pytest.raises(FailedPrecondition, match="no other worker"):
                client.move_session("long")
            w1.in_flight = 0
            moved = client.move_session("chatcmpl-long")  # an HTTP response's id names it too
            assert moved.to_worker_id == "w1" and moved.request_id == "long"  # the policy's choice
        t.join(30)
        assert results["long"].token_ids == _expected("ab", 300) and results["long"].stats.migrations == 2
        # The last worker serving a model cannot be drained, busy or idle.
        cluster.coordinator.registry.get("w2").draining = True
        cluster.coordinator.servicer.affinity.bind("s", "w1")
        t = _stream_in_background(cluster, results, "again", "cd", max_tokens=200)
        assert wait_until(lambda: "again" in cluster.coordinator.servicer._streams, 10)
        with Client(cluster.address) as client:
            with pytest.raises(FailedPrecondition, match="the last live worker serving"):
                list(client.drain_worker("w1"))
        t.join(30)
        assert not isinstance(results.get("again"), FlashfleetError)
        with Client(cluster.address) as client:
            with pytest.raises(FailedPrecondition, match="start another first, or stop this one"):
                list(client.drain_worker("w1"))
    finally:
        cluster.close()


def test_cli_move_and_drain_with_an_api_key(capsys, monkeypatch):
    from flashfleet.cli import main

    cluster, _ = _fake_cluster(api_keys=("k1", "k-admin"), admin_keys=("k-admin",))
    try:
        cluster.coordinator.servicer.affinity.bind("s", "w1")
        results = {}
        t = _stream_in_background(cluster, results, "cli", "ef", max_tokens=300, api_key="k1")
        assert wait_until(lambda: "cli" in cluster.coordinator.servicer._streams, 10)
        monkeypatch.delenv("FLASHFLEET_API_KEY", raising=False)
        assert main(["move", "cli", "--to", "w2", "--address", cluster.address]) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        monkeypatch.setenv("FLASHFLEET_API_KEY", "k1")  # a client key: refused, nothing moves
        assert main(["move", "cli", "--to", "w2", "--address", cluster.address]) == 1
        assert "PERMISSION_DENIED: MoveSession needs an API key with the admin role" in capsys.readouterr().err
        assert main(["drain", "w1", "--address", cluster.address]) == 1
        assert "PERMISSION_DENIED: DrainWorker needs" in capsys.readouterr().err
        monkeypatch.setenv("FLASHFLEET_API_KEY", "k-admin")
        assert main(["move", "cli", "--to", "w2", "--address", cluster.address]) == 0
        assert capsys.readouterr().out.strip() == "cli: w1 -> w2"
        assert main(["drain", "nope", "--address", cluster.address]) == 1
        assert "NOT_FOUND" in capsys.readouterr().err
        t.join(30)
        assert main(["drain", "w1", "--address", cluster.address, "--timeout-s", "30"]) == 0
        out = capsys.readouterr().out
        assert out.splitlines()[-1] == "w1: left, 0 session(s) left, 0 moved", out
        assert results["cli"].worker_id == "w2" and results["cli"].token_ids == _expected("ef", 300)
    finally:
        cluster.close()


def test_clients_cannot_send_an_import_id(fast_and_slow):
    cluster, _ = fast_and_slow
    import grpc

    from flashfleet.v1 import coordinator_pb2_grpc
    with grpc.insecure_channel(cluster.address) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        req = common_pb2.GenerateRequest(model="tiny-llama", prompt="hi", max_tokens=4, import_id="staged")
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "set by the coordinator" in e.value.details()


def test_a_refusing_destination_leaves_the_stream_where_it_was(tiny_models):
    """The chosen idle worker refuses the resumed request (RESOURCE_EXHAUSTED): the source call was
    never cancelled, so the stream goes on there without a lost or repeated token."""
    from fakes import FakeEngine

    from worker.engine.types import Overloaded

    engines = {"good": FakeEngine(token_delay_s=0.02), "full": FakeEngine(refuse=Overloaded)}
    for e in engines.values():
        e.seconds_per_iteration = 0.01  # a batch of B costs B x 10 ms: the idle worker predicts 2x
    cluster = start_cluster(engines, heartbeat_interval_s=0.05, migration=MigrationPolicy(
        min_remaining_tokens=4, cooldown_s=60.0, check_interval_s=0.0, min_saving_s=0.0))
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
        labels = dict(model="fake-model", reason="load", method="reprefill")
        assert m.labels(outcome="aborted", **labels)._value.get() >= 1
        assert m.labels(outcome="ok", **labels)._value.get() == 0
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


def _slowed_engine(path, slowdown, **kw):
    return Engine(EngineConfig(model_path=path, model_name="tiny-llama", capacity=3, **kw),
                  profile=SlowProfile(slowdown))


def _complete_in_background(cluster, results, name, prompt, max_tokens, session_id):
    def run():
        with Client(cluster.address) as client:
            results[name] = client.complete("tiny-llama", prompt=prompt, max_tokens=max_tokens, mode="plain",
                                            session_id=session_id, request_id=name)
    t = threading.Thread(target=run)
    t.start()
    return t


def test_a_session_outgrowing_its_workers_kv_budget_moves_before_it_is_preempted(tiny_models):
    """Two sessions on a worker whose KV budget holds both only while they are short: the one with
    the most growth left moves (reason "memory") to the worker with room before the source must
    preempt, and both keep their greedy output."""
    from worker.metrics import model_footprint

    per_position = model_footprint(tiny_models.llama).kv_bytes_per_token
    # Two rows of 256 positions fit "small" with attention's working memory; two of 512 do not,
    # so the batch preempts when the long session passes 256 positions unless it moved.
    engines = {"small": _slowed_engine(tiny_models.llama, 3.0, kv_budget_bytes=1500 * per_position),
               "roomy": _slowed_engine(tiny_models.llama, 3.0, kv_budget_bytes=32768 * per_position)}
    policy = MigrationPolicy(min_remaining_tokens=8, cooldown_s=60.0, check_interval_s=0.0, min_speedup=1000.0)
    cluster = start_cluster(engines, migration=policy, heartbeat_interval_s=0.1)
    try:
        short_prompt, long_prompt = PROMPTS[1], PROMPTS[0]
        _, short_ref, _ = _reference(engines["roomy"], short_prompt, 150)
        ids, long_ref, _ = _reference(engines["roomy"], long_prompt, 490)
        assert len(short_ref) == 150 and len(long_ref) == 490, "the tiny model ended early; pick other prompts"
        assert len(ids) + 490 > 256  # the long session outgrows its first 256-position buffer
        svc = cluster.coordinator.servicer
        svc.affinity.bind("user-1", "small")  # both sessions' earlier turns were on "small"
        svc.moves.clear()
        results = {}
        short = _complete_in_background(cluster, results, "short", short_prompt, 150, "user-1")
        assert wait_until(lambda: engines["small"].load().active_sessions == 1, 30)
        long = _complete_in_background(cluster, results, "long", long_prompt, 490, "user-1")
        short.join(60)
        long.join(60)
        assert results["short"].token_ids == short_ref and results["short"].worker_id == "small"
        assert results["long"].token_ids == long_ref and results["long"].worker_id == "roomy"
        assert results["long"].stats.migrations == 1 and results["short"].stats.migrations == 0
        assert results["long"].stats.preemptions == 0 and results["short"].stats.preemptions == 0
        assert engines["small"]._scheduler.preemptions == 0
        assert [(m.outcome, m.reason) for m in svc.moves] == [("ok", "memory")], list(svc.moves)
    finally:
        cluster.close()


def test_a_session_between_two_equally_fast_workers_does_not_ping_pong(tiny_models):
    """Migration on (the default policy, checked at every chunk), two workers of equal measured
    speed, one long session: over its whole stream the session moves at most once, and its greedy
    output is the reference. On a busy host the first move may come (the idle worker's profile is
    as old as its reference run); none goes back, since the worker it left times nothing after."""
    engines = {w: _slowed_engine(tiny_models.llama, 3.0) for w in ("w1", "w2")}
    policy = MigrationPolicy(min_remaining_tokens=8, check_interval_s=0.0)
    cluster = start_cluster(engines, migration=policy, heartbeat_interval_s=0.1)
    try:
        refs = {w: _reference(e, PROMPTS[0], 490) for w, e in engines.items()}  # both measure their profile
        ids, ref, _ = refs["w1"]
        assert len(ref) == 490 and refs["w2"][1] == ref
        live = {w.worker_id: w for w in cluster.coordinator.registry.live()}
        assert wait_until(lambda: all(len(w.load.decode_profile) for w in live.values()), 10)
        svc = cluster.coordinator.servicer
        svc.moves.clear()
        with Client(cluster.address) as client:
            done = client.complete("tiny-llama", prompt=PROMPTS[0], max_tokens=490, mode="plain")
        assert done.token_ids == ref and done.stats.generated_tokens == 490
        assert done.stats.migrations <= 1, list(svc.moves)
        assert sum(m.outcome == "ok" for m in svc.moves) == done.stats.migrations, list(svc.moves)
        assert all(w.in_flight == 0 for w in cluster.coordinator.registry.live())
    finally:
        cluster.close()
