"""DFlash acceptance length tau inside the batched engine against one sequence, per prompt.

Per prompt, at one fixed block size, greedy:
  - one sequence   `worker.engine.one_sequence.decode` (what bench_dflash.py measures)
  - batch of 1     the batched functions of worker/engine/batch.py driven in-process (prefill,
                   `Batch.join`, `dflash_cycle`), the prompt alone in its batch
  - batch of N     all prompts in one batch (rows of different lengths); every iteration runs the
                   block size the longest-remaining row can use, as the worker's scheduler does
with tau (tokens per DFlash iteration, bonus included), the iterations whose draft blocks equal
the one-sequence run's at the same iteration (of those run at the same block size), and whether
each output equals plain greedy decoding. If the batched engine conditions each row's draft as
one sequence does, tau is the same in all three (up to the last iterations, where a row alone
shrinks its block to its remaining tokens).

Usage:
  python bench/bench_batch_tau.py --model Qwen2.5-Coder-0.5B-Instruct --draft dflash --prompts 3 --max-tokens 64
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
PROMPTS = ROOT / "bench" / "prompts" / "humaneval_heldout.jsonl"


def _runs(target, draft, prompts: list[list[int]], max_tokens: int, L: int, eos: set[int]) -> dict:
    """{"plain", "one", "batch1", "batchN"}: per prompt (tokens, [(block size, tokens kept, draft
    block)] per DFlash iteration)."""
    import worker.engine.batch as batch_mod
    from worker.caches.rows import RowKVCache, make_row_caches
    from worker.capture import HiddenCapture
    from worker.engine.batch import Batch, Row, dflash_cycle, prefill_chunk
    from worker.engine.one_sequence import decode
    from worker.sampling import greedy

    blocks: list = []
    real = batch_mod.draft_block

    def record(d, b, size):
        out = real(d, b, size)
        blocks.append(out.tolist())
        return out

    def one(p, with_draft):
        blocks.clear()
        toks, cycles = [], []
        for s in decode(target, p, max_tokens, greedy, eos, draft=draft if with_draft else None, block_size=L):
            toks += s.tokens
            if s.drafted:
                cycles.append((s.drafted + 1, len(s.tokens), blocks[len(cycles)][0]))
        return toks, cycles

    def batched(ps):
        blocks.clear()
        capture = HiddenCapture(target, draft.target_layer_ids)
        batch = Batch(make_row_caches(target, 0), [RowKVCache(0) for _ in draft.layers])
        rows, outs, cycles = [], [[] for _ in ps], [[] for _ in ps]
        for i, p in enumerate(ps):
            cache, dcache = make_row_caches(target, 1), [RowKVCache(1) for _ in draft.layers]
            prefill_chunk(target, p[:-1], cache, draft, dcache, capture)
            rows.append(Row(greedy, len(p), p[-1], str(i)))
            batch.join(rows[-1], cache, dcache)
        while batch.rows:
            useful = max(max_tokens - len(outs[int(r.request_id)]) for r in batch.rows)
            size = max(1, min(L, 1 << max(0, useful - 1).bit_length()))
            res = dflash_cycle(target, draft, capture, batch, size)
            done = []
            for k, r in enumerate(batch.rows):
                i = int(r.request_id)
                new, stop = r.commit(res.tokens[k], eos, max_tokens - len(outs[i]))
                outs[i] += new
                if size > 1:
                    cycles[i].append((size, len(new), blocks[-1][k]))
                if stop or len(outs[i]) >= max_tokens:
                    done.append(k)
            if done:
                batch.keep([k for k in range(batch.size) if k not in done])
        return list(zip(outs, cycles))

    batch_mod.draft_block = record
    try:
        return {"plain": [one(p, False) for p in prompts], "one": [one(p, True) for p in prompts],
                "batch1": [batched([p])[0] for p in prompts], "batchN": batched(prompts)}
    finally:
        batch_mod.draft_block = real


def tau(cycles: list) -> float:
    """Tokens per DFlash iteration (bonus included)."""
    return sum(k for _, k, _ in cycles) / len(cycles) if cycles else 0.0


def same_blocks(cycles: list, ref: list) -> tuple[int, int]:
    """(iterations whose draft block equals the reference's at the same iteration, iterations of
    both at the same block size)."""
    pairs = [(a, b) for a, b in zip(cycles, ref) if a[0] == b[0]]
    return sum(a[2] == b[2] for a, b in pairs), len(pairs)


def measure(model_dir: Path, draft_dir: Path, n_prompts: int, max_tokens: int, block: int | None) -> list[dict]:
    """One row per prompt: tau and iterations of each run, blocks equal to one sequence's, outputs
    equal to plain greedy."""
    from worker.fusion import fuse_projections
    from worker.loading import load_target
    from worker.models.dflash_checkpoint import load_dflash_draft
    from worker.training.data import read_prompt_files

    target, tok = load_target(model_dir)  # the dtype a worker computes in
    draft = load_dflash_draft(draft_dir, target)
    fuse_projections(target)
    fuse_projections(draft)
    texts = [r.text for r in read_prompt_files([PROMPTS])][:n_prompts]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                  tokenize=False)) if tok.chat_template else tok.encode(t)
               for t in texts]
    runs = _runs(target, draft, prompts, max_tokens, block or draft.block_size, set(tok.eos_token_ids))
    rows = []
    for i, p in enumerate(prompts):
        ref = runs["plain"][i][0]
        one = runs["one"][i]
        row = {"prompt": i, "prompt_tokens": len(p)}
        for name in ("one", "batch1", "batchN"):
            toks, cycles = runs[name][i]
            eq, n = same_blocks(cycles, one[1])
            row[name] = {"tau": tau(cycles), "iterations": len(cycles), "same_blocks": [eq, n],
                         "equals_plain": toks == ref}
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    head = ("| prompt | tokens | one sequence tau (iterations) | batch of 1 tau (its) | batch of N tau (its) "
            "| blocks = one sequence's (batch of 1 / of N) | output = plain greedy |")
    out = [head, "|" + "---|" * 7]
    for r in rows:
        cells = [f"{r[k]['tau']:.2f} ({r[k]['iterations']})" for k in ("one", "batch1", "batchN")]
        same = " / ".join(f"{r[k]['same_blocks'][0]}/{r[k]['same_blocks'][1]}" for k in ("batch1", "batchN"))
        plain = "yes" if all(r[k]["equals_plain"] for k in ("one", "batch1", "batchN")) else "NO"
        out.append(f"| {r['prompt']} | {r['prompt_tokens']} | " + " | ".join(cells) + f" | {same} | {plain} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="catalog name or model directory")
    p.add_argument("--draft", default="dflash", help="a DFlash draft directory, or 'dflash' for the shipped one")
    p.add_argument("--prompts", type=int, default=3, help="held-out HumanEval prompts (at most 8)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=None, help="fixed block size (default: the draft's)")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    a = p.parse_args(argv)
    from flashfleet.blas import restart_with_openblas
    from flashfleet.models import resolve_model
    from flashfleet.models.drafts import resolve_draft_arg

    restart_with_openblas()  # on a Linux CPU, the BLAS a worker computes with
    model_dir = Path(resolve_model(a.model))
    rows = measure(model_dir, Path(resolve_draft_arg(a.draft, a.model)), a.prompts, a.max_tokens, a.block_size)
    print(f"model {model_dir}; {a.max_tokens} tokens; greedy")
    print(format_table(rows))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
