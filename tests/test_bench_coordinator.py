"""bench/bench_coordinator.py end to end at a tiny size: one coordinator, three simulated workers
(bench/sim_worker.py), a few streams; its table row and JSON carry measured tokens, streams held
and admitted requests with no error, and bad arguments are one line (exit 2). Then a simulated
worker alone, in process: one clock for all of its streams, and its Subscribe stream per the
worker.proto contract."""
import asyncio
import json
import sys

import grpc
import pytest

from bench_scripts import ROOT, run_bench

sys.path.insert(0, str(ROOT / "bench"))

from flashfleet.requests import SUBSCRIPTION_HEADER  # noqa: E402
from flashfleet.v1 import common_pb2, worker_pb2, worker_pb2_grpc  # noqa: E402
from sim_worker import SimWorker, _merge_chunks  # noqa: E402


def test_table_json_and_bad_arguments(tmp_path):
    out = tmp_path / "c.json"
    r = run_bench("bench_coordinator.py", "--workers", 3, "--streams", 8, "--max-tokens", 20, "--tokens-per-s", 40,
                  "--warmup-s", 1, "--duration-s", 3, "--idle-s", 0.5, "--admit-s", 1, "--admit-concurrency", 2,
                  "--sim-procs", 1, "--client-procs", 1, "--json-out", out, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| this |")]
    assert len(rows) == 1, r.stdout
    (row,) = json.loads(out.read_text())
    assert row["coordinators"] == 1 and row["workers"] == 3 and row["streams"] == 8
    assert row["tokens_per_s"] > 0 and row["messages_per_s"] > 0 and row["rate_kept"] > 0.25, row
    assert 1 <= row["held"] <= 8 and row["errors"] == 0 and row["admit_errors"] == 0, row
    assert row["admitted_per_s"] > 0 and row["cpu_s_per_1k_tokens"] > 0 and row["heartbeats_per_s"] == 1.5
    # every simulated worker heartbeats inside the window, answered well within the lease
    assert 0 < row["heartbeat_rtt_p50_s"] <= row["heartbeat_rtt_max_s"] < 5 and row["leases_lost"] == 0, row
    # the coordinator's own measure of its RPC lateness, sampled from its /metrics
    assert 0 < row["rpc_lag_p50_s"] <= row["rpc_lag_max_s"] < 5 and row["lease_expiries"] == 0, row
    bad = run_bench("bench_coordinator.py", "--workers", 0)
    assert bad.returncode == 2 and "must be >= 1" in bad.stderr and "Traceback" not in bad.stderr
    bad = run_bench("bench_coordinator.py", "--baseline-src", tmp_path)
    assert bad.returncode == 2 and "no coordinator/__main__.py there" in bad.stderr


def test_two_coordinators_sharing_the_fleet_state_in_etcd(tmp_path):
    import shutil

    import pytest
    if not shutil.which("etcd"):
        pytest.skip("the etcd binary is not installed (apt-get install etcd-server; .ci/run installs it)")
    out = tmp_path / "e.json"
    r = run_bench("bench_coordinator.py", "--etcd", "--coordinators", 2, "--workers", 4, "--streams", 6,
                  "--max-tokens", 20, "--tokens-per-s", 40, "--warmup-s", 1, "--duration-s", 3, "--idle-s", 0.5,
                  "--admit-s", 1, "--admit-concurrency", 2, "--sim-procs", 1, "--client-procs", 1, "--json-out", out,
                  timeout=300)
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(out.read_text())
    assert row["coordinators"] == 2 and row["streams"] == 12 and row["tokens_per_s"] > 0 and row["errors"] == 0, row


def test_the_coordinator_and_simulated_worker_path_imports_no_mlx():
    import subprocess
    import sys

    from bench_scripts import ROOT
    code = ("import sys; sys.path.insert(0, 'bench'); import coordinator.__main__, coordinator.server, sim_worker, "
            "bench_coordinator; print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'worker')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr)


TOKENS_PER_S = 50.0  # a tick every 20 ms at one token a chunk


async def _serve(**kw) -> tuple[SimWorker, grpc.aio.Server, grpc.aio.Channel, worker_pb2_grpc.WorkerStub]:
    worker = SimWorker("w", "sim", kw.pop("capacity", 4), TOKENS_PER_S, **kw)
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return worker, server, channel, worker_pb2_grpc.WorkerStub(channel)


async def _stop(worker, server, channel) -> None:
    await channel.close()
    await server.stop(0)
    await worker.close()


def _generate(stub, request_id: str, max_tokens: int, subscription: str | None = None, resume: int = 0):
    metadata = ((SUBSCRIPTION_HEADER, subscription),) if subscription is not None else None
    return stub.Generate(common_pb2.GenerateRequest(request_id=request_id, model="sim", max_tokens=max_tokens,
                                                    resume_token_ids=list(range(resume))), metadata=metadata)


async def _drain(call) -> tuple[list, grpc.StatusCode]:
    """The messages a call carried (from the next one on) and the status it ended with."""
    messages = []
    try:
        while (m := await call.read()) is not grpc.aio.EOF:
            messages.append(m)
    except grpc.aio.AioRpcError:
        pass
    return messages, await call.code()


async def _read_subscription(subscription, request_ids: set[str]) -> list[list]:
    """The batches of `subscription` (after its first) until every one of `request_ids` completed."""
    batches, completed = [], set()
    while completed != request_ids:
        batch = await subscription.read()
        assert batch is not grpc.aio.EOF
        batches.append(list(batch.responses))
        completed |= {r.request_id for r in batch.responses if r.WhichOneof("kind") == "complete"}
    return batches


def test_a_subscription_carries_every_stream_of_a_tick_in_one_batch_and_its_calls_carry_nothing():
    async def run():
        worker, server, channel, stub = await _serve()
        try:
            subscription = stub.Subscribe(worker_pb2.SubscribeRequest(subscription_id="s1"))
            first = await subscription.read()
            assert list(first.responses) == []  # the subscription is open
            a = _generate(stub, "a", 12, "s1")
            await asyncio.sleep(0.5 / TOKENS_PER_S)  # half a tick later: b still takes a's ticks
            b = _generate(stub, "b", 4, "s1", resume=1)
            calls = asyncio.gather(_drain(a), _drain(b))
            batches = await _read_subscription(subscription, {"a", "b"})
            assert await calls == [([], grpc.StatusCode.OK), ([], grpc.StatusCode.OK)]
            subscription.cancel()
            return batches, worker
        finally:
            await _stop(worker, server, channel)

    batches, worker = asyncio.run(run())
    responses = [r for batch in batches for r in batch]
    for rid, ids in (("a", list(range(12))), ("b", [1, 2, 3])):
        mine = [r for r in responses if r.request_id == rid]
        assert [t for r in mine[:-1] for t in r.chunk.token_ids] == ids, mine
        assert all(r.WhichOneof("kind") == "chunk" for r in mine[:-1])
        complete = mine[-1].complete
        assert complete.finish_reason == common_pb2.FINISH_REASON_LENGTH and complete.worker_id == "w"
        assert complete.stats.generated_tokens == len(ids) and complete.stats.prompt_tokens > 0
    # One clock: every tick makes a chunk for both running streams at once, so each batch with a
    # chunk of b (admitted between two ticks, done while a runs) holds a chunk of a too.
    with_b = [{r.request_id for r in batch if r.WhichOneof("kind") == "chunk"} for batch in batches]
    with_b = [ids for ids in with_b if "b" in ids]
    assert len(with_b) >= 1 and all(ids == {"a", "b"} for ids in with_b), batches
    assert worker.streams == {} and worker.subscriptions == {} and worker._clock is None


def test_a_subscription_that_closes_or_is_replaced_ends_its_calls_unavailable():
    async def run():
        worker, server, channel, stub = await _serve()
        try:
            unknown = await _drain(_generate(stub, "u", 4, "nobody"))
            empty = stub.Subscribe(worker_pb2.SubscribeRequest())
            no_id = await _drain(empty)

            # the subscriber leaves while a call uses it
            first = stub.Subscribe(worker_pb2.SubscribeRequest(subscription_id="s1"))
            await first.read()
            running = asyncio.ensure_future(_drain(_generate(stub, "r", 1000, "s1")))
            while "r" not in worker.streams:
                await asyncio.sleep(0.01)
            await first.read()  # its chunks flow
            first.cancel()
            closed = await running

            # another Subscribe takes the id
            old = stub.Subscribe(worker_pb2.SubscribeRequest(subscription_id="s2"))
            await old.read()
            running = asyncio.ensure_future(_drain(_generate(stub, "q", 1000, "s2")))
            while "q" not in worker.streams:
                await asyncio.sleep(0.01)
            new = stub.Subscribe(worker_pb2.SubscribeRequest(subscription_id="s2"))
            assert list((await new.read()).responses) == []
            replaced = await running
            old_end = await _drain(old)
            # the new subscription serves the next call
            after = asyncio.ensure_future(_drain(_generate(stub, "n", 2, "s2")))
            batches = await _read_subscription(new, {"n"})
            new.cancel()
            return unknown, no_id, closed, replaced, old_end, await after, batches, worker
        finally:
            await _stop(worker, server, channel)

    unknown, no_id, closed, replaced, old_end, after, batches, worker = asyncio.run(run())
    assert unknown == ([], grpc.StatusCode.UNAVAILABLE)
    assert no_id == ([], grpc.StatusCode.INVALID_ARGUMENT)
    assert closed == ([], grpc.StatusCode.UNAVAILABLE)
    assert replaced == ([], grpc.StatusCode.UNAVAILABLE)
    assert old_end[1] == grpc.StatusCode.UNAVAILABLE  # after the batches it had sent
    assert after == ([], grpc.StatusCode.OK)
    assert [t for b in batches for r in b if r.request_id == "n" for t in r.chunk.token_ids] == [0, 1]
    assert worker.streams == {} and worker.subscriptions == {}  # nothing left holding capacity


def test_cancel_capacity_and_the_direct_stream_on_the_shared_clock():
    async def run():
        worker, server, channel, stub = await _serve(capacity=2)
        try:
            subscription = stub.Subscribe(worker_pb2.SubscribeRequest(subscription_id="s"))
            await subscription.read()
            on_sub = asyncio.ensure_future(_drain(_generate(stub, "s", 1000, "s")))
            direct = _generate(stub, "d", 1000)
            first = await direct.read()
            full = await _drain(_generate(stub, "x", 4))
            loads = [s.request_id for s in worker.load().sessions]
            for rid in ("s", "d"):
                assert (await stub.Cancel(worker_pb2.CancelRequest(request_id=rid))).cancelled
            rest, direct_code = await _drain(direct)
            sub_batches = await _read_subscription(subscription, {"s"})
            subscription.cancel()
            plain = await _drain(_generate(stub, "p", 3))
            return first, full, loads, rest, direct_code, await on_sub, sub_batches, plain
        finally:
            await _stop(worker, server, channel)

    first, full, loads, rest, direct_code, on_sub, sub_batches, plain = asyncio.run(run())
    assert list(first.chunk.token_ids) == [0]
    assert full == ([], grpc.StatusCode.RESOURCE_EXHAUSTED) and sorted(loads) == ["d", "s"]
    assert direct_code == grpc.StatusCode.OK
    assert rest[-1].complete.finish_reason == common_pb2.FINISH_REASON_CANCELLED
    assert on_sub == ([], grpc.StatusCode.OK)
    (complete,) = [r for b in sub_batches for r in b if r.WhichOneof("kind") == "complete"]
    assert complete.complete.finish_reason == common_pb2.FINISH_REASON_CANCELLED
    messages, code = plain
    assert code == grpc.StatusCode.OK and [list(m.chunk.token_ids) for m in messages[:-1]] == [[0], [1], [2]]
    assert messages[-1].complete.finish_reason == common_pb2.FINISH_REASON_LENGTH


@pytest.mark.parametrize("n", [1, 3])
def test_merge_chunks_keeps_each_requests_tokens_in_order_before_its_complete(n):
    def chunk(rid, *ids):
        return common_pb2.GenerateResponse(request_id=rid, chunk=common_pb2.Chunk(text=" t" * len(ids), token_ids=ids))

    done = common_pb2.GenerateResponse(request_id="a", complete=common_pb2.Complete(worker_id="w"))
    queued = [chunk("a", 0, 1), chunk("b", 5), *[chunk("a", 2 + i) for i in range(n)], done, chunk("b", 6)]
    merged = _merge_chunks(queued)
    assert [(r.request_id, r.WhichOneof("kind"), list(r.chunk.token_ids)) for r in merged] == [
        ("a", "chunk", list(range(2 + n))), ("b", "chunk", [5, 6]), ("a", "complete", [])]
    assert merged[0].chunk.text == " t" * (2 + n)
