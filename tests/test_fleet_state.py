"""The fleet state's contract (coordinator/state/), for each implementation: membership and
leases, drain flags, placements, affinity and ownership."""
from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from coordinator.registry import Registry, UnknownLease, WorkerIdInUse
from coordinator.routing import SessionAffinity
from coordinator.state import MemoryState, NotLive
from flashfleet.v1 import common_pb2, worker_pb2


def registration(worker_id: str, address: str = "127.0.0.1:1", capacity: int = 4) -> worker_pb2.RegisterRequest:
    return worker_pb2.RegisterRequest(worker_id=worker_id, address=address,
                                      models=[common_pb2.ModelInfo(name="m")],
                                      load=worker_pb2.WorkerLoad(capacity=capacity))


def memory_state(lease_ttl_s: float = 10.0, clock=None) -> MemoryState:
    registry = Registry(lease_ttl_s, **({"clock": clock} if clock else {}))
    return MemoryState("c1", registry, SessionAffinity(60.0))


def test_memory_state_membership_drain_and_placements():
    now = [0.0]
    state = memory_state(clock=lambda: now[0])

    async def scenario():
        rec = await state.register(registration("w1"))
        assert state.registry.get("w1") is rec and state.owns("w1")
        with pytest.raises(WorkerIdInUse):
            await state.register(registration("w1", address="127.0.0.1:2"))
        with pytest.raises(ValueError):
            await state.register(worker_pb2.RegisterRequest(worker_id="w2"))
        await state.heartbeat("w1", rec.lease_id, worker_pb2.WorkerLoad(capacity=6))
        assert rec.capacity == 6
        with pytest.raises(UnknownLease):
            await state.heartbeat("w1", "not-the-lease", worker_pb2.WorkerLoad())
        with pytest.raises(NotLive):
            await state.set_draining("nope")
        assert (await state.set_draining("w1")).draining
        old_lease = rec.lease_id
        again = await state.register(registration("w1"))  # re-registration keeps the drain
        assert again.draining and again.lease_id != old_lease
        state.place("r1", "w1", 0)
        state.place("r1", "w1", 12)  # after a move: the latest wins
        assert (await state.placement("r1")).tokens == 12
        state.unplace("r1")
        assert await state.placement("r1") is None
        state.place("r2", "w1", 3)
        now[0] = 11.0  # the lease runs out: the worker and the placements on it go
        assert state.registry.get("w1") is None
        assert await state.placement("r2") is None
        with pytest.raises(UnknownLease):
            await state.deregister("w1", again.lease_id)

    asyncio.run(scenario())


async def _wait_for(pred, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        await asyncio.sleep(0.02)
    return pred()


async def _etcd_states(endpoint: str, n: int = 2, lease_ttl_s: float = 10.0):
    """`n` coordinators' EtcdStates over one etcd, each recording its registry's removals."""
    from coordinator.state.etcd import EtcdState

    states = []
    for i in range(n):
        removed: list[tuple[str, str]] = []
        registry = Registry(lease_ttl_s, on_remove=lambda rec, why, removed=removed: removed.append((rec.worker_id, why)),
                            expires=False)
        state = EtcdState(f"c{i + 1}", registry, SessionAffinity(60.0), [endpoint], lease_ttl_s, 60.0)
        state.removed = removed
        await state.start()
        states.append(state)
    return states


def test_etcd_state_one_registration_is_seen_by_every_coordinator(etcd):
    async def scenario():
        a, b = await _etcd_states(etcd.endpoint)
        try:
            rec = await a.register(registration("w1"))
            assert await _wait_for(lambda: b.registry.get("w1") is not None)
            assert b.registry.get("w1").lease_id == rec.lease_id and b.registry.get("w1").capacity == 4
            # Exactly one owner: the coordinator it registered with.
            assert await _wait_for(lambda: b._owners.get("w1") == "c1")
            assert a.owns("w1") and not b.owns("w1")
            # Heartbeats may reach any coordinator: the lease is etcd's.
            await b.heartbeat("w1", rec.lease_id, worker_pb2.WorkerLoad(capacity=7))
            assert await _wait_for(lambda: a.registry.get("w1").capacity == 7)
            assert a.owns("w1") and not b.owns("w1")  # a live owner keeps its worker
            # Another worker under the same id elsewhere is refused, by either coordinator.
            with pytest.raises(WorkerIdInUse):
                await b.register(registration("w1", address="127.0.0.1:2"))
            with pytest.raises(UnknownLease):
                await b.heartbeat("w1", "ff", worker_pb2.WorkerLoad())
            # A drain set through one coordinator is seen by the other, and outlives re-registration.
            await a.set_draining("w1")
            assert await _wait_for(lambda: b.registry.get("w1").draining)
            first_lease = rec.lease_id
            again = await b.register(registration("w1"))
            assert again.draining and again.lease_id != first_lease
            assert await _wait_for(lambda: a.registry.get("w1").lease_id == again.lease_id)
            assert a.registry.get("w1").draining
            with pytest.raises(NotLive):
                await b.set_draining("nope")
            # Placements and affinity written by one coordinator are read by the other.
            a.place("r1", "w1", 0)
            a.place("r1", "w1", 5)
            a.affinity.bind("session-1", "w1")
            await a.flush()
            placed = await b.placement("r1")
            assert (placed.worker_id, placed.coordinator_id, placed.tokens) == ("w1", "c1", 5)
            assert await _wait_for(lambda: b.affinity.lookup("session-1") == "w1")
            a.unplace("r1")
            await a.flush()
            assert await b.placement("r1") is None
            # A clean leave through either coordinator is a leave everywhere, not an expiry.
            b.place("r2", "w1", 1)
            await b.flush()
            await b.deregister("w1", again.lease_id)
            assert await _wait_for(lambda: a.registry.get("w1") is None)
            assert ("w1", "deregistered") in a.removed and ("w1", "expired") not in a.removed
            assert await b.placement("r2") is None  # placements go with the worker's lease
        finally:
            await a.close()
            await b.close()

    asyncio.run(scenario())


def test_etcd_background_writes_go_out_as_few_transactions_and_a_gone_lease_spoils_none(etcd):
    """Placements queued behind one another share a transaction; the one whose worker's lease
    has gone (etcd refuses that whole transaction) is dropped and the others still land."""
    from coordinator.state.etcd import PLACEMENTS, _key
    from coordinator.state.etcd_client import Write

    async def scenario():
        a, b = await _etcd_states(etcd.endpoint)
        try:
            await a.register(registration("w1"))
            gone = await a.client.grant(60)
            await a.client.revoke(gone)
            transactions = []
            write_all = a.client.write_all

            async def counted(writes):
                transactions.append(len(writes))
                return await write_all(writes)
            a.client.write_all = counted
            for i in range(300):
                a.place(f"r{i}", "w1", i)
                if i == 150:
                    a._spawn_write(Write(_key(PLACEMENTS, "r-gone"), b"x", gone))
            for i in range(0, 300, 2):
                a.unplace(f"r{i}")
            await a.flush()
            assert [(await b.placement(f"r{i}")) is None for i in range(6)] == [True, False] * 3
            assert (await b.placement("r299")).tokens == 299
            assert await a.client.get(_key(PLACEMENTS, "r-gone")) is None
            # 451 writes: a few transactions of up to 128, and the lone retries of the spoilt one.
            assert sum(1 for n in transactions if n > 1) <= 8, transactions
        finally:
            await a.close()
            await b.close()

    asyncio.run(scenario())


def test_etcd_lease_expiry_removes_a_dead_worker_everywhere_and_its_owner_alone_counts_it(etcd):
    async def scenario():
        a, b = await _etcd_states(etcd.endpoint, lease_ttl_s=2.0)
        try:
            await a.register(registration("w1"))
            assert await _wait_for(lambda: b.registry.get("w1") is not None)
            t0 = time.monotonic()
            # No heartbeat: etcd ends the lease and both views drop the worker.
            assert await _wait_for(lambda: a.registry.get("w1") is None and b.registry.get("w1") is None, 15)
            assert time.monotonic() - t0 >= 1.0
            assert a.removed == [("w1", "expired")] and b.removed == [("w1", "expired")]
            # Each view saw it; the owner alone runs the duty: it releases the ownership.
            assert await _wait_for(lambda: "w1" not in a._owners and "w1" not in b._owners)
        finally:
            await a.close()
            await b.close()

    asyncio.run(scenario())


def test_etcd_ownership_moves_only_when_its_owner_is_gone(etcd):
    async def scenario():
        a, b = await _etcd_states(etcd.endpoint)
        try:
            rec = await a.register(registration("w1"))
            assert await _wait_for(lambda: b._owners.get("w1") == "c1")
            for _ in range(3):  # heartbeats through b while a lives: a stays the only owner
                await b.heartbeat("w1", rec.lease_id, worker_pb2.WorkerLoad(capacity=4))
                assert a.owns("w1") and not b.owns("w1")
            a.place("r9", "w1", 3)  # queued, not yet written: closing writes it first
            await a.close()  # the owner stops: its lease, and so its ownership, goes at once
            assert (await b.placement("r9")).tokens == 3
            assert await _wait_for(lambda: "w1" not in b._owners)
            await b.heartbeat("w1", rec.lease_id, worker_pb2.WorkerLoad(capacity=4))
            assert b.owns("w1")
        finally:
            await b.close()

    asyncio.run(scenario())


def test_state_settings_from_the_cluster_config_and_flags(tmp_path):
    from coordinator.__main__ import parse_args
    from coordinator.config import CoordinatorConfig
    from flashfleet.config import ConfigError, load_cluster_config

    base = '[[models]]\nname = "m"\npath = "/nonexistent"\n\n[[workers]]\nid = "w1"\nmodel = "m"\n'
    cfg_path = tmp_path / "cluster.toml"
    cfg_path.write_text('[coordinator]\nstate = "etcd"\netcd_endpoints = ["http://10.0.0.11:2379", "10.0.0.12:2379"]\n'
                        + base)
    a = parse_args(["--config", str(cfg_path)])
    assert (a.state, a.etcd_endpoints) == ("etcd", ("http://10.0.0.11:2379", "10.0.0.12:2379"))
    assert parse_args(["--config", str(cfg_path), "--etcd-endpoints", "h:1"]).etcd_endpoints == ("h:1",)
    assert parse_args([]).state == "memory" and CoordinatorConfig().state == "memory"  # the default
    for table, message in (('state = "etcd"\n', "needs etcd_endpoints"),
                           ('state = "redis"\n', "state must be one of"),
                           ('etcd_endpoints = ["h:1"]\n', 'set state = "etcd"'),
                           ('state = "etcd"\netcd_endpoints = "h:1"\n', "must be an array of strings"),
                           ('state = "etcd"\netcd_endpoints = ["https://h:1"]\n', "TLS to etcd is not supported"),
                           ('state = "etcd"\netcd_endpoints = ["h"]\n', "must be host:port")):
        cfg_path.write_text("[coordinator]\n" + table + base)
        with pytest.raises(ConfigError, match=message):
            load_cluster_config(cfg_path)
    with pytest.raises(SystemExit):
        parse_args(["--state", "etcd"])  # no endpoints


def test_a_coordinator_without_etcd_configured_keeps_its_state_in_memory_and_one_that_cannot_reach_etcd_stops():
    from coordinator.config import CoordinatorConfig
    from coordinator.server import start_coordinator
    from etcd_server import free_port
    from harness import LoopThread

    loop = LoopThread()
    try:
        running = loop.run(start_coordinator(CoordinatorConfig(port=0)))
        assert isinstance(running.state, MemoryState) and running.registry.frozen is False
        loop.run(running.stop(grace_s=0.1))
        nobody = f"127.0.0.1:{free_port()}"
        with pytest.raises(RuntimeError, match=f"cannot reach etcd.*{nobody}"):
            loop.run(start_coordinator(CoordinatorConfig(port=0, state="etcd", etcd_endpoints=(nobody,))))
    finally:
        loop.close()


def test_etcd_state_rides_out_an_etcd_restart(etcd):
    # etcd killed and started again (its data kept): heartbeats fail as UNAVAILABLE-like
    # connection errors meanwhile, then work again on the same lease, and each coordinator's
    # watch resumes where it stopped.
    from coordinator.state.etcd_client import EtcdUnavailable

    async def scenario():
        a, b = await _etcd_states(etcd.endpoint)
        try:
            rec = await a.register(registration("w1"))
            assert await _wait_for(lambda: b.registry.get("w1") is not None)
            etcd.kill()
            with pytest.raises(EtcdUnavailable):
                await a.heartbeat("w1", rec.lease_id, worker_pb2.WorkerLoad(capacity=4))
            await asyncio.get_running_loop().run_in_executor(None, etcd.start)
            for _ in range(50):  # the first calls may still find the channel reconnecting
                try:
                    await a.heartbeat("w1", rec.lease_id, worker_pb2.WorkerLoad(capacity=9))
                    break
                except EtcdUnavailable:
                    await asyncio.sleep(0.2)
            assert await _wait_for(lambda: b.registry.get("w1") is not None and b.registry.get("w1").capacity == 9, 15)
            await a.set_draining("w1")
            assert await _wait_for(lambda: b.registry.get("w1").draining, 10)
        finally:
            await a.close()
            await b.close()

    asyncio.run(scenario())


def test_etcd_state_keeps_working_while_any_one_of_three_members_is_killed(tmp_path):
    # Each member in turn is killed (one of them is the leader when it goes: leadership moves
    # only when its holder dies) and restarted: heartbeats keep the worker's lease on the
    # survivors, changes keep reaching the other coordinator, and no worker expires. The lease
    # (TTL 3 s) is shorter than the scenario, so only renewals keep it; as a real worker does, the
    # worker heartbeats throughout (every TTL / 3, as a coordinator renews its own lease), so what
    # a busy host slows (a new leader's election, the other coordinator's watch moving to a live
    # member, a restarted member rejoining) is bounded by the 15 s asserted here, not by the lease
    # running out between heartbeats.
    from coordinator.state.etcd_client import EtcdUnavailable
    from etcd_server import ETCD, SKIP_REASON, start_cluster_of_three

    if ETCD is None:
        pytest.skip(SKIP_REASON)
    members = start_cluster_of_three(tmp_path)
    ttl_s = 3.0

    async def scenario():
        from coordinator.state.etcd import EtcdState

        states = []
        for i in range(2):
            registry = Registry(ttl_s, expires=False)
            endpoints = [m.endpoint for m in members[i:] + members[:i]]  # each starts on another member
            state = EtcdState(f"c{i + 1}", registry, SessionAffinity(60.0), endpoints, ttl_s, 60.0)
            await state.start()
            states.append(state)
        a, b = states
        capacity = [4]  # what the worker's heartbeats report

        async def heartbeats(lease_id: str) -> None:
            # every TTL / 3; one that no member answered is retried at the next, and an expired
            # lease (UnknownLease) ends the task, which the test checks
            while True:
                with contextlib.suppress(EtcdUnavailable):
                    await a.heartbeat("w1", lease_id, worker_pb2.WorkerLoad(capacity=capacity[0]))
                await asyncio.sleep(ttl_s / 3)

        beating = None
        try:
            rec = await a.register(registration("w1"))
            beating = asyncio.ensure_future(heartbeats(rec.lease_id))
            assert await _wait_for(lambda: b.registry.get("w1") is not None)
            for n, member in enumerate(members):
                member.kill()
                capacity[0] = 10 + n
                t0 = time.monotonic()
                while True:  # a new leader is elected within a couple of seconds
                    try:
                        await a.heartbeat("w1", rec.lease_id, worker_pb2.WorkerLoad(capacity=10 + n))
                        break
                    except EtcdUnavailable:
                        assert time.monotonic() - t0 < 15, "no etcd member answered after one died"
                        await asyncio.sleep(0.1)
                assert await _wait_for(lambda: b.registry.get("w1") and b.registry.get("w1").capacity == 10 + n, 15)
                await asyncio.get_running_loop().run_in_executor(None, member.start)
                # back in the cluster before the next one dies: one member down at a time
                await asyncio.get_running_loop().run_in_executor(None, member.wait_healthy)
            assert not beating.done(), beating.exception()  # no heartbeat found the lease expired
            assert b.registry.get("w1").lease_id == rec.lease_id  # the same lease throughout
            await b.set_draining("w1")
            assert await _wait_for(lambda: a.registry.get("w1").draining, 10)
        finally:
            if beating is not None:
                beating.cancel()
            await a.close()
            await b.close()

    try:
        asyncio.run(scenario())
    finally:
        for m in members:
            m.stop()
