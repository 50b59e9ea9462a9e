"""Records DFlash acceptance per cycle on real prompts, for replaying it elsewhere.

Runs greedy DFlash with a fixed block (the draft's B) over held-out prompts (as
`bench_dflash.py` picks them) and writes, per corpus and prompt, the accepted drafts of every
cycle (0..B-1; tau = mean + 1). Acceptance does not depend on the device (up to bf16 near-ties),
so a trace recorded on a CPU in float32 replays the real, correlated acceptance of a draft in
`bench_block_policy.py --trace` against a GPU's measured cycle costs:

    python bench/record_acceptance.py --target MODEL_DIR --dflash-draft DRAFT_DIR \
        [--prompts 3] [--max-tokens 128] --out trace.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    from bench.bench_dflash import CASES, greedy, load_model, read_prompts
    from worker.models.dflash_checkpoint import load_dflash_draft
    from worker.spec.dflash import dflash_generate

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--dflash-draft", required=True)
    ap.add_argument("--prompts", type=int, default=3, help="held-out prompts per corpus")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--cases", type=Path, default=CASES)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.prompts < 1 or a.max_tokens < 1:
        ap.error("--prompts and --max-tokens: at least 1")

    target, tokenizer = load_model(a.target, False, None)
    draft = load_dflash_draft(a.dflash_draft, target)
    prompts = read_prompts(tokenizer, a.prompts, a.max_prompt_tokens, a.cases)
    eos = set(tokenizer.eos_token_ids)
    trace = {"target": a.target, "draft": a.dflash_draft, "block_size": draft.block_size,
             "max_tokens": a.max_tokens, "corpora": {}}
    for corpus, rows in prompts.items():
        runs = trace["corpora"][corpus] = []
        for pr in rows:
            t0 = time.perf_counter()
            steps = [s for s in dflash_generate(pr, a.max_tokens, greedy, eos, target=target, draft=draft)
                     if s.drafted]
            runs.append([s.accepted for s in steps])
            tau = sum(runs[-1]) / len(runs[-1]) + 1 if runs[-1] else float("nan")
            print(f"  {corpus:5s} prompt {len(runs)}: {len(steps)} cycles, tau {tau:.2f}, "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    a.out.write_text(json.dumps(trace))
    for corpus, runs in trace["corpora"].items():
        acc = [j for r in runs for j in r]
        print(f"{corpus:5s} {len(runs)} prompts, {len(acc)} cycles, tau {sum(acc) / max(1, len(acc)) + 1:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
