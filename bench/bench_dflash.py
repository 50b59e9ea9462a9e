"""Decode speed of DFlash against plain and draft-model decoding, on one target and real prompts.

Methods (each one skipped when its inputs are missing):
  plain mlx-lm     mlx_lm.stream_generate (the baseline of the speedup column)
  spec mlx-lm      mlx_lm.stream_generate(draft_model=..., num_draft_tokens=k)      needs --draft
  ours draft       worker.spec.draft_model.generate                                  needs --draft
  ours plain       worker.spec.plain.generate
  ours dflash      worker.spec.dflash.dflash_generate     needs --dflash-draft or --dflash-random-layers
  ... adaptive     the same with the worker's cost model (AdaptiveBlockPolicy and one
                   CostMemory across the method's generations, as a worker's requests)   needs --adaptive
  ... pol SPEC     the same under other cost-model settings                          needs --policy
  ... fused        ours plain and each fixed-block DFlash method again, on a second copy of the
                   target whose q/k/v and gate/up projections are fused (worker/fusion.py, what
                   the worker loads by default)                                      needs --fuse
  ... queued       each fixed-block DFlash method again, fused, with `queue_taps` (the verify's
                   tapped layers handed to the device as their graph is built)   needs --fuse --queue-taps
  ... compiled     each fixed-block DFlash method again, fused, with `compile_target` (every verify
                   and plain step one compiled graph: worker/compiled_forward.py); ours plain
                   compiled; with --adaptive also "adapt compiled" (the cost model, compiled)
                                                                                 needs --fuse --compile
  ... rowsK        each DFlash method verifying K candidate blocks per cycle (`branches`), compiled,
                   fixed block and with --adaptive the cost model        needs --compile-draft --branches K
  ... compiled+draft  each compiled method again with the draft's forward compiled as well
                   (`compile_draft`: worker/compiled_draft.py); with --adaptive "adapt comp+draft"
                                                                   needs --fuse --compile --compile-draft
  ... sg           each compiled-draft method (compiled+draft, adapt comp+draft, rowsK, adapt rowsK)
                   again on a third copy of the
                   target (and a second copy of each draft) whose linear layers of a few rows run
                   `worker.small_gemm` (one kernel node a call instead of cuBLAS; CUDA only)
                                                        needs --compile-draft --small-gemm
  ... sg a         each ' sg' row again with the attention of its compiled forwards on
                   `worker.small_attention` (one kernel a layer instead of cuDNN's SDPA)
                                                        needs --small-gemm --small-attention
  ... ser          each method with the compiled draft (compiled+draft, adapt comp+draft, rowsK)
                   again in the serial order, `overlap_draft=False`: the next draft launched after
                   the verdict is read back                                  needs --serial too
  z-lab dflash     dflash.model_mlx.stream_generate (registry package `dflash` 0.1.0, z-lab)
                                                        --packages zlab, and a DFlash draft
  dflash-mlx       dflash_mlx.runtime.stream_dflash_generate, fixed block (verify_mode "dflash";
                   registry package `dflash-mlx` 0.1.8, bstnxbt)  --packages dflash-mlx, and a draft

The two packages (--packages) run the first unquantized --dflash-draft directory (else the first
one; else the random draft, saved to a temporary directory), each on its own freshly loaded
target, after all our methods are measured (they patch the target model or its attention class);
a package that cannot be imported, cannot load the draft or fails its warm-up is skipped with a
one-line reason (printed, and in --json-out). They are imported only with --packages.

Prompts: --prompts rows of each corpus in --cases (default bench/prompts; code: humaneval.jsonl, en:
enwiki_en.jsonl, pl: dataset_build_pl.jsonl). By default the held-out rows of `flashfleet draft
train` (same split: `split_heldout`, 8 per corpus, 10 %), so a trained draft is measured on
prompts it never saw, each as a user turn in the target's chat template (`--raw` for raw text,
`--prompt-set first` for the first rows); truncated to --max-prompt-tokens. Greedy decoding, the
tokenizer's EOS ends a generation.

Tokens/s is generation only and steady state: tokens committed after the first cycle divided by
the time from the end of the first cycle to the end of the last (this leaves out prefill and
treats bursty speculative methods like token-by-token ones). tau = tokens per cycle (bonus
included). `--rounds N` measures every method N times, in a new shuffled order each round after
the first: tok/s is then the median of the rounds and the speedup the median of each round's
ratio to plain mlx-lm in that round, printed with its range (on the H200 one ratio moved from
0.83x to 1.22x between two identical runs of the 1.5B target). "same" counts prompts whose output equals plain mlx-lm's token for token (the fewest
over the rounds); otherwise
the first differing position is shown (a batched verify in bf16 can round a near-tie differently).

Then, for DFlash, the per-cycle time of the runs is compared with a draft forward and a verify
forward measured alone (each timed over repeated calls at the first prompt's context; for the
fixed-block ' sg' and ' sg a' rows on their own copies, the latter with the small-attention mark
on): a cycle within 1.3x of their sum spends little beyond the two forwards.

Runs on MLX's CPU build and its CUDA build (no Metal-only calls). On CUDA, MLX compiles its
multi-query attention kernel for every new key length (~65 ms each on the H200, cuDNN on or
off); DFlash avoids it with `PaddedKVCache` (worker/models/dflash.py), while mlx-lm's own
speculative decoding, which verifies over a plain KVCache, pays it on every cycle there.

Examples:

    python bench/bench_dflash.py --target ~/.cache/flashfleet/models/SmolLM2-135M-Instruct \\
        --dflash-random-layers 2 --max-tokens 64 --prompts 2
    python bench/bench_dflash.py --target Q1.5B --draft Q0.5B --dflash-draft DFLASH_DIR
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from mlx_lm import load, stream_generate  # noqa: E402

from worker.capture import HiddenCapture  # noqa: E402
from worker.compiled_draft import shared_compiled_draft  # noqa: E402
from worker.compiled_forward import shared_compiled_target  # noqa: E402
from worker.models.dflash import PaddedKVCache  # noqa: E402
from worker.models.dflash_checkpoint import (  # noqa: E402
    init_dflash_draft, load_dflash_draft, save_dflash_draft)
from worker.sampling import greedy  # noqa: E402
from worker.spec import plain  # noqa: E402
from worker.spec.dflash import dflash_generate, make_target_cache  # noqa: E402

CASES = Path(__file__).resolve().parent / "prompts"
CORPORA = {"code": "humaneval.jsonl", "en": "enwiki_en.jsonl", "pl": "dataset_build_pl.jsonl"}
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
PACKAGES = ("zlab", "dflash-mlx")  # registry packages (--packages), run in this order: see main()


def load_model(path: str, random_weights: bool, dtype, tokenizer: bool = True):
    """mlx_lm.load, or (random_weights) the config's architecture with random weights + tokenizer
    (None with tokenizer=False: a directory holding only config.json is enough)."""
    if random_weights:
        from mlx_lm.utils import _get_classes, load_config, load_tokenizer

        config = load_config(Path(path))
        model_cls, args_cls = _get_classes(config)
        model = model_cls(args_cls.from_dict(config))
        tokenizer = load_tokenizer(Path(path), eos_token_ids=config.get("eos_token_id")) if tokenizer else None
    else:
        model, tokenizer = load(path)
    if dtype is not None:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model, tokenizer


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
        rows = rows[:n]
        out[name] = [encode_prompt(tokenizer, r.text, max_prompt_tokens) if chat
                     else tokenizer.encode(r.text)[:max_prompt_tokens] for r in rows]
    return out


def run_steps(gen) -> tuple[list[int], list[tuple[float, int, int]]]:
    """Drains a Step generator; returns (tokens, [(time at the end of the cycle, tokens, block
    size)]), the block size being drafted + 1 (1 for a plain step)."""
    tokens, cycles = [], []
    for s in gen:
        if not s.tokens:  # a prefill chunk (worker.spec.plain.prefill_steps)
            continue
        tokens.extend(s.tokens)
        cycles.append((time.perf_counter(), len(s.tokens), s.drafted + 1))
    return tokens, cycles


def run_mlx_lm(model, tokenizer, prompt, max_tokens, **kw):
    """stream_generate, grouped into cycles (a cycle ends at a token the target chose itself).

    Every response carries one new token; the last one (finish_reason set) carries the final token
    (the max_tokens-th, or the EOS), as our generators yield it.
    """
    tokens, cycles, n = [], [], 0
    for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, sampler=greedy, **kw):
        tokens.append(r.token)
        n += 1
        if not getattr(r, "from_draft", False):
            cycles.append((time.perf_counter(), n))
            n = 0
    if n:
        cycles.append((time.perf_counter(), n))
    return tokens, cycles


class AggregatedRuns(dict):
    """(method, corpus) -> the rounds of `measure` combined: tok/s is the median of the rounds',
    tau, cycles and seconds are over all rounds, `same`/`diffs` are those of the round with the
    fewest outputs equal to plain mlx-lm's, and `rounds_tps` lists every round's tok/s."""

    def __init__(self, runs: dict):
        super().__init__()
        self.runs = runs
        for key, rounds in runs.items():
            toks, cyc = sum(r["toks"] for r in rounds), sum(r["cycles"] for r in rounds)
            worst = min(rounds, key=lambda r: r["same"])
            blocks = sum((Counter(r["blocks"]) for r in rounds), Counter())
            self[key] = dict(tps=statistics.median(r["tps"] for r in rounds), tau=toks / cyc if cyc else 0.0,
                             cycles=cyc, secs=sum(r["secs"] for r in rounds), same=worst["same"],
                             n=worst["n"], diffs=worst["diffs"], rounds_tps=[r["tps"] for r in rounds],
                             blocks=dict(sorted(blocks.items(), reverse=True)))

    def ratios(self, name: str, corpus: str) -> list[float]:
        """Each round's tok/s over plain mlx-lm's in the same round. A method measured in fewer
        rounds (the registry packages, measured after all rounds) pairs with plain mlx-lm's last
        rounds, the nearest in time."""
        mine, base = self.runs[name, corpus], self.runs["plain mlx-lm", corpus]
        return [r["tps"] / b["tps"] if b["tps"] else 0.0 for r, b in zip(mine, base[len(base) - len(mine):])]


def steady_rate(cycles: list[tuple]) -> tuple[float, int, float]:
    """(tokens after the first cycle, number of those cycles, seconds they took); a cycle is
    (end time, tokens[, block size])."""
    if len(cycles) < 2:
        return 0, 0, 0.0
    return sum(c[1] for c in cycles[1:]), len(cycles) - 1, cycles[-1][0] - cycles[0][0]


def block_histogram(cycles: list[tuple]) -> Counter:
    """Cycles per block size, over the same cycles as `steady_rate` (the first left out); empty
    for methods whose cycles carry no block size."""
    return Counter(c[2] for c in cycles[1:] if len(c) > 2)


def first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def time_alone(fn, reps: int) -> float:
    fn()  # warm-up
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def per_cycle_alone(target, draft, prompt: list[int], block: int, reps: int,
                    compiled: bool = False, compiled_draft: bool = False) -> tuple[float, float]:
    """Seconds of one draft forward and one verify forward (block tokens), each alone (block 1:
    no draft, 0.0, and the verify is a plain decoding step); `compiled`: the verify through the
    target's shared `CompiledTarget`, as `dflash_generate(compile_target=True)` runs it;
    `compiled_draft`: the draft through its shared `CompiledDraft` (`compile_draft=True`)."""
    tc = make_target_cache(target)
    cap = HiddenCapture(target, draft.target_layer_ids)
    with cap:
        target(mx.array([prompt]), cache=tc)
    taps = cap.hidden()
    dc = draft.make_cache()
    draft.extend_context(taps[:, :-1], dc)
    mx.eval(taps, [c.state for c in tc], [c.state for c in dc])
    block_ids = mx.array([[prompt[-1]] + [draft.mask_token_id] * (block - 1)], dtype=mx.uint32)
    x = mx.array([(prompt * block)[-block:]], dtype=mx.uint32)
    one_tap = taps[:, -1:]

    dfwd = shared_compiled_draft(draft) if compiled_draft else None

    def draft_fwd():  # injects one context position, as a cycle with one accepted token does
        d = dfwd(block_ids, one_tap, dc) if dfwd is not None else draft.draft_tokens(draft(block_ids, one_tap, dc)[0])
        mx.eval(d)
        for c in dc:
            c.trim(1)

    fwd = shared_compiled_target(target, draft.target_layer_ids) if compiled else None

    def verify_fwd():
        if fwd is not None:
            logits, taps = fwd(x, tc)
        else:
            with cap:
                logits = target(x, cache=tc)
            taps = cap.hidden()
        t = greedy(logits[0])
        mx.eval(t, taps)
        for c in tc:
            c.trim(block)

    # block 1 is a plain step: nothing to draft
    return (time_alone(draft_fwd, reps) if block > 1 else 0.0), time_alone(verify_fwd, reps)


def one_line(e: BaseException, limit: int = 300) -> str:
    s = " ".join(f"{type(e).__name__}: {e}".split())
    return s if len(s) <= limit else s[:limit - 3] + "..."


def draft_config(path: str) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def package_draft_dir(dirs: list[str], random_draft, tmp: list) -> str | None:
    """The draft directory the packages run: the first --dflash-draft without `quantization` in
    its config.json, else the first one; else the random draft saved to a temporary directory
    (appended to `tmp`, cleaned up by the caller); None without any DFlash draft."""
    for d in dirs:
        if "quantization" not in draft_config(d):
            return d
    if dirs:
        return dirs[0]
    if random_draft is None:
        return None
    tmp.append(tempfile.TemporaryDirectory(prefix="bench_dflash_draft_"))
    save_dflash_draft(random_draft, tmp[-1].name)
    return tmp[-1].name


def load_zlab(target, tokenizer, draft_dir: str, block: int, max_tokens: int, dtype):
    """z-lab `dflash` (dflash.model_mlx) on `target`, which must be its own instance: its
    stream_generate hooks the target's layers in place (_patch_model) for the taps.
    Returns run(prompt) -> (tokens, cycles); one yielded response = one cycle (one verify)."""
    import dflash.model_mlx as zl

    # load_draft passes its argument to huggingface_hub.snapshot_download (model_mlx.py:431), which
    # accepts only Hub ids and rejects a local directory (HFValidationError), even offline. Our
    # drafts are local directories: resolve existing directories to themselves, Hub ids as before.
    if not getattr(zl, "_bench_local_dirs", False):
        hub = zl.snapshot_download
        zl.snapshot_download = lambda repo_id, **kw: repo_id if Path(repo_id).is_dir() else hub(repo_id, **kw)
        zl._bench_local_dirs = True
    draft = zl.load_draft(draft_dir)
    if dtype is not None:
        draft.set_dtype(dtype)
        mx.eval(draft.parameters())

    def run(prompt):
        tokens, cycles = [], []
        for r in zl.stream_generate(target, draft, tokenizer, prompt, block_size=block, max_tokens=max_tokens,
                                    temperature=0.0):
            if r.tokens:
                tokens.extend(r.tokens)
                cycles.append((time.perf_counter(), len(r.tokens)))
        return tokens, cycles

    return run


def load_dflash_mlx(target_path: str, draft_dir: str, block: int, max_tokens: int, eos: set[int], dtype,
                    params=None, stats: dict | None = None):
    """bstnxbt `dflash-mlx` with a fixed block (verify_mode "dflash"; its default "adaptive"
    shrinks the block when acceptance is low). It loads its own target from `target_path`
    (load_runtime_bundle); `params` (random-weights runs) replaces that target's weights.
    Returns run(prompt) -> (tokens, cycles); a cycle = the tokens of one `cycles_completed` value
    of its TokenEvents (one verify each). Its engine also drafts by prompt lookup ("copyspec",
    always on, engine/copyspec.py) when the last token's n-gram occurs in the prompt: such cycles
    verify a copied block instead of the DFlash draft's; `stats` counts them (copyspec_hits) and
    all cycles."""
    from dflash_mlx.engine.target_qwen_gdn import QwenGdnTargetOps

    # dflash-mlx accepts only targets whose model_type contains "qwen", or Gemma 4
    # (QwenGdnTargetOps.supports_model, engine/target_ops.py resolve_target_ops), and so refuses
    # llama targets (SmolLM2) with NotImplementedError. Its Qwen ops are generic (embed_tokens ->
    # layers -> norm -> head, taps = layer outputs): also accept any other non-Gemma model of that
    # shape. Gemma stays with its own backend (Gemma scales embeddings; the generic ops would not).
    if not getattr(QwenGdnTargetOps, "_bench_any_llama_like", False):
        qwen_only = QwenGdnTargetOps.supports_model
        QwenGdnTargetOps.supports_model = lambda self, m: qwen_only(self, m) or (
            "gemma" not in self.model_type(m) and self._has_qwen_text_shape(m))
        QwenGdnTargetOps._bench_any_llama_like = True
    from dflash_mlx.engine.events import TokenEvent
    from dflash_mlx.runtime import stream_dflash_generate
    from dflash_mlx.runtime.bundle import load_runtime_bundle
    from dflash_mlx.runtime.context import build_offline_runtime_context

    ctx = build_offline_runtime_context(verify_mode="dflash")
    # draft_quant "none": run the draft's weights as stored (a local draft never gets its registry's
    # on-load w4 default anyway; that path uses Metal-only verify kernels, verify_qmm.py).
    b = load_runtime_bundle(model_ref=target_path, draft_ref=draft_dir, draft_quant="none",
                            verify_config=ctx.verify)
    if params is not None:
        b.target_model.update(params)
    if dtype is not None:
        b.target_model.set_dtype(dtype)
        b.draft_model.set_dtype(dtype)
    mx.eval(b.target_model.parameters(), b.draft_model.parameters())

    def run(prompt):
        tokens, cycles, last = [], [], None
        for ev in stream_dflash_generate(
                target_model=b.target_model, target_ops=b.target_ops, tokenizer=b.tokenizer,
                draft_model=b.draft_model, draft_backend=b.draft_backend, prompt="",
                prompt_tokens_override=list(prompt), max_new_tokens=max_tokens, block_tokens=block,
                stop_token_ids=sorted(eos), runtime_context=ctx):
            if isinstance(ev, TokenEvent):
                hits, n_cycles = ev.copyspec_hits, ev.cycles_completed
                tokens.append(int(ev.token_id))
                if ev.cycles_completed != last:
                    cycles.append((time.perf_counter(), 1))
                    last = ev.cycles_completed
                else:
                    cycles[-1] = (time.perf_counter(), cycles[-1][1] + 1)
        if stats is not None and tokens:
            stats["copyspec_hits"] = stats.get("copyspec_hits", 0) + hits
            stats["cycles"] = stats.get("cycles", 0) + n_cycles
        return tokens, cycles

    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="mlx-lm model directory")
    p.add_argument("--draft", help="mlx-lm draft model directory (same tokenizer) for draft-model modes")
    p.add_argument("--dflash-draft", nargs="+", default=[], help="DFlash draft directories (published layout)")
    p.add_argument("--policy", nargs="+", default=[], metavar="DECAY:PROBE[:WINDOW[:OPTIMISM]]",
                   help="also run each DFlash draft under these cost-model settings (as bench_block_policy.py "
                        "--settings; 0.9:8:0:1.5 is the default)")
    p.add_argument("--fuse", action="store_true",
                   help="also run ours plain and the fixed-block DFlash methods on a fused copy of the target")
    p.add_argument("--queue-taps", action="store_true",
                   help="with --fuse: also the fused DFlash methods with the verify's taps queued as built")
    p.add_argument("--compile", action="store_true",
                   help="with --fuse: also the fused DFlash methods with every verify one compiled graph")
    p.add_argument("--branches", type=int, nargs="*", default=[], metavar="K",
                   help="with --fuse --compile --compile-draft: also each DFlash method verifying K candidate "
                        "blocks per cycle (`dflash_generate(branches=K)`), fixed block and, with --adaptive, "
                        "the cost model ('rowsK' rows)")
    p.add_argument("--compile-draft", action="store_true",
                   help="with --fuse --compile: also each compiled DFlash method (and adapt compiled) with the "
                        "draft's forward compiled too (worker/compiled_draft.py)")
    p.add_argument("--serial", action="store_true",
                   help="with --compile-draft: also each method with the compiled draft in the serial order "
                        "(`overlap_draft=False`: the next draft launched after the read-back; ' ser' rows)")
    p.add_argument("--small-gemm", action="store_true",
                   help="with --compile-draft: also each compiled-draft method on copies of the target and drafts "
                        "whose linears run worker.small_gemm (CUDA only; ' sg' rows)")
    p.add_argument("--small-attention", action="store_true",
                   help="with --small-gemm: also each ' sg' row with its compiled forwards attending through "
                        "worker.small_attention (' sg a' rows)")
    p.add_argument("--adaptive", action="store_true",
                   help="also run each DFlash draft with the worker's cost model (AdaptiveBlockPolicy)")
    p.add_argument("--dflash-random-layers", type=int, default=0,
                   help="time an untrained random DFlash draft of N layers (low acceptance: per-cycle cost)")
    p.add_argument("--block-size", type=int, default=None, help="DFlash block size (default: the draft's)")
    p.add_argument("--num-draft-tokens", type=int, default=3, help="k of the draft-model modes")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompts", type=int, default=2, help="prompts per corpus")
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--dtype", choices=sorted(DTYPES), help="cast the models' weights (default: as stored)")
    p.add_argument("--random-weights", action="store_true",
                   help="random weights in the shape of --target/--draft (only config + tokenizer read): "
                        "per-cycle cost without carrying weights")
    p.add_argument("--reps", type=int, default=10, help="repetitions of the alone-timings")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every method this many times, in a rotated order each round; tok/s is the "
                        "median, the speedup the median of each round's ratio (with its range)")
    p.add_argument("--warm-all", action="store_true",
                   help="warm up on every timed prompt (an untimed round), not only the shortest and the longest: "
                        "every compiled shape the timed rounds meet is then traced and its kernels built, as in a "
                        "worker that has served such requests before")
    p.add_argument("--cases", type=Path, default=CASES)
    p.add_argument("--prompt-set", choices=("heldout", "first"), default="heldout")
    p.add_argument("--raw", action="store_true", help="raw prompt text instead of the chat template")
    p.add_argument("--kv-bucket", type=int, default=None,
                   help="PaddedKVCache bucket in positions (default 256 or $FLASHFLEET_KV_BUCKET)")
    p.add_argument("--json-out", type=Path, default=None, help="also write the results as JSON")
    p.add_argument("--only", nargs="+", default=[], metavar="TEXT",
                   help="measure only the methods whose names contain one of these (plain mlx-lm, the "
                        "baseline, always runs)")
    p.add_argument("--packages", nargs="+", choices=PACKAGES, default=[],
                   help="also run these registry DFlash packages (z-lab `dflash`, bstnxbt `dflash-mlx`) "
                        "on the first unquantized --dflash-draft (or the random draft)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds: at least 1")
    if args.queue_taps and not args.fuse:
        p.error("--queue-taps: its rows run on the fused target; add --fuse")
    if args.compile and not args.fuse:
        p.error("--compile: its rows run on the fused target; add --fuse")
    if args.compile_draft and not args.compile:
        p.error("--compile-draft: its rows compile the verify as well; add --fuse --compile")
    if args.branches and (not args.compile_draft or min(args.branches) < 2):
        p.error("--branches: K >= 2, with --fuse --compile --compile-draft (candidate rows run compiled)")
    if args.serial and not args.compile_draft:
        p.error("--serial: the serial order is an alternative for the compiled draft; add --fuse --compile --compile-draft")
    if args.small_attention and not args.small_gemm:
        p.error("--small-attention: its rows are the ' sg' rows again; add --small-gemm")
    if args.small_gemm and not args.compile_draft:
        p.error("--small-gemm: its rows are the compiled-draft methods; add --fuse --compile --compile-draft")
    overlaps = (True, False) if args.serial else (True,)  # overlap_draft of the compiled draft's methods
    from bench.bench_block_policy import policy_from_spec

    for spec in args.policy:
        try:
            policy_from_spec(spec)
        except ValueError:
            p.error(f"--policy {spec}: expected DECAY:PROBE[:WINDOW[:OPTIMISM]], e.g. 0.95:8 or 0.9:8:0:1.5")

    print(f"device: {mx.default_device()}  mlx {mx.__version__}", flush=True)
    mx.random.seed(0)
    dtype = DTYPES.get(args.dtype)
    target, tokenizer = load_model(args.target, args.random_weights, dtype)
    fused_target = None
    if args.fuse:  # a second copy, so that plain mlx-lm and the unfused rows keep mlx-lm's own layers
        from worker.fusion import fuse_projections

        fused_target = load_model(args.target, args.random_weights, dtype, tokenizer=False)[0]
        if args.random_weights:
            fused_target.update(target.parameters())
        groups = fuse_projections(fused_target)
        print(f"fused: {groups} projection groups of the target's copy", flush=True)
    sg_target = None
    if args.small_gemm:  # a third copy: the other rows keep cuBLAS's matmuls
        from worker.fusion import fuse_projections
        from worker.small_gemm import available, use_small_gemm

        if not available():
            p.error("--small-gemm: needs MLX's CUDA backend (and FLASHFLEET_SMALL_GEMM not 0)")
        if not args.dflash_draft:
            p.error("--small-gemm: its rows need a --dflash-draft directory (a copy of the draft is loaded)")
        sg_target = load_model(args.target, args.random_weights, dtype, tokenizer=False)[0]
        if args.random_weights:
            sg_target.update(target.parameters())
        fuse_projections(sg_target)
        print(f"small gemm: {use_small_gemm(sg_target)} linears of the target's third copy", flush=True)
    draft_lm = load_model(args.draft, args.random_weights, dtype)[0] if args.draft else None
    if args.kv_bucket:
        PaddedKVCache.step = args.kv_bucket
    dflash = {}  # method name -> draft
    for path in args.dflash_draft:
        d = load_dflash_draft(path, target, dtype=dtype)
        dflash[f"ours dflash {Path(path).name}"[:28]] = d
    random_draft = None
    if args.dflash_random_layers:
        random_draft = dflash[f"ours dflash random x{args.dflash_random_layers}"] = init_dflash_draft(
            target, num_layers=args.dflash_random_layers, block_size=args.block_size or 16,
            tokenizer_vocab_size=len(tokenizer.vocab))
    sg_drafts = {}  # method name -> the draft's copy for the sg target, its linears on small_gemm
    if sg_target is not None:
        for (name, d), path in zip(dflash.items(), args.dflash_draft):
            sd = sg_drafts[name] = load_dflash_draft(path, sg_target, dtype=dtype)
            use_small_gemm(sd)
    eos = set(tokenizer.eos_token_ids)
    prompts = read_prompts(tokenizer, args.prompts, args.max_prompt_tokens, args.cases, args.prompt_set,
                           chat=not args.raw)
    M = args.max_tokens
    k = args.num_draft_tokens

    methods = {"plain mlx-lm": lambda pr: run_mlx_lm(target, tokenizer, pr, M)}
    if draft_lm is not None:
        methods[f"spec mlx-lm k={k}"] = lambda pr: run_mlx_lm(
            target, tokenizer, pr, M, draft_model=draft_lm, num_draft_tokens=k)
        try:
            from worker.spec import draft_model as ours_draft
            methods[f"ours draft k={k}"] = lambda pr: run_steps(ours_draft.generate(
                pr, M, greedy, eos, model=target, draft_model=draft_lm, num_draft_tokens=k))
        except ImportError:
            pass
    methods["ours plain"] = lambda pr: run_steps(plain.generate(pr, M, greedy, eos, model=target))
    for name, d in dflash.items():
        methods[name] = lambda pr, d=d: run_steps(dflash_generate(
            pr, M, greedy, eos, target=target, draft=d, block_size=args.block_size or d.block_size))
    # fixed-block DFlash method -> (draft, the target its verify runs, the plain row of that target)
    fixed_block = {name: (d, target, "ours plain", False, False) for name, d in dflash.items()}
    if fused_target is not None:
        methods["ours plain fused"] = lambda pr: run_steps(plain.generate(pr, M, greedy, eos, model=fused_target))
        for name, d in list(dflash.items()):  # the draft borrows the first copy's embedding and head: same weights
            fname = f"{name[:22].strip()} fused"
            fixed_block[fname] = (d, fused_target, "ours plain fused", False, False)
            methods[fname] = lambda pr, d=d: run_steps(dflash_generate(
                pr, M, greedy, eos, target=fused_target, draft=d, block_size=args.block_size or d.block_size))
            if args.queue_taps:
                qname = f"{name[:19].strip()} queued"
                if qname in methods:  # two drafts' names alike in their first characters
                    qname = f"{name[:16].strip()} {len(methods)} queued"
                methods[qname] = lambda pr, d=d: run_steps(dflash_generate(
                    pr, M, greedy, eos, target=fused_target, draft=d, block_size=args.block_size or d.block_size,
                    queue_taps=True))
            if args.compile and "ours plain compiled" not in methods:
                methods["ours plain compiled"] = lambda pr: run_steps(plain.generate(
                    pr, M, greedy, eos, model=fused_target, compile_target=True))
            # compiled verify; with --compile-draft also the draft compiled (the worker's GPU path)
            for suffix, cd in ([("compiled", False)] if args.compile else []) + (
                    [("compiled+draft", True)] if args.compile and args.compile_draft else []):
                cname = f"{name[:28 - len(suffix) - 1].strip()} {suffix}"
                if cname in methods:
                    cname = f"{name[:25 - len(suffix) - 1].strip()} {len(methods)} {suffix}"
                fixed_block[cname] = (d, fused_target, "ours plain compiled", True, cd)
                for ov in overlaps if cd else (True,):
                    methods[cname if ov else f"{cname[:24].strip()} ser"] = lambda pr, d=d, cd=cd, ov=ov: run_steps(
                        dflash_generate(pr, M, greedy, eos, target=fused_target, draft=d,
                                        block_size=args.block_size or d.block_size, compile_target=True,
                                        compile_draft=cd, overlap_draft=ov))
                if cd and name in sg_drafts:  # one row, on small_gemm's linears
                    fixed_block[f"{cname[:25].strip()} sg"] = (sg_drafts[name], sg_target, "plain mlx-lm", True, True)
                    methods[f"{cname[:25].strip()} sg"] = lambda pr, d=sg_drafts[name]: run_steps(dflash_generate(
                        pr, M, greedy, eos, target=sg_target, draft=d, block_size=args.block_size or d.block_size,
                        compile_target=True, compile_draft=True))
            for K in args.branches:  # K candidate blocks per verify (not in the cycle-cost lines)
                for ov in overlaps:
                    methods[f"{name[:19].strip()} rows{K}{'' if ov else ' ser'}"] = lambda pr, d=d, K=K, ov=ov: run_steps(
                        dflash_generate(pr, M, greedy, eos, target=fused_target, draft=d,
                                        block_size=args.block_size or d.block_size, compile_target=True,
                                        compile_draft=True, branches=K, overlap_draft=ov))
                if name in sg_drafts:
                    methods[f"{name[:19].strip()} rows{K} sg"] = lambda pr, d=sg_drafts[name], K=K: run_steps(
                        dflash_generate(pr, M, greedy, eos, target=sg_target, draft=d,
                                        block_size=args.block_size or d.block_size, compile_target=True,
                                        compile_draft=True, branches=K))
    if args.adaptive or args.policy:  # the cost model picks each block size
        from worker.spec.cost_model import AdaptiveBlockPolicy, CostMemory

        def policy_maker(spec: str | None, B: int):
            # One CostMemory per method, shared by its generations (warm-ups included), as a
            # worker shares one across its requests.
            memory = CostMemory()
            if spec is None:  # what the worker runs by default
                return lambda: AdaptiveBlockPolicy(B, memory=memory)
            return lambda: policy_from_spec(spec, B, memory)
        for name, d in list(dflash.items()):
            B = args.block_size or d.block_size
            for spec in ([None] if args.adaptive else []) + list(args.policy):
                make = policy_maker(spec, B)
                short = name.removeprefix("ours dflash ")[:10].strip()
                label = f"{name[:19]} adaptive" if spec is None else f"{short} pol {spec}"
                methods[label[:28]] = lambda pr, d=d, B=B, make=make: run_steps(dflash_generate(
                    pr, M, greedy, eos, target=target, draft=d, block_size=B, policy=make()))
            if args.adaptive and args.compile:  # the worker's path: fused, compiled, cost model
                make = policy_maker(None, B)
                methods[f"{short} adapt compiled"] = lambda pr, d=d, B=B, make=make: run_steps(
                    dflash_generate(pr, M, greedy, eos, target=fused_target, draft=d, block_size=B,
                                    policy=make(), compile_target=True))
                for ov in overlaps if args.compile_draft else ():
                    make_d = policy_maker(None, B)
                    methods[f"{short} adapt comp+draft{'' if ov else ' ser'}"] = lambda pr, d=d, B=B, make=make_d, ov=ov: (
                        run_steps(dflash_generate(pr, M, greedy, eos, target=fused_target, draft=d, block_size=B,
                                                  policy=make(), compile_target=True, compile_draft=True,
                                                  overlap_draft=ov)))
                if args.compile_draft and name in sg_drafts:
                    make_s1 = policy_maker(None, B)
                    methods[f"{short} adapt comp+draft sg"] = lambda pr, d=sg_drafts[name], B=B, make=make_s1: (
                        run_steps(dflash_generate(pr, M, greedy, eos, target=sg_target, draft=d, block_size=B,
                                                  policy=make(), compile_target=True, compile_draft=True)))
                for K, ov in ((K, ov) for K in args.branches for ov in overlaps):  # rows, the worker's GPU path
                    make_b = policy_maker(None, B)
                    methods[f"{short} adapt rows{K}{'' if ov else ' ser'}"] = lambda pr, d=d, B=B, make=make_b, K=K, ov=ov: (
                        run_steps(dflash_generate(pr, M, greedy, eos, target=fused_target, draft=d, block_size=B,
                                                  policy=make(), compile_target=True, compile_draft=True,
                                                  branches=K, overlap_draft=ov)))
                for K in args.branches if name in sg_drafts else ():  # the same on small_gemm's linears
                    make_s = policy_maker(None, B)
                    methods[f"{short} adapt rows{K} sg"] = lambda pr, d=sg_drafts[name], B=B, make=make_s, K=K: (
                        run_steps(dflash_generate(pr, M, greedy, eos, target=sg_target, draft=d, block_size=B,
                                                  policy=make(), compile_target=True, compile_draft=True,
                                                  branches=K)))
    attention_rows = set()  # the ' sg a' rows: run (and their cycle's parts timed) with the mark on
    if args.small_attention:  # every ' sg' row again with worker.small_attention on
        from worker.small_attention import use_small_attention

        @contextlib.contextmanager
        def attention_on():
            marked = [sg_target, *sg_drafts.values()]
            for m in marked:
                use_small_attention(m)
            try:
                yield
            finally:
                for m in marked:
                    use_small_attention(m, False)

        def with_attention(fn):
            def run(pr):
                with attention_on():
                    return fn(pr)
            return run
        for n in [n for n in methods if n.endswith(" sg")]:
            methods[f"{n} a"] = with_attention(methods[n])
            if n in fixed_block:
                fixed_block[f"{n} a"] = fixed_block[n]
                attention_rows.add(f"{n} a")

    if args.only:
        keep = {n for n in methods if n == "plain mlx-lm" or any(t in n for t in args.only)}
        fixed_block = {n: v for n, v in fixed_block.items() if n in keep}
        keep |= {v[2] for v in fixed_block.values()}  # the plain row each cycle-cost line divides by
        methods = {n: fn for n, fn in methods.items() if n in keep}
        if len(methods) == 1:
            p.error(f"--only {' '.join(args.only)}: no method's name contains it")
        print(f"methods: {', '.join(methods)}", flush=True)
    warm = prompts["code"][0][:32]
    # Compile/allocate once before timing, on the shortest and the longest timed prompt: on the
    # GPU a KV-cache bucket's first use compiles kernels, which would otherwise land in whichever
    # method reaches it first. Buckets only prompts in between reach (long prompts with a small
    # --kv-bucket), and shapes met only at other prompts' ends (a block shrunk near max_tokens, a
    # cost-model choice, its candidate rows) are not warmed unless --warm-all.
    timed = [pr for rows in prompts.values() for pr in rows]
    warm_set = timed if args.warm_all else [min(timed, key=len), max(timed, key=len)]
    for fn in methods.values():
        for pr in warm_set:
            fn(pr)

    runs = {}  # (method, corpus) -> one dict per round
    bases = {}  # corpus -> plain mlx-lm's outputs (first round)

    def measure(name, fn, corpus, rows):
        toks, secs, cyc, same, diffs, blocks = 0, 0.0, 0, 0, [], Counter()
        for i, pr in enumerate(rows):
            out, cycles = fn(pr)
            n, c, s = steady_rate(cycles)
            toks, cyc, secs = toks + n, cyc + c, secs + s
            blocks += block_histogram(cycles)
            if name == "plain mlx-lm" and len(bases.get(corpus, [])) < len(rows):
                bases.setdefault(corpus, []).append(out)
            elif name != "plain mlx-lm":
                d = first_diff(out, bases[corpus][i])
                same += d is None
                if d is not None:
                    diffs.append(d)
        runs.setdefault((name, corpus), []).append(dict(tps=toks / secs if secs else 0.0, toks=toks, cycles=cyc,
                                                        secs=secs, same=same, n=len(rows), diffs=diffs,
                                                        blocks=blocks))
        print(f"  {corpus:5s} {name:28s} done", file=sys.stderr, flush=True)

    # The first round keeps the listed order (plain mlx-lm first: its outputs are the reference);
    # later rounds shuffle it (seeded), so no method always runs right after the same neighbour.
    names = list(methods)
    for r in range(args.rounds):
        order = names if r == 0 else random.Random(r).sample(names, len(names))
        for corpus, rows in prompts.items():
            for name in order:
                measure(name, methods[name], corpus, rows)
    results = AggregatedRuns(runs)

    # Our DFlash drafts' cycle cost alone: measured here, before any package is imported (printed
    # after the table).
    cycle_cost, cycle_lines = {}, []
    for name, (d, verify_model, plain_name, compiled, compiled_draft) in fixed_block.items():
        B = args.block_size or d.block_size
        cyc = sum(results[name, c]["cycles"] for c in prompts)
        secs = sum(results[name, c]["secs"] for c in prompts)
        per_cycle = secs / cyc if cyc else float("nan")
        with attention_on() if name in attention_rows else contextlib.nullcontext():
            d_s, v_s = per_cycle_alone(verify_model, d, prompts["code"][0], B, args.reps, compiled, compiled_draft)
        plain_step = statistics.mean(
            results[plain_name, c]["secs"] / max(1, results[plain_name, c]["cycles"]) for c in prompts)
        cycle_cost[name] = dict(per_cycle_s=per_cycle, draft_s=d_s, verify_s=v_s, plain_step_s=plain_step)
        cycle_lines.append(
            f"\n{name} per cycle (B={B}): {per_cycle * 1e3:.2f} ms in the runs; alone: draft "
            f"{d_s * 1e3:.2f} ms + verify {v_s * 1e3:.2f} ms = {(d_s + v_s) * 1e3:.2f} ms; "
            f"ratio {per_cycle / (d_s + v_s):.2f} (target <= 1.3); plain step {plain_step * 1e3:.2f} ms")

    # Registry packages, only now, after every measurement of ours: each patches its target
    # process-wide or in place. z-lab hooks the layers of the model instance it is given, so it
    # gets its own fresh target. dflash-mlx loads its own target, but replaces the attention
    # class's __call__ (every instance of the class: our target and z-lab's included), so it runs
    # last and nothing is measured after it. Neither package is imported before this point.
    packages = {}  # method name -> dict(draft=..., skipped=reason or None)
    tmp_dirs = []
    order = [p for p in PACKAGES if p in args.packages]
    pkg_dir = package_draft_dir(args.dflash_draft, random_draft, tmp_dirs) if order else None
    for pkg in order:
        B = args.block_size or (int(draft_config(pkg_dir).get("dflash_config", {}).get(
            "block_size", draft_config(pkg_dir).get("block_size", 16))) if pkg_dir else 16)
        name = f"{'z-lab dflash' if pkg == 'zlab' else 'dflash-mlx'} B={B}"
        packages[name] = dict(package=pkg, skipped=None, draft=pkg_dir if args.dflash_draft or not pkg_dir else
                              f"ours dflash random x{args.dflash_random_layers} (saved to {pkg_dir})")
        stats = packages[name]["stats"] = {}
        try:
            if pkg_dir is None:
                raise RuntimeError("needs a DFlash draft: --dflash-draft or --dflash-random-layers")
            if pkg == "zlab":
                zt = load_model(args.target, args.random_weights, dtype)[0]
                if args.random_weights:
                    zt.update(target.parameters())  # the same random weights as ours
                fn = load_zlab(zt, tokenizer, pkg_dir, B, M, dtype)
            else:
                fn = load_dflash_mlx(args.target, pkg_dir, B, M, eos, dtype,
                                     target.parameters() if args.random_weights else None, stats)
            fn(warm)  # compile/allocate once; also where Metal-only kernels fail off Metal
            stats.clear()
        except Exception as e:  # noqa: BLE001 - a package that cannot run this draft is skipped
            q = draft_config(pkg_dir).get("quantization") if pkg_dir else None
            packages[name]["skipped"] = (f"quantized draft ({q.get('bits')}-bit, group {q.get('group_size')}): "
                                         if q else "") + one_line(e)
            print(f"  skip {name}: {packages[name]['skipped']}", file=sys.stderr, flush=True)
            continue
        methods[name] = fn
        for corpus, rows in prompts.items():
            measure(name, fn, corpus, rows)
        results = AggregatedRuns(runs)  # one round: they patch the target, so nothing runs after them
        cyc = sum(results[name, c]["cycles"] for c in prompts)
        secs = sum(results[name, c]["secs"] for c in prompts)
        cycle_cost[name] = dict(per_cycle_s=secs / cyc if cyc else float("nan"))
        copy = (f"; prompt-lookup (copyspec) blocks in {stats['copyspec_hits']} of its {stats['cycles']} "
                f"cycles" if "copyspec_hits" in stats else "")
        cycle_lines.append(f"\n{name} per cycle: {cycle_cost[name]['per_cycle_s'] * 1e3:.2f} ms in the runs "
                           f"(draft {packages[name]['draft']}{copy})")
    for t in tmp_dirs:
        t.cleanup()

    weights = " (random weights)" if args.random_weights else ""
    print(f"\ntarget {args.target}{weights}  max_tokens {M}  prompts/corpus {args.prompts} "
          f"({args.prompt_set}, {'raw' if args.raw else 'chat'})  dtype {args.dtype or 'as stored'}  "
          f"kv bucket {PaddedKVCache.step}  device {mx.default_device()}")
    if args.rounds > 1:
        print(f"{args.rounds} rounds: tok/s is the median; speedup the median of the rounds' ratios (range)")
    spread = f" {'range':>11s}" if args.rounds > 1 else ""
    print(f"{'corpus':6s} {'method':28s} {'tok/s':>8s} {'tau':>6s} {'speedup':>8s}{spread}  same-as-plain")
    for corpus in prompts:
        for name in methods:
            r = results[name, corpus]
            same = "-" if name == "plain mlx-lm" else f"{r['same']}/{r['n']}" + (
                f" (first diff at {min(r['diffs'])})" if r["diffs"] else "")
            ratios = results.ratios(name, corpus)
            r["speedup"] = statistics.median(ratios)
            r["speedup_range"] = [min(ratios), max(ratios)]
            rng = "" if args.rounds == 1 else f" {'-':>11s}" if name == "plain mlx-lm" else \
                f" {min(ratios):5.2f}-{max(ratios):4.2f}x"
            print(f"{corpus:6s} {name:28s} {r['tps']:8.2f} {r['tau']:6.2f} {r['speedup']:7.2f}x{rng}  {same}")

    # What the cost model chose (methods whose block size varies): cycles per block size, 1 = a
    # plain step; a block shrinks near max_tokens in every method, so fixed ones are left out.
    for corpus in prompts:
        for name in methods:
            b = results[name, corpus]["blocks"]
            if ("adapt" in name or " pol " in name) and b:
                total = sum(b.values())
                sizes = ", ".join(f"{k}: {v}" for k, v in b.items())
                print(f"blocks {corpus:5s} {name:28s} cycles per block size {sizes} (plain {b.get(1, 0) / total:.0%})")

    for name, r in packages.items():
        if r["skipped"]:
            print(f"{name} skipped (draft {r['draft']}): {r['skipped']}")
    for line in cycle_lines:
        print(line)
    if args.json_out:
        record = {
            "argv": sys.argv, "device": str(mx.default_device()), "mlx": mx.__version__,
            "kv_bucket": PaddedKVCache.step, "cycle_cost": cycle_cost,
            "results": [dict(method=m, corpus=c, **{k: v for k, v in r.items() if k != "diffs"})
                        for (m, c), r in results.items()]}
        if args.packages:
            record["packages"] = packages
        args.json_out.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
