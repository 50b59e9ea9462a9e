"""Decode speed of one session on the worker's path against plain mlx-lm, on held-out prompts.

Methods, greedy, the same --max-tokens, per prompt:
  plain mlx-lm   mlx_lm.stream_generate: the baseline a user would pick (the speedup's divisor)
  ours plain     worker.engine.one_sequence.decode without a draft: the batched engine's plain
                 step for a batch of one
  ours dflash    worker.engine.one_sequence.decode with the DFlash draft (--dflash-draft, or a
                 random one of --dflash-random-layers layers), every cycle at one block size
                 (--block-size, default the draft's)

Ours run on a second copy of the target prepared as a worker loads it (fused projections,
worker/fusion.py; `worker.small_gemm` where MLX's CUDA backend has it), plain mlx-lm on mlx-lm's
own layers. Prompts: --prompts rows of each corpus in --cases (default bench/prompts; code:
humaneval.jsonl, en: enwiki_en.jsonl, pl: dataset_build_pl.jsonl), by default the held-out rows
of `flashfleet draft train` (`split_heldout`: a trained draft never saw them), each a user turn
in the target's chat template (`--raw`: the text as is), cut to --max-prompt-tokens. The
tokenizer's EOS ends a generation.

Tok/s is generation only: tokens after each prompt's first step (one token for mlx-lm, one
iteration for ours) over the time from the end of that step to the end of the last, summed over
the corpus's prompts (prefill left out). One untimed warm-up of every method comes first. With
--rounds N every method runs N times in a new order each round; tok/s is then the median over
rounds, the speedup the median of the rounds' ratios to plain mlx-lm. tau = tokens per DFlash
cycle (bonus included; a last step of one token drafts nothing and is no cycle). "same" counts prompts whose output equals plain mlx-lm's token for token
(in bf16 a batched verify can round a near-tie differently; the first differing position is
listed in --json-out).

Runs on MLX's CPU build and its CUDA build (no Metal-only calls).

    python bench/bench_dflash.py --target ~/.cache/flashfleet/models/SmolLM2-135M-Instruct \\
        --dflash-random-layers 2 --max-tokens 64 --prompts 2
    python bench/bench_dflash.py --target Q1.5B --dflash-draft DFLASH_DIR --rounds 3
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from mlx_lm import load, stream_generate  # noqa: E402

from worker.engine.one_sequence import decode  # noqa: E402
from worker.models.dflash_checkpoint import init_dflash_draft, load_dflash_draft  # noqa: E402
from worker.sampling import greedy  # noqa: E402

CASES = Path(__file__).resolve().parent / "prompts"
CORPORA = {"code": "humaneval.jsonl", "en": "enwiki_en.jsonl", "pl": "dataset_build_pl.jsonl"}
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
BASELINE = "plain mlx-lm"


def load_model(path: str, random_weights: bool, dtype, tokenizer: bool = True):
    """mlx_lm.load, or (random_weights) the config's architecture with random weights + tokenizer
    (None with tokenizer=False: a directory holding only config.json is enough), cast to `dtype`;
    None: the dtype a worker computes in on this device (`worker.loading.compute_dtype`: float32
    on a CPU, the stored 16-bit dtype on a GPU), so every method runs as a worker would."""
    from worker.loading import compute_dtype, stored_dtype

    if random_weights:
        from mlx_lm.utils import _get_classes, load_config, load_tokenizer

        config = load_config(Path(path))
        model_cls, args_cls = _get_classes(config)
        model = model_cls(args_cls.from_dict(config))
        tokenizer = load_tokenizer(Path(path), eos_token_ids=config.get("eos_token_id")) if tokenizer else None
    else:
        model, tokenizer = load(path)
    model.set_dtype(dtype or compute_dtype(stored_dtype(model)))
    mx.eval(model.parameters())
    return model, tokenizer


def as_worker_loads(model) -> str:
    """Prepares `model` as a worker does after loading (fused projections; small_gemm on CUDA);
    returns a one-line account."""
    from worker import small_gemm
    from worker.fusion import fuse_projections

    said = f"fused {fuse_projections(model)} projection groups"
    if small_gemm.available():
        said += f"; small gemm on {small_gemm.use_small_gemm(model)} linears"
    return said


def read_prompts(tokenizer, n: int, max_prompt_tokens: int, cases: Path, prompt_set: str = "heldout",
                 chat: bool = True) -> dict[str, list[list[int]]]:
    """Token ids of n prompts per corpus: held-out rows (as `flashfleet draft train` splits them:
    8 per corpus, 10 %, among the first 450 rows) or the first rows; chat-templated or raw."""
    from worker.training.data import encode_prompt, read_prompt_files, split_heldout

    out = {}
    for name, file in CORPORA.items():
        rows = read_prompt_files([cases / file], max_per_file=450)
        if prompt_set == "heldout":
            rows = split_heldout(rows, 8, 0.1)[1]
        out[name] = [encode_prompt(tokenizer, r.text, max_prompt_tokens) if chat
                     else tokenizer.encode(r.text)[:max_prompt_tokens] for r in rows[:n]]
    return out


def run_mlx_lm(model, tokenizer, prompt, max_tokens) -> tuple[list[int], list[tuple[float, int, int]]]:
    """Plain greedy stream_generate: (tokens, one step per token: (arrival time, 1, drafted 0))."""
    tokens, steps = [], []
    for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, sampler=greedy):
        tokens.append(r.token)
        steps.append((time.perf_counter(), 1, 0))
    return tokens, steps


def run_ours(target, prompt, max_tokens, eos, draft=None, block_size=None):
    """`one_sequence.decode`: (tokens, per step (end time, tokens committed, tokens drafted))."""
    tokens, steps = [], []
    for s in decode(target, prompt, max_tokens, greedy, eos, draft=draft, block_size=block_size):
        tokens.extend(s.tokens)
        steps.append((time.perf_counter(), len(s.tokens), s.drafted))
    return tokens, steps


def first_diff(a: list[int], b: list[int]) -> int | None:
    """The first position where a and b differ (or where the shorter ends), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def measure(methods: dict, prompts: dict[str, list[list[int]]], rounds: int, seed: int = 0) -> dict:
    """Runs every method on every corpus's prompts `rounds` times (the first round in the listed
    order, later ones shuffled); returns {(method, corpus): [per round {"tokens", "seconds" (after
    each prompt's first step), "cycles", "cycle_tokens" (steps that drafted, and the tokens they
    committed), "outputs"}]}."""
    order = list(methods)
    rng = random.Random(seed)
    runs: dict = {}
    for r in range(rounds):
        if r:
            rng.shuffle(order)
        for corpus, prs in prompts.items():
            for name in order:
                n = secs = cyc = cyc_tokens = 0
                outs = []
                for pr in prs:
                    toks, steps = methods[name](pr)
                    outs.append(toks)
                    if len(steps) > 1:  # generation only: from the end of the first step
                        n += sum(k for _, k, _ in steps[1:])
                        secs += steps[-1][0] - steps[0][0]
                    cyc += sum(1 for _, _, d in steps if d)
                    cyc_tokens += sum(k for _, k, d in steps if d)
                runs.setdefault((name, corpus), []).append(
                    dict(tokens=n, seconds=secs, cycles=cyc, cycle_tokens=cyc_tokens, outputs=outs))
                print(f"  round {r + 1} {corpus:5s} {name} done", file=sys.stderr, flush=True)
    return runs


def summarize(runs: dict, methods: list[str], corpora: list[str]) -> list[dict]:
    """One row per (corpus, method): median tok/s, median speedup over the rounds' ratios to plain
    mlx-lm (with its range), tau, and prompts whose output equals plain mlx-lm's."""
    rows = []
    for corpus in corpora:
        base = runs[BASELINE, corpus]
        for name in methods:
            rounds = runs[name, corpus]
            tps = [r["tokens"] / r["seconds"] if r["seconds"] else 0.0 for r in rounds]
            ratios = [t / (b["tokens"] / b["seconds"]) if b["seconds"] and b["tokens"] else 0.0
                      for t, b in zip(tps, base)]
            cyc = sum(r["cycles"] for r in rounds)
            diffs = [first_diff(o, b) for o, b in zip(rounds[-1]["outputs"], base[-1]["outputs"])]
            rows.append(dict(corpus=corpus, method=name, tps=statistics.median(tps), rounds_tps=tps,
                             speedup=statistics.median(ratios), speedup_range=[min(ratios), max(ratios)],
                             tau=sum(r["cycle_tokens"] for r in rounds) / cyc if cyc else None,
                             same=sum(d is None for d in diffs), n=len(diffs), first_diffs=diffs))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="mlx-lm model directory (with --random-weights: config + tokenizer)")
    p.add_argument("--dflash-draft", default=None, help="DFlash draft directory")
    p.add_argument("--dflash-random-layers", type=int, default=0,
                   help="without --dflash-draft: an untrained random draft of N layers (per-cycle cost, tau near 1)")
    p.add_argument("--block-size", type=int, default=None, help="DFlash block size (default: the draft's)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompts", type=int, default=8, help="prompts per corpus")
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--dtype", choices=sorted(DTYPES), help="cast the models' weights (default: the dtype a worker computes in here)")
    p.add_argument("--random-weights", action="store_true",
                   help="random weights in the shape of --target (only its config and tokenizer are read)")
    p.add_argument("--rounds", type=int, default=1, help="measure every method this many times (median)")
    p.add_argument("--cases", type=Path, default=CASES)
    p.add_argument("--prompt-set", choices=("heldout", "first"), default="heldout")
    p.add_argument("--raw", action="store_true", help="raw prompt text instead of the chat template")
    p.add_argument("--json-out", type=Path, default=None, help="also write the results as JSON")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds: at least 1")
    if args.max_tokens < 2:
        p.error("--max-tokens: at least 2 (the first step is not timed)")
    if args.block_size is not None and args.block_size < 1:
        p.error("--block-size: at least 1")

    print(f"device: {mx.default_device()}  mlx {mx.__version__}", flush=True)
    mx.random.seed(0)
    dtype = DTYPES.get(args.dtype)
    target, tokenizer = load_model(args.target, args.random_weights, dtype)
    ours = load_model(args.target, args.random_weights, dtype, tokenizer=False)[0]
    if args.random_weights:
        ours.update(target.parameters())
    print(f"ours: {as_worker_loads(ours)}", flush=True)
    draft = None
    if args.dflash_draft:
        # the target's dtype, as a worker loads a draft, unless --dtype says otherwise
        draft = load_dflash_draft(args.dflash_draft, ours, **({"dtype": dtype} if dtype else {}))
        dname = f"ours dflash {Path(args.dflash_draft).name}"[:28]
    elif args.dflash_random_layers:
        draft = init_dflash_draft(ours, num_layers=args.dflash_random_layers, block_size=args.block_size or 16,
                                  tokenizer_vocab_size=len(tokenizer.vocab))
        dname = f"ours dflash random x{args.dflash_random_layers}"
    if draft is not None:
        from worker import small_gemm

        if small_gemm.available():  # as the worker loads a DFlash draft
            small_gemm.use_small_gemm(draft)
    eos = set(tokenizer.eos_token_ids)
    prompts = read_prompts(tokenizer, args.prompts, args.max_prompt_tokens, args.cases, args.prompt_set,
                           chat=not args.raw)
    M, B = args.max_tokens, args.block_size or (draft.block_size if draft is not None else None)
    methods = {BASELINE: lambda pr: run_mlx_lm(target, tokenizer, pr, M),
               "ours plain": lambda pr: run_ours(ours, pr, M, eos)}
    if draft is not None:
        methods[dname] = lambda pr: run_ours(ours, pr, M, eos, draft, B)

    warm = [pr for prs in prompts.values() for pr in prs[:1]]
    for name, fn in methods.items():  # kernels and allocations, untimed
        for pr in warm:
            fn(pr)
    runs = measure(methods, prompts, args.rounds)
    rows = summarize(runs, list(methods), list(prompts))

    print(f"\n{M} tokens, greedy, {args.prompts} prompts a corpus" + (f", block size {B}" if B else "")
          + (f"; {args.rounds} rounds: tok/s is the median, the speedup the median of the rounds' ratios"
             if args.rounds > 1 else ""))
    print(f"{'corpus':6s} {'method':28s} {'tok/s':>8s} {'speedup':>8s} {'range':>11s} {'tau':>6s} {'same':>6s}")
    for r in rows:
        lo, hi = r["speedup_range"]
        tau = f"{r['tau']:.2f}" if r["tau"] is not None else "-"
        print(f"{r['corpus']:6s} {r['method']:28s} {r['tps']:8.1f} {r['speedup']:7.2f}x "
              f"{f'{lo:.2f}-{hi:.2f}':>11s} {tau:>6s} {r['same']:>3d}/{r['n']}")
    if args.json_out:
        args.json_out.write_text(json.dumps(dict(
            device=str(mx.default_device()), mlx=mx.__version__, target=args.target, max_tokens=M, block_size=B,
            rounds=args.rounds, results=rows), indent=1))
    return 0


if __name__ == "__main__":
    from flashfleet.blas import restart_with_openblas

    restart_with_openblas()  # on a Linux CPU, the BLAS a worker computes with
    sys.exit(main())
