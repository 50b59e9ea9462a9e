"""Simulated DFlash sessions: the adaptive block-size policy against a fixed block and plain decoding.

Each cycle's acceptance is geometric with probability p per drafted position (Leviathan et al.
2023's model, as `worker/spec/cost_model.py` assumes); cycle costs per block size are given (by
default the fifth H200 session's: plain step 5.57 ms, cycles 9.0-9.8 ms for B = 2-16, 1.5B
target). A cycle the policy times apart (extra sync, no draft queued ahead) costs `--timed-cost`
times more and reports no cost, as `dflash_generate` does. Prints tokens/s per policy setting
(acceptance decay, plain-mode probe interval) and p, the share of plain steps, and how many cycles
the policy takes to turn to plain decoding after acceptance collapses from 0.9 to 0:

    python bench/bench_block_policy.py [--settings 0.9:32 0.95:8 --p 0.2 0.45 0.565 0.65 --seeds 6]

Plain Python (no MLX); a second or two.
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.spec.cost_model import AdaptiveBlockPolicy, CostModel  # noqa: E402

H200_COST_MS = {1: 5.57, 2: 9.0, 4: 9.2, 8: 9.5, 16: 9.8}


def run(policy: AdaptiveBlockPolicy, p: float, cycles: int, rng: random.Random, cost_ms: dict,
        timed_cost: float) -> tuple[list[int], float]:
    """Runs `cycles` cycles; returns the block sizes chosen and the tokens/s over them."""
    chosen, tokens, ms = [], 0, 0.0
    for _ in range(cycles):
        bs, timed = policy.next_block_size()
        k = bs - 1
        j = next((i for i in range(k) if rng.random() >= p), k)
        apart = timed and bs > 1
        policy.observe(bs, k, j, None if apart else cost_ms[bs] / 1e3)
        chosen.append(bs)
        tokens += j + 1
        ms += cost_ms[bs] * (timed_cost if apart else 1.0)
    return chosen, tokens / ms * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", nargs="+", default=["0.9:32", "0.95:8"],
                    help="DECAY:PROBE_EVERY pairs (0.9:32 was the policy before 2026-12-01, 0.95:8 after)")
    ap.add_argument("--p", type=float, nargs="+", default=[0.2, 0.45, 0.565, 0.65])
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=100, help="cycles before measuring")
    ap.add_argument("--cycles", type=int, default=500, help="cycles measured")
    ap.add_argument("--timed-cost", type=float, default=1.28, help="cost of a cycle timed apart (H200: 12.5/9.8)")
    a = ap.parse_args(argv)
    cost = H200_COST_MS
    print(f"costs ms {cost}; {a.seeds} seeds, {a.cycles} cycles measured after {a.warmup}")
    print("| decay:probe | " + " | ".join(f"p={p} tok/s (plain share)" for p in a.p) + " | cycles to plain after a collapse |")
    print("|---" * (len(a.p) + 2) + "|")
    for setting in a.settings:
        decay, probe = float(setting.split(":")[0]), int(setting.split(":")[1])

        def make() -> AdaptiveBlockPolicy:
            return AdaptiveBlockPolicy(16, model=CostModel(decay=decay), probe_every=probe)
        cells = []
        for p in a.p:
            rates, plain = [], []
            for seed in range(a.seeds):
                rng, policy = random.Random(seed), make()
                run(policy, p, a.warmup, rng, cost, a.timed_cost)
                chosen, rate = run(policy, p, a.cycles, rng, cost, a.timed_cost)
                rates.append(rate)
                plain.append(chosen.count(1) / len(chosen))
            cells.append(f"{sum(rates) / a.seeds:.0f} ({sum(plain) / a.seeds:.2f})")
        lags = []
        for seed in range(a.seeds):
            rng, policy = random.Random(seed), make()
            run(policy, 0.9, 120, rng, cost, a.timed_cost)
            chosen, _ = run(policy, 0.0, 200, rng, cost, a.timed_cost)
            lags.append(next((i for i in range(len(chosen) - 10) if chosen[i:i + 10].count(1) >= 7), len(chosen)))
        print(f"| {setting} | " + " | ".join(cells) + f" | {sum(lags) / len(lags):.0f} |")
    fixed = " | ".join(f"{(1 - p ** 16) / (1 - p) / cost[16] * 1e3:.0f}" for p in a.p)
    print(f"| fixed B=16 | {fixed} | - |")
    print(f"| plain | " + " | ".join(f"{1e3 / cost[1]:.0f}" for _ in a.p) + " | - |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
