"""Session migration by KV transfer: a running session's state exported by one engine, checked and
staged by another (worker/engine/kv_transfer.py, worker/kv_wire.py), claimed by the resumed
request; and the coordinator moving live streams that way, the destination pulling the state
straight from the source (coordinator/kv_transfer.py, worker/kv_pull.py), with every failure
leaving the session on exactly one worker with its full greedy output."""
from __future__ import annotations

import queue
import time

import numpy as np
import pytest

from harness import run_request, wait_until
from worker import kv_wire
from worker.config import EngineConfig
from worker.engine.thread import Engine
from worker.engine.types import (CorruptState, DoneEvent, Draining, GenerationRequest, Overloaded,
                                 StateMismatch, TokenEvent, UnknownSession)

PROMPT = "The river flows"
MAX_TOKENS = 200


class SlowSession:
    """Submits a request whose emit sleeps `delay_s` per event (the engine thread slows with it),
    so it is still decoding when a test exports it; collects its tokens."""

    def __init__(self, engine, request, delay_s=0.01):
        self.tokens: list[int] = []
        self.done: queue.Queue = queue.Queue()
        self.delay_s = delay_s
        engine.submit(request, self._emit)

    def _emit(self, ev):
        if isinstance(ev, TokenEvent):
            self.tokens.extend(ev.token_ids)
            time.sleep(self.delay_s)
        elif isinstance(ev, DoneEvent):
            self.done.put(ev)
        else:
            self.done.put(ev)


def _engine(path, draft=None, **kw):
    return Engine(EngineConfig(model_path=path, model_name="tiny-llama", draft_path=draft, capacity=3, **kw))


@pytest.fixture(scope="module")
def engines(tiny_models):
    a, b = _engine(tiny_models.llama), _engine(tiny_models.llama)
    yield a, b
    a.close()
    b.close()


def _import(engine, chunks):
    """What the worker servicer's PullSession does with the export's stream, without gRPC: returns the
    import id, or raises the error it would abort with (dropping the reservation)."""
    rx = kv_wire.StateReceiver()
    import_id = ""
    try:
        for msg in chunks:
            kind = msg.WhichOneof("kind")
            if kind == "header":
                import_id = engine.transfer.reserve_import(rx.header(msg.header)).result(30)
                rx.allocate()
            elif kind == "data":
                rx.data(msg.data)
            else:
                state = rx.finish(msg.trailer)
                engine.transfer.stage_import(import_id, state.tokens, state.caches).result(30)
                return import_id, state
        raise CorruptState("no trailer")
    except BaseException:
        if import_id:
            engine.transfer.drop_import(import_id)
        raise


def _export_running(engine, request, after_tokens=20):
    s = SlowSession(engine, request)
    assert wait_until(lambda: len(s.tokens) >= after_tokens, 30)
    state = engine.transfer.export_session(request.request_id).result(30)
    return s, state


def _reference(engine, ids, mode="plain", max_tokens=MAX_TOKENS):
    tokens, done = run_request(engine, GenerationRequest(f"ref-{mode}-{len(ids)}", tuple(ids), max_tokens, mode=mode))
    assert len(tokens) == max_tokens, "the tiny model ended early; pick another prompt"
    return tokens


def _resume(engine, ids, state, reference, rid, mode="plain", import_id=""):
    """Claims an import on `engine` the way a migration does: resume after the state's tokens."""
    done_tokens = list(state.tokens[len(ids):])
    assert done_tokens == reference[:len(done_tokens)]
    text = engine._encode_tokenizer.decode(done_tokens)
    tokens, done = run_request(engine, GenerationRequest(rid, tuple(ids), MAX_TOKENS, mode=mode,
                                                         resume_tokens=tuple(done_tokens), resume_text=text,
                                                         import_id=import_id))
    return done_tokens + tokens, done


def test_export_import_round_trip_is_exact_and_claimed_as_transferred_positions(engines):
    a, b = engines
    ids = a.encode_prompt(PROMPT, None)
    ref = _reference(a, ids)
    s, state = _export_running(a, GenerationRequest("rt-1", tuple(ids), MAX_TOKENS, mode="plain"))
    assert s.done.get(60).finish_reason == "length" and s.tokens == ref  # the source kept decoding
    assert state.positions == len(state.tokens) - 1 > len(ids)
    chunks = list(kv_wire.state_chunks(state, chunk_bytes=1000))
    assert sum(m.WhichOneof("kind") == "data" for m in chunks) > len(state.caches) * 2  # split
    import_id, got = _import(b, chunks)
    for sent, recv in zip(state.caches, got.caches):
        assert sent.layout == recv.layout
        assert np.array_equal(sent.keys, recv.keys) and np.array_equal(sent.values, recv.values)
    assert b.load().kv_cache_bytes > 0  # the staged state counts against the budget
    out, done = _resume(b, ids, state, ref, "rt-claim", import_id=import_id)
    assert out == ref
    assert done.stats.transferred_tokens == state.positions and done.stats.cached_tokens == 0
    assert wait_until(lambda: b.load().kv_cache_bytes == 0)


def test_a_claim_after_more_tokens_prefills_only_those_and_a_shorter_one_cuts_the_state(engines):
    a, b = engines
    ids = a.encode_prompt(PROMPT, None)
    ref = _reference(a, ids)
    s, state = _export_running(a, GenerationRequest("rt-2", tuple(ids), MAX_TOKENS, mode="plain"))
    s.done.get(60)
    # The client received 7 tokens more than the snapshot holds: the destination prefills those.
    longer = state.__class__(state.request_id, state.mode, tuple(ids) + tuple(ref[:len(state.tokens) - len(ids) + 7]),
                             state.positions, state.caches)
    import_id, _ = _import(b, kv_wire.state_chunks(state))
    out, done = _resume(b, ids, longer, ref, "rt-longer", import_id=import_id)
    assert out == ref and done.stats.transferred_tokens == state.positions
    # ... or 5 fewer (the coordinator had not read them when it cut): the state is cut to them.
    shorter = state.__class__(state.request_id, state.mode, state.tokens[:-5], state.positions - 5, [])
    import_id, _ = _import(b, kv_wire.state_chunks(state))
    out, done = _resume(b, ids, shorter, ref, "rt-shorter", import_id=import_id)
    assert out == ref and done.stats.transferred_tokens == state.positions - 5
    # An import whose tokens are not the request's is dropped; the request prefills as usual.
    import_id, _ = _import(b, kv_wire.state_chunks(state))
    other = b.encode_prompt("Once upon a time", None)
    tokens, done = run_request(b, GenerationRequest("rt-other", tuple(other), 20, mode="plain", import_id=import_id))
    assert tokens == run_request(a, GenerationRequest("rt-other-ref", tuple(other), 20, mode="plain"))[0]
    assert done.stats.transferred_tokens == 0
    assert wait_until(lambda: b.load().kv_cache_bytes == 0)


def test_mismatched_corrupt_and_unknown_states_are_refused_and_nothing_stays(engines, tiny_models):
    a, b = engines
    ids = a.encode_prompt(PROMPT, None)
    s, state = _export_running(a, GenerationRequest("bad-1", tuple(ids), MAX_TOKENS, mode="plain"))
    s.done.get(60)
    good = list(kv_wire.state_chunks(state, chunk_bytes=4096))

    other = list(good)
    other[0] = type(good[0])()
    other[0].CopyFrom(good[0])
    other[0].header.model_fingerprint = "another-model:0123:bfloat16"
    with pytest.raises(StateMismatch, match="model"):
        _import(b, other)
    other[0].header.model_fingerprint = good[0].header.model_fingerprint
    other[0].header.format_version = 99
    with pytest.raises(StateMismatch, match="format version 99"):
        _import(b, other)

    corrupt = list(good)
    i = next(k for k, m in enumerate(good) if m.WhichOneof("kind") == "data")
    corrupt[i] = type(good[i])()
    corrupt[i].CopyFrom(good[i])
    corrupt[i].data.data = bytes([good[i].data.data[0] ^ 1]) + good[i].data.data[1:]
    with pytest.raises(CorruptState, match="CRC-32"):
        _import(b, corrupt)
    corrupt[i].data.crc32 = __import__("zlib").crc32(corrupt[i].data.data)  # a consistent chunk: the sha256 sees it
    with pytest.raises(CorruptState, match="SHA-256"):
        _import(b, corrupt)
    with pytest.raises(CorruptState, match="no trailer"):
        _import(b, good[:-3])
    assert wait_until(lambda: b.load().kv_cache_bytes == 0)  # no reservation left by any of them

    with pytest.raises(UnknownSession):
        a.transfer.export_session("no-such-request").result(30)


def test_an_unclaimed_import_expires_and_frees_its_reservation(engines):
    a, b = engines
    ids = a.encode_prompt(PROMPT, None)
    s, state = _export_running(a, GenerationRequest("ttl-1", tuple(ids), MAX_TOKENS, mode="plain"))
    s.done.get(60)
    b.transfer.import_ttl_s = 0.5
    try:
        _import(b, kv_wire.state_chunks(state))
        assert b.load().kv_cache_bytes > 0
        assert wait_until(lambda: b.load().kv_cache_bytes == 0, 5)  # with no session running
    finally:
        from worker.engine.kv_transfer import DEFAULT_IMPORT_TTL_S
        b.transfer.import_ttl_s = DEFAULT_IMPORT_TTL_S
    # A Cancel of the request drops its staged state too.
    _import(b, kv_wire.state_chunks(state))
    assert b.load().kv_cache_bytes > 0
    assert b.abort("ttl-1") is False  # not running here, but its import goes
    assert wait_until(lambda: b.load().kv_cache_bytes == 0)


def test_a_state_larger_than_the_free_budget_is_refused_with_numbers(engines, tiny_models):
    a, _ = engines
    ids = a.encode_prompt(PROMPT, None)
    s, state = _export_running(a, GenerationRequest("big-1", tuple(ids), MAX_TOKENS, mode="plain"))
    s.done.get(60)
    per_position = a._scheduler.bytes_per_position["plain"]
    small = _engine(tiny_models.llama, kv_budget_bytes=per_position * 256 * 2 + 1)
    try:
        running = SlowSession(small, GenerationRequest("hog", tuple(ids), 150, mode="plain"), delay_s=0.02)
        assert wait_until(lambda: len(running.tokens) > 5, 30)
        with pytest.raises(Overloaded, match="bytes of KV cache"):
            _import(small, kv_wire.state_chunks(state))
        small.abort("hog")
        assert wait_until(lambda: small.load().kv_cache_bytes == 0)
    finally:
        small.close()


def test_dflash_session_state_round_trip_keeps_greedy_output(tiny_models, dflash_dir):
    a, b = _engine(tiny_models.llama, dflash_dir), _engine(tiny_models.llama, dflash_dir)
    try:
        ids = a.encode_prompt(PROMPT, None)
        ref = _reference(a, ids, mode="dflash")
        s, state = _export_running(a, GenerationRequest("df-1", tuple(ids), MAX_TOKENS, mode="dflash"))
        s.done.get(60)
        assert state.mode == "dflash" and state.draft_fingerprint
        assert any(c.layout.part == "draft" for c in state.caches)
        import_id, _ = _import(b, kv_wire.state_chunks(state))
        out, done = _resume(b, ids, state, ref, "df-claim", mode="dflash", import_id=import_id)
        assert out == ref and done.stats.transferred_tokens == state.positions
        assert done.stats.mode == "dflash"
        # A plain worker refuses a DFlash state (no draft to load it into).
        plain = _engine(tiny_models.llama)
        try:
            with pytest.raises(StateMismatch):
                _import(plain, kv_wire.state_chunks(state))
        finally:
            plain.close()
    finally:
        a.close()
        b.close()





# ----- through the cluster: coordinator + two MLX workers over loopback gRPC ------------------------

class ScriptedPolicy:
    """A migration policy for tests: move to the other idle worker once `at[k]` tokens have been
    sent, where k counts the moves made so far (a failed attempt is retried, at most `attempts`
    times in all)."""

    enabled = True
    check_interval_s = 0.0
    min_remaining_tokens = 1

    def __init__(self, at, attempts=6):
        self.at, self.attempts = list(at), attempts
        self.sources: list[str] = []

    def decide(self, request, source, sent_tokens, workers, moved_s, now_s, left_worker=None, left_s=None,
               left_gain=0.0, left_timings=None):
        from coordinator.migration import Decision
        if not self.sources or self.sources[-1] != source.worker_id:
            self.sources.append(source.worker_id)
        k = len(self.sources) - 1
        if k >= len(self.at) or sent_tokens < self.at[k] or self.attempts <= 0:
            return None
        other = [w for w in workers if w.worker_id != source.worker_id and w.in_flight == 0 and not w.unreachable]
        if other:
            self.attempts -= 1
            return Decision(other[0], "load")
        return None


def _slow(engine, delay_s=0.002):
    """Slows an engine's iterations, so a tiny model's stream lasts long enough to move."""
    sched = engine._scheduler
    inner = type(sched).iterate

    def iterate():
        time.sleep(delay_s)
        inner(sched)
    sched.iterate = iterate


@pytest.fixture(scope="module")
def pair(tiny_models):
    from harness import start_cluster
    engines = {w: _engine(tiny_models.llama) for w in ("w1", "w2")}
    for e in engines.values():
        _slow(e)
    cluster = start_cluster(engines)
    yield cluster, engines
    cluster.close()


def _run(cluster, engines, policy, method="kv", mode="plain", prompt=PROMPT, max_tokens=MAX_TOKENS):
    import dataclasses

    from flashfleet import Client
    svc = cluster.coordinator.servicer
    svc.config = dataclasses.replace(svc.config, migration=policy, migration_method=method)
    svc.moves.clear()
    with Client(cluster.address) as client:
        done = client.complete("tiny-llama", prompt=prompt, max_tokens=max_tokens, mode=mode)
    # Exactly one worker ends up with the session; nothing stays staged or reserved anywhere.
    assert wait_until(lambda: all(e.load().active_sessions == 0 and e.load().kv_cache_bytes == 0
                                  for e in engines.values()), 10), [e.load() for e in engines.values()]
    assert all(w.in_flight == 0 for w in cluster.coordinator.registry.live())
    return done, list(svc.moves)


def _ref(engine, mode="plain", prompt=PROMPT, max_tokens=MAX_TOKENS):
    ids = engine.encode_prompt(prompt, None)
    return _reference(engine, ids, mode=mode, max_tokens=max_tokens)


@pytest.mark.parametrize("method", ["kv", "reprefill"])
def test_a_session_moved_twice_keeps_its_greedy_output(pair, method):
    cluster, engines = pair
    ref = _ref(engines["w1"])
    done, moves = _run(cluster, engines, ScriptedPolicy([30, 110]), method=method)
    assert done.token_ids == ref and done.finish_reason == "length"
    assert done.stats.migrations == 2 and done.stats.generated_tokens == MAX_TOKENS
    ok = [m for m in moves if m.outcome == "ok"]
    assert [m.method for m in ok] == [method, method], moves
    if method == "kv":
        assert all(m.bytes_moved > 0 and 0 < m.pause_s <= m.total_s for m in ok)
        assert done.stats.transferred_tokens > 0  # the last worker's positions came by transfer
    else:
        assert all(m.bytes_moved == 0 for m in ok) and done.stats.transferred_tokens == 0


@pytest.fixture(scope="module")
def dflash_pair(tiny_models, dflash_dir):
    from harness import start_cluster
    engines = {w: _engine(tiny_models.llama, dflash_dir) for w in ("w1", "w2")}
    for e in engines.values():
        _slow(e)
    cluster = start_cluster(engines)
    yield cluster, engines
    cluster.close()


@pytest.mark.parametrize("method", ["kv", "reprefill"])
def test_a_dflash_session_moved_twice_keeps_its_greedy_output(dflash_pair, method):
    cluster, engines = dflash_pair
    ref = _ref(engines["w1"], mode="dflash")
    done, moves = _run(cluster, engines, ScriptedPolicy([30, 110]), method=method, mode="dflash")
    assert done.token_ids == ref and done.stats.migrations == 2 and done.stats.mode == "dflash"
    assert done.stats.generated_tokens == MAX_TOKENS
    ok = [m for m in moves if m.outcome == "ok"]
    assert [m.method for m in ok] == [method, method], moves
    if method == "kv":
        assert done.stats.transferred_tokens > 0
    else:  # the destinations prefilled prompt + output into the target and the draft
        assert all(m.bytes_moved == 0 for m in ok) and done.stats.transferred_tokens == 0


def test_the_state_goes_worker_to_worker_and_never_through_the_coordinator(pair, monkeypatch):
    """The coordinator only asks the destination to pull (PullSession): it never opens the
    source's export, so the state's bytes cross no link of the coordinator's."""
    cluster, engines = pair
    svc = cluster.coordinator.servicer
    called: list[str] = []
    real_stub = svc.pool.stub

    class Recording:
        def __init__(self, stub):
            self._stub = stub

        def __getattr__(self, name):
            called.append(name)
            return getattr(self._stub, name)

    monkeypatch.setattr(svc.pool, "stub", lambda address: Recording(real_stub(address)))
    ref = _ref(engines["w1"])
    done, moves = _run(cluster, engines, ScriptedPolicy([30]))
    assert done.token_ids == ref and done.stats.migrations == 1 and done.stats.transferred_tokens > 0
    (move,) = moves
    assert (move.outcome, move.method) == ("ok", "kv") and move.bytes_moved > 0
    assert "PullSession" in called and "ExportSession" not in called, called


def test_a_pull_between_workers_that_require_a_join_token_carries_it(tiny_models):
    """Workers with a join token serve only callers that present it: the destination's call to
    the source's export presents its own, so the move is by KV transfer, not its fallback."""
    from harness import start_cluster
    engines = {w: _engine(tiny_models.llama) for w in ("w1", "w2")}
    for e in engines.values():
        _slow(e)
    cluster = start_cluster(engines, join_token="fleet-secret")
    try:
        ref = _ref(engines["w1"])
        done, moves = _run(cluster, engines, ScriptedPolicy([30]))
        assert done.token_ids == ref and done.stats.transferred_tokens > 0
        assert [(m.outcome, m.method) for m in moves] == [("ok", "kv")], moves
    finally:
        cluster.close()
        for e in engines.values():
            e.close()


def test_a_pull_of_an_unknown_session_or_without_a_source_is_refused_and_nothing_stays(pair):
    import grpc

    from flashfleet.v1 import worker_pb2, worker_pb2_grpc
    cluster, engines = pair
    source, dest = cluster.workers
    with grpc.insecure_channel(f"127.0.0.1:{dest.port}") as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.PullSession(worker_pb2.PullSessionRequest(request_id="no-such-request",
                                                           source_address=source.advertise_address), timeout=30)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert e.value.details().startswith(f"export from {source.advertise_address} failed:"), e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.PullSession(worker_pb2.PullSessionRequest(request_id="r"), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "source_address" in e.value.details()
    assert all(e.load().kv_cache_bytes == 0 for e in engines.values())


def _inject(monkeypatch, fault):
    """Replaces the destination's reading of the source's export (worker/kv_pull.py) with one
    that misbehaves: "export" (the source's export fails at once), "cut" (the stream stops half
    way), "checksum" (a data chunk's bytes change)."""
    import grpc

    from worker import kv_pull

    real = kv_pull.relay_chunks

    async def relay_chunks(export_call, relayed):
        if fault == "export":
            relayed.export_error = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                                        grpc.aio.Metadata(), "source gone")
            return
        n = 0
        async for chunk in real(export_call, relayed):
            n += 1
            if fault == "cut" and n == 3:
                return
            if fault == "checksum" and chunk.WhichOneof("kind") == "data":
                chunk.data.data = bytes([chunk.data.data[0] ^ 0xFF]) + chunk.data.data[1:]
            yield chunk
    monkeypatch.setattr(kv_pull, "relay_chunks", relay_chunks)


@pytest.mark.parametrize("fault", ["export", "cut", "checksum", "import_refused", "import_unavailable"])
def test_a_failed_transfer_falls_back_to_reprefill(pair, monkeypatch, fault):
    cluster, engines = pair
    ref = _ref(engines["w1"])
    if fault == "import_refused":
        for e in engines.values():  # the destination has no room for the state
            monkeypatch.setattr(e.transfer, "reserve_import", lambda header: _failed(Overloaded("no room for it")))
    elif fault == "import_unavailable":
        for e in engines.values():  # the destination's PullSession fails UNAVAILABLE (its engine stops)
            monkeypatch.setattr(e.transfer, "reserve_import", lambda header: _failed(Draining("shutting down")))
    else:
        _inject(monkeypatch, fault)
    done, moves = _run(cluster, engines, ScriptedPolicy([30]))
    assert done.token_ids == ref and done.stats.migrations == 1
    assert [(m.outcome, m.method) for m in moves] == [("aborted", "kv"), ("ok", "reprefill")], moves
    assert done.stats.transferred_tokens == 0


def _failed(error):
    from concurrent.futures import Future
    f = Future()
    f.set_exception(error)
    return f


def test_a_destination_that_refuses_the_claim_leaves_the_session_on_its_source(pair, monkeypatch):
    from worker.engine.types import Overloaded as Full
    cluster, engines = pair
    ref = _ref(engines["w1"])
    for e in engines.values():
        real = e.submit

        def submit(request, emit, real=real):
            if request.import_id:
                raise Full("at capacity")
            return real(request, emit)
        monkeypatch.setattr(e, "submit", submit)
    done, moves = _run(cluster, engines, ScriptedPolicy([30], attempts=1))
    assert done.token_ids == ref and done.stats.migrations == 0
    assert [(m.outcome, m.method) for m in moves] == [("aborted", "kv")], moves


def test_a_source_that_dies_during_the_transfer_fails_over_to_the_staged_state(tiny_models):
    """The source's engine stops once its state is exported, before the coordinator cuts the
    stream: the stream fails UNAVAILABLE, and its failover claims the state staged on the other
    worker."""
    import asyncio
    import dataclasses

    from flashfleet import Client
    from harness import start_cluster
    from worker import kv_pull
    engines = {w: _engine(tiny_models.llama) for w in ("w1", "w2")}
    for e in engines.values():
        _slow(e)
    cluster = start_cluster(engines)
    real = kv_pull.relay_chunks
    policy = ScriptedPolicy([30], attempts=1)

    async def relay_chunks(export_call, relayed):
        async for chunk in real(export_call, relayed):
            if chunk.WhichOneof("kind") == "trailer":  # the whole state is out: the source dies
                await asyncio.to_thread(engines[policy.sources[-1]].close)
                await asyncio.sleep(0.5)  # the stream fails while the import is still open
            yield chunk

    kv_pull.relay_chunks = relay_chunks
    try:
        ref = _ref(engines["w1"])
        svc = cluster.coordinator.servicer
        svc.config = dataclasses.replace(svc.config, migration=policy)
        with Client(cluster.address) as client:
            done = client.complete("tiny-llama", prompt=PROMPT, max_tokens=MAX_TOKENS, mode="plain")
        assert done.token_ids == ref and done.stats.migrations == 1
        assert [(m.outcome, m.method) for m in svc.moves] == [("failover", "kv")], list(svc.moves)
        assert done.stats.transferred_tokens > 0
        survivor = ({"w1", "w2"} - {policy.sources[0]}).pop()
        assert done.worker_id == survivor
        assert wait_until(lambda: engines[survivor].load().kv_cache_bytes == 0
                          and engines[survivor].load().active_sessions == 0)
    finally:
        kv_pull.relay_chunks = real
        cluster.close()
        for e in engines.values():
            e.close()


def test_a_destination_that_dies_during_the_transfer_leaves_the_session_on_its_source(tiny_models):
    """The destination's server stops (no deregistration, as a killed process) while the state is
    being relayed, after it reserved room for the import: the transfer fails, the move is given up
    and the stream goes on from its source with its full greedy output; the dead worker's engine
    dropped the reservation with the failed call, and nothing stays on the source."""
    import asyncio
    import dataclasses

    from flashfleet import Client
    from harness import start_cluster
    from worker import kv_pull
    engines = {w: _engine(tiny_models.llama) for w in ("w1", "w2")}
    for e in engines.values():
        _slow(e)
    cluster = start_cluster(engines, heartbeat_interval_s=0.1)
    real = kv_pull.relay_chunks
    policy = ScriptedPolicy([30], attempts=2)
    reserved = []
    stopping = []  # the destination's server stop (held: a task nobody holds may be collected)

    async def relay_chunks(export_call, relayed):
        async for chunk in real(export_call, relayed):
            yield chunk
            if chunk.WhichOneof("kind") == "data" and not reserved:  # the header is through: room reserved
                dest_id = ({"w1", "w2"} - {policy.sources[-1]}).pop()
                dest = cluster.workers[list(engines).index(dest_id)]
                for _ in range(250):
                    if engines[dest_id].load().kv_cache_bytes > 0:
                        break
                    await asyncio.sleep(0.02)
                reserved.append(engines[dest_id].load().kv_cache_bytes)
                dest.stop_heartbeats()
                # The destination is gone, mid-import: its server stops (this pull's handler, which
                # runs this, is cancelled with every other call of it).
                stopping.append(asyncio.ensure_future(dest.server.stop(0)))
                await asyncio.sleep(30)

    kv_pull.relay_chunks = relay_chunks
    try:
        ref = _ref(engines["w1"])
        svc = cluster.coordinator.servicer
        svc.config = dataclasses.replace(svc.config, migration=policy)
        with Client(cluster.address) as client:
            done = client.complete("tiny-llama", prompt=PROMPT, max_tokens=MAX_TOKENS, mode="plain")
        source = policy.sources[0]
        assert reserved and reserved[0] > 0, reserved  # the destination held room for the state
        assert done.token_ids == ref and done.finish_reason == "length"
        assert done.worker_id == source and done.stats.migrations == 0 and done.stats.transferred_tokens == 0
        moves = list(svc.moves)
        assert moves and (moves[0].outcome, moves[0].method) == ("aborted", "kv"), moves
        assert all(m.outcome == "aborted" for m in moves), moves  # the fallback's re-prefill found it gone too
        assert wait_until(lambda: all(e.load().kv_cache_bytes == 0 and e.load().active_sessions == 0
                                      for e in engines.values()), 10), [e.load() for e in engines.values()]
        live = cluster.coordinator.registry.live()
        assert all(w.in_flight == 0 for w in live)
    finally:
        kv_pull.relay_chunks = real
        cluster.close()
        for e in engines.values():
            e.close()


def test_a_header_whose_payload_size_disagrees_with_its_layouts_is_refused():
    # The receiver sizes its buffers from the layouts: a payload_bytes that says otherwise is refused
    # before any budget is reserved or any byte taken.
    from flashfleet.v1 import worker_pb2
    from worker.engine.types import InvalidRequest

    lay = worker_pb2.CacheLayout(part="target", layer=0, dtype="float16", key_shape=[1, 2, 8, 4],
                                 value_shape=[1, 2, 8, 4])
    size = 2 * (1 * 2 * 8 * 4) * 2  # keys and values, two bytes a value
    header = worker_pb2.SessionStateHeader(format_version=1, caches=[lay], payload_bytes=size, positions=8,
                                           token_ids=list(range(8)), request_id="r")
    assert kv_wire.StateReceiver().header(header).payload_bytes == size
    for wrong in (size - 1, size + 1, 0, 2 * size):
        header.payload_bytes = wrong
        with pytest.raises(InvalidRequest, match=f"payload_bytes {wrong} but the layouts hold {size}"):
            kv_wire.StateReceiver().header(header)
