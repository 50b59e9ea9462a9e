"""The migration policy (coordinator/migration.py) on simulated fleets with an injected clock, and
what workers measure for it (worker/engine/profile.py)."""
from __future__ import annotations

import math

import pytest

from coordinator.migration import MigrationPolicy, position_keyed, profile_seconds, profile_timings
from coordinator.registry import WorkerRecord
from flashfleet.v1 import common_pb2, worker_pb2
from worker.engine.block_policy import Acceptance
from worker.engine.profile import DecodeProfile, SessionRates, speculative_speedup

BYTES_PER_TOKEN = 1000
AUTO, PLAIN, DRAFT, DFLASH = (common_pb2.DECODE_MODE_AUTO, common_pb2.DECODE_MODE_PLAIN,
                              common_pb2.DECODE_MODE_DRAFT, common_pb2.DECODE_MODE_DFLASH)


def _profile(step_s: float, per_row: float):
    """Seconds per iteration = step_s x (1 + per_row x (B - 1)) x (1 + C / 8192)."""
    return [worker_pb2.DecodeCost(batch_size=b, context_tokens=c, seconds=step_s * (1 + per_row * (b - 1)) * (1 + c / 8192),
                                  samples=5) for b in (1, 2, 4, 8) for c in (256, 1024, 4096)]


class Fleet:
    """Worker records whose loads the test edits; sessions are (worker id, SessionLoad)."""

    def __init__(self):
        self.workers: dict[str, WorkerRecord] = {}

    def add(self, wid, step_s=0.01, per_row=1.0, budget=0, capacity=8, prefill_s=1e-4, draft_mode=AUTO,
            profiled=True, bandwidth=0.0):
        load = worker_pb2.WorkerLoad(capacity=capacity, kv_budget_bytes=budget,
                                     decode_profile=_profile(step_s, per_row) if profiled else [],
                                     prefill_seconds_per_token=prefill_s, peak_memory_bandwidth_bytes_per_s=bandwidth)
        info = common_pb2.ModelInfo(name="m", kv_bytes_per_token=BYTES_PER_TOKEN, draft_mode=draft_mode,
                                    draft="d" if draft_mode != AUTO else "")
        self.workers[wid] = WorkerRecord(wid, f"{wid}:1", "lease", [info], load, 0.0, model_names=frozenset({"m"}))
        return self.workers[wid]

    def place(self, wid, rid, context, remaining, speedup=1.0):
        w = self.workers[wid]
        w.load.sessions.append(worker_pb2.SessionLoad(request_id=rid, context_tokens=context,
                                                      kv_bytes=context * BYTES_PER_TOKEN, remaining_tokens=remaining,
                                                      speculative_speedup=speedup))
        w.in_flight += 1
        self._sync(w)

    def move(self, rid, src, dst):
        s = next(x for x in self.workers[src].load.sessions if x.request_id == rid)
        kept = [x for x in self.workers[src].load.sessions if x.request_id != rid]
        del self.workers[src].load.sessions[:]
        self.workers[src].load.sessions.extend(kept)
        self.workers[src].in_flight -= 1
        self.workers[dst].load.sessions.append(s)
        self.workers[dst].in_flight += 1
        for w in (self.workers[src], self.workers[dst]):
            self._sync(w)

    @staticmethod
    def _sync(w):
        used = sum(s.kv_bytes for s in w.load.sessions)
        w.load.kv_cache_bytes = used
        w.load.kv_free_bytes = max(0, w.load.kv_budget_bytes - used)

    def live(self):
        return list(self.workers.values())


def _req(rid="r", max_tokens=2000, **kw):
    return common_pb2.GenerateRequest(model="m", prompt="p", request_id=rid, max_tokens=max_tokens, **kw)


def test_profile_prediction_interpolates_and_extrapolates():
    prof = [worker_pb2.DecodeCost(batch_size=1, context_tokens=256, seconds=0.010),
            worker_pb2.DecodeCost(batch_size=1, context_tokens=1024, seconds=0.016),
            worker_pb2.DecodeCost(batch_size=4, context_tokens=256, seconds=0.022)]
    assert profile_seconds(prof, 1, 256) == pytest.approx(0.010)
    assert profile_seconds(prof, 1, 640) == pytest.approx(0.013)  # halfway between 256 and 1024
    assert profile_seconds(prof, 1, 100) == pytest.approx(0.010)  # flat below the smallest bucket
    assert profile_seconds(prof, 1, 1792) == pytest.approx(0.022)  # along the last slope above
    assert profile_seconds(prof, 2, 256) == pytest.approx(0.014)  # between batch buckets 1 and 4
    assert profile_seconds(prof, 8, 256) == pytest.approx(0.038)
    assert profile_seconds([], 1, 256) is None


def test_a_long_session_moves_to_the_faster_worker_and_a_short_one_stays():
    fleet = Fleet()
    slow, fast = fleet.add("slow", step_s=0.03), fleet.add("fast", step_s=0.01)
    fleet.place("slow", "long", context=300, remaining=1500)
    fleet.place("slow", "short", context=300, remaining=40)
    p = MigrationPolicy()
    d = p.decide(_req("long"), slow, 20, fleet.live(), None, 100.0)
    assert d is not None and d.dest is fast and d.reason == "speed"
    assert d.saved_s > p.hysteresis * d.cost_s > 0
    assert p.decide(_req("short"), slow, 20, fleet.live(), None, 100.0) is None  # 40 < min_remaining_tokens
    assert p.decide(_req("long"), fast, 20, [fast, slow], None, 100.0) is None  # never to the slower one
    assert p.decide(_req("long"), slow, 20, fleet.live(), 99.0, 100.0) is None  # moved 1 s ago: cooldown
    assert p.decide(_req("long"), slow, 0, fleet.live(), None, 100.0) is None  # nothing streamed yet
    assert MigrationPolicy(enabled=False).decide(_req("long"), slow, 20, fleet.live(), None, 100.0) is None


def test_no_move_when_the_move_costs_more_than_it_saves():
    fleet = Fleet()
    slow = fleet.add("slow", step_s=0.012)
    fleet.add("fast", step_s=0.010, prefill_s=0.01)  # a slow re-prefill and a slow link: a dear move
    fleet.place("slow", "big", context=4000, remaining=100)  # 4 MB of KV, 100 tokens left
    policy = MigrationPolicy(link_bandwidth_bytes_per_s=1e6)
    cost = policy.move_cost_s(slow.load.sessions[0], fleet.workers["fast"])
    assert cost == pytest.approx(4.0)  # min(4 MB / 1 MB/s, 4000 x 10 ms)
    assert policy.decide(_req("big"), slow, 20, fleet.live(), None, 0.0) is None
    # The same session with plenty of tokens left gains more than the move costs.
    fleet.workers["slow"].load.sessions[0].remaining_tokens = 20000
    assert policy.decide(_req("big", max_tokens=30000), slow, 20, fleet.live(), None, 0.0) is not None


def test_an_idle_worker_wins_over_a_shared_one_as_a_load_move():
    fleet = Fleet()
    a, b = fleet.add("a"), fleet.add("b")
    fleet.place("a", "r1", 300, 1000)
    fleet.place("a", "r2", 300, 1000)
    d = MigrationPolicy().decide(_req("r1"), a, 10, fleet.live(), None, 0.0)
    assert d is not None and d.dest is b and d.reason == "load"
    # When batching is free (an iteration costs the same at any batch size) sharing costs nothing.
    flat = Fleet()
    a2 = flat.add("a", per_row=0.0)
    flat.add("b", per_row=0.0)
    flat.place("a", "r1", 300, 1000)
    flat.place("a", "r2", 300, 1000)
    assert MigrationPolicy().decide(_req("r1"), a2, 10, flat.live(), None, 0.0) is None


def test_nothing_ping_pongs_over_many_checks():
    """Eight sessions start on a slow worker beside a fast one; every 0.25 s each asks the policy
    and moves where it says. They spread out, then stay: no session goes back to a worker it left
    within the cooldown, and the second half of the run moves nothing."""
    fleet = Fleet()
    fleet.add("slow", step_s=0.03)
    fleet.add("fast", step_s=0.01)
    where = {}
    for i in range(8):
        fleet.place("slow", f"s{i}", 300, 100000)
        where[f"s{i}"] = "slow"
    policy = MigrationPolicy()
    moved_s: dict[str, float] = {}
    left: dict[str, tuple[str, float]] = {}
    moves = []
    now = 0.0
    for step in range(400):
        now = step * 0.25
        for rid in sorted(where):
            src = fleet.workers[where[rid]]
            lw, ls = left.get(rid, (None, None))
            d = policy.decide(_req(rid, max_tokens=200000), src, 10, fleet.live(), moved_s.get(rid), now, lw, ls)
            if d is None:
                continue
            if lw == d.dest.worker_id:
                assert now - ls >= policy.cooldown_s, f"{rid} went back to {lw} within the cooldown"
            fleet.move(rid, src.worker_id, d.dest.worker_id)
            moves.append((now, rid, src.worker_id, d.dest.worker_id))
            left[rid] = (src.worker_id, now)
            moved_s[rid] = now
            where[rid] = d.dest.worker_id
    assert moves, "nothing moved off the slow worker"
    assert all(t < 50.0 for t, *_ in moves), moves  # settled within the first half
    per_worker = {w: sum(1 for x in where.values() if x == w) for w in ("slow", "fast")}
    assert per_worker["fast"] > per_worker["slow"] > 0, per_worker  # the fast one runs more, not all
    assert len(moves) <= 8, moves


def test_going_back_to_the_worker_a_session_left_must_beat_the_gain_that_made_it_leave():
    """A session left "a" for "b" on a predicted 1.2x, and "a" has timed steps since it dropped
    the session. Profiles measured at other moments of a busy host now say "a" is 1.2x faster
    than "b": that alone does not take it back (it needs 1.1 x 1.2), nor to a third worker that
    is only as fast as "a" would be; a clearly faster "a" (its batch emptied) does."""
    fleet = Fleet()
    a, b = fleet.add("a", step_s=0.010), fleet.add("b", step_s=0.012)
    fleet.place("b", "s", context=300, remaining=1500)
    p = MigrationPolicy()
    since = profile_timings(a) - 1  # "a" timed a step after it dropped the session
    back = p.decide(_req("s"), b, 20, fleet.live(), None, 100.0, "a", 0.0, left_gain=1.2, left_timings=since)
    assert back is None
    moved = p.decide(_req("s"), b, 20, fleet.live(), None, 100.0, "a", 0.0, left_gain=0.0,  # a drain's move
                     left_timings=since)
    assert moved is not None and moved.dest is a and moved.gain == pytest.approx(1.2, rel=0.01)
    c = fleet.add("c", step_s=0.010)
    other = p.decide(_req("s"), b, 20, fleet.live(), None, 100.0, "a", 0.0, left_gain=1.2, left_timings=since)
    assert other is not None and other.dest is c  # the rule is about the way back only
    del fleet.workers["c"]
    a.load = worker_pb2.WorkerLoad(capacity=8, decode_profile=_profile(0.006, 1.0), prefill_seconds_per_token=1e-4)
    back = p.decide(_req("s"), b, 20, fleet.live(), None, 100.0, "a", 0.0, left_gain=1.2, left_timings=since)
    assert back is not None and back.dest is a and back.gain == pytest.approx(2.0, rel=0.01)


def test_no_speed_move_goes_back_to_a_worker_that_timed_nothing_since_the_session_left():
    """An idle worker's profile is as old as its last session: weighed against the fresh timings
    of the session's worker on a busy host it reads faster by however much the load rose since.
    Without timings of "a" after it dropped the session (or before its first load report without
    it: None), even a "clearly faster" "a" gets no speed move back; a third worker still can."""
    fleet = Fleet()
    a, b = fleet.add("a", step_s=0.006), fleet.add("b", step_s=0.012)
    fleet.place("b", "s", context=300, remaining=1500)
    p = MigrationPolicy()
    for timings in (None, profile_timings(a)):
        assert p.decide(_req("s"), b, 20, fleet.live(), None, 100.0, "a", 0.0, left_gain=1.2,
                        left_timings=timings) is None
    assert p.decide(_req("s"), b, 20, fleet.live(), None, 100.0, "a", 0.0, left_gain=1.2,
                    left_timings=profile_timings(a) - 1).dest is a
    c = fleet.add("c", step_s=0.006)
    assert p.decide(_req("s"), b, 20, fleet.live(), None, 100.0, "a", 0.0, left_gain=1.2).dest is c


def test_a_session_whose_growth_exceeds_the_kv_budget_moves_before_it_does():
    fleet = Fleet()
    src = fleet.add("src", budget=3_000_000)
    dest = fleet.add("dest", step_s=0.02, budget=10_000_000)  # slower: only memory moves it
    fleet.place("src", "grows", context=1000, remaining=1500)  # 2.5 MB at the end
    fleet.place("src", "small", context=500, remaining=100)  # 0.6 MB
    assert src.load.kv_cache_bytes < src.load.kv_budget_bytes  # it fits now...
    p = MigrationPolicy()
    assert p.kv_need_bytes(src, "m") > src.load.kv_budget_bytes  # ...not once they have grown
    d = p.decide(_req("grows"), src, 10, fleet.live(), None, 0.0)
    assert d is not None and d.dest is dest and d.reason == "memory"
    assert p.decide(_req("small"), src, 10, fleet.live(), None, 0.0) is None  # the bigger grower goes
    # No destination with room for its growth: it stays (the worker preempts as before).
    dest.load.kv_budget_bytes = 2_000_000
    assert p.decide(_req("grows"), src, 10, fleet.live(), None, 0.0) is None


def test_kv_need_counts_the_engines_padding_buckets_and_working_memory():
    from flashfleet.kv_need import POSITION_BUCKET, final_need_bytes
    from worker.caches.rows import STEP

    assert POSITION_BUCKET == STEP  # the formula's buffers are the engine's
    # One batch pads every row to its longest, in whole buckets; 4 layers: 2/4 of it as working memory.
    assert final_need_bytes([(10, 100), (300, 100)], layers=4) == 2 * 512 * 100 * 3 // 2
    # Two methods are two batches; the working memory is of the larger one.
    assert final_need_bytes([(10, 100), (10, 300)], layers=2) == 256 * 100 + 256 * 300 + 256 * 300
    assert final_need_bytes([], layers=2) == 0


def test_a_fresh_session_that_fits_alone_does_not_move_for_memory():
    fleet = Fleet()
    # One 256-position buffer and, with 2 layers, its working memory of as much again.
    src = fleet.add("src", budget=512 * BYTES_PER_TOKEN)
    fleet.add("dest", step_s=0.02, budget=10_000_000)
    src.load.kv_layers = 2
    fleet.place("src", "fresh", context=17, remaining=140)  # 157 positions at the end: one buffer
    src.load.sessions[0].kv_bytes = 256 * BYTES_PER_TOKEN  # it holds a whole buffer at 17 tokens
    assert MigrationPolicy().kv_need_bytes(src, "m") == src.load.kv_budget_bytes
    assert MigrationPolicy().decide(_req("fresh"), src, 10, fleet.live(), None, 0.0) is None


def test_drain_moves_every_session_even_when_migration_is_off_or_cooling_down():
    fleet = Fleet()
    src, fast, slow = fleet.add("src", step_s=0.01), fleet.add("fast", step_s=0.01), fleet.add("slow", step_s=0.05)
    for i in range(3):
        fleet.place("src", f"r{i}", 300, 5)  # few tokens left: no speed move would take them
    src.draining = True
    for policy in (MigrationPolicy(), MigrationPolicy(enabled=False)):
        for i in range(3):
            d = policy.decide(_req(f"r{i}"), src, 10, fleet.live(), 9.0, 10.0)  # moved 1 s ago
            assert d is not None and d.reason == "drain" and d.dest is fast
    fast.draining = True  # a draining worker is no destination
    assert MigrationPolicy().decide(_req("r0"), src, 10, fleet.live(), None, 0.0).dest is slow
    slow.in_flight = slow.load.capacity  # full
    assert MigrationPolicy().decide(_req("r0"), src, 10, fleet.live(), None, 0.0) is None


def test_a_worker_without_a_profile_is_predicted_from_peak_bandwidth_or_not_at_all():
    fleet = Fleet()
    src = fleet.add("src", step_s=0.03, bandwidth=100e9)
    new = fleet.add("new", profiled=False, bandwidth=400e9)
    fleet.place("src", "r", 300, 1500)
    p = MigrationPolicy()
    assert p.seconds_per_iteration(new, 1, 300, fleet.live()) == pytest.approx(
        profile_seconds(src.load.decode_profile, 1, 300) / 4)
    d = p.decide(_req("r"), src, 10, fleet.live(), None, 0.0)
    assert d is not None and d.dest is new
    new.load.peak_memory_bandwidth_bytes_per_s = 0  # unknown: no candidate for a speed move
    assert p.decide(_req("r"), src, 10, fleet.live(), None, 0.0) is None


def test_seeded_samples_move_only_between_position_keyed_decoders():
    fleet = Fleet()
    src = fleet.add("src", step_s=0.03)
    fleet.add("fast", step_s=0.01)
    fleet.place("src", "r", 300, 1500)
    p = MigrationPolicy()
    seeded = dict(temperature=0.8, seed=7)
    assert p.decide(_req("r", **seeded), src, 10, fleet.live(), None, 0.0) is not None  # plain: keyed by position
    assert p.decide(_req("r", mode=DFLASH, **seeded), src, 10, fleet.live(), None, 0.0) is None  # no DFlash draft
    classic = Fleet()
    src2 = classic.add("src", step_s=0.03, draft_mode=DRAFT)
    classic.add("fast", step_s=0.01, draft_mode=DRAFT)
    classic.place("src", "r", 300, 1500)
    assert not position_keyed(_req("r", **seeded), src2)  # AUTO resolves to the classic draft
    assert p.decide(_req("r", **seeded), src2, 10, classic.live(), None, 0.0) is None
    assert p.decide(_req("r", mode=PLAIN, **seeded), src2, 10, classic.live(), None, 0.0) is not None
    assert p.decide(_req("r", temperature=0.8), src2, 10, classic.live(), None, 0.0) is not None  # unseeded


def test_policy_rejects_bad_settings():
    for bad in (dict(min_remaining_tokens=0), dict(link_bandwidth_bytes_per_s=0), dict(min_speedup=0.5),
                dict(hysteresis=-1), dict(cooldown_s=-1)):
        with pytest.raises(ValueError):
            MigrationPolicy(**bad)


# ----- worker side ------------------------------------------------------------------------------

def test_decode_profile_drops_warm_up_keeps_the_least_recent_timing_and_skips_speculative_iterations():
    prof = DecodeProfile(decay=0.5, window=3, horizon=100)
    prof.decode(3, 300, 1, 9.0)  # first of bucket (4, 512): warm-up, dropped
    assert prof.snapshot() == []
    prof.decode(3, 300, 1, 0.03)
    prof.decode(4, 400, 1, 0.02)
    prof.decode(4, 400, 1, 0.09)  # waited for a CPU: not the worker's speed
    prof.decode(4, 400, 4, 5.0)  # a DFlash iteration at block 4: not a plain step
    (entry,) = prof.snapshot()
    assert (entry.batch_size, entry.context_tokens, entry.samples) == (4, 512, 3)
    assert entry.seconds == pytest.approx(0.02)
    for _ in range(3):  # the window holds 3: a cost that grew is followed
        prof.decode(4, 400, 1, 0.05)
    assert prof.snapshot()[0].seconds == pytest.approx(0.05)
    prof.prefill(100, 0.5)
    prof.prefill(100, 1.5)
    assert prof.prefill_seconds_per_token == pytest.approx(0.01)
    prof.reset()
    assert prof.snapshot() == [] and prof.prefill_seconds_per_token == 0


def test_slow_profile_sleeps_and_records_the_slower_time():
    """The tests' injected SlowProfile (tests/fakes.py): the engine sleeps (F - 1) x each timed
    iteration and the profile records F x it; the product's DecodeProfile never sleeps."""
    from fakes import SlowProfile

    slept = []
    prof = SlowProfile(3.0, sleep=slept.append, decay=0.0)
    for _ in range(2):
        prof.decode(1, 10, 1, 0.01)
    prof.prefill(10, 0.01)
    assert slept == pytest.approx([0.02, 0.02, 0.02])
    assert prof.snapshot()[0].seconds == pytest.approx(0.03)
    assert prof.prefill_seconds_per_token == pytest.approx(0.003)
    with pytest.raises(ValueError):
        SlowProfile(0.5)


def test_session_rates_and_speculative_speedup():
    rates = SessionRates(decay=0.0)
    rates.observe("a", 0, 0.0)
    assert rates.rate("a") == 0.0
    rates.observe("a", 10, 0.5)
    assert rates.rate("a") == pytest.approx(20.0)
    rates.keep(set())
    assert rates.rate("a") == 0.0
    # Block 4 costs twice a plain step; a row accepting everything commits 4 tokens: 2x.
    known = Acceptance.known
    assert speculative_speedup([known(1.0)], {1: 0.01, 4: 0.02}) == pytest.approx([2.0])
    # Drafts that are never accepted: the batch steps plainly.
    assert speculative_speedup([known(0.0), known(0.0)], {1: 0.01, 4: 0.02}) == [1.0, 1.0]
    assert speculative_speedup([known(0.9)], {4: 0.02}) == [1.0]  # no plain cost measured: unknown
    a = 0.8
    expected = (1 - a ** 4) / (1 - a) * 0.01 / 0.015
    assert speculative_speedup([known(a)], {1: 0.01, 4: 0.015})[0] == pytest.approx(expected)
    assert not math.isnan(expected)


def test_a_speed_move_must_save_hysteresis_times_its_cost():
    fleet = Fleet()
    slow = fleet.add("slow", step_s=0.012)
    fleet.add("fast", step_s=0.010)
    fleet.place("slow", "s", context=1000, remaining=1000)
    free = MigrationPolicy(hysteresis=0.0, min_saving_s=0.0).decide(_req("s"), slow, 20, fleet.live(), None, 100.0)
    assert free is not None and 0 < free.cost_s < free.saved_s
    ratio = free.saved_s / free.cost_s
    for hysteresis, moves in ((ratio * 0.98, True), (ratio * 1.02, False)):
        d = MigrationPolicy(hysteresis=hysteresis, min_saving_s=0.0).decide(_req("s"), slow, 20, fleet.live(),
                                                                            None, 100.0)
        assert (d is not None) == moves, (hysteresis, ratio, d)


def test_a_check_in_a_large_fleet_weighs_a_bounded_sample_and_still_finds_the_faster_worker(monkeypatch):
    """100 equally slow workers and one fast idle one: a check predicts at most a handful of
    workers (its cost does not grow with the fleet), and over repeated checks the draws find the
    fast one."""
    import random

    fleet = Fleet()
    src = fleet.add("src", step_s=0.03)
    for i in range(99):
        fleet.add(f"slow{i}", step_s=0.03)
    fast = fleet.add("fast", step_s=0.01)
    fleet.place("src", "long", context=300, remaining=1500)
    policy = MigrationPolicy(max_candidates=8, rng=random.Random(0))
    predicted: list[str] = []
    real = MigrationPolicy.seconds_per_iteration

    def counting(self, worker, batch, context, peers=()):
        predicted.append(worker.worker_id)
        return real(self, worker, batch, context, peers)

    monkeypatch.setattr(MigrationPolicy, "seconds_per_iteration", counting)
    decisions = []
    for t in range(40):
        predicted.clear()
        decisions.append(policy.decide(_req("long"), src, 20, fleet.live(), None, float(t)))
        assert len(predicted) <= 2 * policy.max_candidates + 1, len(predicted)  # source + 2 per candidate
    found = [d for d in decisions if d is not None]
    assert found and all(d.dest is fast and d.reason == "speed" for d in found)
    # A fleet no larger than the sample is weighed whole: the fast worker is found at once.
    small = Fleet()
    s = small.add("src", step_s=0.03)
    for i in range(7):
        small.add(f"slow{i}", step_s=0.03)
    f = small.add("fast", step_s=0.01)
    small.place("src", "long", context=300, remaining=1500)
    assert policy.decide(_req("long"), s, 20, small.live(), None, 0.0).dest is f


def test_a_parsed_profile_predicts_exactly_what_interpolating_every_bucket_does():
    """ProfileTable interpolates only the batch buckets around the batch asked for: the result is
    the same float as interpolating every bucket's context first, below, between, on and above
    the measured batch sizes and contexts."""
    import random

    from coordinator.migration import ProfileTable, _interpolate

    rng = random.Random(1)
    for _ in range(50):
        batches = sorted(rng.sample([1, 2, 3, 4, 8, 16, 32, 64], rng.randint(1, 6)))
        prof = [worker_pb2.DecodeCost(batch_size=b, context_tokens=c, seconds=rng.uniform(0.005, 0.05))
                for b in batches for c in sorted(rng.sample([256, 512, 1024, 4096, 8192], rng.randint(1, 4)))]
        table = ProfileTable(prof)
        by_batch = {}
        for c in prof:
            by_batch.setdefault(c.batch_size, []).append((c.context_tokens, c.seconds))
        for batch in (1, 2, 3, 5, 8, 13, 64, 100):
            for context in (1, 256, 300, 1024, 5000, 20000):
                every = _interpolate(sorted((b, _interpolate(sorted(p), context)) for b, p in by_batch.items()), batch)
                assert table.seconds(batch, context) == every
    assert ProfileTable([]).seconds(1, 256) is None
