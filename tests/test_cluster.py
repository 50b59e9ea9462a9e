"""Coordinator + workers over real gRPC on loopback, with fake engines (no MLX)."""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace

import grpc
import pytest

from flashfleet import AsyncClient, Client
from flashfleet.errors import (DeadlineExceeded, InvalidArgument, ModelNotFound, Overloaded)
from fakes import FakeEngine
from harness import start_cluster, wait_until
from worker.engine.types import Overloaded as EngineOverloaded


@pytest.fixture
def cluster():
    c = start_cluster({"w1": FakeEngine(), "w2": FakeEngine()})
    yield c
    c.close()


def routed_count(cluster, outcome: str, worker: str):
    """The coordinator's requests_total for fake-model, this outcome and worker (None: no sample)."""
    return cluster.coordinator_registry.get_sample_value(
        "flashfleet_coordinator_requests_total", {"model": "fake-model", "worker": worker, "outcome": outcome})



def test_generate_streams_tokens_and_stats(cluster):
    with Client(cluster.address) as client:
        chunks = list(client.generate("fake-model", prompt="abc", max_tokens=5))
    assert all(c.finish_reason is None for c in chunks[:-1]) and 1 <= len(chunks) - 1 <= 5
    last = chunks[-1]
    assert last.finish_reason == "length"
    assert last.stats.generated_tokens == 5 and last.stats.prompt_tokens == 3
    base = sum(ord(c) % 100 for c in "abc")
    # chunks the worker queued while writing go as one message: the tokens are the same
    assert [t for c in chunks[:-1] for t in c.token_ids] == [(base + i) % 100 for i in range(5)]
    assert last.worker_id in {"w1", "w2"}
    assert last.stats.queue_s >= 0


def test_complete_and_list_models_and_status(cluster):
    with Client(cluster.address) as client:
        done = client.complete("fake-model", messages=[{"role": "user", "content": "hi"}],
                               max_tokens=3)
        assert done.finish_reason == "length" and len(done.token_ids) == 3
        assert done.text == "".join(f"<{t}>" for t in done.token_ids)
        models = client.list_models()
        assert [m.info.name for m in models] == ["fake-model"]
        assert sorted(models[0].worker_ids) == ["w1", "w2"]
        status = client.cluster_status()
        assert sorted(w.worker_id for w in status.workers) == ["w1", "w2"]


def test_concurrent_clients_use_both_workers():
    engines = {"w1": FakeEngine(token_delay_s=0.05), "w2": FakeEngine(token_delay_s=0.05)}
    c = start_cluster(engines)
    try:
        results = []

        def one(i):
            with Client(c.address) as client:
                results.append(client.complete("fake-model", prompt=f"p{i}", max_tokens=10))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        [t.start() for t in threads]
        [t.join(30) for t in threads]
        assert len(results) == 8
        served = {r.worker_id for r in results}
        assert served == {"w1", "w2"}, served
        assert len(engines["w1"].submitted) > 0 and len(engines["w2"].submitted) > 0
    finally:
        c.close()


def test_worker_without_heartbeats_leaves_registry_and_gets_no_sessions():
    c = start_cluster({"w1": FakeEngine(), "w2": FakeEngine()}, lease_ttl_s=0.6,
                      heartbeat_interval_s=0.1)
    try:
        c.workers[1].stop_heartbeats()
        assert wait_until(lambda: [w.worker_id for w in c.coordinator.registry.live()] == ["w1"])
        assert c.coordinator.metrics.lease_expiries._value.get() == 1
        with Client(c.address) as client:
            served = {client.complete("fake-model", prompt=f"x{i}", max_tokens=2).worker_id
                      for i in range(6)}
            assert served == {"w1"}
            assert [w.worker_id for w in client.cluster_status().workers] == ["w1"]
    finally:
        c.close()


def test_client_cancellation_frees_the_worker():
    engine = FakeEngine(token_delay_s=0.05)
    c = start_cluster({"w1": engine})
    try:
        with Client(c.address) as client:
            stream = client.generate("fake-model", prompt="long", max_tokens=1000)
            next(stream)
            next(stream)
            stream.close()  # the caller stops reading: the RPC is cancelled
        assert wait_until(lambda: engine.load().active_sessions == 0)
        assert len(engine.aborted) == 1
        assert wait_until(lambda: c.coordinator.registry.live()[0].in_flight == 0)
    finally:
        c.close()


def test_a_request_id_in_flight_is_not_accepted_twice():
    """Two concurrent requests with one request_id: the second is refused (INVALID_ARGUMENT, the
    first keeps streaming); once the first ends, the id may be used again."""
    engine = FakeEngine(token_delay_s=0.05)
    c = start_cluster({"w1": engine, "w2": FakeEngine(token_delay_s=0.05)})
    try:
        with Client(c.address) as client:
            stream = client.generate("fake-model", prompt="long", max_tokens=1000, request_id="r-1")
            next(stream)
            with pytest.raises(InvalidArgument, match="request_id 'r-1' is already in flight"):
                client.complete("fake-model", prompt="again", max_tokens=3, request_id="r-1")
            next(stream)  # the first one is unaffected
            stream.close()
            assert wait_until(lambda: not c.coordinator.servicer._in_flight)
            done = client.complete("fake-model", prompt="again", max_tokens=3, request_id="r-1")
            assert done.request_id == "r-1" and done.finish_reason == "length"
    finally:
        c.close()


def test_deadline_propagates_and_frees_the_worker():
    engine = FakeEngine(token_delay_s=0.05)
    c = start_cluster({"w1": engine})
    routed = lambda outcome: routed_count(c, outcome, "w1")  # noqa: E731
    try:
        with Client(c.address) as client, pytest.raises(DeadlineExceeded):
            client.complete("fake-model", prompt="long", max_tokens=1000, timeout_s=0.5)
        assert wait_until(lambda: engine.load().active_sessions == 0)
        # Counted as a deadline, not as a client's cancel; a cancel stays a cancel.
        assert wait_until(lambda: routed("deadline") == 1) and not routed("cancelled")
        with Client(c.address) as client:
            stream = client.generate("fake-model", prompt="long", max_tokens=1000)
            next(stream)
            stream.close()
        assert wait_until(lambda: routed("cancelled") == 1) and routed("deadline") == 1
    finally:
        c.close()


def test_one_stop_string_is_one_stop_string():
    from flashfleet.requests import build_request

    assert list(build_request("m", "hi", stop="XYZ4").stop) == ["XYZ4"]  # not its characters
    assert list(build_request("m", "hi", stop=["a", "bc"]).stop) == ["a", "bc"]


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(prompt=""), "prompt is empty"),
    (dict(prompt="   "), "prompt is empty"),
    (dict(prompt="hi", max_tokens=-1), "max_tokens"),
    (dict(prompt="hi", max_tokens=0), "max_tokens"),
    (dict(prompt="hi", temperature=-0.5), "temperature"),
    (dict(prompt="hi", temperature=float("nan")), "temperature"),
    (dict(prompt="hi", top_p=0.0), "top_p"),
    (dict(prompt="hi", top_p=1.5), "top_p"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "role"),
    (dict(messages=[]), "messages is empty"),
    (dict(prompt="hi", stop=[""]), "stop"),
    (dict(prompt="x" * 5000, max_tokens=10), "context"),
])
def test_bad_requests_get_invalid_argument_and_server_keeps_serving(cluster, kwargs, fragment):
    with Client(cluster.address) as client:
        with pytest.raises(InvalidArgument) as err:
            client.complete("fake-model", **kwargs)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert fragment in err.value.details
        assert client.complete("fake-model", prompt="ok", max_tokens=2).finish_reason == "length"


def test_malformed_message_is_rejected_by_the_sdk_before_sending(cluster):
    with Client(cluster.address) as client, pytest.raises(InvalidArgument, match="messages\\[0\\]"):
        client.complete("fake-model", messages=[{"role": "user"}])


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(prompt=b"hello"), "prompt must be a str, got bytes (decode bytes first"),
    (dict(prompt=5), "prompt must be a str, got int"),
    (dict(messages="hello"), "messages must be a list of chat turns"),
    (dict(messages=7), "messages must be a list, got int"),
    (dict(prompt="hi", stop=[1, 2]), "stop must be a str or a list of str, got [1, 2]"),
    (dict(prompt="hi", stop=b"ab"), "stop must be a str or a list of str"),
    (dict(prompt="hi", stop=5), "stop must be a str or a list of str, got 5"),
    (dict(prompt="hi", stop=["\ud800"]), "stop[0] is not valid text"),
])
def test_wrong_types_are_invalid_argument_naming_the_field(kwargs, fragment):
    """Checked in the SDK before anything is sent (no server needed): the message names the
    field and what it must be, not protobuf's internals."""
    from flashfleet.requests import build_request

    with pytest.raises(InvalidArgument) as err:
        build_request("fake-model", **kwargs)
    assert fragment in err.value.details, err.value.details


def test_no_stop_and_an_unset_max_tokens_fit_a_long_prompt(cluster):
    """stop=None is no stop strings; max_tokens left unset (the SDK's default) is the worker's
    default capped by the context the prompt leaves, so a prompt near the context still gets an
    answer, where an explicit max_tokens too large is refused."""
    with Client(cluster.address) as client:
        done = client.complete("fake-model", prompt="x" * 4000, stop=None)  # context 4096
        assert done.finish_reason == "length" and 0 < len(done.token_ids) <= 96
        with pytest.raises(InvalidArgument):
            client.complete("fake-model", prompt="x" * 4000, max_tokens=256)


def test_unknown_model_is_not_found(cluster):
    with Client(cluster.address) as client:
        with pytest.raises(ModelNotFound) as err:
            client.complete("no-such-model", prompt="hi")
        assert "no-such-model" in err.value.details and "fake-model" in err.value.details


def test_retry_on_another_worker_before_first_token():
    refusing = FakeEngine(refuse=EngineOverloaded)
    good = FakeEngine()
    c = start_cluster({"bad": refusing, "good": good})
    try:
        retries = c.coordinator.metrics.retries.labels(model="fake-model")
        with Client(c.address) as client:
            # Power of two choices picks the refusing worker first about half the time: until it
            # has (P(never in 40) = 2^-40; 6 tries failed CI about once in 64), every request is
            # still served by the good worker.
            for i in range(40):
                assert client.complete("fake-model", prompt=f"r{i}", max_tokens=2).worker_id == "good"
                if retries._value.get() >= 1:
                    break
        assert retries._value.get() >= 1
    finally:
        c.close()


def test_all_workers_full_gives_resource_exhausted():
    c = start_cluster({"w1": FakeEngine(refuse=EngineOverloaded)})
    try:
        with Client(c.address) as client, pytest.raises(Overloaded):
            client.complete("fake-model", prompt="hi", max_tokens=2)
    finally:
        c.close()


def test_session_stickiness():
    c = start_cluster({"w1": FakeEngine(), "w2": FakeEngine(), "w3": FakeEngine()})
    try:
        with Client(c.address) as client:
            first = client.complete("fake-model", prompt="a", max_tokens=1, session_id="s-1")
            for _ in range(5):
                again = client.complete("fake-model", prompt="b", max_tokens=1, session_id="s-1")
                assert again.worker_id == first.worker_id
    finally:
        c.close()


def test_async_client(cluster):
    async def main():
        async with AsyncClient(cluster.address) as client:
            texts = [c.text async for c in client.generate("fake-model", prompt="z", max_tokens=4)]
            done = await client.complete("fake-model", prompt="z", max_tokens=4)
            models = await client.list_models()
            return texts, done, models

    texts, done, models = asyncio.run(main())
    assert "".join(texts) == done.text and done.finish_reason == "length"
    assert models[0].info.name == "fake-model"


def test_async_client_made_before_the_loop_runs(cluster):
    """A client built at import time works in asyncio.run; a second loop gets a clear error, and
    after close() the client works in a new loop."""
    client = AsyncClient(cluster.address)

    async def one():
        return (await client.complete("fake-model", prompt="z", max_tokens=2)).text

    assert asyncio.run(one())
    with pytest.raises(RuntimeError, match="one AsyncClient per event loop"):
        asyncio.run(one())

    async def closed_then_again():
        await client.close()

    asyncio.run(closed_then_again())
    assert asyncio.run(one())


def test_tls_hints_only_where_tls_can_be_the_cause():
    from flashfleet.errors import from_rpc_error

    class Failed(grpc.RpcError):
        def __init__(self, details):
            self._details = details

        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return self._details

    assert "if the cluster serves TLS" in from_rpc_error(Failed("Socket closed"), False).details
    # The coordinator relaying a worker lost mid-stream: a working connection, no TLS hint.
    relayed = "worker w1 failed after 5 tokens (UNAVAILABLE): Stream removed (Socket closed)"
    assert from_rpc_error(Failed(relayed), False).details == relayed
    wrong_name = from_rpc_error(Failed("Hostname Verification Check failed."), True).details
    assert "does not name the host dialled" in wrong_name


def test_worker_health_and_reflection(cluster):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    for address in (cluster.address, cluster.workers[0].advertise_address):
        with grpc.insecure_channel(address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_unset_max_tokens_takes_the_worker_default(cluster):
    with Client(cluster.address) as client:
        done = client.complete("fake-model", prompt="abc", max_tokens=None)
    assert done.finish_reason == "length" and len(done.token_ids) == 256


def test_deregistered_worker_is_marked_down_and_forgets_sessions():
    c = start_cluster({"w1": FakeEngine(), "w2": FakeEngine()})
    try:
        with Client(c.address) as client:
            first = client.complete("fake-model", prompt="a", max_tokens=1, session_id="s")
        leaving = next(w for w in c.workers if w.worker_id == first.worker_id)
        ages = c.coordinator_registry.get_sample_value
        assert wait_until(lambda: ages("flashfleet_coordinator_worker_heartbeat_age_seconds",
                                       {"worker": first.worker_id}) is not None)
        c.loop.run(leaving.stop(grace_s=0.2))
        c.workers.remove(leaving)
        m = c.coordinator.metrics
        assert m.worker_up.labels(worker=first.worker_id)._value.get() == 0
        assert m.lease_expiries._value.get() == 0
        # Its heartbeat age is gone (not frozen at its last value); the other worker's remains.
        assert ages("flashfleet_coordinator_worker_heartbeat_age_seconds", {"worker": first.worker_id}) is None
        other = next(w.worker_id for w in c.workers)
        assert wait_until(lambda: ages("flashfleet_coordinator_worker_heartbeat_age_seconds", {"worker": other})
                          is not None)
        with Client(c.address) as client:
            again = client.complete("fake-model", prompt="b", max_tokens=1, session_id="s")
            assert again.worker_id != first.worker_id
            with pytest.raises(ModelNotFound):
                client.complete("made-up-name-123", prompt="x", max_tokens=1)
        assert m.routed.labels(model="(unknown)", worker="", outcome="no_worker")._value.get() == 1
    finally:
        c.close()


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(prompt="hi", seed=-1), "seed must be an int in [0, 2**64), got -1"),
    (dict(prompt="hi", seed=2**64), "seed must be an int in [0, 2**64)"),
    (dict(prompt="hi", max_tokens=2**31), "max_tokens must be an int that fits int32"),
    (dict(prompt="hi", max_tokens="5"), "max_tokens must be an int that fits int32 (and > 0), got '5'"),
    (dict(prompt="hi", max_tokens=2.5), "max_tokens must be an int"),
    (dict(prompt="hi", temperature="hot"), "temperature must be a number (0 = greedy), got 'hot'"),
    (dict(prompt="hi", top_p="x"), "top_p must be a number in (0, 1]"),
    (dict(prompt="hi", temperature=10**400), "temperature must be a number"),  # was OverflowError
    (dict(prompt="hi", top_p=-(10**400)), "top_p must be a number in (0, 1]"),
    (dict(prompt="abc\ud800def"), "prompt is not valid text"),
    (dict(messages=[{"role": "user", "content": "x\udfff"}]), "messages[0].content"),
    (dict(prompt="a " * 2_500_000), "4 MiB"),
    (dict(prompt="hi", timeout_s=0), "timeout_s"),
    (dict(prompt="hi", timeout_s=float("nan")), "timeout_s"),
    (dict(prompt="hi", timeout_s=float("inf")), "timeout_s"),  # gRPC would end it at once
    (dict(prompt="hi", timeout_s=1e12), "at most"),
    (dict(prompt="hi", timeout_s="5"), "number of seconds"),
    (dict(prompt="hi", session_id=5), "session_id must be a str"),  # not blamed on max_tokens
    (dict(prompt="hi", request_id=5), "request_id must be a str"),
    (dict(prompt="hi", mode=[]), "unknown mode []"),  # was "unhashable type: 'list'"
])
def test_sdk_rejects_values_it_cannot_send(cluster, kwargs, fragment):
    with Client(cluster.address) as client:
        with pytest.raises(InvalidArgument) as err:
            client.complete("fake-model", **kwargs)
        assert fragment in err.value.details


def test_complete_names_itself_for_a_keyword_generate_does_not_take(cluster):
    with Client(cluster.address) as client:
        with pytest.raises(TypeError, match=r"complete\(\) got unexpected keyword argument\(s\) foo; "
                                            r"it takes generate\(\)'s: .*max_tokens"):
            client.complete("fake-model", prompt="hi", foo=1)

    async def run():
        async with AsyncClient(cluster.address) as client:
            await client.complete("fake-model", prompt="hi", bar=2)
    with pytest.raises(TypeError, match=r"complete\(\) got unexpected keyword argument\(s\) bar"):
        asyncio.run(run())


def test_a_closed_client_works_again_and_control_calls_keep_a_deadline(cluster, monkeypatch):
    client = Client(cluster.address)
    assert client.complete("fake-model", prompt="a", max_tokens=2).finish_reason == "length"
    client.close()
    client.close()  # twice is fine
    # A call after close() opens a new channel (it raised a bare "Channel closed!" ValueError).
    assert client.complete("fake-model", prompt="a", max_tokens=2).finish_reason == "length"
    assert [m.info.name for m in client.list_models()] == ["fake-model"]
    # timeout_s=None on a control call means the default deadline, not none at all.
    seen = []
    real = client._stub.ListModels
    monkeypatch.setattr(client._stub, "ListModels",
                        lambda req, timeout=None: seen.append(timeout) or real(req, timeout=timeout))
    client.list_models(timeout_s=None)
    assert seen == [pytest.approx(10.0)]
    client.close()
    with pytest.raises(TypeError, match="address must be a 'host:port' string"):
        Client(5)
    with pytest.raises(TypeError, match="address must be a 'host:port' string"):
        AsyncClient(50051)


def test_worker_shutdown_mid_stream_ends_the_clients_stream_promptly():
    """A worker stopped (SIGTERM path: deregister, grace, stop) while streaming: the client's
    stream ends with an error within the grace period, not at its deadline."""
    from flashfleet.errors import FlashfleetError
    c = start_cluster({"w1": FakeEngine(token_delay_s=0.05)})
    try:
        with Client(c.address) as client:
            stream = client.generate("fake-model", prompt="long", max_tokens=2000, timeout_s=60)
            next(stream)
            t0 = time.monotonic()
            fut = asyncio.run_coroutine_threadsafe(c.workers[0].stop(grace_s=0.5), c.loop.loop)
            with pytest.raises(FlashfleetError) as err:
                for _ in stream:
                    pass
            elapsed = time.monotonic() - t0
            fut.result(10)
        c.workers.clear()
        assert elapsed < 10, f"client waited {elapsed:.1f} s"
        assert "worker w1 failed after" in err.value.details and "TLS" not in err.value.details
    finally:
        c.close()


def test_second_server_on_a_busy_port_fails_to_bind(cluster):
    from prometheus_client import CollectorRegistry

    from coordinator.config import CoordinatorConfig
    from coordinator.server import start_coordinator
    busy = cluster.coordinator.port
    with pytest.raises(RuntimeError, match="could not bind"):
        cluster.loop.run(start_coordinator(CoordinatorConfig(port=busy), CollectorRegistry()))


def test_status_cli_shows_each_workers_draft(capsys):
    from flashfleet.cli.status import main as status_main

    drafted = FakeEngine()
    drafted.model = replace(drafted.model, draft="flashfleet/drafts/SmolLM2-135M-Instruct", draft_mode="dflash")
    c = start_cluster({"w1": drafted, "w2": FakeEngine()})
    try:
        assert status_main(["--address", c.address]) == 0
        lines = capsys.readouterr().out.splitlines()
        rows = {line.split()[0]: line for line in lines}
        assert "flashfleet/drafts/SmolLM2-135M-Instruct (dflash)" in rows["w1"]  # shipped: not the target
        assert " - " in rows["w2"] and "dflash" not in rows["w2"]
        # every column lines up with its header, however wide the draft's name
        header = rows["worker"]
        for col in ("sessions", "KV used / budget", "prompt cache", "served", "heartbeat"):
            end = header.index(col) + len(col)  # numbers are right-aligned under their header
            assert all(r[end - 1] != " " and (len(r) == end or r[end] == " ") for r in (rows["w1"], rows["w2"])), col
    finally:
        c.close()


def test_stats_and_status_carry_the_prompt_cache_and_kv_budget(capsys):
    """A session's second turn goes back to its worker and reports the prompt tokens that
    worker's prompt cache held; heartbeats bring each worker's KV budget, free bytes and prompt
    cache bytes to the cluster status and `flashfleet status`."""
    from flashfleet.cli.status import main as status_main

    budget = 800 << 20
    c = start_cluster({"w1": FakeEngine(kv_budget_bytes=budget), "w2": FakeEngine(kv_budget_bytes=budget)},
                      heartbeat_interval_s=0.1)
    try:
        with Client(c.address) as client:
            first = client.complete("fake-model", prompt="shared prefix, turn one", max_tokens=2, session_id="s")
            second = client.complete("fake-model", prompt="shared prefix, turn two", max_tokens=2, session_id="s")
            assert second.worker_id == first.worker_id
            assert first.stats.cached_tokens == 0 and first.stats.preemptions == 0
            assert second.stats.cached_tokens == len("shared prefix, turn ")

            def served_worker():
                return next(w for w in client.cluster_status().workers if w.worker_id == first.worker_id)
            assert wait_until(lambda: served_worker().prompt_cache_bytes == 2000)  # the fake's 1000 per turn
            w = served_worker()
            assert w.kv_budget_bytes == budget and w.kv_free_bytes == budget - w.kv_cache_bytes
        assert status_main(["--address", c.address]) == 0
        rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
        assert " / 800 MiB" in rows[first.worker_id] and "0.0 MiB" in rows[first.worker_id]  # 2000 B cached
    finally:
        c.close()


def test_cli_generate_prints_whole_lines_and_stats_on_stderr(cluster, capsys):
    from flashfleet.cli.generate import main

    assert main(["abc", "--model", "fake-model", "--raw", "--max-tokens", "5", "--address", cluster.address]) == 0
    out, err = capsys.readouterr()
    assert out and out.endswith("\n") and not out.endswith("\n\n")  # piped output ends with one whole line
    first, last = err.splitlines()
    assert len(first.split()) == 3 and first.startswith("-- request ")  # the id `flashfleet move` takes
    assert last.startswith("-- length; worker ") and "tok/s" in last
    assert main(["abc", "--model", "fake-model", "--max-tokens", "2", "--request-id", "mine",
                 "--address", cluster.address]) == 0
    assert capsys.readouterr().err.startswith("-- request mine\n")
    assert main(["abc", "--model", "no-such-model", "--address", cluster.address]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err
    assert main(["abc", "--model", "fake-model", "--max-tokens", "2", "--presence-penalty", "0.5",
                 "--logit-bias", "5=-100", "--logit-bias", "7=2.5", "--address", cluster.address]) == 0
    capsys.readouterr()
    assert main(["abc", "--model", "fake-model", "--frequency-penalty", "3", "--address", cluster.address]) == 1
    assert "frequency_penalty must be a number in [-2, 2]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["abc", "--logit-bias", "5:1", "--address", cluster.address])
    assert "--logit-bias: expected TOKEN_ID=BIAS" in capsys.readouterr().err


def test_a_request_that_does_not_parse_is_invalid_argument_and_others_are_served(cluster):
    """Bytes protobuf cannot parse (a prompt that is not UTF-8, a truncated message), as a client
    in another language can send them: INVALID_ARGUMENT saying what to fix (grpc alone answers
    UNKNOWN), on the coordinator and on a worker; health checks and real requests still work."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from flashfleet.v1 import common_pb2

    good = common_pb2.GenerateRequest(model="fake-model", prompt="cafe", max_tokens=2).SerializeToString()
    not_utf8 = good.replace(b"cafe", b"caf\xe9")
    worker_address = cluster.workers[0].advertise_address
    for address, method in ((cluster.address, "/flashfleet.v1.Coordinator/Generate"),
                            (worker_address, "/flashfleet.v1.Worker/Generate")):
        with grpc.insecure_channel(address) as ch:
            call = ch.unary_stream(method)  # raw bytes in and out
            for data in (not_utf8, good[:-1]):
                with pytest.raises(grpc.RpcError) as e:
                    list(call(data, timeout=5))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (address, e.value)
                assert "not a valid protobuf message" in e.value.details()
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    with Client(cluster.address) as client:
        assert client.complete("fake-model", prompt="cafe", max_tokens=2).finish_reason == "length"
        assert [m.info.name for m in client.list_models()] == ["fake-model"]


def test_a_vanished_worker_is_not_every_requests_first_try():
    """A worker killed without deregistering (kill -9, a pulled cable) keeps its lease until it
    expires; after one request finds it gone (UNAVAILABLE before a first token, retried on the
    other worker), routing passes it over instead of trying it first each time. A heartbeat
    (it came back) clears the mark."""
    c = start_cluster({"w1": FakeEngine(), "w2": FakeEngine()}, lease_ttl_s=60.0)
    try:
        gone = next(w for w in c.workers if w.worker_id == "w1")
        gone.stop_heartbeats()
        c.loop.run(gone.server.stop(0))  # no deregistration: the lease stays
        retries = c.coordinator.metrics.retries.labels(model="fake-model")
        with Client(c.address) as client:
            served = [client.complete("fake-model", prompt=f"r{i}", max_tokens=2).worker_id for i in range(12)]
        assert served == ["w2"] * 12
        assert retries._value.get() <= 1  # only the request that found it gone tried it
        rec = c.coordinator.registry.get("w1")
        assert rec is not None and rec.unreachable
        c.coordinator.registry.heartbeat("w1", rec.lease_id, rec.load)
        assert not rec.unreachable
    finally:
        c.workers.remove(gone)
        c.close()


def test_a_worker_that_dies_mid_stream_is_marked_and_status_says_so(capsys):
    """A worker gone after its first tokens: the stream fails over to the other worker (nothing
    replayed), the dead worker is marked unreachable at once, so the next request goes to the
    other worker without a failed try, and `flashfleet status` shows the mark."""
    from flashfleet.cli.status import main as status_main

    c = start_cluster({"w1": FakeEngine(token_delay_s=0.05), "w2": FakeEngine(token_delay_s=0.05)},
                      lease_ttl_s=60.0)
    gone = None
    try:
        retries = c.coordinator.metrics.retries.labels(model="fake-model")
        with Client(c.address) as client:
            stream = client.generate("fake-model", prompt="long", max_tokens=200)
            assert next(stream).token_ids
            serving = [w for w in c.workers if c.coordinator.registry.get(w.worker_id).in_flight == 1]
            assert len(serving) == 1
            gone = serving[0]
            gone.stop_heartbeats()
            c.loop.run(gone.server.stop(0))  # the process dies: no deregistration, the lease stays
            last = list(stream)[-1]
            assert last.finish_reason == "length" and last.worker_id != gone.worker_id
            assert c.coordinator.registry.get(gone.worker_id).unreachable
            before = retries._value.get()
            other = client.complete("fake-model", prompt="next", max_tokens=2).worker_id
            assert other != gone.worker_id
            assert retries._value.get() == before  # no try on the dead worker first
        assert status_main(["--address", c.address]) == 0
        rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
        assert rows[gone.worker_id].endswith("unreachable") and rows[other].endswith("live")
    finally:
        if gone is not None:
            c.workers.remove(gone)
        c.close()


def test_routing_prefers_reachable_workers_with_room_and_falls_back():
    """Marked workers are passed over only while an unmarked one has room: with every unmarked
    worker full, a marked worker with free slots still gets the request (no RESOURCE_EXHAUSTED)."""
    from coordinator.registry import WorkerRecord
    from coordinator.routing import PowerOfTwoRouter, SessionAffinity, route
    from flashfleet.v1 import common_pb2, worker_pb2

    def rec(wid, in_flight, unreachable=False):
        return WorkerRecord(worker_id=wid, address=f"{wid}:1", lease_id="l", models=[common_pb2.ModelInfo(name="m")],
                            load=worker_pb2.WorkerLoad(capacity=2), last_heartbeat_s=0.0, in_flight=in_flight,
                            model_names=frozenset({"m"}), unreachable=unreachable)

    router, affinity = PowerOfTwoRouter(), SessionAffinity(ttl_s=60.0)
    marked, healthy = rec("a", 0, unreachable=True), rec("b", 0)
    assert all(route("m", "", [marked, healthy], set(), router, affinity) is healthy for _ in range(20))
    assert route("m", "", [marked, rec("b", 2)], set(), router, affinity) is marked  # b full: a serves
    assert route("m", "", [marked], set(), router, affinity) is marked  # the only one: tried anyway


def test_a_deadline_before_the_first_token_is_counted():
    engine = FakeEngine(token_delay_s=2.0)  # the first token comes after the deadline
    c = start_cluster({"w1": engine})
    routed = lambda outcome: routed_count(c, outcome, "")  # noqa: E731 - no worker had answered
    try:
        with Client(c.address) as client, pytest.raises(DeadlineExceeded):
            client.complete("fake-model", prompt="slow", max_tokens=3, timeout_s=0.3)
        assert wait_until(lambda: routed("deadline") == 1)
    finally:
        c.close()


def _hold(client, prompt="hold", max_tokens=1000):
    """Opens a stream and reads its first chunk: the worker's slot stays taken until close()."""
    stream = client.generate("fake-model", prompt=prompt, max_tokens=max_tokens)
    next(stream)
    return stream


def _queued(c, fn):
    """Runs `fn` (a blocking request) in a thread; returns the thread once its request waits in
    the coordinator's queue."""
    t = threading.Thread(target=fn)
    t.start()
    assert wait_until(lambda: c.coordinator.servicer.admission.waiting == 1)
    return t


def test_a_burst_beyond_capacity_waits_for_slots_and_is_served():
    """Six requests at once on one worker of capacity 2: the four that find it full wait in the
    coordinator's queue (coordinator/admission.py) and are served as slots free up, in place of
    RESOURCE_EXHAUSTED; their queue time says they waited, and the gauge returns to 0."""
    # A request holds its slot for 4 tokens x 0.25 s: the last two wait for two requests' worth (2 s),
    # the first two for none; bounds far from both, so a busy host's delays do not reach them.
    c = start_cluster({"w1": FakeEngine(capacity=2, token_delay_s=0.25)})
    try:
        async def burst():
            async with AsyncClient(c.address) as client:
                return await asyncio.gather(*(client.complete("fake-model", prompt=f"p{i}", max_tokens=4)
                                              for i in range(6)))
        done = asyncio.run(asyncio.wait_for(burst(), 60))
        assert [d.finish_reason for d in done] == ["length"] * 6
        waited = sorted(d.stats.queue_s for d in done)
        assert waited[-1] > 1.5 and waited[0] < 0.5
        assert c.coordinator.servicer.admission.waiting == 0
        assert c.coordinator_registry.get_sample_value("flashfleet_coordinator_queued_requests") == 0
    finally:
        c.close()


def test_the_queue_is_bounded_in_length_and_in_time():
    """With the one slot held: the first waiter times out after queue_timeout_s, a second
    waiter beyond max_queued is refused at once, both RESOURCE_EXHAUSTED saying why; a client
    deadline shorter than the wait ends it as DEADLINE_EXCEEDED; nothing stays queued."""
    c = start_cluster({"w1": FakeEngine(capacity=1, token_delay_s=0.05)}, max_queued=1, queue_timeout_s=3.0)
    try:
        with Client(c.address) as holder, Client(c.address) as client:
            held = _hold(holder)
            results = {}

            def waiter():
                t0 = time.monotonic()
                try:
                    client.complete("fake-model", prompt="w", max_tokens=2)
                except Overloaded as e:
                    results["waiter"] = (time.monotonic() - t0, e.details)

            t = _queued(c, waiter)
            t0 = time.monotonic()
            with pytest.raises(Overloaded, match="already wait \\(max_queued 1\\)"):
                client.complete("fake-model", prompt="x", max_tokens=2)
            assert time.monotonic() - t0 < 2.0  # refused at once, not after the 3 s wait
            t.join(15)
            waited, details = results["waiter"]
            assert waited >= 2.9 and "stayed at capacity for 3 s" in details
            with pytest.raises(DeadlineExceeded):
                client.complete("fake-model", prompt="d", max_tokens=2, timeout_s=0.2)
            assert wait_until(lambda: c.coordinator.servicer.admission.waiting == 0)
            held.close()
            assert client.complete("fake-model", prompt="after", max_tokens=2).finish_reason == "length"
    finally:
        c.close()


@pytest.mark.parametrize("abort_delay_s, min_queue_s", [(0.0, 0.3), (3.0, 2.5)])
def test_a_waiting_request_takes_the_slot_a_finished_stream_frees(abort_delay_s, min_queue_s):
    # abort_delay_s: the worker frees the slot only when its engine has ended the session, after
    # the coordinator let the call go (here 3 s, longer than route_attempts' backoff of at most
    # 2 x 1 s). Its RESOURCE_EXHAUSTED meanwhile means "full for now": the waiter is served.
    c = start_cluster({"w1": FakeEngine(capacity=1, token_delay_s=0.05, abort_delay_s=abort_delay_s)},
                      queue_timeout_s=20)
    try:
        with Client(c.address) as holder, Client(c.address) as client:
            held = _hold(holder)
            out = {}
            t = _queued(c, lambda: out.setdefault("done", client.complete("fake-model", prompt="w", max_tokens=2)))
            time.sleep(0.3)
            assert "done" not in out  # still waiting while the slot is held
            held.close()  # the slot frees: the waiter is woken and served
            t.join(15)
            assert out["done"].finish_reason == "length" and out["done"].stats.queue_s >= min_queue_s
    finally:
        c.close()


def test_a_full_worker_is_refused_after_route_attempts_when_nothing_may_wait():
    # The cancelled stream keeps its slot for 30 s: a request that waited for it would be served
    # after that long, so the refusal, its try count and a bound far from 30 s tell them apart.
    c = start_cluster({"w1": FakeEngine(capacity=1, token_delay_s=0.05, abort_delay_s=30.0)}, max_queued=0)
    try:
        with Client(c.address) as holder, Client(c.address) as client:
            held = _hold(holder)
            held.close()
            assert wait_until(lambda: all(w.in_flight == 0 for w in c.coordinator.servicer.registry.live()))
            retries = c.coordinator.metrics.retries.labels(model="fake-model")
            before = retries._value.get()
            t0 = time.monotonic()
            with pytest.raises(Overloaded, match="capacity 1 reached"):
                client.complete("fake-model", prompt="x", max_tokens=2)
            assert retries._value.get() - before == 2  # route_attempts (3) tries, no more
            assert time.monotonic() - t0 < 15.0  # route_attempts' backoff only (<= 1 s a wait), no waiting
    finally:
        c.close()


def test_max_queued_0_refuses_at_once_as_before():
    c = start_cluster({"w1": FakeEngine(capacity=1, token_delay_s=0.05)}, max_queued=0)
    try:
        with Client(c.address) as holder, Client(c.address) as client:
            held = _hold(holder)
            with pytest.raises(Overloaded, match="max_queued 0"):
                client.complete("fake-model", prompt="x", max_tokens=2)
            held.close()
    finally:
        c.close()


def test_every_deadline_expiry_is_counted_as_a_deadline():
    # The client's deadline cancels the call a few ms before the server's copy of it runs out;
    # those cancels are deadlines too, not client cancels (ten in a row, mid-stream and early).
    engine = FakeEngine(token_delay_s=0.05)
    c = start_cluster({"w1": engine})
    try:
        with Client(c.address) as client:
            for i in range(10):
                with pytest.raises(DeadlineExceeded):
                    client.complete("fake-model", prompt=f"long {i}", max_tokens=1000,
                                    timeout_s=0.1 + 0.03 * i)
        counted = lambda: {o: (routed_count(c, o, "w1") or 0) + (routed_count(c, o, "") or 0)  # noqa: E731
                           for o in ("deadline", "cancelled")}
        assert wait_until(lambda: sum(counted().values()) == 10), counted()
        assert counted() == {"deadline": 10, "cancelled": 0}
    finally:
        c.close()


def test_deadline_passed_allows_for_the_clients_clock_running_ahead():
    from coordinator.stream import DEADLINE_SLACK_S, deadline_passed as _deadline_passed

    def remaining(seconds):
        return lambda: seconds

    assert _deadline_passed(remaining(0.0)) and _deadline_passed(remaining(-1.0))
    assert _deadline_passed(remaining(DEADLINE_SLACK_S / 2))  # cancelled just before the server saw it
    assert not _deadline_passed(remaining(DEADLINE_SLACK_S * 2))  # the client cancelled early
    assert not _deadline_passed(remaining(None))  # no deadline at all


def test_a_worker_keeps_trying_a_missing_coordinator_and_says_so(monkeypatch, caplog):
    # Started before its coordinator, a worker warns (once a period, not once an attempt) and
    # keeps trying for as long as it takes; it registers as soon as the coordinator is up.
    import logging

    import worker.server as worker_server
    from coordinator.config import CoordinatorConfig
    from coordinator.server import start_coordinator
    from flashfleet.cli.up import free_port
    from harness import LoopThread
    from worker.server import start_worker

    monkeypatch.setattr(worker_server, "UNREACHABLE_WARN_EVERY_S", 0.5)
    caplog.set_level(logging.WARNING, logger="flashfleet.worker")
    port = free_port()
    loop = LoopThread()
    w = loop.run(start_worker(FakeEngine(), "early", coordinator=f"127.0.0.1:{port}"))
    coordinator = None
    try:
        assert wait_until(lambda: len([r for r in caplog.records if "cannot register" in r.message]) >= 2,
                          timeout=8)
        warnings = [r.message for r in caplog.records if "cannot register" in r.message]
        assert f"127.0.0.1:{port}" in warnings[0] and "UNAVAILABLE" in warnings[0]
        attempts_per_warning = 0.5 / 0.2  # the first retries come faster than the warnings
        assert len(warnings) < 8 * attempts_per_warning
        assert not w.registered.is_set() and not w._heartbeat_tasks[0].done()
        coordinator = loop.run(start_coordinator(CoordinatorConfig(port=port)))
        loop.run(asyncio.wait_for(w.registered.wait(), 10))
        assert [r.worker_id for r in coordinator.registry.live()] == ["early"]
    finally:
        loop.run(w.stop(grace_s=0.5))
        if coordinator is not None:
            loop.run(coordinator.stop(grace_s=0.5))
        loop.close()


def test_a_draining_coordinator_counts_no_lease_expiries():
    # While the coordinator drains it refuses heartbeats; a stream that outlives the lease TTL
    # must not turn every worker into a lease expiry (and a FlashfleetWorkerLeaseExpired alert).
    engine = FakeEngine(token_delay_s=0.05)
    c = start_cluster({"w1": engine}, lease_ttl_s=0.5, heartbeat_interval_s=0.1)
    try:
        client = Client(c.address)
        stream = client.generate("fake-model", prompt="long", max_tokens=30)  # about 1.5 s
        next(stream)
        c.loop.run(c.coordinator.stop(grace_s=3.0))  # waits for the stream, past the 0.5 s TTL
        assert sum(1 for _ in stream) > 0
        assert c.coordinator.metrics.lease_expiries._value.get() == 0
        client.close()
    finally:
        for w in c.workers:
            c.loop.run(w.stop(grace_s=0.2))
        c.loop.close()


def test_a_request_for_a_free_model_does_not_wait_behind_another_models_queue():
    c = start_cluster({"w1": FakeEngine(capacity=1, token_delay_s=0.05),
                       "w2": FakeEngine(name="other-model", capacity=1)}, queue_timeout_s=20)
    try:
        with Client(c.address) as holder, Client(c.address) as client, Client(c.address) as free:
            held = _hold(holder)
            out = {}
            t = _queued(c, lambda: out.setdefault("done", client.complete("fake-model", prompt="w", max_tokens=2)))
            t0 = time.monotonic()
            done = free.complete("other-model", prompt="o", max_tokens=2)
            # waiting behind the held slot would last until it is given back (20 s queue timeout)
            assert done.worker_id == "w2" and done.stats.queue_s < 5.0 and time.monotonic() - t0 < 10.0
            assert "done" not in out and c.coordinator.servicer.admission.waiting == 1  # still waits
            held.close()
            t.join(10)
            assert out["done"].finish_reason == "length"
    finally:
        c.close()


def test_a_huge_field_in_an_error_message_stays_a_clear_error(cluster):
    """An error message quoting a 20 KB model name is cut, so it reaches the client as the error it
    is (gRPC refuses status details over 16 KB, which would surface as RESOURCE_EXHAUSTED)."""
    with Client(cluster.address) as client:
        with pytest.raises(ModelNotFound, match=r"more characters"):
            client.complete("m" * 20_000, prompt="hi", max_tokens=2)
        with pytest.raises(InvalidArgument):
            client.complete("fake-model", messages=[{"role": "r" * 20_000, "content": "hi"}], max_tokens=2)
        assert client.complete("fake-model", prompt="still serving", max_tokens=2).finish_reason == "length"


def test_a_stream_whose_worker_dies_resumes_on_another_worker():
    """Failover: the serving worker's server goes away mid-stream (no deregistration, as a killed
    process); the coordinator resumes the session on the other worker from the tokens already
    streamed, and the client sees every token once and a normal end."""
    engines = {"w1": FakeEngine(token_delay_s=0.05), "w2": FakeEngine(token_delay_s=0.05)}
    c = start_cluster(engines)
    try:
        with Client(c.address) as client:
            ref = client.complete("fake-model", prompt="count along", max_tokens=40)
            stream = client.generate("fake-model", prompt="count along", max_tokens=40)
            got = [next(stream), next(stream), next(stream)]
            serving = next(w for w in c.workers if engines[w.worker_id].load().active_sessions)
            serving.stop_heartbeats()
            c.loop.run(serving.server.stop(0))  # the worker is gone mid-stream
            got += list(stream)
        tokens = [t for ch in got for t in ch.token_ids]
        assert tokens == list(ref.token_ids)
        assert got[-1].finish_reason == "length" and got[-1].stats.migrations == 1
        assert got[-1].worker_id != serving.worker_id
        assert c.coordinator_registry.get_sample_value(
            "flashfleet_coordinator_migrations_total",
            {"model": "fake-model", "reason": "failure", "outcome": "failover", "method": "reprefill"}) == 1
    finally:
        c.close()


def test_a_request_id_reused_right_after_its_deadline_waits_for_the_engine_to_end_the_old_one():
    # The engine frees an aborted request at its next turn (here 1 s after the abort), after the
    # coordinator has let the id go: a client retrying at once with the same id is served once
    # the old one has ended, not refused as a duplicate of a request it no longer has.
    engine = FakeEngine(token_delay_s=0.05, abort_delay_s=1.0)
    c = start_cluster({"w1": engine})
    try:
        with Client(c.address) as client:
            with pytest.raises(DeadlineExceeded):
                client.complete("fake-model", prompt="slow", max_tokens=200, request_id="retry-1", timeout_s=0.2)
            assert "retry-1" in engine.active  # still running on the worker
            done = client.complete("fake-model", prompt="again", max_tokens=3, request_id="retry-1")
            assert done.finish_reason == "length" and len(done.token_ids) == 3
            assert engine.aborted == ["retry-1"]
            assert c.workers[0].servicer._sessions == {}
    finally:
        c.close()


def test_too_many_stop_strings_or_chat_turns_are_refused_before_any_work(cluster):
    # Each stop string is searched for after every token on the engine thread, and chat turns are
    # templated before the context check: both are bounded before any work.
    with Client(cluster.address) as client:
        with pytest.raises(InvalidArgument, match="65 stop strings; at most 64"):
            client.complete("fake-model", prompt="hi", max_tokens=2, stop=[f"s{i}" for i in range(65)])
        assert client.complete("fake-model", prompt="hi", max_tokens=2,
                               stop=[f"s{i}" for i in range(64)]).finish_reason == "length"
        with pytest.raises(InvalidArgument, match="a stop string of 1,025 characters; at most 1,024"):
            client.complete("fake-model", prompt="hi", max_tokens=2, stop=["x" * 1025])
        turns = [{"role": "user", "content": "x"}] * 4097  # FakeEngine's context: 4096 tokens
        with pytest.raises(InvalidArgument, match="4,097 chat turns cannot fit the model's context of 4,096"):
            client.complete("fake-model", messages=turns, max_tokens=2)
    assert sum(len(w.engine.submitted) for w in cluster.workers) == 1  # only the one with 64 stops


def test_up_port_zero_is_one_free_port_kept_for_the_cluster():
    """`flashfleet up --port 0` picks a free port once (a restarted coordinator comes back there);
    a given port is kept as it is."""
    import socket

    from flashfleet.cli.up import fixed_port

    port = fixed_port(0, "127.0.0.1")
    assert port > 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    assert fixed_port(50123, "127.0.0.1") == 50123


def test_up_says_it_is_still_loading_while_its_workers_load(tiny_models, tmp_path, monkeypatch):
    """A worker's load (weights, then the shapes it warms) is silent; `up` says it is waiting."""
    from flashfleet.cli import up

    monkeypatch.setattr(up, "STILL_LOADING_EVERY_S", 0.2)
    cluster = up.LocalCluster(str(tiny_models.llama), workers=1, capacity=2, log_dir=tmp_path,
                              port=up.free_port(), worker_args=("--warmup-shapes-s", "2"))
    lines: list[str] = []
    cluster.start(timeout_s=300, progress=lines.append)
    try:
        still = [line for line in lines if "still loading after" in line]
        assert still and any("1/1 workers ready" in line for line in lines), lines
        assert lines.index(still[0]) < next(i for i, line in enumerate(lines) if "workers ready" in line)
    finally:
        cluster.stop()


def test_a_worker_started_again_on_another_port_takes_its_id_over_at_once():
    """A supervisor that gives a restarted worker a free port (`flashfleet up`, launchd with
    port 0): the old address refuses connections, so the id is free now, not after its lease."""
    import socket

    from flashfleet.v1 import common_pb2, worker_pb2, worker_pb2_grpc

    c = start_cluster({}, lease_ttl_s=30.0)
    alive = socket.create_server(("127.0.0.1", 0))  # where the first worker "listens"
    first = f"127.0.0.1:{alive.getsockname()[1]}"
    gone = socket.create_server(("127.0.0.1", 0))
    second = f"127.0.0.1:{gone.getsockname()[1]}"
    gone.close()

    def register(address):
        return stub.Register(worker_pb2.RegisterRequest(
            worker_id="w", address=address, models=[common_pb2.ModelInfo(name="fake-model")],
            load=worker_pb2.WorkerLoad(capacity=2)), timeout=5)

    try:
        with grpc.insecure_channel(c.address) as ch:
            stub = worker_pb2_grpc.RegistryStub(ch)
            register(first)
            with pytest.raises(grpc.RpcError) as e:
                register(second)  # the first still listens: a second worker given the same id
            assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
            assert c.coordinator.registry.get("w").address == first
            alive.close()  # the first worker died
            register(second)
            assert c.coordinator.registry.get("w").address == second
            assert c.coordinator.metrics.lease_expiries._value.get() == 0
    finally:
        alive.close()
        c.close()
