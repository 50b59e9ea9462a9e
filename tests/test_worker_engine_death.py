"""A worker whose engine thread dies leaves the fleet and exits non-zero (`worker.watchdog`,
`RunningWorker.leave_after_engine_death`), and `flashfleet up` starts it again."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from fakes import FakeEngine
from flashfleet import Client
from flashfleet.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from harness import start_cluster, wait_until
from worker.watchdog import ENGINE_DIED_EXIT, watch_engine

ROOT = Path(__file__).resolve().parents[1]
DYING_WORKER = Path(__file__).resolve().parent / "engine_death_worker.py"



# ----- the watchdog alone ----------------------------------------------------------------------

class _Engine:
    """`alive` turns False on the `dies_at`-th look at it."""

    def __init__(self, dies_at: int):
        self.looks, self.dies_at = 0, dies_at

    @property
    def alive(self) -> bool:
        self.looks += 1
        return self.looks < self.dies_at


def test_watch_engine_calls_back_once_when_alive_turns_false():
    engine, deaths = _Engine(dies_at=4), []

    async def on_death():
        deaths.append(engine.looks)

    asyncio.run(asyncio.wait_for(watch_engine(engine, on_death, poll_s=0.001), 5))
    assert deaths == [4]  # after the look that found it dead, not before


def test_watch_engine_never_calls_back_for_a_live_engine_and_stops_when_cancelled():
    engine, deaths = _Engine(dies_at=10**9), []

    async def on_death():
        deaths.append(True)

    async def run():
        task = asyncio.ensure_future(watch_engine(engine, on_death, poll_s=0.001))
        while engine.looks <= 3:  # its looks, not a time: a busy host may run it rarely
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(run(), 30))
    assert engine.looks > 3 and deaths == []


# ----- in-process cluster, fake engines --------------------------------------------------------

def test_a_worker_whose_engine_dies_ends_its_streams_and_leaves_the_registry():
    """The lease lasts 60 s, so only the worker's own deregistration takes it out this fast (no
    lease expired). Its stream ends UNAVAILABLE there, and the coordinator resumes it on the other
    worker."""
    c = start_cluster({"w1": FakeEngine(token_delay_s=0.05), "w2": FakeEngine(token_delay_s=0.05)},
                      lease_ttl_s=60.0)
    try:
        with Client(c.address) as client:
            stream = client.generate("fake-model", prompt="long", max_tokens=60, timeout_s=60)
            assert next(stream).token_ids
            dying = next(w for w in c.workers if c.coordinator.registry.get(w.worker_id).in_flight == 1)
            t0 = time.monotonic()
            dying.engine.alive = False
            last = list(stream)[-1]
            assert last.finish_reason == "length" and last.worker_id != dying.worker_id
            assert last.stats.migrations == 1
            assert wait_until(lambda: c.coordinator.registry.get(dying.worker_id) is None, 30)
            elapsed = time.monotonic() - t0
            c.loop.run(asyncio.wait_for(dying.left.wait(), 10))
            assert dying.engine_died
            health = c.loop.run(dying.health.Check(health_pb2.HealthCheckRequest(service=""), None))
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert dying.worker_id not in [w.worker_id for w in client.cluster_status(timeout_s=5).workers]
            served = client.complete("fake-model", prompt="next", max_tokens=3)
            assert served.worker_id != dying.worker_id and served.finish_reason == "length"
        assert c.coordinator.metrics.lease_expiries._value.get() == 0  # it deregistered
        assert elapsed < 30, f"left the registry after {elapsed:.1f} s"
        with grpc.insecure_channel(dying.advertise_address) as ch:  # its server is stopped
            with pytest.raises(grpc.RpcError) as err:
                worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        c.close()


def test_a_live_worker_stopped_on_purpose_is_not_taken_for_dead():
    """stop() closes the engine; the watchdog must not report that as a death."""
    c = start_cluster({"w1": FakeEngine()})
    try:
        w = c.workers[0]
        c.loop.run(w.stop(grace_s=0.2))
        w.engine.alive = False  # what closing a real engine does
        time.sleep(1.0)  # two of the watchdog's looks
        assert not w.engine_died and not w.left.is_set()
    finally:
        c.close()


def _worker_stream(address: str, request_id: str):
    channel = grpc.insecure_channel(address)
    stub = worker_pb2_grpc.WorkerStub(channel)
    stream = stub.Generate(common_pb2.GenerateRequest(model="fake-model", prompt="long", max_tokens=2000,
                                                      request_id=request_id), timeout=30)
    return channel, stub, stream


def test_a_request_the_engine_cancels_unasked_ends_unavailable_and_an_asked_cancel_completes():
    """An engine that stops (or whose thread crashes) ends its sessions as "cancelled": the
    client must get an error, not a Complete that reads like a finished answer; a Cancel RPC
    still ends the stream with a Complete whose reason is cancelled."""
    engine = FakeEngine(token_delay_s=0.02)
    c = start_cluster({"w1": engine})
    w = c.workers[0]
    try:
        channel, stub, stream = _worker_stream(w.advertise_address, "asked")
        with channel:
            assert next(stream).WhichOneof("kind") == "chunk"
            assert stub.Cancel(worker_pb2.CancelRequest(request_id="asked"), timeout=5).cancelled
            last = list(stream)[-1]
            assert last.complete.finish_reason == common_pb2.FINISH_REASON_CANCELLED
        channel, stub, stream = _worker_stream(w.advertise_address, "unasked")
        with channel:
            assert next(stream).WhichOneof("kind") == "chunk"
            engine.close()  # the engine stops on its own: nobody asked for this request's end
            with pytest.raises(grpc.RpcError) as err:
                list(stream)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "the engine of worker w1 stopped" in err.value.details()
    finally:
        c.close()


# ----- a real worker process, its engine thread killed ----------------------------------------

def test_a_worker_process_whose_engine_thread_dies_deregisters_and_exits_70(tiny_models, tmp_path):
    c = start_cluster({}, lease_ttl_s=60.0)  # only a deregistration takes the worker out quickly
    log_path = tmp_path / "worker.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLASHFLEET_OPENBLAS": "0"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, str(DYING_WORKER), "--model", str(tiny_models.llama),
                                 "--model-name", "tiny", "--coordinator", c.address, "--worker-id", "doomed",
                                 "--capacity", "2", "--drain-timeout", "1"],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        with Client(c.address) as client:
            def registered():
                assert proc.poll() is None, log_path.read_text()
                return [w.worker_id for w in client.cluster_status(timeout_s=5).workers] == ["doomed"]

            assert wait_until(registered, 300), log_path.read_text()
            address = client.cluster_status(timeout_s=5).workers[0].address
            t0 = time.monotonic()
            proc.send_signal(signal.SIGUSR1)
            # The idle engine thread runs again (and dies) when this request reaches it.
            with grpc.insecure_channel(address) as ch:
                stream = worker_pb2_grpc.WorkerStub(ch).Generate(
                    common_pb2.GenerateRequest(model="tiny", prompt="The river flows", max_tokens=8), timeout=30)
                with pytest.raises(grpc.RpcError) as err:
                    list(stream)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
            assert "the engine of worker doomed stopped" in err.value.details()
            # Bounds far from the 60 s lease, which a busy host's slower exit must not reach
            # (no lease expired: the worker deregistered).
            assert wait_until(lambda: not client.cluster_status(timeout_s=5).workers, 30), log_path.read_text()
            left_s = time.monotonic() - t0
            assert c.coordinator.metrics.lease_expiries._value.get() == 0
        code = proc.wait(40)
        exited_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        c.close()
    text = log_path.read_text()
    assert code == ENGINE_DIED_EXIT, text
    assert "EngineKilled" in text  # the engine thread's own traceback
    assert "the engine thread of worker doomed died" in text and "exits with status 70" in text
    assert left_s < 30 and exited_s < 45, (left_s, exited_s)


# ----- flashfleet up starts a failed worker again ---------------------------------------------

def test_restart_policy_and_capped_doubling_delays():
    from flashfleet.cli.restarts import RestartBackoff, should_restart

    assert should_restart(ENGINE_DIED_EXIT) and should_restart(1) and should_restart(-signal.SIGKILL)
    assert not should_restart(0) and not should_restart(2)  # stopped on purpose; bad config or model
    b = RestartBackoff(first_s=1.0, max_s=5.0, stable_s=60.0)
    assert [b.delay("w1", ran_s=2.0) for _ in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert b.delay("w2", ran_s=2.0) == 1.0  # each worker has its own run of failures
    assert b.delay("w1", ran_s=61.0) == 1.0  # it ran long enough: the run starts over
    assert b.delay("w1", ran_s=2.0) == 2.0


class _Exiting:
    """A child process stand-in: poll() answers `returncode` once a test sets it."""

    def __init__(self, argv, stdout, **kwargs):
        self.argv, self.stdout, self.returncode = argv, stdout, None

    def poll(self):
        return self.returncode


def test_up_starts_a_failed_worker_again_with_its_command_and_log(tmp_path, monkeypatch):
    from flashfleet.cli import up
    from flashfleet.cli.restarts import RestartBackoff

    spawned = []
    monkeypatch.setattr(up.subprocess, "Popen", lambda argv, **kw: spawned.append(_Exiting(argv, **kw))
                        or spawned[-1])
    cluster = up.LocalCluster(workers=2, port=1, log_dir=tmp_path)
    cluster._spawn("coordinator", ["coordinator"])
    cluster._spawn("worker-1", ["worker", "--worker-id", "worker-1"], {"X": "1"})
    cluster._spawn("worker-2", ["worker", "--worker-id", "worker-2"])
    said, backoff = [], RestartBackoff(first_s=0.0)
    cluster.tend(backoff, said.append)
    assert said == [] and len(spawned) == 3

    spawned[1].returncode = ENGINE_DIED_EXIT  # worker-1's engine died
    cluster.tend(backoff, said.append)
    assert said[0].startswith(f"worker-1 exited with code {ENGINE_DIED_EXIT}; starting it again in 0 s")
    assert said[1] == "worker-1 started again"
    assert spawned[3].argv == spawned[1].argv and cluster.commands["worker-1"][1] == {"X": "1"}
    assert spawned[3].stdout.mode == "ab" and spawned[1].stdout.mode == "wb"  # the log goes on
    assert cluster.procs["worker-1"] is spawned[3]

    spawned[2].returncode = 2  # a bad config: a restart would fail the same way
    spawned[3].returncode = 0  # stopped on purpose
    said.clear()
    with pytest.raises(RuntimeError, match="every worker has exited"):
        cluster.tend(backoff, said.append)
    assert len(spawned) == 4 and all("keep serving" in line for line in said) and len(said) == 2

    cluster.procs["worker-1"] = spawned[1]
    spawned[1].returncode = -signal.SIGKILL
    spawned[0].returncode = -signal.SIGKILL  # the coordinator killed: started again at once, same command
    said.clear()
    cluster.tend(backoff, said.append)
    assert any(line.startswith("the coordinator exited with code -9; starting it again on port 1 in 0.0 s")
               for line in said)
    assert "the coordinator started again" in said
    coordinator = cluster.procs["coordinator"]
    assert coordinator is not spawned[0] and coordinator.argv == spawned[0].argv and coordinator.stdout.mode == "ab"
    coordinator.returncode = 1  # failing again at once: after a wait
    cluster.tend(backoff, said.append)
    assert "coordinator" not in cluster.procs and cluster.restarts_due["coordinator"] > 0
    cluster.restarts_due["coordinator"] = 0.0
    cluster.tend(backoff, said.append)
    cluster.procs["coordinator"].returncode = 2  # a bad config: it stops the cluster
    with pytest.raises(RuntimeError, match="the coordinator exited with code 2"):
        cluster.tend(backoff, said.append)


def test_up_waits_out_the_delay_and_drops_restarts_not_yet_due_when_stopped(tmp_path, monkeypatch):
    from flashfleet.cli import up
    from flashfleet.cli.restarts import RestartBackoff

    spawned = []
    monkeypatch.setattr(up.subprocess, "Popen", lambda argv, **kw: spawned.append(_Exiting(argv, **kw))
                        or spawned[-1])
    cluster = up.LocalCluster(workers=1, port=1, log_dir=tmp_path)
    cluster._spawn("worker-1", ["worker"])
    spawned[0].returncode = ENGINE_DIED_EXIT
    said = []
    cluster.tend(RestartBackoff(first_s=30.0), said.append)  # not "every worker has exited": one is due
    assert "starting it again in 30 s" in said[0] and len(spawned) == 1 and "worker-1" in cluster.restarts_due
    cluster.stop(grace_s=0.1)
    assert cluster.restarts_due == {}


def test_up_restarts_a_killed_worker_process_and_it_registers_again(tiny_models, tmp_path):
    from flashfleet.cli.restarts import RestartBackoff
    from flashfleet.cli.up import LocalCluster, free_port, served_name

    cluster = LocalCluster(str(tiny_models.llama), workers=1, port=free_port(), log_dir=tmp_path,
                           worker_args=("--drain-timeout", "1"))
    cluster.start(timeout_s=300, progress=lambda line: None)
    try:
        with Client(cluster.address) as client:
            (old,) = [w.address for w in client.cluster_status(timeout_s=5).workers]
            first = cluster.procs["worker-1"]
            first.send_signal(signal.SIGKILL)
            first.wait(10)
            said, backoff = [], RestartBackoff(first_s=0.1)

            def registered_again():
                cluster.tend(backoff, said.append)
                proc = cluster.procs.get("worker-1")
                return proc is not None and proc is not first and [
                    (w.worker_id, w.address != old) for w in client.cluster_status(timeout_s=5).workers
                ] == [("worker-1", True)]

            assert wait_until(registered_again, 300), (said, (tmp_path / "worker-1.log").read_text()[-2000:])
            done = client.complete(served_name(cluster.model), prompt="The river", max_tokens=2)
        assert done.worker_id == "worker-1" and done.finish_reason in ("length", "stop")
        assert said[0].startswith(f"worker-1 exited with code {-signal.SIGKILL}; starting it again")
        assert said[1] == "worker-1 started again"
        assert (tmp_path / "worker-1.log").read_text().count("worker worker-1 serving") == 2  # one log
    finally:
        cluster.stop()


def test_the_shipped_services_restart_a_worker_that_exits_with_a_failure():
    """systemd and launchd start the worker again after exit status 70 (the engine died)."""
    import configparser
    import plistlib

    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read_string((ROOT / "deploy" / "systemd" / "flashfleet-worker.service").read_text())
    service = unit["Service"]
    assert service["Restart"] in ("on-failure", "always")  # not on-abnormal: it skips exit codes
    assert str(ENGINE_DIED_EXIT) not in service.get("RestartPreventExitStatus", "").split()
    plist = plistlib.loads((ROOT / "deploy" / "launchd" / "com.flashfleet.worker.plist").read_bytes())
    assert plist["KeepAlive"] is True or plist["KeepAlive"].get("SuccessfulExit") is False
