"""The batched DFlash block-size policy on simulated costs (no MLX)."""
from __future__ import annotations

import pytest

from worker.engine.block_policy import Acceptance, BatchBlockPolicy


def run(policy: BatchBlockPolicy, cost, accept: list[float], iterations: int = 200, context: int = 300) -> dict:
    """Drives the policy for `iterations` with cost(L, B) seconds and rows of known geometric
    acceptance `accept`; returns how often each L ran."""
    seen: dict = {}
    rows = [Acceptance.known(a) for a in accept]
    for _ in range(iterations):
        L = policy.choose(rows, context, max_useful=64)
        policy.observe(len(accept), context, L, cost(L, len(accept)))
        seen[L] = seen.get(L, 0) + 1
    return seen


def test_expected_tokens_of_geometric_acceptance():
    """A row keeping each draft with probability a commits (1 - a^L) / (1 - a) tokens a block of L."""
    assert Acceptance.known(0.0).expected(16) == pytest.approx(1.0)
    assert Acceptance.known(1.0).expected(8) == pytest.approx(8.0)
    assert Acceptance.known(0.5).expected(2) == pytest.approx(1.5)
    assert Acceptance.known(0.8).expected(16) == pytest.approx((1 - 0.8 ** 16) / 0.2)


def test_a_good_draft_on_a_bandwidth_bound_device_speculates_at_the_largest_block():
    p = BatchBlockPolicy(16, explore_every=0)
    seen = run(p, lambda L, B: 0.010 + 0.0001 * L * B, [0.9] * 4)
    assert max(seen, key=seen.get) == 16


def test_a_poor_draft_falls_back_to_plain_and_never_tries_large_blocks():
    """a = 0.2: E(L) <= 1.25 tokens, but a draft + verify costs 1.6x a plain step: plain wins, and
    blocks past 2 are never measured (they could gain at most E(L) / c(2) < 1)."""
    p = BatchBlockPolicy(16, explore_every=0)
    seen = run(p, lambda L, B: 0.010 if L == 1 else 0.016 + 0.0001 * L, [0.2] * 4)
    assert seen.get(1, 0) >= 190
    assert set(seen) <= {1, 2}


def test_compute_bound_batches_speculate_less():
    """Cost linear in B x L (a CPU): at batch 8 the verify is not free and plain decoding wins where
    at batch 1 a moderate draft still pays."""
    def cost(L, B):
        return 0.004 + 0.001 * B * L + (0.002 if L > 1 else 0.0)
    one = run(BatchBlockPolicy(16, explore_every=0), cost, [0.7])
    eight = run(BatchBlockPolicy(16, explore_every=0), cost, [0.7] * 8)
    assert max(one, key=one.get) > 1
    assert max(eight, key=eight.get) == 1


def test_costs_are_kept_per_batch_and_context_bucket():
    p = BatchBlockPolicy(8)
    for _ in range(3):
        p.observe(3, 300, 4, 0.02)
    assert p.cost(4, 400, 4) == pytest.approx(0.02)  # same buckets: batch 3-4, context 257-512
    assert p.cost(5, 300, 4) is None and p.cost(3, 600, 4) is None


def test_acceptance_counts_decay():
    a = Acceptance()
    for _ in range(50):
        a.observe(15, 15)
    assert a.expected(16) > 12
    for _ in range(100):
        a.observe(15, 0)
    assert a.rates(1)[0] < 0.1 and a.expected(16) < 2


def test_acceptance_is_estimated_per_position_from_censored_cycles():
    """A bursty draft: half the cycles keep nothing, half keep the whole block. E(L) follows the
    observed positions (1 + 0.5 (L - 1)), where the rate of the first position alone (what blocks
    of 2 show) would give the geometric E(16) = 2; and a cycle cut at position j says nothing of
    the positions after it (they keep the last estimate)."""
    a = Acceptance(weight=0.01, decay=0.999)
    for _ in range(40):
        a.observe(15, 0)
        a.observe(15, 15)
    assert a.expected(8) == pytest.approx(4.5, rel=0.02)
    assert a.expected(16) == pytest.approx(8.5, rel=0.02)
    assert Acceptance.known(0.5).expected(16) == pytest.approx(2.0, abs=1e-3)
    r = a.rates(15)
    assert r[0] == pytest.approx(0.5, abs=0.01) and min(r[1:]) > 0.99
    b = Acceptance(prior=[0.3], weight=2.0)
    b.observe(3, 3)  # positions 0-2 kept (a block of 4): position 3 onwards never verified
    assert b.rates(6)[3:] == pytest.approx([b.rates(6)[2]] * 3)  # the last estimate carries on
    assert b.rates(6, optimistic=True)[0] == b.rates(6)[0]  # verified: no bonus
    assert b.rates(6, optimistic=True)[3] > b.rates(6)[3]  # never verified: could be better
    assert b.curve(4) == pytest.approx([b.expected(L) for L in (1, 2, 3, 4)])
    with pytest.raises(ValueError):
        Acceptance(prior=[1.5])


def drive(policy: BatchBlockPolicy, cost, cycles: list[int], rows: int, iterations: int = 300) -> tuple[dict, float]:
    """Drives the policy with rows that learn their acceptance: row r's i-th cycle would keep
    cycles[(i + 7 r) % len(cycles)] drafts at block 16 (min(that, L - 1) at block L). Returns how
    often each L ran and the tokens committed per second."""
    accs = [Acceptance() for _ in range(rows)]
    seen: dict = {}
    tokens = seconds = 0.0
    for i in range(iterations):
        L = policy.choose(accs, 300, max_useful=64)
        seconds += cost(L, rows)
        policy.observe(rows, 300, L, cost(L, rows))
        seen[L] = seen.get(L, 0) + 1
        for r, a in enumerate(accs):
            k = min(cycles[(i + 7 * r) % len(cycles)], L - 1) if L > 1 else 0
            if L > 1:
                a.observe(L - 1, k)
            tokens += k + 1
    return seen, tokens / seconds


BURSTY = [0, 0, 15, 1, 0, 3, 0, 15, 2, 0, 7, 0, 1, 15, 0, 4]  # tau 4.0 at block 16, 2.3 at block 4


def test_a_bursty_draft_runs_long_blocks_where_short_ones_do_not_pay():
    """A device whose iteration costs about the same at every block size, 2.4x a plain step (the
    draft forward and the host's work per iteration): blocks of 2 or 4 lose to plain steps, a
    block of 16 commits 4 tokens and wins 1.6x. The policy measures the long blocks and runs them."""
    def cost(L, B):
        return 0.0096 if L == 1 else 0.023 + 0.0001 * L
    seen, tps = drive(BatchBlockPolicy(16), cost, BURSTY, rows=8)
    assert max(seen, key=seen.get) == 16
    plain = 8 / cost(1, 8)
    assert tps > 1.4 * plain


def test_a_bursty_draft_on_a_cpu_stays_plain_and_probes_small_blocks_only():
    """Cost linear in B x L (a CPU) at 8 rows: the same draft does not pay at any block; the
    policy stops probing once the measured costs grow past what the acceptance could repay."""
    def cost(L, B):
        return 0.004 + 0.001 * B * L + (0.002 if L > 1 else 0.0)
    seen, _ = drive(BatchBlockPolicy(16), cost, BURSTY, rows=8)
    assert seen.get(1, 0) >= 280
    assert set(seen) <= {1, 2, 4}


def test_a_size_that_did_not_pay_elsewhere_is_not_measured_again_in_a_new_bucket():
    """Measured at batch 1: a 2-token block costs 1.8x a plain step and a = 0.1. At batch 2 (a new
    bucket) the policy estimates the block from that ratio and decodes plainly from the start."""
    p = BatchBlockPolicy(16, explore_every=0)
    cost = lambda L, B: 0.010 if L == 1 else 0.018  # noqa: E731
    run(p, cost, [0.1], iterations=40)
    seen = run(p, cost, [0.1, 0.1], iterations=40)
    assert seen == {1: 40}


def test_re_measurements_thin_out_while_the_choice_holds():
    """Plain steps win throughout: the neighbouring size is re-measured at 64, 192, 448, ...
    iterations (the interval doubling), not every 64."""
    p = BatchBlockPolicy(16, explore_every=64)
    probes = []
    for i in range(1000):
        L = p.choose([Acceptance.known(0.1)], 300, max_useful=64)
        p.observe(1, 300, L, 0.010 if L == 1 else 0.030)
        if L != 1 and i > 10:
            probes.append(i)
    assert 3 <= len(probes) <= 5
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert all(b > a for a, b in zip(gaps, gaps[1:]))


def test_a_busy_host_does_not_make_a_poor_draft_look_worth_running():
    """Timings on a loaded host: half the iterations of every size wait 4-20 ms for a CPU on top
    of their cost (1.5 ms a plain step, a 2-token block twice that). A draft that is never right
    still runs in at most a few probes of 120 iterations, in each of 200 seeded runs (a mean of
    timings let one slowed plain step make the block look cheaper, and then kept it chosen)."""
    import random

    worst = 0
    for seed in range(200):
        rng, p, row, drafted = random.Random(seed), BatchBlockPolicy(4), Acceptance((0.5,)), 0
        for _ in range(120):
            L = p.choose([row], 300, max_useful=64)
            p.observe(1, 300, L, 0.0015 * L + (rng.uniform(0.004, 0.020) if rng.random() < 0.5 else 0.0))
            if L > 1:
                drafted += 1
                row.observe(L - 1, 0)
        worst = max(worst, drafted)
    assert worst <= 4, worst


def test_the_least_recent_timing_is_the_cost_and_old_ones_age_out():
    from worker.engine.timings import RecentTimings

    t = RecentTimings(window=4, horizon=10)
    assert t.estimate() is None and len(t) == 0
    for tick, s in enumerate([0.009, 0.002, 0.015, 0.011]):
        t.add(tick, s)
    assert t.estimate() == 0.002 and len(t) == 4  # a slowed timing does not raise it
    t.add(4, 0.003)  # the window holds 4: the 0.009 is gone, the 0.002 still counts
    assert t.estimate() == 0.002
    t.add(13, 0.004)  # the 0.002 (tick 1) is more than 10 ticks before the newest
    assert t.estimate() == 0.003 and len(t) == 3
    with pytest.raises(ValueError):
        RecentTimings(window=0)


def test_the_decode_profile_keeps_costs_in_the_block_policys_buckets():
    """The plain-step costs a worker reports (`DecodeProfile`) and the costs the block policy
    chooses by are bucketed alike: one bucketing (`BatchBlockPolicy.key`), one context floor."""
    from worker.engine.block_policy import BatchBlockPolicy
    from worker.engine.profile import DecodeProfile

    for batch_size, context in ((1, 1), (3, 255), (5, 257), (8, 1000), (9, 5000)):
        profile = DecodeProfile()
        for _ in range(2):  # the first iteration of a bucket is warm-up
            profile.decode(batch_size, context, 1, 0.01)
        [entry] = profile.snapshot()
        assert (entry.batch_size, entry.context_tokens) == BatchBlockPolicy.key(batch_size, context)
