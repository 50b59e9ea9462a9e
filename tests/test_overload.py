"""The coordinator's own overload (coordinator/overload.py): it times an RPC through its own
server; while that is late, new requests wait for room and worker leases get the lateness as
grace."""
from __future__ import annotations

import os
import time

from coordinator.overload import MAX_RPC_LAG_S, RpcLag
from coordinator.registry import Registry
from fakes import FakeEngine
from flashfleet import Client
from flashfleet.v1 import common_pb2, worker_pb2
from harness import start_cluster, wait_until


def test_a_sustained_late_answer_is_an_overload_and_its_end_wakes_the_waiters():
    woken = []
    lag = RpcLag(window=3, on_recover=lambda: woken.append(1))
    assert lag.lag_s == 0.0 and not lag.overloaded()
    lag.record(2.0)  # one slow answer (a garbage collection) among quick ones is not an overload ...
    lag.record(0.01)
    lag.record(0.01)
    assert not lag.overloaded() and woken == []
    for _ in range(3):  # ... every recent answer late is
        lag.record(MAX_RPC_LAG_S * 2)
    assert lag.overloaded() and lag.lag_s == MAX_RPC_LAG_S * 2
    lag.record(0.01)  # one answer on time again ends it
    assert not lag.overloaded() and woken == [1]
    lag._pending_since = time.monotonic() - 3 * MAX_RPC_LAG_S  # a probe unanswered that long counts at once
    assert lag.overloaded() and lag.lag_s >= 3 * MAX_RPC_LAG_S


def test_a_lease_waits_out_the_coordinators_own_lateness():
    now = [0.0]
    registry = Registry(lease_ttl_s=10.0, clock=lambda: now[0])
    grace = [0.0]
    registry.grace = lambda: grace[0]
    registry.register(worker_pb2.RegisterRequest(worker_id="w", address="w:1",
                                                 models=[common_pb2.ModelInfo(name="m")]))
    now[0] = 12.0
    grace[0] = 5.0  # its heartbeat may be waiting in this coordinator's queue
    assert registry.get("w") is not None
    grace[0] = 0.0
    assert registry.get("w") is None


def test_a_running_coordinator_times_itself_and_holds_new_requests_while_overloaded():
    cluster = start_cluster({"w1": FakeEngine()})
    try:
        fleet = cluster.coordinator.servicer.fleet
        assert wait_until(lambda: len(fleet.rpc_lag._rtts) >= 3, 10)
        assert 0.0 < fleet.rpc_lag.lag_s < MAX_RPC_LAG_S  # an idle coordinator answers at once
        probe_dir = fleet.rpc_lag._dir
        assert os.stat(probe_dir).st_mode & 0o077 == 0  # only this user can reach the probe's socket
        req = common_pb2.GenerateRequest(model="fake-model", prompt="p")
        assert fleet.has_room(req)

        async def late():  # as if every recent answer took a second (on the loop: no probe between)
            fleet.rpc_lag._rtts.extend([1.0] * 3)
            return fleet.has_room(req)

        assert cluster.loop.run(late()) is False
        with Client(cluster.coordinator.address) as client:  # held in the queue, then served once on time
            assert client.complete("fake-model", prompt="hello", max_tokens=3).token_ids
    finally:
        cluster.close()
    assert not os.path.exists(probe_dir)


def test_probe_directories_left_by_killed_coordinators_are_removed(tmp_path):
    import subprocess
    import sys

    from coordinator.overload import PROBE_DIR_PREFIX, remove_stale_probe_dirs

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid no longer runs
    stale = tmp_path / f"{PROBE_DIR_PREFIX}{gone.pid}-abc"
    live = tmp_path / f"{PROBE_DIR_PREFIX}{os.getpid()}-def"
    other = tmp_path / "something-else"
    for d in (stale, live, other):
        d.mkdir()
        (d / "probe.sock").write_text("")
    assert remove_stale_probe_dirs(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists() and other.exists()


def test_a_probe_directory_is_kept_while_its_lock_is_held_whatever_its_pid(tmp_path):
    """A coordinator in another pid namespace has a pid this process cannot see: its lock, not
    its pid, keeps its directory; a directory whose lock nobody holds goes."""
    import fcntl

    from coordinator.overload import PROBE_DIR_PREFIX, PROBE_LOCK_FILE, RpcLag, remove_stale_probe_dirs

    unseen_pid = 4_194_304  # above Linux's pid_max: no process here has it
    held = tmp_path / f"{PROBE_DIR_PREFIX}{unseen_pid}-held"
    unheld = tmp_path / f"{PROBE_DIR_PREFIX}{os.getpid()}-unheld"
    for d in (held, unheld):
        d.mkdir()
        (d / PROBE_LOCK_FILE).write_text("")
    fd = os.open(held / PROBE_LOCK_FILE, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert remove_stale_probe_dirs(str(tmp_path)) == [str(unheld)]
        assert held.exists() and not unheld.exists()
    finally:
        os.close(fd)
    assert remove_stale_probe_dirs(str(tmp_path)) == [str(held)]  # its holder let go: stale

    class Server:  # what `attach` needs of a grpc server
        def add_insecure_port(self, address):
            return 1

    lag = RpcLag()
    lag.attach(Server())
    try:  # a live coordinator's own directory, in the real temporary directory, is kept
        assert lag._dir not in remove_stale_probe_dirs()
        assert os.path.exists(os.path.join(lag._dir, PROBE_LOCK_FILE))
    finally:
        lag.close()
    assert lag._dir is None


def test_a_probe_that_cannot_connect_measures_nothing_and_is_no_overload(tmp_path):
    import asyncio

    lag = RpcLag(interval_s=0.05)
    lag._dir = str(tmp_path)  # no socket there: a temporary-files cleaner took it, say

    async def probe_for(seconds):
        task = asyncio.ensure_future(lag.run())
        await asyncio.sleep(seconds)
        late = lag.overloaded()
        task.cancel()
        return late

    assert asyncio.run(probe_for(1.2)) is False  # every probe failed UNAVAILABLE: nothing measured
    assert lag.lag_s < MAX_RPC_LAG_S and not lag._rtts


def test_calls_arriving_while_the_loop_is_busy_wait_for_it_instead_of_ending_cancelled():
    """grpc holds calls the server's event loop has not taken yet; past 1,000 of them its default
    ends some CANCELLED before the coordinator sees them. Here 2,000 arrive while the loop is
    blocked: every one is answered once it runs again."""
    import asyncio

    import grpc

    from flashfleet.v1 import coordinator_pb2, coordinator_pb2_grpc

    cluster = start_cluster({})
    calls = 2000

    async def burst() -> dict[str, int]:
        async with grpc.aio.insecure_channel(cluster.address) as ch:
            stub = coordinator_pb2_grpc.CoordinatorStub(ch)
            await stub.ListModels(coordinator_pb2.ListModelsRequest(), timeout=10)  # connected
            cluster.loop.loop.call_soon_threadsafe(time.sleep, 4.0)  # the coordinator's loop is busy
            await asyncio.sleep(0.2)
            results = await asyncio.gather(
                *(stub.ListModels(coordinator_pb2.ListModelsRequest(), timeout=60) for _ in range(calls)),
                return_exceptions=True)
        codes: dict[str, int] = {}
        for r in results:
            name = r.code().name if isinstance(r, grpc.aio.AioRpcError) else type(r).__name__
            codes[name] = codes.get(name, 0) + 1
        return codes

    try:
        assert asyncio.run(burst()) == {"ListModelsResponse": calls}
    finally:
        cluster.close()
