"""``flashfleet draft``: train and evaluate DFlash drafts for a target model.

    flashfleet draft train --target MODEL --prompts FILE... --out DRAFT_DIR [options]
    flashfleet draft eval  --target MODEL --draft DRAFT_DIR --prompts FILE... [options]
    flashfleet draft vocab --target MODEL --draft DRAFT_DIR --data TRAIN_JSONL --size K --out DIR

`train` lets the target answer the prompts (its chat template, batched), trains a DFlash draft
with the paper's recipe (arXiv 2602.06036 §4.2; SpecForge's implementation), writes it in the
published layout plus a training card, and reports the acceptance length tau on held-out prompts.
Reruns reuse the cached data and resume from the last checkpoint. `eval` measures tau of an
existing draft on prompt files (all of them, or only the held-out split the trainer would use).
`vocab` gives an existing draft (a published one too) a draft vocabulary: the K most frequent
tokens of the target's answers in a data cache, as `train --draft-vocab K` does. MLX is imported
only when a command runs.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

__all__ = ["build_parser", "main"]



class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Appends a flag's default unless its help already states it, it is None, or it is a switch."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is None or isinstance(action.default, bool):
            return text
        return super()._get_help_string(action)

def _minutes(text: str) -> float:
    v = float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return v


def _at_least(low: int):
    """An argparse type: an integer >= low."""
    def parse(text: str) -> int:
        v = int(text)
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}")
        return v
    parse.__name__ = f"integer >= {low}"  # argparse names the type in its error message
    return parse


def _temperature(text: str) -> float:
    v = float(text)
    if v < 0:
        raise argparse.ArgumentTypeError("must be >= 0 (0: greedy)")
    return v


def _sample_temperature(text: str) -> float:
    v = float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError("must be > 0 (a temperature of 0 repeats the greedy answer)")
    return v


def _top_p(text: str) -> float:
    v = float(text)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError("must be in (0, 1]")
    return v


def _number(low: float, high: float = float("inf"), low_open: bool = False, high_open: bool = False):
    """An argparse type: a finite float in the interval [low, high] (an end excluded when open)."""
    def parse(text: str) -> float:
        v = float(text)
        ok = math.isfinite(v) and (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
        if not ok:
            ends = ("(" if low_open else "[") + f"{low:g}, " + (f"{high:g}" if math.isfinite(high) else "inf") \
                + (")" if high_open or not math.isfinite(high) else "]")
            raise argparse.ArgumentTypeError(f"must be a number in {ends}")
        return v
    parse.__name__ = "number"
    return parse


def _val_fraction(text: str) -> float:
    v = float(text)
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError("must be in [0, 1) (0: no validation)")
    return v


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``flashfleet draft`` (sub-commands ``train``, ``eval`` and ``vocab``)."""
    parser = argparse.ArgumentParser(prog="flashfleet draft", description="Train and evaluate DFlash drafts.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    t = commands.add_parser("train", help="generate data with the target, train a DFlash draft, measure tau",
                            formatter_class=_Help)
    t.add_argument("--target", required=True, help="target model directory or fetched catalog name")
    t.add_argument("--prompts", required=True, nargs="+", metavar="FILE",
                   help=".jsonl files with a 'prompt' field, or text files with one prompt per line; "
                        "the file stem is the corpus name")
    t.add_argument("--out", required=True, help="output directory of the draft and its training card")
    t.add_argument("--work-dir", default=None, help="data cache and resumable state (default: OUT.work)")
    t.add_argument("--overwrite", action="store_true",
                   help="replace a draft already in --out (without it a new run refuses to; a run that "
                        "continues --out's own checkpoint may always write there)")
    g = t.add_argument_group("draft shape (default: chosen from the target)")
    g.add_argument("--draft-layers", type=_at_least(1), default=None, help="draft depth (default: ~1 per 15 target layers)")
    g.add_argument("--num-taps", type=_at_least(1), default=5, help="tapped target layers, spread over layers 1..L-3")
    g.add_argument("--target-layer-ids", type=_at_least(0), nargs="+", default=None, help="explicit tapped layers")
    g.add_argument("--mask-token-id", type=_at_least(0), default=None, help="MASK id (default: an unused row)")
    g.add_argument("--block-size", type=_at_least(2), default=16, help="B: tokens per block (last token + B-1 drafts)")
    g.add_argument("--intermediate-size", type=_at_least(1), default=None, help="draft MLP width (default: the target's)")
    g.add_argument("--max-draft-mib", type=_number(0, low_open=True), default=None,
                   help="shrink the MLP, then the depth, until the saved draft fits this size")
    g = t.add_argument_group("data")
    g.add_argument("--max-prompts-per-file", type=_at_least(1), default=None,
                   help="read at most this many prompts of each file (default: all)")
    g.add_argument("--max-prompt-tokens", type=_at_least(1), default=256, help="cap on a prompt's own tokens")
    g.add_argument("--max-new-tokens", type=_at_least(1), default=256, help="cap on the target's answer, tokens")
    g.add_argument("--heldout-per-corpus", type=_at_least(0), default=8, help="held-out prompts per corpus (cap)")
    g.add_argument("--heldout-fraction", type=_number(0, 1, high_open=True), default=0.1,
                   help="held-out share per corpus")
    g.add_argument("--gen-temperature", type=_temperature, default=0.0, help="the target's sampling (0: greedy)")
    g.add_argument("--gen-top-p", type=_top_p, default=1.0,
                   help="nucleus sampling of every sampled answer (with --gen-temperature > 0 or --gen-samples > 1)")
    g.add_argument("--gen-samples", type=_at_least(1), default=1,
                   help="answers per training prompt: the first at --gen-temperature, the others sampled "
                        "at --gen-sample-temperature (more data from the same prompts)")
    g.add_argument("--gen-sample-temperature", type=_sample_temperature, default=0.8,
                   help="temperature of the extra answers of --gen-samples")
    g.add_argument("--synthetic-prompts", type=_at_least(0), default=0, metavar="N",
                   help="after the first pass, the target writes N user prompts itself (Magpie: sampled after "
                        "its chat template's user-turn prefix) and answers them: new data beyond the prompt "
                        "files, split over --processes; corpus 'synthetic', never held out")
    g.add_argument("--synthetic-max-tokens", type=_at_least(1), default=128, help="cap on a synthetic prompt, tokens")
    g.add_argument("--synthetic-temperature", type=_sample_temperature, default=1.0,
                   help="temperature the synthetic prompts are sampled at (top-p 0.95)")
    g.add_argument("--synthetic-openings", type=_at_least(0), default=0, metavar="WORDS",
                   help="each synthetic prompt starts with the first WORDS words of a random training prompt "
                        "and the target writes the rest: prompts near your files' own (0: Magpie from the "
                        "bare user turn; a coder target's own prompts mention code one time in six)")
    g.add_argument("--synthetic-openings-from", nargs="+", default=[], metavar="CORPUS",
                   help="take the openings only from these prompt files (their names without suffix, e.g. "
                        "code_requests humaneval); default all")
    g.add_argument("--extra-data", nargs="+", default=[], metavar="DIR",
                   help="earlier runs' data caches of this target (WORK/data or WORK/data-rank*of*; train.jsonl "
                        "or train.jsonl.xz / .gz): their greedy answers to this run's prompts are reused instead of "
                        "generated, their other sequences added; held-out prompts dropped")
    g.add_argument("--gen-batch-size", type=_at_least(1), default=64, help="sequences the target answers at once")
    g.add_argument("--regenerate-data", action="store_true",
                   help="generate the data again even when WORK/data matches these options (e.g. after a "
                        "run cut short by --gen-max-minutes)")
    g.add_argument("--gen-max-minutes", type=_minutes, default=None,
                   help="stop generating after this long (answers so far are kept)")
    g = t.add_argument_group("training")
    g.add_argument("--batch-size", type=_at_least(1), default=16, help="sequences per step")
    g.add_argument("--anchors", type=_at_least(1), default=64, help="random anchors (blocks) per sequence per step")
    g.add_argument("--gamma", type=_number(0, low_open=True), default=None, help="loss decay (default: 7 for B=16, 5 for 10, 4 for 8)")
    g.add_argument("--lr", type=_number(0), default=6e-4,
                   help="peak learning rate (0: the weights stay as they start)")
    g.add_argument("--weight-decay", type=_number(0), default=0.01, help="AdamW weight decay")
    g.add_argument("--warmup", type=_number(0, 1, high_open=True), default=0.04, help="warmup fraction of the run")
    g.add_argument("--min-lr-ratio", type=_number(0, 1), default=0.0, help="cosine floor, fraction of --lr")
    g.add_argument("--grad-clip", type=_number(0), default=1.0, help="global gradient-norm clip (0: off)")
    g.add_argument("--epochs", type=_minutes, default=6.0,
                   help="passes over the training sequences (with --gen-samples N there are N per prompt)")
    g.add_argument("--steps", type=_at_least(1), default=None, help="training steps (overrides --epochs)")
    g.add_argument("--max-minutes", type=_minutes, default=None,
                   help="training time budget; the schedule follows the time fraction (default: none)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--compute-dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="auto: bfloat16 on a GPU, float32 on a CPU")
    g.add_argument("--target-dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    g.add_argument("--save-dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    g.add_argument("--init-layers", default="target", choices=("target", "random"),
                   help="a new draft's layers start as copies of the target's last layers (where shapes "
                        "match), or random")
    g.add_argument("--init-from", default=None, metavar="DRAFT_DIR",
                   help="start from this saved draft (its shape and weights, dequantized if 4/8-bit) "
                        "instead of a random one: training continues across runs; a larger --draft-layers "
                        "or --intermediate-size grows it (new weights add nothing at the first step)")
    g.add_argument("--draft-vocab", type=_at_least(0), default=None, metavar="K",
                   help="the draft proposes from the K most frequent tokens of the training answers "
                        "(EAGLE-3's reduced draft vocabulary: a smaller head to read and to train through; "
                        "a token outside it is never drafted, the output stays the target's); 0: the whole "
                        "head (default: an --init-from draft's own vocabulary, else the whole head)")
    g.add_argument("--quantize-bits", type=int, default=None, choices=(4, 8),
                   help="save the draft's linear layers MLX-quantized (default: unquantized, in --save-dtype; "
                   "the size budget counts quantized bytes; the shipped drafts use 4)")
    g.add_argument("--quantize-group-size", type=int, default=64, choices=(32, 64, 128),
                   help="weights sharing one scale and bias (with --quantize-bits)")
    g.add_argument("--no-compile", dest="compile", action="store_false", help="do not mx.compile the step")
    g.add_argument("--cache-taps-gib", type=_number(0), default=8.0,
                   help="GiB of memory for the target taps, computed once and kept: the length classes that "
                        "fit together are cached, the others' batches recompute them (0: every batch)")
    g.add_argument("--length-buckets", type=_at_least(1), default=4,
                   help="length classes: a batch is padded to its class's width instead of the longest "
                        "sequence's (1: off)")
    g.add_argument("--checkpoint-every", type=_at_least(0), default=200, help="steps between checkpoints (0: end only)")
    g.add_argument("--no-resume", dest="resume", action="store_false", help="ignore an existing checkpoint")
    g.add_argument("--log-every", type=_at_least(1), default=10, help="steps per loss-curve point")
    g = t.add_argument_group("evaluation")
    g.add_argument("--no-eval", dest="eval", action="store_false", help="skip tau on the held-out prompts")
    g.add_argument("--eval-max-new-tokens", type=_at_least(1), default=128)
    g.add_argument("--eval-max-minutes", type=_minutes, default=None,
                   help="time limit of each tau measurement, counted from the end of its first prompt "
                        "(kernel compiles on a cold GPU)")
    g.add_argument("--eval-untrained", action="store_true", help="also measure the untrained draft")
    g.add_argument("--no-eval-unquantized", dest="eval_unquantized", action="store_false",
                   help="with --quantize-bits, measure only the saved (quantized) draft, not the weights "
                        "before quantization too (half the evaluation time)")
    g.add_argument("--val-fraction", type=_val_fraction, default=0.005,
                   help="share of prompts whose answers are held out of training for teacher-forced "
                        "validation (chosen by a hash of the prompt: the same in every run; 0: none)")
    g.add_argument("--val-max-sequences", type=_at_least(1), default=256,
                   help="measure about this many of them at most (the lowest prompt hashes, split evenly over "
                        "processes): the cost of each validation on large data")
    g.add_argument("--val-every", type=_at_least(0), default=500,
                   help="steps between validations (loss and tau estimate on the validation sequences; "
                        "also before the first step of a new run; 0: only at the end)")
    g = t.add_argument_group("several processes (data parallel; docs/training.md)")
    g.add_argument("--processes", type=_at_least(1), default=1,
                   help="train data parallel with this many processes on this host (one per GPU with nccl), "
                        "started through mlx.launch; across hosts run mlx.launch yourself")
    g.add_argument("--backend", choices=("nccl", "ring"), default=None,
                   help="mlx.launch backend for --processes (default: nccl with CUDA, else ring)")
    t.add_argument("--quiet", action="store_true", help="no progress bars")

    e = commands.add_parser("eval", help="acceptance length tau of a draft on prompt files",
                            formatter_class=_Help)
    e.add_argument("--target", required=True, help="target model directory or fetched catalog name")
    e.add_argument("--draft", required=True,
                   help="DFlash draft directory, or 'dflash': the draft shipped for --target")
    e.add_argument("--prompts", required=True, nargs="+", metavar="FILE")
    e.add_argument("--heldout-only", action="store_true",
                   help="only the held-out split `train` uses: give the same --heldout-* and "
                   "--max-prompts-per-file values as the training run, or training prompts can slip in")
    e.add_argument("--heldout-per-corpus", type=_at_least(0), default=8)
    e.add_argument("--heldout-fraction", type=_number(0, 1, high_open=True), default=0.1)
    e.add_argument("--max-prompts-per-file", type=_at_least(1), default=None)
    e.add_argument("--max-prompt-tokens", type=_at_least(1), default=256)
    e.add_argument("--max-new-tokens", type=_at_least(1), default=128)
    e.add_argument("--block-size", type=_at_least(2), default=None, help="decode block size (default: the draft's)")
    e.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    e.add_argument("--max-minutes", type=_minutes, default=None)
    e.add_argument("--json", action="store_true", help="print the result as JSON")
    e.add_argument("--quiet", action="store_true", help="no progress bars")

    v = commands.add_parser("vocab", help="give a draft a vocabulary: the K most frequent tokens of answers",
                            formatter_class=_Help)
    v.add_argument("--target", required=True, help="target model directory or fetched catalog name")
    v.add_argument("--draft", required=True,
                   help="DFlash draft directory, or 'dflash': the draft shipped for --target")
    v.add_argument("--data", required=True, nargs="+", metavar="TRAIN_JSONL",
                   help="data caches of the target's answers (`train` writes WORK/data/train.jsonl; .xz read too)")
    v.add_argument("--size", required=True, type=_at_least(0), metavar="K", help="tokens kept (0: the whole head)")
    v.add_argument("--out", required=True, help="where the draft is written with its vocabulary (may be --draft)")
    return parser


_NOT_CONFIG = {"command", "quiet", "processes", "backend"}  # CLI-only arguments, not TrainConfig fields


def _train_processes(args, argv: list[str]) -> int:
    """Re-runs this command as `--processes` ranks under mlx.launch. Each rank gets the same
    arguments plus `--processes 1` (argparse keeps the last value, whatever spelling came first)."""
    from worker.training.config import TrainConfig
    from worker.training.distributed import default_backend, run_local_ranks
    from worker.training.preflight import preflight

    # Before any rank starts: a bad input is one message, not one per rank after each loaded the
    # target (each rank checks again, cheaply, in _train).
    preflight(TrainConfig(**{k: v for k, v in vars(args).items() if k not in _NOT_CONFIG}))
    backend = args.backend or default_backend()
    print(f"flashfleet draft: {args.processes} processes over {backend} (mlx.launch)", file=sys.stderr, flush=True)
    try:
        failed = run_local_ranks(args.processes, backend,
                                 [sys.executable, "-m", "flashfleet.cli.draft_cmd", *argv, "--processes", "1"])
    except ValueError as e:  # a request this host cannot serve (GPU placement)
        print(f"flashfleet draft: {e}", file=sys.stderr)
        return 2
    if failed:
        print("flashfleet draft: a training process failed (its output is above)", file=sys.stderr)
        return 1
    return 0


def _train(args) -> int:
    from worker.training.config import TrainConfig
    from worker.training.preflight import preflight
    from worker.training.train import train_draft

    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k not in _NOT_CONFIG}, progress=not args.quiet)
    preflight(cfg)  # a bad --init-from or prompt file fails now, not after the target answered every prompt
    card = train_draft(cfg)
    ev = card.get("eval", {}).get("trained")  # ranks other than 0 of a distributed run get no card
    if ev and ev["all"]["tau"] is not None:
        print(f"tau on held-out prompts: {ev['all']['tau']:.3f} ({args.out}/TRAINING.md)")
    return 0


def _draft_dir(draft: str) -> str:
    """`draft` unless it names a catalog model rather than a directory: a fetched model is a target
    or a classic draft, never a DFlash draft, so say that instead of "does not exist"."""
    from flashfleet.models.catalog import is_catalog_name
    from worker.models.dflash_checkpoint import DraftCheckpointError

    if not Path(draft).expanduser().exists() and is_catalog_name(draft):
        raise DraftCheckpointError(
            f"--draft {draft} is a catalog model, not a DFlash draft: give a DFlash draft directory "
            "(config.json with dflash_config), or 'dflash' for the draft shipped for --target")
    return draft


def _eval(args) -> int:
    from worker.models.dflash_checkpoint import load_dflash_draft
    from worker.training.data import DataError, encode_prompt, read_prompt_files, split_heldout
    from worker.training.evaluate import evaluate_tau
    from worker.training.config import resolve_dtype
    from worker.training.target import load_target, resolve_target

    from flashfleet.models.drafts import resolve_draft_arg

    draft_dir = _draft_dir(resolve_draft_arg(args.draft, args.target))  # before the target loads
    dtype = resolve_dtype(args.dtype)
    target, tokenizer = load_target(resolve_target(args.target), dtype)
    draft = load_dflash_draft(draft_dir, target, dtype=dtype)
    prompts = read_prompt_files(args.prompts, args.max_prompts_per_file)
    if args.heldout_only:
        prompts = split_heldout(prompts, args.heldout_per_corpus, args.heldout_fraction)[1]
    if not prompts:
        raise DataError("no prompts to evaluate" + (" in the held-out split (it needs corpora of 2 or more "
                        "prompts and --heldout-per-corpus >= 1)" if args.heldout_only else ""))
    rows = [{"corpus": p.corpus, "prompt_ids": encode_prompt(tokenizer, p.text, args.max_prompt_tokens)}
            for p in prompts]
    result = evaluate_tau(target, draft, rows, args.max_new_tokens, tokenizer.eos_token_ids,
                          block_size=args.block_size, progress=not args.quiet,
                          max_seconds=args.max_minutes * 60 if args.max_minutes else None)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for c, v in list(result["per_corpus"].items()) + [("all", result["all"])]:
            tau = "-" if v["tau"] is None else f"{v['tau']:.3f}"
            print(f"{c:<28} tau {tau:>6}  prompts {v['prompts']:>4}  cycles {v['cycles']:>6}  tokens {v['tokens']:>7}")
    return 0


def _vocab(args) -> int:
    from pathlib import Path

    from worker.models.dflash_checkpoint import load_dflash_draft, save_dflash_draft
    from worker.training.data import DataError
    from worker.training.defaults import choose_draft_vocab, label_token_counts
    from worker.training.extra_data import training_file_rows
    from worker.training.config import resolve_dtype
    from worker.training.target import load_target, resolve_target

    from flashfleet.models.drafts import resolve_draft_arg

    draft_dir = _draft_dir(resolve_draft_arg(args.draft, args.target))
    target, tokenizer = load_target(resolve_target(args.target), resolve_dtype("auto"))
    draft = load_dflash_draft(draft_dir, target, dtype=None)  # saved again: keep the checkpoint's dtype
    V = int(draft.args.vocab_size or target.args.vocab_size)
    responses = []
    for f in map(Path, args.data):
        if not f.is_file():
            raise FileNotFoundError(f"--data {f}: no such file (a data cache's train.jsonl)")
        try:
            responses += [row["response_ids"] for row in training_file_rows(f, V)]
        except DataError as e:
            raise DataError(f"--data {f}: not a data cache (rows with response_ids): {e}") from None
    counts = label_token_counts(responses, V)
    if args.size:
        ids, coverage = choose_draft_vocab(counts, args.size, always=tokenizer.eos_token_ids)
        draft.set_vocab(ids)
    else:
        draft.set_vocab(None)
        coverage = 1.0
    save_dflash_draft(draft, args.out)
    kept = "the whole head" if not args.size else f"{draft.vocab.size} of {V} tokens"
    print(f"{args.out}: the draft proposes from {kept}, covering {100 * coverage:.2f}% of "
          f"{int(counts.sum())} answer tokens in {len(responses)} answers")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``flashfleet draft``; returns the process exit code.

    Returns:
        0 on success, 2 on bad arguments or inputs (missing files, a draft that does not fit the
        target, unusable data), 130 when interrupted (Ctrl-C; a train run can resume), or a
        multi-process train's own status (1 when a rank failed).
    """
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    from flashfleet.models.drafts import NoShippedDraftError
    from worker.models.dflash_checkpoint import DraftCheckpointError
    from worker.training.data import DataError
    from worker.training.defaults import DraftSizeError
    from worker.training.config import TrainConfigError
    from worker.training.interrupt import TrainingInterrupted

    try:
        if args.command == "train" and args.processes > 1:
            from worker.training.distributed import launched

            if launched():
                print("flashfleet draft: --processes under a launcher: each rank would start its own; "
                      "drop --processes when you run mlx.launch yourself", file=sys.stderr)
                return 2
            return _train_processes(args, list(sys.argv[1:] if argv is None else argv))
        return {"train": _train, "eval": _eval, "vocab": _vocab}[args.command](args)
    except (FileNotFoundError, NotADirectoryError, DataError, DraftSizeError, TrainConfigError,
            DraftCheckpointError, NoShippedDraftError) as e:
        print(f"flashfleet draft: {e}", file=sys.stderr)
        return 2
    except TrainingInterrupted as e:
        work = args.work_dir or f"{args.out.rstrip('/')}.work"
        where = f"a checkpoint is in {work}/resume; " if e.saved else ""
        print(f"flashfleet draft: interrupted at step {e.step}; {where}run the same command again to "
              "resume (--no-resume starts over)", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        hint = (" run the same command again: a finished data cache and the last checkpoint "
                "(every --checkpoint-every steps) are reused" if args.command == "train" else "")
        print(f"flashfleet draft: interrupted;{hint}", file=sys.stderr)
        return 130


if __name__ == "__main__":  # `python -m flashfleet.cli.draft_cmd`, e.g. under mlx.launch
    sys.exit(main())
