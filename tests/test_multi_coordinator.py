"""Two active coordinators sharing the fleet's state through a real etcd (coordinator/state/etcd.py),
with real workers (fake engines, and one tiny MLX model) registered with one of them."""
from __future__ import annotations

import asyncio
import threading

import pytest
from prometheus_client import CollectorRegistry

from coordinator.config import CoordinatorConfig
from coordinator.migration import MigrationPolicy
from coordinator.server import start_coordinator
from fakes import FakeEngine
from flashfleet import Client
from harness import LoopThread, wait_until
from worker.metrics import WorkerMetrics
from worker.server import start_worker


class Fleet:
    """Coordinators "A" and "B" over one etcd on one event loop thread, and workers that each
    register with one of them."""

    def __init__(self, etcd, **config):
        self.loop = LoopThread()
        self.coordinators = {}
        self.workers = {}
        for name in ("A", "B"):
            cfg = CoordinatorConfig(port=0, state="etcd", etcd_endpoints=(etcd.endpoint,), **config)
            self.coordinators[name] = self.loop.run(start_coordinator(cfg, CollectorRegistry()))

    def add_worker(self, worker_id: str, engine, via: str = "A"):
        w = self.loop.run(start_worker(engine, worker_id, coordinator=self.coordinators[via].address,
                                       metrics=WorkerMetrics(CollectorRegistry(), engine)))
        self.loop.run(asyncio.wait_for(w.registered.wait(), 10))
        self.workers[worker_id] = w
        return w

    def sees(self, name: str, worker_id: str):
        return self.coordinators[name].registry.get(worker_id)

    def close(self) -> None:
        for w in self.workers.values():
            try:
                self.loop.run(w.stop(grace_s=0.5))
            except Exception:
                pass
        for c in self.coordinators.values():
            self.loop.run(c.stop(grace_s=0.5))
        self.loop.close()


@pytest.fixture
def fleet(etcd):
    f = Fleet(etcd, lease_ttl_s=2.0, heartbeat_interval_s=0.2,
              migration=MigrationPolicy(enabled=False, check_interval_s=0.0), migration_method="reprefill")
    yield f
    f.close()


def _expected(prompt: str, n: int) -> list[int]:
    base = sum(ord(c) % 100 for c in prompt)  # FakeEngine's tokens
    return [(base + i) % 100 for i in range(n)]


def test_a_worker_registered_with_one_coordinator_serves_requests_sent_to_the_other(fleet):
    engine = FakeEngine()
    fleet.add_worker("w1", engine, via="A")
    assert wait_until(lambda: fleet.sees("B", "w1") is not None, 10)
    with Client(fleet.coordinators["B"].address) as client:
        done = client.complete("fake-model", prompt="hello", max_tokens=5)
        assert [m.info.name for m in client.list_models()] == ["fake-model"]
        status = client.cluster_status()
    assert done.worker_id == "w1" and done.token_ids == _expected("hello", 5)
    assert [w.worker_id for w in status.workers] == ["w1"]
    assert len(engine.submitted) == 1
    # Its heartbeats reach A only, yet B's view of its load follows them through etcd.
    before = fleet.sees("B", "w1").last_heartbeat_s
    assert wait_until(lambda: fleet.sees("B", "w1").last_heartbeat_s > before, 5)


def test_a_full_worker_refuses_and_the_other_coordinator_tries_another(fleet):
    # Each coordinator counts only its own streams: B sees w1 idle while A fills it. w1's own
    # RESOURCE_EXHAUSTED keeps the capacity right, and B tries the other worker.
    engines = {w: FakeEngine(capacity=1, token_delay_s=0.02) for w in ("w1", "w2")}
    for w, e in engines.items():
        fleet.add_worker(w, e, via="A")
    a, b = fleet.coordinators["A"], fleet.coordinators["B"]
    assert wait_until(lambda: all(fleet.sees("B", w) for w in engines), 10)
    results = {}

    def long_stream():
        with Client(a.address) as client:
            results["A"] = client.complete("fake-model", prompt="aaa", max_tokens=150)

    t = threading.Thread(target=long_stream)
    t.start()
    try:
        assert wait_until(lambda: any(len(e.active) == 1 for e in engines.values()), 10)
        busy = next(w for w, e in engines.items() if e.active)
        other = next(w for w in engines if w != busy)
        assert fleet.sees("B", busy).in_flight == 0  # B does not know A's stream
        fleet.sees("B", other).unreachable = True  # B tries the busy worker first
        with Client(b.address) as client:
            done = client.complete("fake-model", prompt="bbb", max_tokens=5)
        assert done.worker_id == other and done.token_ids == _expected("bbb", 5)
        assert b.metrics.retries.labels(model="fake-model")._value.get() == 1
        assert len(engines[busy].submitted) == 1  # the refused request never ran there
    finally:
        t.join(30)
    assert results["A"].token_ids == _expected("aaa", 150)


def test_a_drain_set_through_one_coordinator_is_seen_by_the_other(fleet):
    for w in ("w1", "w2"):
        fleet.add_worker(w, FakeEngine(), via="A")
    assert wait_until(lambda: fleet.sees("B", "w1") and fleet.sees("B", "w2"), 10)
    with Client(fleet.coordinators["A"].address) as client:
        steps = client.drain_worker("w1", timeout_s=30)
        assert next(steps).state in ("draining", "leaving")
        assert wait_until(lambda: fleet.sees("B", "w1") is None or fleet.sees("B", "w1").draining, 10)
        with Client(fleet.coordinators["B"].address) as other:
            served = {other.complete("fake-model", prompt=f"p{i}", max_tokens=2).worker_id for i in range(6)}
        assert served == {"w2"}
        assert list(steps)[-1].state == "left"
    # It deregistered cleanly: gone from both views, not counted as an expiry anywhere.
    assert wait_until(lambda: fleet.sees("A", "w1") is None and fleet.sees("B", "w1") is None, 10)
    assert all(c.metrics.lease_expiries._value.get() == 0 for c in fleet.coordinators.values())


def test_a_dead_workers_lease_expires_for_both_coordinators_and_is_counted_once(fleet):
    fleet.add_worker("w1", FakeEngine(), via="A")
    dead = fleet.add_worker("w2", FakeEngine(), via="B")
    assert wait_until(lambda: all(fleet.sees(c, w) for c in "AB" for w in ("w1", "w2")), 10)
    dead.stop_heartbeats()  # it dies without deregistering
    assert wait_until(lambda: fleet.sees("A", "w2") is None and fleet.sees("B", "w2") is None, 15)
    assert fleet.sees("A", "w1") is not None and fleet.sees("B", "w1") is not None
    expiries = {n: c.metrics.lease_expiries._value.get() for n, c in fleet.coordinators.items()}
    assert expiries == {"A": 0, "B": 1}  # its owner (B, where it registered) alone counts it
    with Client(fleet.coordinators["B"].address) as client:
        assert {client.complete("fake-model", prompt=f"q{i}", max_tokens=2).worker_id for i in range(4)} == {"w1"}


def test_the_workers_owner_decides_the_moves_of_streams_either_coordinator_proxies(etcd):
    # w1 slow, w2 fast (their reported decode profiles): the policy moves a session on w1 to
    # w2. w1 registered with A, so A owns it: A moves its own stream, and decides the move of
    # B's stream from the same worker too (moves/<request id> in etcd), which B makes. B, not
    # owning w1, decides none itself.
    policy = MigrationPolicy(min_remaining_tokens=8, cooldown_s=60.0, check_interval_s=0.0, min_saving_s=0.0)
    f = Fleet(etcd, lease_ttl_s=2.0, heartbeat_interval_s=0.05, migration=policy, migration_method="reprefill")
    try:
        f.add_worker("w1", FakeEngine(token_delay_s=0.02, seconds_per_iteration=0.05), via="A")
        f.add_worker("w2", FakeEngine(token_delay_s=0.02, seconds_per_iteration=0.002), via="A")
        assert wait_until(lambda: all(f.sees(c, w) for c in "AB" for w in ("w1", "w2")), 10)
        a, b = f.coordinators["A"], f.coordinators["B"]
        assert a.state.owns("w1") and not b.state.owns("w1")
        for c in (a, b):
            c.servicer.affinity.bind("s", "w1")
        results = {}

        def stream(name, coordinator):
            with Client(coordinator.address) as client:
                results[name] = client.complete("fake-model", prompt=name, max_tokens=200, session_id="s")

        threads = [threading.Thread(target=stream, args=(n, c)) for n, c in (("via-a", a), ("via-b", b))]
        [t.start() for t in threads]
        [t.join(60) for t in threads]
        for name in ("via-a", "via-b"):
            assert results[name].worker_id == "w2" and results[name].stats.migrations >= 1, name
            assert results[name].token_ids == _expected(name, 200)  # greedy: as if never moved
        assert a.servicer.fleet.moves_decided_for_others >= 1 and b.servicer.fleet.moves_decided_for_others == 0
        made = [m for m in b.servicer.moves if m.outcome == "ok"]
        assert made and {m.reason for m in made} <= {"speed", "load"}
    finally:
        f.close()


def test_a_tiny_model_worker_registered_with_a_serves_greedy_requests_through_b(etcd, tiny_models):
    from worker.config import EngineConfig
    from worker.engine.thread import Engine

    engine = Engine(EngineConfig(model_path=tiny_models.llama, model_name="tiny-llama", capacity=2))
    f = Fleet(etcd, lease_ttl_s=3.0, heartbeat_interval_s=0.2)
    try:
        f.add_worker("m1", engine, via="A")
        assert wait_until(lambda: f.sees("B", "m1") is not None, 10)
        outs = {}
        for name in "AB":
            with Client(f.coordinators[name].address) as client:
                outs[name] = client.complete("tiny-llama", prompt="The fleet", max_tokens=12, temperature=0.0)
        assert outs["A"].token_ids == outs["B"].token_ids and len(outs["B"].token_ids) == 12
        assert outs["B"].worker_id == "m1"
    finally:
        f.close()


def test_a_worker_given_both_coordinators_stays_in_the_fleet_when_its_coordinator_is_killed(etcd, tmp_path):
    # Coordinator A is a process (`python -m coordinator --state etcd ...`), B in this one. The
    # worker registers with A and heartbeats there; A gets SIGKILL. The worker's heartbeats move to
    # B under the same lease, so the worker never leaves the fleet; B takes over its ownership
    # once A's own etcd lease has run out, and keeps serving through it.
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(tmp_path / "coordinator-a.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "coordinator", "--port", str(port), "--state", "etcd",
                             "--etcd-endpoints", f"http://{etcd.endpoint}", "--lease-ttl-s", "2",
                             "--heartbeat-interval-s", "0.1"], stdout=log, stderr=subprocess.STDOUT)
    loop = LoopThread()
    b = loop.run(start_coordinator(CoordinatorConfig(port=0, state="etcd", etcd_endpoints=(etcd.endpoint,),
                                                     lease_ttl_s=2.0, heartbeat_interval_s=0.1),
                                   CollectorRegistry()))
    engine = FakeEngine()
    w = None
    try:
        a_address = f"127.0.0.1:{port}"
        assert wait_until(lambda: b"coordinator ready" in (tmp_path / "coordinator-a.log").read_bytes(), 60)
        w = loop.run(start_worker(engine, "w1", coordinator=f"{a_address},{b.address}",
                                  metrics=WorkerMetrics(CollectorRegistry(), engine)))
        loop.run(asyncio.wait_for(w.registered.wait(), 60))
        assert list(w._leases) == [a_address] and w.shared_state, (tmp_path / "coordinator-a.log").read_text()
        lease = w._leases[a_address]
        assert wait_until(lambda: b.registry.get("w1") is not None, 10)
        assert not b.state.owns("w1")
        proc.kill()
        proc.wait(10)
        assert wait_until(lambda: list(w._leases) == [b.address], 10)
        assert wait_until(lambda: b.state.owns("w1"), 10)  # A's ownership went with A's lease
        loop.run(asyncio.sleep(2.5))  # longer than the lease TTL: heartbeats through B kept it
        assert b.registry.get("w1") is not None and b.registry.get("w1").lease_id == lease
        assert b.metrics.lease_expiries._value.get() == 0
        with Client(b.address) as client:
            assert client.complete("fake-model", prompt="still here", max_tokens=3).worker_id == "w1"
    finally:
        proc.kill()
        proc.wait(10)
        log.close()
        if w is not None:
            loop.run(w.stop(grace_s=0.5))
        loop.run(b.stop(grace_s=0.5))
        loop.close()


def test_a_request_waiting_at_one_coordinator_takes_a_worker_that_registers_with_the_other(fleet):
    fleet.add_worker("w1", FakeEngine(capacity=1, token_delay_s=0.02), via="A")
    b = fleet.coordinators["B"]
    assert wait_until(lambda: fleet.sees("B", "w1") is not None, 10)
    results = {}

    def run(name, prompt, max_tokens):
        with Client(b.address) as client:
            results[name] = client.complete("fake-model", prompt=prompt, max_tokens=max_tokens)

    long = threading.Thread(target=run, args=("long", "lll", 600))  # ~12 s on w1, B's only worker
    long.start()
    try:
        assert wait_until(lambda: fleet.sees("B", "w1").in_flight == 1, 10)
        waiting = threading.Thread(target=run, args=("waiting", "www", 3))
        waiting.start()
        assert wait_until(lambda: b.servicer.admission.waiting == 1, 10)  # B's view is full: it queues
        fleet.add_worker("w2", FakeEngine(), via="A")  # registers with A; B learns of it from etcd
        waiting.join(8)
        assert not waiting.is_alive() and results["waiting"].worker_id == "w2"
        assert "long" not in results  # it was not the end of the long stream that let it through
    finally:
        long.join(30)
    assert results["long"].token_ids == _expected("lll", 600)
