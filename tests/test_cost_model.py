"""The speculation cost model and the adaptive block-size policy (pure Python, no MLX)."""
from __future__ import annotations

import random

import pytest

from worker.spec.cost_model import AdaptiveBlockPolicy, CostModel

MS = 1e-3


def _model(costs_ms: dict[int, float], a: float, **kw) -> CostModel:
    """A CostModel with a fixed acceptance `a` (prior only) and the given measured costs."""
    m = CostModel(prior_acceptance=a, prior_weight=1e9, **kw)
    for b, c in costs_ms.items():
        for _ in range(2):  # the first measurement of each size is warm-up and dropped
            m.observe_cost(b, c * MS)
    return m


def test_expected_tokens_is_leviathan_formula():
    m = CostModel()
    assert m.expected_tokens(4, a=0.0) == 1.0
    assert m.expected_tokens(4, a=1.0) == 4.0
    assert m.expected_tokens(4, a=0.5) == pytest.approx(1.875)  # 1 + .5 + .25 + .125
    assert m.expected_tokens(1, a=0.9) == pytest.approx(1.0)  # plain decoding


def test_acceptance_mle_from_prefix_counts_and_decay():
    m = CostModel(prior_weight=0.0, decay=1.0)
    m.observe_cycle(drafted=3, accepted=3)  # 3 successes, no failure
    m.observe_cycle(drafted=3, accepted=1)  # 1 success, then a failure
    assert m.acceptance_rate == pytest.approx(4 / 5)
    m.observe_cycle(drafted=0, accepted=0)  # plain steps carry no acceptance information
    assert m.acceptance_rate == pytest.approx(4 / 5)
    d = CostModel(prior_weight=0.0, decay=0.5)
    for _ in range(20):
        d.observe_cycle(15, 15)
    for _ in range(20):
        d.observe_cycle(15, 0)
    assert d.acceptance_rate < 0.01  # the old, good cycles have faded


def test_costs_drop_warmup_and_interpolate():
    m = CostModel(cost_decay=0.0)
    m.observe_cost(4, 1.0)  # warm-up, dropped
    assert m.cycle_cost(4) is None and m.samples(4) == 0
    m.observe_cost(4, 4 * MS)
    m.observe_cost(16, 1.0)
    m.observe_cost(16, 16 * MS)
    assert m.cycle_cost(8) == pytest.approx(8 * MS)  # linear between measured sizes
    assert m.cycle_cost(2) == pytest.approx(4 * MS)  # flat below the smallest
    assert m.cycle_cost(1) is None  # plain is never extrapolated from speculative cycles


def test_h200_note_numbers():
    """H200 costs of a 1.5B target with a 5-layer draft (a decode step 6.41 ms, a 16-token cycle
    2.2 ms drafting + 7.0 ms verifying), tau = 4 at B = 16."""
    m = _model({1: 6.41, 16: 2.2 + 7.0}, a=0.5)
    a = next(x / 1000 for x in range(1, 1000) if m.expected_tokens(16, a=x / 1000) >= 4.0)
    m = _model({1: 6.41, 16: 2.2 + 7.0}, a=a)
    assert m.throughput(16) == pytest.approx(435, rel=0.01)
    assert m.throughput(1) == pytest.approx(156, rel=0.01)
    assert m.decide([1, 16]).block_size == 16


def test_decide_flat_verify_picks_largest_block():
    flat = {1: 6.4, 2: 9.0, 4: 9.0, 8: 9.1, 16: 9.2}  # GPU at short context
    assert _model(flat, a=0.8).decide([1, 2, 4, 8, 16]).block_size == 16


def test_decide_linear_verify_picks_small_block_or_plain():
    linear = {1: 10.0, 2: 12.0, 4: 22.0, 8: 42.0, 16: 82.0}  # CPU: verify grows with the block
    assert _model(linear, a=0.7).decide([1, 2, 4, 8, 16]).block_size == 2
    d = _model(linear, a=0.1).decide([1, 2, 4, 8, 16])
    assert d.block_size == 1 and d.tokens_per_s == d.plain_tokens_per_s == pytest.approx(100)


def test_min_gain_hysteresis():
    costs = {1: 10.0, 4: 20.0}
    a = 0.6  # E[n|4] = 2.176 -> 108.8 tok/s vs 100 plain: +8.8 %
    assert _model(costs, a=a, min_gain=1.05).decide([1, 4]).block_size == 4
    assert _model(costs, a=a, min_gain=1.10).decide([1, 4]).block_size == 1


def test_no_measurements_speculates_at_the_largest_size():
    d = CostModel().decide([1, 2, 8])
    assert d.block_size == 8 and d.tokens_per_s is None


def test_policy_explores_every_size_largest_first_then_settles():
    p = AdaptiveBlockPolicy(8, min_samples=1)
    assert p.candidates == [1, 2, 4, 8]
    order = []
    for _ in range(8):
        bs, timed = p.next_block_size()
        assert timed == (bs == 1)  # exploring runs cycles as they normally run (draft queued ahead)
        order.append(bs)
        p.observe(bs, bs - 1, bs - 1, 1 * MS)  # always fully accepted, constant cost
    assert order == [8, 8, 4, 4, 2, 2, 1, 1]
    assert p.next_block_size()[0] == 8


def test_policy_caps_candidates_at_the_draft_block():
    assert AdaptiveBlockPolicy(4, candidates=(2, 3, 16)).candidates == [1, 2, 3, 4]
    assert AdaptiveBlockPolicy(1).next_block_size() == (1, True)


def _simulate(policy, accept_p, cost_ms, cycles, rng):
    """Runs a synthetic session; returns the block sizes chosen."""
    chosen = []
    for _ in range(cycles):
        bs, timed = policy.next_block_size()
        k = bs - 1
        j = 0
        while j < k and rng.random() < accept_p:
            j += 1
        policy.observe(bs, k, j, None if timed and bs > 1 else cost_ms[bs] * MS)  # as dflash_generate feeds it
        chosen.append(bs)
    return chosen


def test_policy_falls_back_to_plain_and_comes_back():
    rng = random.Random(0)
    cost = {1: 10.0, 2: 11.0, 4: 11.5, 8: 12.0, 16: 13.0}  # verify nearly flat
    p = AdaptiveBlockPolicy(16, time_every=4, explore_every=50, probe_every=8)
    good = _simulate(p, 0.9, cost, 120, rng)
    assert good[-40:].count(16) >= 35  # high acceptance, flat cost: the full block
    bad = _simulate(p, 0.0, cost, 200, rng)  # the draft stops matching (e.g. a topic change)
    assert bad.index(1) < 100  # the ~20-cycle window forgets a long run of full blocks
    assert bad[-80:].count(1) >= 65  # mostly plain, with periodic speculative probes
    assert any(b > 1 for b in bad[-80:])
    back = _simulate(p, 0.9, cost, 200, rng)
    assert back[-40:].count(16) >= 35  # the probes noticed the draft is good again


# Measured on the H200: plain step 5.57 ms, DFlash cycles 9.0-9.8 ms (bf16 1.5B target).
H200_COST_MS = {1: 5.57, 2: 9.0, 4: 9.2, 8: 9.5, 16: 9.8}


@pytest.mark.parametrize("accept_p, most", [(0.565, "speculative"), (0.2, "plain")])
def test_policy_speculates_when_a_middling_draft_pays(accept_p, most):
    """At tau ~2.3 (p = 0.565) a fixed block of 16 beats plain decoding by 1.3x on those costs;
    the policy used to fall back to plain most of the time there (a 10-cycle acceptance window
    and a probe every 32 plain steps). At p = 0.2 speculation loses and plain must win."""
    plain_share = []
    for seed in range(4):
        rng = random.Random(seed)
        p = AdaptiveBlockPolicy(16)
        chosen = _simulate(p, accept_p, H200_COST_MS, 500, rng)
        plain_share.append(chosen[-400:].count(1) / 400)
    mean = sum(plain_share) / len(plain_share)
    assert mean < 0.3 if most == "speculative" else mean > 0.75


def test_policy_never_times_apart_with_time_every_zero():
    """time_every=0 (the worker without spec_timing_sync): every speculative cycle runs with its
    draft queued ahead; only plain steps (timed for free) say timed."""
    rng = random.Random(1)
    p = AdaptiveBlockPolicy(16, time_every=0)
    for _ in range(200):
        bs, timed = p.next_block_size()
        assert timed == (bs == 1)
        k = bs - 1
        j = next((i for i in range(k) if rng.random() > 0.8), k)
        p.observe(bs, k, j, H200_COST_MS[bs] * MS)


def test_block_policy_benchmark_prints_the_comparison(capsys):
    """bench/bench_block_policy.py (the simulation the docs quote) runs and ranks the settings."""
    bench = _bench_policy()
    assert bench.main(["--p", "0.565", "--seeds", "2", "--cycles", "300"]) == 0
    rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| 0.")}
    rate = {k: float(v.split("|")[2].split()[0]) for k, v in rows.items()}
    assert rate["0.9:8:0:1.5"] > rate["0.95:8"] > rate["0.9:32"]  # each policy change gained here


def test_policy_defaults_are_the_workers():
    p = AdaptiveBlockPolicy(16)
    assert p.time_every == 0  # cycles are timed apart only when the worker asks (spec_timing_sync)
    assert p.model.optimism == 1.5 and p.model.decay == 0.9


def test_cost_window_takes_the_median_of_recent_cycles():
    m = CostModel(cost_window=3)
    for s in (9.0, 1.0, 2.0, 100.0, 3.0):  # the first is the warm-up, dropped
        m.observe_cost(4, s)
    assert m.cycle_cost(4) == 3.0  # median of the last 3 (2, 100, 3): one outlier moves nothing
    ewma = CostModel()
    for s in (9.0, 1.0, 2.0, 100.0, 3.0):
        ewma.observe_cost(4, s)
    assert ewma.cycle_cost(4) > 20  # the default mean follows the outlier


def _bench_policy():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "bench_block_policy.py"
    spec = importlib.util.spec_from_file_location("bench_block_policy", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_trace_replay_maps_recorded_acceptance_to_any_block_size(tmp_path, capsys):
    import json

    bench = _bench_policy()
    s = bench.TraceSession([3, 0, 15, 2])  # cycles at positions 0, 4, 5, 21; 24 tokens
    assert s.length == 24
    assert [s.accepted(p, 16) for p in (0, 1, 3, 4, 5, 10, 20, 21)] == [3, 2, 0, 0, 15, 10, 0, 2]
    assert s.accepted(5, 4) == 3 and s.accepted(0, 2) == 1  # capped by the block

    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"draft": "d", "max_tokens": 24, "corpora": {"code": [[3, 0, 15, 2]] * 2}}))
    assert bench.main(["--trace", str(trace), "--seeds", "1", "--settings", "0.95:8"]) == 0
    rows = {line.split("|")[1].strip(): line.split("|")[2].split() for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and not line.startswith("| policy")}
    fixed, plain = rows["fixed B=16"], rows["plain"]
    assert float(fixed[1].strip("(,")) == pytest.approx(24 / 4)  # the recorded tau: 24 tokens in 4 cycles
    assert float(fixed[0]) == pytest.approx(48 / (8 * 9.8) * 1e3, rel=0.01)
    assert float(plain[0]) == pytest.approx(1e3 / 5.57, rel=0.01) and plain[2].strip(")") == "1.00"
    assert "adaptive 0.95:8" in rows


def test_noise_slows_every_policy_alike():
    import random

    bench = _bench_policy()
    rates = {}
    for kind in ("none", "spikes", "drift"):
        _, rates[kind] = bench.run(bench.FixedBlock(16), 0.5, 400, random.Random(0), bench.H200_COST_MS, 1.0,
                                   bench.Noise(kind, random.Random(1)))
    assert rates["none"] > rates["spikes"] and rates["none"] > rates["drift"]


def test_optimism_needs_evidence_before_plain_decoding():
    """Below break-even (a = 0.4 on H200-like costs: 170 tok/s against 1.05 x 180 for plain), a few
    cycles' evidence does not switch to plain decoding under optimism, many cycles' does, and
    without optimism a few suffice; a useless draft falls back whatever the optimism."""
    def model(optimism, cycles, pattern):
        m = CostModel(decay=1.0, prior_weight=0.0, optimism=optimism)
        for b, c in ((1, 5.57e-3), (16, 9.8e-3)):
            for _ in range(3):
                m.observe_cost(b, c)
        for i in range(cycles):
            m.observe_cycle(15, pattern[i % len(pattern)])
        return m

    assert CostModel(optimism=1.5, prior_weight=0.0).acceptance_bound() == 0.0  # no evidence: nothing added
    below = (1, 1, 0)  # 2 accepted per 3 rejections: a = 0.4
    assert model(0.0, 6, below).acceptance_rate == pytest.approx(0.4)
    assert model(0.0, 6, below).decide([1, 16]).block_size == 1
    assert model(1.5, 6, below).decide([1, 16]).block_size == 16
    assert model(1.5, 600, below).decide([1, 16]).block_size == 1
    for opt in (0.0, 1.5):
        assert model(opt, 20, (0,)).decide([1, 16]).block_size == 1  # nothing ever accepted


def test_cost_memory_lets_a_new_session_skip_exploring():
    """Costs a session keeps go to the worker's CostMemory (not its warm-up cycles); the next
    session's policy starts with them and picks its block from its first cycle on."""
    from worker.spec.cost_model import CostMemory

    memory = CostMemory()
    first = AdaptiveBlockPolicy(16, memory=memory)
    seen = []
    for _ in range(40):
        bs, timed = first.next_block_size()
        seen.append(bs)
        cost = {1: 5.57, 2: 9.0, 4: 9.2, 8: 9.5, 16: 9.8}[bs] * (10 if seen.count(bs) == 1 else 1)  # warm-ups slow
        first.observe(bs, bs - 1, min(bs - 1, 2), cost / 1e3)
    assert set(seen[:15]) == {1, 2, 4, 8, 16}  # a cold policy explores every size
    assert memory.costs_at()[16] == pytest.approx(9.8e-3) and memory.costs_at()[1] == pytest.approx(5.57e-3)  # no warm-up

    second = AdaptiveBlockPolicy(16, memory=memory)
    bs, _ = second.next_block_size()
    assert all(second.model.samples(b) >= second.min_samples for b in second.candidates)  # nothing to explore
    assert bs == second.decision.block_size and second.model.cycle_cost(16) == pytest.approx(9.8e-3)
    # The seeded session still drops its own first cycle at a size (it may hold a compile).
    bs, _ = second.next_block_size()
    second.observe(bs, bs - 1, 2, 0.5)  # a 500 ms first cycle: a kernel compile
    assert second.model.cycle_cost(bs) == pytest.approx(memory.costs_at()[bs]) and memory.costs_at()[bs] < 0.1
    second.observe(bs, bs - 1, 2, {1: 5.57, 2: 9.0, 4: 9.2, 8: 9.5, 16: 9.8}[bs] / 1e3)
    assert memory.costs_at()[bs] < 0.1  # the kept one went to the memory; the compile did not
    cold = AdaptiveBlockPolicy(16)
    assert cold.model.samples(16) == 0 and cold.next_block_size()[0] == 16  # explores, largest first


def test_cost_memory_keeps_costs_per_context_length():
    """Verify costs grow with the KV cache (H200: 16 tokens 7.0 ms at 512, 12.8 ms at 8K; a plain
    step 6.4 and 6.3): a session is seeded with the costs of its own context length, the nearest
    bucket that has a size standing in for one that has not."""
    from worker.spec.cost_model import CostMemory, context_bucket

    assert [context_bucket(n) for n in (0, 1, 512, 513, 1024, 1025, 8000)] == [512, 512, 512, 1024, 1024, 2048, 8192]
    memory = CostMemory(decay=0.5)
    memory.observe(16, 7.0e-3, 300)
    memory.observe(1, 6.4e-3, 300)
    memory.observe(16, 12.8e-3, 8000)
    memory.observe(16, 13.2e-3, 7000)  # the same bucket: a mean
    memory.observe(8, 9.7e-3, 8100)
    assert memory.costs_at(100) == {16: pytest.approx(7.0e-3), 1: pytest.approx(6.4e-3), 8: pytest.approx(9.7e-3)}
    assert memory.costs_at(8000) == {16: pytest.approx(13.0e-3), 8: pytest.approx(9.7e-3), 1: pytest.approx(6.4e-3)}
    # 2K is as far from 512 as from 8K in buckets (2 vs 2): the longer context, pessimistic, wins.
    assert memory.costs_at(2048)[16] == pytest.approx(13.0e-3) and memory.costs_at(1024)[16] == pytest.approx(7.0e-3)

    long = AdaptiveBlockPolicy(16, memory=memory, context_tokens=8000)
    short = AdaptiveBlockPolicy(16, memory=memory, context_tokens=200)
    assert long.model.cycle_cost(16) == pytest.approx(13.0e-3) and short.model.cycle_cost(16) == pytest.approx(7.0e-3)
    short.observe(16, 15, 15, 7.2e-3, context_tokens=600)  # its first cycle at 16: warm-up, not kept
    short.observe(16, 15, 15, 7.2e-3, context_tokens=600)
    assert memory.costs_at(600)[16] == pytest.approx(7.2e-3) and memory.costs_at(100)[16] == pytest.approx(7.0e-3)
    memory.clear()
    assert memory.costs_at(100) == {}


def test_short_generations_gain_from_the_cost_memory(capsys):
    bench = _bench_policy()
    assert bench.main(["--short", "30", "--p", "0.05", "0.65", "--seeds", "2"]) == 0
    rows = {line.split("|")[1].strip(): [float(x) for x in line.split("|")[2:-1]]
            for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "policy" not in line}
    assert all(m > c for m, c in zip(rows["cost memory"], rows["cold"]))
    assert rows["plain"][0] == round(1e3 / 5.57)  # printed as whole tokens/s


def test_compile_noise_charges_each_size_once_per_key_bucket(capsys):
    """`--noise compiles`: the first speculative cycle of a (block size, 256-position bucket) costs
    65 ms more, later ones and plain steps nothing; a fixed block pays once per bucket it enters,
    so it loses less than a policy that runs several sizes (the docs' table)."""
    import random

    bench = _bench_policy()
    n = bench.Noise("compiles", random.Random(0))
    assert n(9.8, 16) == pytest.approx(9.8 + bench.COMPILE_MS) and n(9.8, 16) == 9.8  # bucket of 216
    assert n(9.0, 2) == pytest.approx(9.0 + bench.COMPILE_MS) and n(5.57, 1) == 5.57  # another size; plain
    n.advance(bench.KEY_BUCKET)  # into the next bucket: compiled again
    assert n(9.8, 16) == pytest.approx(9.8 + bench.COMPILE_MS)

    _, clean = bench.run(bench.FixedBlock(16), 0.565, 600, random.Random(0), bench.H200_COST_MS, 1.0)
    _, noisy = bench.run(bench.FixedBlock(16), 0.565, 600, random.Random(0), bench.H200_COST_MS, 1.0,
                         bench.Noise("compiles", random.Random(0)))
    assert noisy < clean

    assert bench.main(["--noise", "compiles", "--p", "0.565", "--seeds", "2", "--settings", "0.9:8:0:1.5"]) == 0
    assert bench.main(["--noise", "compiles", "--p", "0.565", "--seeds", "2", "--settings", "0.9:8:0:1.5",
                       "--candidates", "16"]) == 0
    out = capsys.readouterr().out
    assert "candidates [16]" in out
    adaptive = [float(line.split("|")[2].split()[0]) for line in out.splitlines() if line.startswith("| 0.9:8:0:1.5")]
    fixed = [float(line.split("|")[2].split()[0]) for line in out.splitlines() if line.startswith("| fixed B=16")]
    assert len(adaptive) == 2 and adaptive[0] < fixed[0]  # the cold-process case the docs describe
