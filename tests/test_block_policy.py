"""The batched DFlash block-size policy on simulated costs (no MLX)."""
from __future__ import annotations

import pytest

from worker.engine.block_policy import Acceptance, BatchBlockPolicy, expected_tokens


def run(policy: BatchBlockPolicy, cost, accept: list[float], iterations: int = 200, context: int = 300) -> dict:
    """Drives the policy for `iterations` with cost(L, B) seconds; returns how often each L ran."""
    seen: dict = {}
    for _ in range(iterations):
        L = policy.choose(accept, context, max_useful=64)
        policy.observe(len(accept), context, L, cost(L, len(accept)))
        seen[L] = seen.get(L, 0) + 1
    return seen


def test_expected_tokens():
    assert expected_tokens(0.0, 16) == 1.0
    assert expected_tokens(1.0, 8) == 8.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.5)


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
    assert a.rate > 0.95
    for _ in range(50):
        a.observe(15, 0)
    assert a.rate < 0.1


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
        L = p.choose([0.1], 300, max_useful=64)
        p.observe(1, 300, L, 0.010 if L == 1 else 0.030)
        if L != 1 and i > 10:
            probes.append(i)
    assert 3 <= len(probes) <= 5
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert all(b > a for a, b in zip(gaps, gaps[1:]))
