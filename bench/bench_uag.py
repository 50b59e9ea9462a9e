"""Benchmark cross-tokenizer speculative decoding (uag): naive vs context-aware translation.

For each corpus (code: humaneval.jsonl, English prose: enwiki_en.jsonl, Polish:
dataset_build_pl.jsonl from bench/prompts) and each draft, runs plain greedy decoding (the
baseline, same run) and uag greedy decoding with both translations, checks that every uag output
equals the plain output token for token, and prints a Markdown table: acceptance (accepted /
proposed target tokens), target tokens per round, tokens/s, speedup vs plain, the share of time
spent translating, and the draft tokens fed to re-sync the draft per round.

`--oracle` measures acceptance only, cheaply, over many prompts: the target's greedy output of
every prompt is computed once by plain decoding (cached in --refs) and the target is replaced by
an oracle whose argmax at each position is the next token of that output. Under greedy decoding a
uag run is fully determined by the target's greedy output (a proposal is accepted iff it equals
it; the first mismatch commits the output's token), so acceptance, tokens per round and the
draft's work are those of the real run, at the cost of the draft's forwards only. No timings.

Models are loaded as a worker loads them (`worker.loading.load_target`: float32 on a CPU), and on
a Linux CPU the script restarts itself with the workers' OpenBLAS preloaded (`flashfleet.blas`).

Usage:
    python bench/bench_uag.py --target Qwen2.5-Coder-0.5B-Instruct \
        --drafts SmolLM2-135M-Instruct Gemma-3-270M --prompts 2 --max-tokens 32 -k 3
    # acceptance only, 8 prompts per corpus (the first call per corpus fills the reference cache):
    ... python bench/bench_uag.py --oracle --drafts SmolLM2-135M-Instruct --prompts 8 \
        --max-tokens 48 -k 3 5
Model names are directories under ~/.cache/flashfleet/models (or absolute paths).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm import load  # noqa: E402

from worker.loading import compute_dtype, load_target, stored_dtype  # noqa: E402
from worker.sampling import greedy  # noqa: E402
from worker.decoding import plain  # noqa: E402
from worker.decoding.cross_tokenizer import byte_vocab, generate  # noqa: E402

MODELS = Path.home() / ".cache" / "flashfleet" / "models"
CASES = Path(__file__).resolve().parent / "prompts"
CORPORA = {"code": "humaneval.jsonl", "en": "enwiki_en.jsonl", "pl": "dataset_build_pl.jsonl"}
INSTRUCTION = {
    "code": "Complete this Python function:\n\n",
    "en": "Continue this text:\n\n",
    "pl": "Kontynuuj ten tekst:\n\n",
}
DEFAULT_REFS = Path.home() / ".cache" / "flashfleet" / "bench_uag_refs.json"


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


class ListCache:
    """A trimmable "cache" that only records the fed token ids (for `OracleLM`)."""

    def __init__(self):
        self.fed: list[int] = []
        self.state = mx.zeros((1,))

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(n, len(self.fed))
        if n:
            del self.fed[-n:]
        return n


class OracleLM:
    """The target under greedy decoding, replayed from its greedy output `ref`: the logits at a
    position whose generated prefix equals ref[:i] are one-hot on ref[i] (anything else gets
    token 0, a position the acceptance rule never reaches)."""

    def __init__(self, prompt_len: int, ref: list[int], vocab_size: int):
        self.prompt_len, self.ref, self.vocab_size = prompt_len, ref, vocab_size

    def __call__(self, x, cache):
        fed = cache[0].fed
        ids = x.reshape(-1).tolist()
        logits = np.zeros((1, len(ids), self.vocab_size), np.float32)
        for i, t in enumerate(ids):
            fed.append(t)
            gen = fed[self.prompt_len:]
            j = len(gen)
            if j < len(self.ref) and gen == self.ref[:j]:
                logits[0, i, self.ref[j]] = 1.0
        return mx.array(logits)


def reference_key(target: str, prompt: list[int], max_tokens: int, dtype: mx.Dtype,
                  env: dict | None = None) -> str:
    """The --refs cache key of one plain greedy output: the target's name, the prompt, max_tokens,
    and what the output depends on beyond them: the dtype the target computes in, the device and
    the preloaded BLAS (`LD_PRELOAD`'s first library; "default" without one). Outputs computed in
    another dtype or with another BLAS part at the first near tie, so they never stand in for
    each other.

    Args:
        target: the target's name or directory (its last path component is used).
        prompt: prompt token ids.
        max_tokens: tokens generated at most.
        dtype: the target's floating dtype as it computes (`worker.loading.stored_dtype` after
            the cast to the compute dtype).
        env: the environment to read `LD_PRELOAD` from (default os.environ).

    Returns:
        A sha256 hex digest.
    """
    import os

    env = os.environ if env is None else env
    blas = Path(env.get("LD_PRELOAD", "").split(":")[0]).name or "default"
    device = "gpu" if mx.default_device().type == mx.gpu else "cpu"
    return hashlib.sha256(json.dumps([Path(target).name, prompt, max_tokens, str(dtype), device, blas])
                          .encode()).hexdigest()


def reference_outputs(args, tm, tt, eos, ids: list[list[int]]) -> tuple[list[list[int]], float]:
    """Plain greedy outputs of the prompts (timed), taken from / added to the --refs cache in
    --oracle mode (`reference_key`: per dtype, device and BLAS); returns (outputs, seconds spent
    decoding)."""
    cache = {}
    path = Path(args.refs)
    if args.oracle and path.exists():
        cache = json.loads(path.read_text())
    outs, secs = [], 0.0
    for p in ids:
        key = reference_key(args.target, p, args.max_tokens, stored_dtype(tm))
        if key not in cache:
            out, _, s = run(lambda: plain.generate(p, args.max_tokens, greedy, eos, model=tm))
            cache[key] = out
            secs += s
            if args.oracle:  # saved at once: a long first run may be cut short
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(cache))
        outs.append(cache[key])
    return outs, secs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="Qwen2.5-Coder-0.5B-Instruct")
    ap.add_argument("--drafts", nargs="+", default=["SmolLM2-135M-Instruct", "Gemma-3-270M"])
    ap.add_argument("--corpora", nargs="+", default=list(CORPORA), choices=list(CORPORA))
    ap.add_argument("--prompts", type=int, default=2, help="prompts per corpus")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-prompt-chars", type=int, default=400)
    ap.add_argument("-k", "--num-draft-tokens", type=int, nargs="+", default=[3],
                    help="draft tokens per round (several values: one row each)")
    ap.add_argument("--modes", nargs="+", default=["naive", "context"], choices=["naive", "context"])
    ap.add_argument("--oracle", action="store_true",
                    help="acceptance only: replay the target's cached greedy output (no timings)")
    ap.add_argument("--refs", default=str(DEFAULT_REFS), help="reference-output cache (--oracle)")
    args = ap.parse_args()

    # --oracle: the target's weights are read only if a reference output is missing; cast lazily
    # to the dtype a worker computes in, as load_target does
    tm, tt = load(model_path(args.target), lazy=True)
    tm.set_dtype(compute_dtype(stored_dtype(tm)))
    if not args.oracle:
        mx.eval(tm.parameters())
    eos = set(tt.eos_token_ids)
    vocab_size = len(byte_vocab(tt).bytes_of)
    drafts = {}
    for name in args.drafts:
        dm, dt = load_target(model_path(name))
        byte_vocab(dt)
        drafts[name] = (dm, dt)
    if not args.oracle:  # warm-up (lazy set-up, first-call overheads)
        warm = tt.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
        list(plain.generate(warm, 2, greedy, eos, model=tm))
        for dm, dt in drafts.values():
            list(generate(warm, 3, greedy, eos, model=tm, tokenizer=tt, draft_model=dm, draft_tokenizer=dt))

    rows = []  # dicts, one per table row
    for corpus in args.corpora:
        texts = prompts(corpus, args.prompts, args.max_prompt_chars)
        ids = [tt.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]
        refs, base_s = reference_outputs(args, tm, tt, eos, ids)
        base_tps = sum(len(r) for r in refs) / base_s if base_s else None
        if not args.oracle:
            rows.append(dict(corpus=corpus, draft="plain", k="-", mode="-", tps=base_tps, eq="yes"))
            print(f"{corpus:5s} plain {base_tps:.2f} tok/s", flush=True)
        for name, (dm, dt) in drafts.items():
            for k in args.num_draft_tokens:
                for mode in args.modes:
                    tok = secs = prop = acc = rounds = tr = fed = 0
                    same = 0
                    for p, ref in zip(ids, refs):
                        if args.oracle:
                            kw = dict(model=OracleLM(len(p), ref, vocab_size), cache=[ListCache()])
                        else:
                            kw = dict(model=tm)
                        out, steps, s = run(lambda: generate(
                            p, args.max_tokens, greedy, eos, tokenizer=tt, draft_model=dm,
                            draft_tokenizer=dt, num_draft_tokens=k, translation=mode, **kw))
                        same += out == ref
                        tok += len(out)
                        secs += s
                        prop += sum(x.drafted for x in steps)
                        acc += sum(x.accepted for x in steps)
                        rounds += len(steps)
                        tr += sum(x.translate_s for x in steps)
                        fed += sum(x.resync_tokens for x in steps)
                    r = dict(corpus=corpus, draft=name, k=k, mode=mode, acc=acc, prop=prop,
                             tpr=tok / rounds, feed=fed / rounds, tr=tr / secs, eq=f"{same}/{len(ids)}")
                    if not args.oracle:
                        r.update(tps=tok / secs, sp=tok / secs / base_tps)
                    rows.append(r)
                    print(f"{corpus:5s} {name} k={k} {mode}: acceptance {acc / max(prop, 1):.3f} ({acc}/{prop}) "
                          f"tokens/round {tok / rounds:.2f} == plain {r['eq']}"
                          + ("" if args.oracle else f" {r['tps']:.2f} tok/s x{r['sp']:.2f}"), flush=True)

    print()
    if args.oracle:
        print("| corpus | draft | k | translation | acceptance (accepted/proposed) | tokens/round "
              "| re-sync feed/round | == greedy |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['corpus']} | {r['draft']} | {r['k']} | {r['mode']} | "
                  f"{r['acc'] / max(r['prop'], 1):.3f} ({r['acc']}/{r['prop']}) | {r['tpr']:.2f} | "
                  f"{r['feed']:.2f} | {r['eq']} |")
        return
    print("| corpus | draft | k | translation | acceptance | tokens/round | tokens/s | vs plain "
          "| translate time | == plain |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        fa = f"{r['acc'] / max(r['prop'], 1):.2f}" if "acc" in r else "-"
        ft = f"{r['tpr']:.2f}" if "tpr" in r else "1.00"
        fr = f"{100 * r['tr']:.1f}%" if "tr" in r else "-"
        print(f"| {r['corpus']} | {r['draft']} | {r['k']} | {r['mode']} | {fa} | {ft} | {r['tps']:.2f} | "
              f"{r.get('sp', 1.0):.2f}x | {fr} | {r['eq']} |")


if __name__ == "__main__":
    from flashfleet.blas import restart_with_openblas

    restart_with_openblas()
    main()
