"""Routing by KV room (coordinator/routing.py) with simulated workers: WorkerRecords whose
heartbeat loads report KV budgets and free bytes, no gRPC."""
from __future__ import annotations

import random

import pytest

from coordinator.registry import Registry, WorkerRecord
from coordinator.routing import (PowerOfTwoRouter, SessionAffinity, has_kv_room, request_tokens_bound,
                                 route)
from flashfleet.requests import WORKER_DEFAULT_MAX_TOKENS
from flashfleet.v1 import common_pb2, worker_pb2

MODEL = "m"
PER_TOKEN = 1000  # KV bytes per token the simulated workers register


def worker(wid: str, free_bytes: int | None, per_token: int = PER_TOKEN, in_flight: int = 0,
           capacity: int = 4) -> WorkerRecord:
    """A live worker serving MODEL; free_bytes None: it reports no KV budget."""
    budget = 0 if free_bytes is None else 10 * free_bytes + 1
    load = worker_pb2.WorkerLoad(capacity=capacity, kv_budget_bytes=budget, kv_free_bytes=free_bytes or 0,
                                 kv_cache_bytes=budget - (free_bytes or 0))
    return WorkerRecord(worker_id=wid, address=f"{wid}:1", lease_id="l",
                        models=[common_pb2.ModelInfo(name=MODEL, kv_bytes_per_token=per_token)], load=load,
                        last_heartbeat_s=0.0, in_flight=in_flight, model_names=frozenset({MODEL}))


def pick(workers, tokens, session_id="", affinity=None, seed=0, n=50) -> set[str]:
    """Worker ids `route` chose over n routings (seeded router)."""
    router = PowerOfTwoRouter(random.Random(seed))
    affinity = affinity or SessionAffinity(ttl_s=60.0)
    return {route(MODEL, session_id, workers, set(), router, affinity, tokens=tokens).worker_id for _ in range(n)}


def test_request_tokens_bound_counts_prompt_bytes_and_the_generation_budget():
    raw = common_pb2.GenerateRequest(model=MODEL, prompt="zażółć", max_tokens=7)
    assert request_tokens_bound(raw) == len("zażółć".encode()) + 7
    chat = common_pb2.GenerateRequest(model=MODEL, messages=common_pb2.ChatMessages(messages=[
        common_pb2.ChatMessage(role="system", content="be brief"),
        common_pb2.ChatMessage(role="user", content="hi")]))
    assert request_tokens_bound(chat) == len("be brief") + len("hi") + WORKER_DEFAULT_MAX_TOKENS


def test_has_kv_room_compares_free_bytes_with_tokens_times_bytes_per_token():
    assert has_kv_room(worker("a", free_bytes=100 * PER_TOKEN), MODEL, 100)
    assert not has_kv_room(worker("a", free_bytes=100 * PER_TOKEN - 1), MODEL, 100)
    assert has_kv_room(worker("a", free_bytes=None), MODEL, 10**9)  # no budget reported
    assert has_kv_room(worker("a", free_bytes=0, per_token=0), MODEL, 10**9)  # no bytes per token
    assert has_kv_room(worker("a", free_bytes=0), MODEL, 0)  # nothing to compare


def test_registry_heartbeat_carries_free_kv_bytes():
    registry = Registry(lease_ttl_s=10.0, clock=lambda: 0.0)
    rec = registry.register(worker_pb2.RegisterRequest(
        worker_id="a", address="a:1", models=[common_pb2.ModelInfo(name=MODEL, kv_bytes_per_token=PER_TOKEN)],
        load=worker_pb2.WorkerLoad(capacity=2)))
    assert rec.kv_free_bytes is None and rec.kv_bytes_per_token(MODEL) == PER_TOKEN
    assert rec.kv_bytes_per_token("other") == 0
    registry.heartbeat("a", rec.lease_id, worker_pb2.WorkerLoad(capacity=2, kv_budget_bytes=5000,
                                                                 kv_cache_bytes=3000, kv_free_bytes=2000))
    assert registry.get("a").kv_free_bytes == 2000


def test_leases_run_out_on_time_with_expiry_swept_only_when_one_may_have():
    """The registry sweeps its workers only once the oldest heartbeat it knows is past the TTL;
    each lease still ends exactly when it runs out, whatever registered or heartbeat since."""
    now = [0.0]
    gone = []
    registry = Registry(lease_ttl_s=10.0, clock=lambda: now[0], on_remove=lambda rec, why: gone.append((rec.worker_id, why)))

    def register(wid):
        return registry.register(worker_pb2.RegisterRequest(
            worker_id=wid, address=f"{wid}:1", models=[common_pb2.ModelInfo(name=MODEL)],
            load=worker_pb2.WorkerLoad(capacity=2)))

    a = register("a")
    now[0] = 5.0
    register("b")
    now[0] = 9.0
    registry.heartbeat("a", a.lease_id, worker_pb2.WorkerLoad(capacity=2))
    now[0] = 10.5  # a's first lease would be over, but it heartbeat at 9
    assert sorted(w.worker_id for w in registry.live()) == ["a", "b"] and gone == []
    now[0] = 15.0
    assert sorted(w.worker_id for w in registry.live()) == ["a", "b"]
    now[0] = 15.5  # b: 10.5 s since its registration
    assert [w.worker_id for w in registry.live()] == ["a"] and gone == [("b", "expired")]
    now[0] = 19.0
    assert registry.get("a") is a
    now[0] = 19.5
    assert registry.get("a") is None and registry.live() == [] and gone[-1] == ("a", "expired")
    now[0] = 100.0
    c = register("c")  # a registry emptied by expiry tracks a new worker's lease again
    now[0] = 110.5
    assert registry.get("c") is None and gone[-1] == ("c", "expired")
    assert c.worker_id == "c"


def test_a_worker_registering_again_keeps_its_record_and_another_cannot_take_its_id():
    from coordinator.registry import WorkerIdInUse

    now = [0.0]
    registry = Registry(lease_ttl_s=10.0, clock=lambda: now[0])

    def register(address):
        return registry.register(worker_pb2.RegisterRequest(
            worker_id="a", address=address, models=[common_pb2.ModelInfo(name=MODEL)],
            load=worker_pb2.WorkerLoad(capacity=2)))

    rec = register("a:1")
    rec.in_flight, rec.served_requests = 2, 7  # streams open to it
    again = register("a:1")  # the same worker (restarted, or its lease ran out)
    assert again is rec and again.in_flight == 2 and again.served_requests == 7
    assert again.lease_id != "" and registry.get("a") is rec
    with pytest.raises(WorkerIdInUse, match="in use by the worker at a:1"):
        register("a:2")  # a second worker given the same id
    assert registry.get("a").address == "a:1"
    rec.unreachable = True  # the first one's calls fail: a replacement may take over
    assert register("a:2") is rec and rec.address == "a:2" and not rec.unreachable
    now[0] = 20.0  # its lease ran out: the id is free for anyone
    assert register("a:3").address == "a:3"


def test_a_worker_without_room_is_passed_over_while_another_has_room():
    tight, roomy = worker("tight", free_bytes=50 * PER_TOKEN), worker("roomy", free_bytes=500 * PER_TOKEN,
                                                                      in_flight=3)
    # tight is less utilised (0/4 vs 3/4) but cannot hold 100 tokens: roomy every time
    assert pick([tight, roomy], tokens=100) == {"roomy"}
    # a request that fits both goes by utilisation again
    assert pick([tight, roomy], tokens=10) == {"tight"}


def test_with_no_worker_that_has_room_routing_goes_on_as_usual():
    idle, busy = worker("idle", free_bytes=10 * PER_TOKEN), worker("busy", free_bytes=20 * PER_TOKEN, in_flight=2)
    assert pick([idle, busy], tokens=1000) == {"idle"}  # by utilisation, as without KV reports
    level = worker("level", free_bytes=20 * PER_TOKEN)
    assert pick([idle, level], tokens=1000) == {"level"}  # a tie: the more free bytes


def test_a_worker_that_does_not_report_kv_counts_as_having_room():
    unknown, tight = worker("unknown", free_bytes=None, in_flight=1), worker("tight", free_bytes=PER_TOKEN)
    assert pick([unknown, tight], tokens=100) == {"unknown"}


def test_on_equal_utilisation_more_free_kv_wins():
    # no bytes per token: every worker "has room", free bytes only break ties
    a, b = worker("a", free_bytes=100, per_token=0), worker("b", free_bytes=900, per_token=0)
    assert pick([a, b], tokens=100) == {"b"}
    c = worker("c", free_bytes=None, per_token=0)  # unknown loses to a reported amount
    assert pick([a, c], tokens=100) == {"a"}
    busy = worker("busy", free_bytes=10**6, per_token=0, in_flight=2)  # utilisation still comes first
    assert pick([a, busy], tokens=100) == {"a"}


@pytest.mark.parametrize("sticky_free, other_free, expected", [
    (500 * PER_TOKEN, 900 * PER_TOKEN, "sticky"),  # room on its worker: affinity holds
    (10 * PER_TOKEN, 900 * PER_TOKEN, "other"),  # no room there, room elsewhere: moves
    (10 * PER_TOKEN, 20 * PER_TOKEN, "sticky"),  # no room anywhere: stays with its prompt cache
])
def test_session_affinity_holds_unless_its_worker_lacks_room(sticky_free, other_free, expected):
    affinity = SessionAffinity(ttl_s=60.0)
    affinity.bind("s", "sticky")
    workers = [worker("sticky", free_bytes=sticky_free, in_flight=2), worker("other", free_bytes=other_free)]
    assert pick(workers, tokens=100, session_id="s", affinity=affinity) == {expected}


def test_session_affinity_forgets_expired_sessions_without_being_asked_for_them():
    now = [0.0]
    affinity = SessionAffinity(ttl_s=10.0, clock=lambda: now[0])
    for i in range(1000):  # one-turn sessions never looked up again
        now[0] = i * 0.1
        affinity.bind(f"s{i}", "w1")
    assert len(affinity._by_session) <= 101  # only those bound within the last 10 s are kept
    assert affinity.lookup("s999") == "w1" and affinity.lookup("s0") is None
    affinity.bind("s990", "w2")  # a rebind refreshes its place
    now[0] += 9.95
    affinity.bind("new", "w1")
    assert affinity.lookup("s990") == "w2" and affinity.lookup("s989") is None


def test_session_affinity_is_bounded_in_count_within_its_ttl():
    # Clients choose session ids: a flood of new ids within one ttl must not grow the map past
    # its cap; the least recently bound go first and a recent rebind survives.
    affinity = SessionAffinity(ttl_s=3600.0, clock=lambda: 0.0, max_sessions=50)
    affinity.bind("kept", "w1")
    for i in range(49):
        affinity.bind(f"s{i}", "w1")
    affinity.bind("kept", "w2")  # rebinding moves it to the back
    for i in range(49, 98):  # 49 more: the 49 older ids go, "kept" stays
        affinity.bind(f"s{i}", "w1")
    assert len(affinity._by_session) == 50
    assert affinity.lookup("kept") == "w2"
    assert affinity.lookup("s0") is None and affinity.lookup("s48") is None and affinity.lookup("s97") == "w1"
    with pytest.raises(ValueError):
        SessionAffinity(ttl_s=1.0, max_sessions=0)


def test_session_affinity_tells_on_bind_but_not_on_remember():
    told = []
    affinity = SessionAffinity(ttl_s=60.0)
    affinity.on_bind = lambda s, w: told.append((s, w))
    affinity.bind("a", "w1")
    affinity.bind("", "w1")  # no session: nothing to bind or tell
    affinity.remember("b", "w2")  # another coordinator's binding
    assert told == [("a", "w1")]
    assert affinity.lookup("b") == "w2"
    affinity.forget("b")
    assert affinity.lookup("b") is None


def _register(registry: Registry, wid: str, capacity: int, free_bytes: int | None = None) -> WorkerRecord:
    budget = 0 if free_bytes is None else 10 * free_bytes + 1
    return registry.register(worker_pb2.RegisterRequest(
        worker_id=wid, address=f"{wid}:1", models=[common_pb2.ModelInfo(name=MODEL, kv_bytes_per_token=PER_TOKEN)],
        load=worker_pb2.WorkerLoad(capacity=capacity, kv_budget_bytes=budget, kv_free_bytes=free_bytes or 0)))


def test_the_registrys_free_slot_index_follows_slots_heartbeats_and_leaving_workers():
    from coordinator.stream import Slot

    now = [0.0]
    registry = Registry(lease_ttl_s=10.0, clock=lambda: now[0])
    a, b = _register(registry, "a", 1), _register(registry, "b", 2)
    free = lambda: sorted(w.worker_id for w in registry.free_sample(MODEL, 16))  # noqa: E731
    assert free() == ["a", "b"] and registry.free_sample("other", 16) == []
    slot = Slot(a, lambda: None)
    assert free() == ["b"]
    slot.release()
    assert free() == ["a", "b"]
    registry.heartbeat("b", b.lease_id, worker_pb2.WorkerLoad(capacity=1))
    held = Slot(b, lambda: None)
    assert free() == ["a"]
    registry.heartbeat("b", b.lease_id, worker_pb2.WorkerLoad(capacity=3))  # it grew: free again
    assert free() == ["a", "b"]
    registry.deregister("b", b.lease_id)
    held.release()  # a stream that outlived its worker's lease gives its slot back: b stays out
    assert free() == ["a"] and [w.worker_id for w in registry.serving(MODEL)] == ["a"]
    now[0] = 11.0
    assert free() == [] and registry.serving(MODEL) == []  # a's lease ran out


def test_admission_and_routing_at_a_thousand_workers_look_at_the_few_with_a_free_slot():
    from coordinator.config import CoordinatorConfig
    from coordinator.state import MemoryState
    from coordinator.stream import Fleet, Slot

    registry = Registry(lease_ttl_s=10.0, clock=lambda: 0.0)
    state = MemoryState("c", registry, SessionAffinity(ttl_s=60.0))
    fleet = Fleet(CoordinatorConfig(), state, pool=None, router=PowerOfTwoRouter(random.Random(0)))
    records = [_register(registry, f"w{i}", 1, free_bytes=None if i != 7 else 0) for i in range(1000)]
    slots = [Slot(w, lambda: None) for w in records if w.worker_id not in ("w7", "w777")]
    req = common_pb2.GenerateRequest(model=MODEL, prompt="p", max_tokens=8)
    assert fleet.has_room(req)
    # w7 has no KV room: w777 is the pick, as `route` over the whole fleet chooses
    assert fleet.pick(req, set(), 8).worker_id == "w777"
    assert route(MODEL, "", registry.live(), set(), fleet.router, state.affinity, tokens=8).worker_id == "w777"
    assert fleet.pick(req, {"w777"}, 8) is None  # only w7 left, without room: `route` decides
    Slot(records[777], lambda: None), Slot(records[7], lambda: None)
    assert not fleet.has_room(req)
    records[5].unreachable = True  # every reachable worker is full; w5 unreachable changes nothing
    assert not fleet.has_room(req)
    for s in slots:
        s.release()
    assert fleet.has_room(req)
    assert fleet.pick(common_pb2.GenerateRequest(model="other", prompt="p"), set(), 8) is None
