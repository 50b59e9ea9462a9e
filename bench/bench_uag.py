"""Benchmark cross-tokenizer speculative decoding (uag): naive vs context-aware translation.

For each corpus (code: humaneval.jsonl, English prose: enwiki_en.jsonl, Polish:
dataset_build_pl.jsonl from /work/shared/cases) and each draft, runs plain greedy decoding (the
baseline, same run) and uag greedy decoding with both translations, checks that every uag output
equals the plain output token for token, and prints a Markdown table: acceptance (accepted /
proposed target tokens), target tokens per round, tokens/s, speedup vs plain, and the share of time
spent translating.

Usage (CPU, OpenBLAS preloaded):
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \
    python bench/bench_uag.py --target Qwen2.5-Coder-0.5B-Instruct \
        --drafts SmolLM2-135M-Instruct Gemma-3-270M --prompts 2 --max-tokens 32 -k 3
Model names are directories under ~/.cache/flashfleet/models (or absolute paths).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_lm import load  # noqa: E402

from worker.sampling import greedy  # noqa: E402
from worker.spec import plain  # noqa: E402
from worker.spec.cross_tokenizer import byte_vocab, generate  # noqa: E402

MODELS = Path.home() / ".cache" / "flashfleet" / "models"
CASES = Path("/work/shared/cases")
CORPORA = {"code": "humaneval.jsonl", "en": "enwiki_en.jsonl", "pl": "dataset_build_pl.jsonl"}
INSTRUCTION = {
    "code": "Complete this Python function:\n\n",
    "en": "Continue this text:\n\n",
    "pl": "Kontynuuj ten tekst:\n\n",
}


def model_path(name: str) -> str:
    p = Path(name)
    return str(p if p.is_absolute() else MODELS / name)


def prompts(corpus: str, n: int, max_chars: int) -> list[str]:
    with (CASES / CORPORA[corpus]).open(encoding="utf-8") as f:
        rows = [json.loads(line)["prompt"] for _, line in zip(range(n), f)]
    return [INSTRUCTION[corpus] + r[:max_chars] for r in rows]


def run(fn) -> tuple[list[int], list, float]:
    start = time.perf_counter()
    steps = [s for s in fn() if s.tokens]  # drop prefill chunks
    return [t for s in steps for t in s.tokens], steps, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="Qwen2.5-Coder-0.5B-Instruct")
    ap.add_argument("--drafts", nargs="+", default=["SmolLM2-135M-Instruct", "Gemma-3-270M"])
    ap.add_argument("--corpora", nargs="+", default=list(CORPORA), choices=list(CORPORA))
    ap.add_argument("--prompts", type=int, default=2, help="prompts per corpus")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-prompt-chars", type=int, default=400)
    ap.add_argument("-k", "--num-draft-tokens", type=int, default=3)
    args = ap.parse_args()

    tm, tt = load(model_path(args.target))
    eos = set(tt.eos_token_ids)
    byte_vocab(tt)
    drafts = {}
    for name in args.drafts:
        dm, dt = load(model_path(name))
        byte_vocab(dt)
        drafts[name] = (dm, dt)
    # warm-up (lazy set-up, first-call overheads)
    warm = tt.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    list(plain.generate(warm, 2, greedy, eos, model=tm))
    for dm, dt in drafts.values():
        list(generate(warm, 3, greedy, eos, model=tm, tokenizer=tt, draft_model=dm, draft_tokenizer=dt))

    rows = []
    for corpus in args.corpora:
        texts = prompts(corpus, args.prompts, args.max_prompt_chars)
        ids = [tt.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]
        base_tok = base_s = 0.0
        refs = []
        for p in ids:
            out, _, s = run(lambda: plain.generate(p, args.max_tokens, greedy, eos, model=tm))
            refs.append(out)
            base_tok += len(out)
            base_s += s
        base_tps = base_tok / base_s
        rows.append((corpus, "plain", "-", None, None, base_tps, 1.0, None, True))
        print(f"{corpus:5s} plain {base_tps:.2f} tok/s", flush=True)
        for name, (dm, dt) in drafts.items():
            for mode in ("naive", "context"):
                tok = secs = prop = acc = rounds = tr = 0.0
                same = True
                for p, ref in zip(ids, refs):
                    out, steps, s = run(lambda: generate(
                        p, args.max_tokens, greedy, eos, model=tm, tokenizer=tt, draft_model=dm,
                        draft_tokenizer=dt, num_draft_tokens=args.num_draft_tokens, translation=mode))
                    same &= out == ref
                    tok += len(out)
                    secs += s
                    prop += sum(x.drafted for x in steps)
                    acc += sum(x.accepted for x in steps)
                    rounds += len(steps)
                    tr += sum(x.translate_s for x in steps)
                tps = tok / secs
                rows.append((corpus, name, mode, acc / prop if prop else 0.0, tok / rounds, tps,
                             tps / base_tps, tr / secs, same))
                print(f"{corpus:5s} {name} {mode}: acc {acc / max(prop, 1):.2f} {tps:.2f} tok/s "
                      f"x{tps / base_tps:.2f} same={same}", flush=True)

    print()
    print("| corpus | draft | translation | acceptance | tokens/round | tokens/s | vs plain | translate time | == plain |")
    print("|---|---|---|---|---|---|---|---|---|")
    for corpus, name, mode, a, tpr, tps, sp, trs, same in rows:
        fa = "-" if a is None else f"{a:.2f}"
        ft = "1.00" if tpr is None else f"{tpr:.2f}"
        fr = "-" if trs is None else f"{100 * trs:.1f}%"
        print(f"| {corpus} | {name} | {mode} | {fa} | {ft} | {tps:.2f} | {sp:.2f}x | {fr} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
