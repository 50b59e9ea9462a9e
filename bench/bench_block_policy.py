"""Simulated DFlash sessions: the adaptive block-size policy against a fixed block and plain decoding.

Each cycle's acceptance is geometric with probability p per drafted position (Leviathan et al.
2023's model, as `worker/spec/cost_model.py` assumes); cycle costs per block size are given (by
default costs measured on the H200 for the 1.5B target: plain step 5.57 ms, cycles 9.0-9.8 ms
for B = 2-16). A cycle the policy times apart (extra sync, no draft queued ahead) costs `--timed-cost`
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
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.spec.cost_model import AdaptiveBlockPolicy, CostMemory, CostModel  # noqa: E402

H200_COST_MS = {1: 5.57, 2: 9.0, 4: 9.2, 8: 9.5, 16: 9.8}
# The same at 8K tokens of context, derived, not measured as whole cycles: the verify part (cycle
# less a 2.0 ms draft, assumed unchanged) scaled by the 8K/512 forward-time ratios measured on
# the H200 for the 1.5B target (L=1 0.98, 2 1.28, 4 1.66, 8 1.33, 16 1.84; one run each).
H200_LONG_COST_MS = {1: 5.46, 2: 11.0, 4: 14.0, 8: 12.0, 16: 16.3}
LONG_CONTEXT = 8192


def policy_from_spec(spec: str, block_size: int = 16, memory: Optional[CostMemory] = None,
                     candidates=None) -> AdaptiveBlockPolicy:
    """A policy from DECAY:PROBE_EVERY[:COST_WINDOW[:OPTIMISM]] (the settings this script and
    `bench_dflash.py --policy` take; the CostModel's other arguments at their defaults).

    Raises:
        ValueError: not 2 to 4 fields, decay outside (0, 1], probe < 1, a negative or non-integer
            window, a negative optimism.
    """
    parts = spec.split(":")
    if not 2 <= len(parts) <= 4 or (len(parts) > 2 and not parts[2].isdigit()):
        raise ValueError(spec)
    decay, probe = float(parts[0]), int(parts[1])
    optimism = float(parts[3]) if len(parts) > 3 else 0.0
    if not 0 < decay <= 1 or probe < 1 or optimism < 0:
        raise ValueError(spec)
    model = CostModel(decay=decay, cost_window=int(parts[2]) if len(parts) > 2 else 0, optimism=optimism)
    return AdaptiveBlockPolicy(block_size, candidates, model=model, probe_every=probe, memory=memory)


COMPILE_MS = 65.0  # a multi-token attention's kernel for a new key length, H200 (PaddedKVCache's docstring)
KEY_BUCKET = 256  # PaddedKVCache.step: the key length a verify sees changes once per this many positions
PROMPT_TOKENS = 200  # where the simulated session's context starts, for the "compiles" noise


class Noise:
    """A cycle's cost with noise, `noise(cost_ms, block_size)` -> ms: "none"; "spikes" (one cycle
    in 10 costs 1.8x, independently); "drift" (the machine alternates between normal and 1.6x
    slower periods of about 100 cycles, every block size alike); "compiles" (the first
    speculative cycle of each block size in each 256-position key bucket of a growing context
    costs `COMPILE_MS` more, as MLX's CUDA attention compiles per key length; plain steps do
    not). The first two are hypothetical shapes: the H200 runs showed cells of 60 forwards moving
    by up to 84% between repeats, not their form. `advance(n)`
    moves the context on by the n tokens a cycle committed."""

    def __init__(self, kind: str, rng: random.Random):
        self.kind, self.rng, self.slow = kind, rng, False
        self.position, self.compiled = PROMPT_TOKENS, set()

    def __call__(self, cost_ms: float, block_size: int = 0) -> float:
        if self.kind == "spikes":
            return cost_ms * (1.8 if self.rng.random() < 0.1 else 1.0)
        if self.kind == "drift":
            if self.rng.random() < 0.01:
                self.slow = not self.slow
            return cost_ms * (1.6 if self.slow else 1.0)
        if self.kind == "compiles" and block_size > 1:
            key = (block_size, -(-(self.position + block_size) // KEY_BUCKET))
            if key not in self.compiled:
                self.compiled.add(key)
                return cost_ms + COMPILE_MS
        return cost_ms

    def advance(self, tokens: int) -> None:
        self.position += tokens


class FixedBlock:
    """The policy interface with one block size, never timed apart (the fixed and plain rows)."""

    def __init__(self, block_size: int):
        self.block_size = block_size

    def next_block_size(self) -> tuple[int, bool]:
        return self.block_size, False

    def observe(self, *_args) -> None:
        pass


def run(policy: AdaptiveBlockPolicy, p: float, cycles: int, rng: random.Random, cost_ms: dict,
        timed_cost: float, noise: Noise | None = None, context: int = 0) -> tuple[list[int], float]:
    """Runs `cycles` cycles at `context` tokens of context (what the policy is told, for its cost
    memory); returns the block sizes chosen and the tokens/s over them."""
    chosen, tokens, ms = [], 0, 0.0
    for _ in range(cycles):
        bs, timed = policy.next_block_size()
        k = bs - 1
        j = next((i for i in range(k) if rng.random() >= p), k)
        apart = timed and bs > 1
        cost = noise(cost_ms[bs], bs) if noise else cost_ms[bs]
        if noise:
            noise.advance(j + 1)
        policy.observe(bs, k, j, None if apart else cost / 1e3, context)
        chosen.append(bs)
        tokens += j + 1
        ms += cost * (timed_cost if apart else 1.0)
    return chosen, tokens / ms * 1e3 if ms else 0.0


class TraceSession:
    """A real generation's acceptance, replayed at any block size (from a JSON trace: per corpus and
    prompt, the accepted drafts of every fixed-block cycle).

    The trace holds the accepted drafts of each fixed-block cycle; a cycle starting at position
    P with j accepted means the draft matched positions P+1..P+j. A cycle of block B starting at
    a position p inside such a run is taken to accept min(B-1, P+j-p) drafts, one starting where
    a recorded cycle started accepts min(B-1, j): exact for the recorded starts, an estimate
    inside a run (a later start sees more context and may match longer). A block starting at a
    recorded bonus position is given the matches of nothing before the next recorded start, which
    is pessimistic when the recorded cycle accepted its whole block. The generation ends at
    `max_tokens` (the recording's last cycles may have verified past it)."""

    def __init__(self, accepted: list[int], max_tokens: Optional[int] = None):
        self.run_end = {}  # start position -> last matched position
        pos = 0
        for j in accepted:
            self.run_end[pos] = pos + j
            pos += j + 1
        self.length = pos if max_tokens is None else min(pos, max_tokens)
        self.starts = sorted(self.run_end)

    def accepted(self, pos: int, block_size: int) -> int:
        from bisect import bisect_right

        start = self.starts[bisect_right(self.starts, pos) - 1]
        return max(0, min(block_size - 1, self.run_end[start] - pos))


def replay(policy, session: TraceSession, cost_ms: dict, timed_cost: float, noise: "Noise | None" = None
           ) -> tuple[int, float, int, int]:
    """Runs one recorded generation to its end under `policy`; returns (tokens, ms, cycles, plain steps)."""
    pos, ms, cycles, plain = 0, 0.0, 0, 0
    while pos < session.length:
        bs, timed = policy.next_block_size()
        j = session.accepted(pos, bs) if bs > 1 else 0
        j = min(j, session.length - pos - 1)  # the last cycle ends at the generation's end
        apart = timed and bs > 1
        cost = noise(cost_ms[bs], bs) if noise else cost_ms[bs]
        if noise:
            noise.advance(j + 1)
        policy.observe(bs, bs - 1, j, None if apart else cost / 1e3)
        pos += j + 1
        ms += cost * (timed_cost if apart else 1.0)
        cycles += 1
        plain += bs == 1
    return pos, ms, cycles, plain


def trace_table(a, path: Path) -> None:
    """Per corpus of a recorded trace: tokens/s of each setting, the fixed block and plain decoding,
    a fresh policy per generation (as the worker makes one per request)."""
    import json

    trace = json.loads(Path(path).read_text())
    cost = H200_COST_MS
    corpora = trace["corpora"]
    print(f"trace {path} (draft {trace.get('draft')}, {trace.get('max_tokens')} tokens per generation); "
          f"costs ms {cost}; noise {a.noise}; {a.seeds} noise seeds")
    print("| policy | " + " | ".join(f"{c} tok/s (tau, plain share)" for c in corpora) + " |")
    print("|---" * (len(corpora) + 1) + "|")
    rows = [(f"adaptive {s}", s) for s in a.settings] + [("fixed B=16", 16), ("plain", 1)]
    for name, setting in rows:
        cells = []
        for runs in corpora.values():
            tok = ms = cyc = pl = 0
            for seed in range(a.seeds):
                for k, acc in enumerate(runs):
                    if isinstance(setting, int):
                        policy = FixedBlock(setting)
                    else:
                        policy = policy_from_spec(setting)
                    n = Noise(a.noise, random.Random(1000 * seed + k))
                    t, m, c, p = replay(policy, TraceSession(acc, trace.get("max_tokens")), cost, a.timed_cost, n)
                    tok, ms, cyc, pl = tok + t, ms + m, cyc + c, pl + p
            spec = cyc - pl
            tau = (tok - pl) / spec if spec else 1.0
            cells.append(f"{tok / ms * 1e3:.0f} ({tau:.2f}, {pl / cyc:.2f})")
        print(f"| {name} | " + " | ".join(cells) + " |")


def short_table(a) -> None:
    """Generations of `a.short` cycles, each under a fresh policy (as the worker makes one per
    request): cold, or sharing one `CostMemory` across a seed's generations (the first ones left
    out of the measurement), against the fixed block and plain decoding, per p. With `a.mixed`,
    generations alternate between short context (`H200_COST_MS`) and 8K (`H200_LONG_COST_MS`),
    and the memory is shared either blind to context (every cost in one bucket) or per context
    length (as the worker does)."""
    gens = 20
    kinds = [(H200_COST_MS, 0), (H200_LONG_COST_MS, LONG_CONTEXT)] if a.mixed else [(H200_COST_MS, 0)]
    print(f"{a.short}-cycle generations, a fresh default policy each; costs ms {kinds[0][0]}"
          + (f" and, every other generation, at {LONG_CONTEXT} tokens of context {kinds[1][0]}" if a.mixed else "")
          + f"; noise {a.noise}; {a.seeds} seeds x {gens} generations")
    names = (("cold", "cost memory, blind to context", "cost memory per context", "fixed B=16", "fixed B=8", "plain")
             if a.mixed else ("cold", "cost memory", "fixed B=16", "plain"))
    cols = [(p, k) for p in a.p for k in range(len(kinds))]
    print("| policy | " + " | ".join(f"p={p}" + (" short" if k == 0 else " 8K") * bool(a.mixed) + " tok/s"
                                     for p, k in cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name in names:
        cells = []
        for p, kind in cols:
            rates = []
            for seed in range(a.seeds):
                rng, noise, memory = random.Random(seed), Noise(a.noise, random.Random(1000 + seed)), CostMemory()
                for g in range(gens):
                    cost, context = kinds[g % len(kinds)]
                    told = 0 if "blind" in name else context
                    policy = (FixedBlock(16) if name == "fixed B=16" else FixedBlock(8) if name == "fixed B=8"
                              else FixedBlock(1) if name == "plain" else
                              AdaptiveBlockPolicy(16, memory=None if name == "cold" else memory, context_tokens=told))
                    _, rate = run(policy, p, a.short, rng, cost, a.timed_cost, noise, told)
                    if g >= len(kinds) and g % len(kinds) == kind:  # the first ones fill the memory
                        rates.append(rate)
            cells.append(f"{sum(rates) / len(rates):.0f}")  # mean over generations
        print(f"| {name} | " + " | ".join(cells) + " |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", nargs="+", default=["0.9:32", "0.95:8", "0.9:8:0:1.5"],
                    help="DECAY:PROBE_EVERY[:COST_WINDOW[:OPTIMISM]] (0.9:8:0:1.5 is the worker's; "
                         "COST_WINDOW n > 0: costs are the median of the last n cycles, else a mean; "
                         "OPTIMISM z: plain decoding only when speculation loses at acceptance + z standard errors)")
    ap.add_argument("--noise", choices=("none", "spikes", "drift", "compiles"), default="none",
                    help="cycle-cost noise (class Noise); the fixed block and plain rows get the same")
    ap.add_argument("--candidates", type=int, nargs="+", default=None,
                    help="block sizes the policies choose among (default the worker's: 2 4 8 16; 1 and 16 always)")
    ap.add_argument("--p", type=float, nargs="+", default=[0.2, 0.45, 0.565, 0.65])
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=100, help="cycles before measuring")
    ap.add_argument("--cycles", type=int, default=500, help="cycles measured")
    ap.add_argument("--timed-cost", type=float, default=1.28, help="cost of a cycle timed apart (H200: 12.5/9.8)")
    ap.add_argument("--short", type=int, default=0, metavar="N",
                    help="short generations of N cycles, fresh policy each: cold vs a shared CostMemory")
    ap.add_argument("--mixed", action="store_true",
                    help="with --short: alternate short- and long-context generations (cost memory per context)")
    ap.add_argument("--trace", type=Path, default=None,
                    help="replay real acceptance from a JSON trace (corpus -> prompt -> accepted drafts per cycle) "
                         "instead of geometric p")
    a = ap.parse_args(argv)
    if a.short:
        short_table(a)
        return 0
    if a.trace:
        trace_table(a, a.trace)
        return 0
    cost = H200_COST_MS
    print(f"costs ms {cost}; noise {a.noise}; {a.seeds} seeds, {a.cycles} cycles measured after {a.warmup}"
          + (f"; candidates {a.candidates}" if a.candidates else ""))
    print("| decay:probe[:window] | " + " | ".join(f"p={p} tok/s (plain share)" for p in a.p)
          + " | cycles to plain after a collapse |")
    print("|---" * (len(a.p) + 2) + "|")

    def measure(make, p: float) -> tuple[float, float]:
        rates, plain = [], []
        for seed in range(a.seeds):
            rng, policy = random.Random(seed), make()
            noise = Noise(a.noise, random.Random(1000 + seed))
            run(policy, p, a.warmup, rng, cost, a.timed_cost, noise)
            chosen, rate = run(policy, p, a.cycles, rng, cost, a.timed_cost, noise)
            rates.append(rate)
            plain.append(chosen.count(1) / len(chosen))
        return sum(rates) / a.seeds, sum(plain) / a.seeds

    for setting in a.settings:
        def make(setting=setting) -> AdaptiveBlockPolicy:
            return policy_from_spec(setting, candidates=a.candidates)
        cells = [f"{r:.0f} ({share:.2f})" for r, share in (measure(make, p) for p in a.p)]
        lags = []
        for seed in range(a.seeds):
            rng, policy = random.Random(seed), make()
            run(policy, 0.9, 120, rng, cost, a.timed_cost)
            chosen, _ = run(policy, 0.0, 200, rng, cost, a.timed_cost)
            lags.append(next((i for i in range(len(chosen) - 10) if chosen[i:i + 10].count(1) >= 7), len(chosen)))
        print(f"| {setting} | " + " | ".join(cells) + f" | {sum(lags) / len(lags):.0f} |")
    for name, B in (("fixed B=16", 16), ("plain", 1)):
        print(f"| {name} | " + " | ".join(f"{measure(lambda B=B: FixedBlock(B), p)[0]:.0f}" for p in a.p) + " | - |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
