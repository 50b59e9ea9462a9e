"""What verifying several candidate blocks in one target forward would add to DFlash's tau.

On the H200 a 1.5B target's verify is bound by per-operation overhead: 16 tokens cost about what
2 do (docs/benchmarks.md, "A cycle per block size"), so K candidate blocks verified together
(a batch of K rows sharing the KV cache's prefix) could cost little more than one. Whether that
pays depends on how often the draft's second choices are right where its first choice is wrong,
which this measures before anything is built: one ordinary greedy DFlash run per prompt, the
draft's top-4 tokens and probabilities at every block position recorded, then, per cycle, the
longest accepted prefix each candidate set would have had against the target's actual greedy
continuation (which a candidate matching up to position p shares with the run: greedy output is
a function of the prefix). Candidate sets of K blocks (each [b, d_1..d_15], d_i one of the
draft's top-4 at position i; K = 1 is the run itself):

  first     d_1 = the draft's i-th choice in block i, first choices elsewhere (Medusa's widest
            level: Cai et al. 2024, "Medusa", candidate trees)
  each      block 1 all first choices; block i (i >= 2) the second choice at position i-1
  joint     the K blocks of highest joint probability under the draft's per-position
            marginals (a heap over rank vectors; SpecInfer / Sequoia-style static selection)

tau here counts a cycle's accepted draft tokens + 1 and assumes the cycle boundaries of the run
(a longer acceptance would move the next cycle's start): a first-order estimate of the gain, to
decide whether batched verification is worth building, not a speed measurement.

    python bench/bench_branch_gain.py --target DIR --dflash-draft DIR --prompts 4 --max-tokens 128
"""
from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from bench.bench_dflash import CASES, DTYPES, load_model, read_prompts  # noqa: E402
from worker.models.dflash_checkpoint import load_dflash_draft  # noqa: E402
from worker.sampling import greedy  # noqa: E402
from worker.spec.dflash import dflash_generate  # noqa: E402

TOP = 4


class RecordingDraft:
    """A DFlash draft that records, per call, where its block starts (the draft context length
    after the call) and its top-4 target ids and probabilities at each drafted position."""

    def __init__(self, draft):
        self.draft, self.calls = draft, []

    def __getattr__(self, name):
        return getattr(self.draft, name)

    def __call__(self, inputs, target_hidden, cache):
        logits = self.draft(inputs, target_hidden, cache)
        probs = mx.softmax(logits[0].astype(mx.float32), axis=-1)
        idx = mx.argsort(-probs, axis=-1)[:, :TOP]
        p = mx.take_along_axis(probs, idx, axis=-1)
        ids = idx if self.draft.vocab is None else self.draft.vocab[idx]
        self.calls.append((cache[0].offset, ids.tolist(), p.tolist()))
        return logits


def accepted(block: list[int], truth: list[int]) -> int:
    n = 0
    while n < len(block) and n < len(truth) and block[n] == truth[n]:
        n += 1
    return n


def candidate_sets(ids: list[list[int]], probs: list[list[float]], k: int) -> dict[str, list[list[int]]]:
    """The K candidate blocks of each strategy (drafted positions only)."""
    n = len(ids)
    top1 = [r[0] for r in ids]
    first = [[ids[0][i]] + top1[1:] for i in range(min(k, TOP))]
    each = [top1] + [top1[:i] + [ids[i][1]] + top1[i + 1:] for i in range(min(k - 1, n))]
    # joint: best-first over rank vectors; a child raises one position's rank by one
    logp = [[math.log(max(p, 1e-30)) for p in row] for row in probs]
    start = (0,) * n
    heap, seen, joint = [(-sum(r[0] for r in logp), start)], {start}, []
    while heap and len(joint) < k:
        neg, ranks = heapq.heappop(heap)
        joint.append([ids[i][r] for i, r in enumerate(ranks)])
        for i in range(n):
            if ranks[i] + 1 < TOP:
                child = ranks[:i] + (ranks[i] + 1,) + ranks[i + 1:]
                if child not in seen:
                    seen.add(child)
                    heapq.heappush(heap, (neg + logp[i][ranks[i]] - logp[i][ranks[i] + 1], child))
    return {"first": first, "each": each, "joint": joint}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--dflash-draft", required=True)
    p.add_argument("--prompts", type=int, default=4, help="held-out prompts per corpus")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--corpora", nargs="+", default=["code", "en", "pl"])
    p.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    p.add_argument("--cases", type=Path, default=CASES)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args(argv)

    dtype = DTYPES.get(args.dtype)
    target, tokenizer = load_model(args.target, False, dtype)
    draft = load_dflash_draft(args.dflash_draft, target, dtype=dtype)
    prompts = read_prompts(tokenizer, args.prompts, args.max_prompt_tokens, args.cases)
    eos = set(tokenizer.eos_token_ids)
    result = {}
    print(f"{'corpus':7}{'K':>3}  {'strategy':9}{'tau':>7}{'gain':>8}  cycles")
    for corpus in args.corpora:
        sums = {}  # (strategy, K) -> total accepted+1
        cycles = 0
        for pr in prompts[corpus]:
            rec = RecordingDraft(draft)
            steps = list(dflash_generate(pr, args.max_tokens, greedy, eos, target=target, draft=rec))
            out = [t for s in steps for t in s.tokens]
            for offset, ids, probs in rec.calls:
                g = offset - len(pr)  # index in `out` of the block's first token
                truth = out[g + 1: g + 1 + len(ids)]
                if len(truth) < len(ids):
                    continue  # the run ended inside this block (max_tokens or EOS)
                cycles += 1
                base = accepted([r[0] for r in ids], truth)
                sums[("linear", 1)] = sums.get(("linear", 1), 0) + base + 1
                for k in args.ks:
                    for name, blocks in candidate_sets(ids, probs, k).items():
                        best = max(accepted(b, truth) for b in blocks)
                        sums[(name, k)] = sums.get((name, k), 0) + best + 1
        lin = sums[("linear", 1)] / cycles
        result[corpus] = {"cycles": cycles, "tau": {f"{n}:{k}": v / cycles for (n, k), v in sums.items()}}
        for (name, k), v in sorted(sums.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            print(f"{corpus:7}{k:>3}  {name:9}{v / cycles:7.3f}{v / cycles / lin:7.2f}x  {cycles}", flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
