"""Training-data generation throughput: static batches with and without dropping ended rows.

The target answers the same prompts (chat template, from bench/prompts) once per setting of
`compact_at` (`worker/training/generation.py`) and the script prints answer tokens per second,
side by side, and whether the greedy answers are identical:

    python bench/bench_generation.py --target MODEL_DIR [--prompts 32 --batch-size 16
        --max-new-tokens 128 --compact-at 2 0.5]

compact_at 2 never drops rows (every row decodes until the batch's last one ends), 0.5 drops the
ended rows once they are half of the rows still decoding (the default). One untimed warm-up
batch runs first. Runs on the CPU (mlx[cpu]) and on a GPU.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CASES = ROOT / "bench" / "prompts"


def main(argv=None) -> int:
    import mlx.core as mx

    from worker.training.data import encode_prompt, interleave_by_corpus, read_prompt_files
    from worker.training.generation import generate_responses
    from worker.training.config import resolve_dtype
    from worker.training.target import load_target

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--cases", type=Path, default=CASES)
    ap.add_argument("--prompts", type=int, default=32, help="prompts answered per setting")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=128)
    ap.add_argument("--compact-at", type=float, nargs="+", default=[2.0, 0.5])
    a = ap.parse_args(argv)
    if a.prompts < 1 or a.batch_size < 1 or a.max_new_tokens < 1:
        ap.error("--prompts, --batch-size and --max-new-tokens must be >= 1")
    files = sorted(a.cases.glob("*.jsonl"))
    if not files:
        ap.error(f"no *.jsonl prompt files in {a.cases}")

    target, tokenizer = load_target(Path(a.target), resolve_dtype("auto"))
    prompts = interleave_by_corpus(read_prompt_files(files, max_per_file=a.prompts))[: a.prompts]
    enc = [encode_prompt(tokenizer, p.text, a.max_prompt_tokens) for p in prompts]
    eos = sorted(tokenizer.eos_token_ids)
    generate_responses(target, enc[: a.batch_size], 8, eos, batch_size=a.batch_size)  # warm-up
    print(f"{len(enc)} prompts, batch {a.batch_size}, up to {a.max_new_tokens} new tokens, device "
          f"{mx.default_device()}", flush=True)
    rows, first = [], None
    for c in a.compact_at:
        t0 = time.perf_counter()
        out = generate_responses(target, enc, a.max_new_tokens, eos, batch_size=a.batch_size, compact_at=c)
        secs = time.perf_counter() - t0
        tokens = sum(len(r) for r in out)
        first = first or (out, tokens / secs)
        rows.append((c, tokens, secs, tokens / secs, out == first[0]))
    print("\n| compact_at | answer tokens | seconds | tokens/s | vs first | same answers |")
    print("|---|---|---|---|---|---|")
    for c, tokens, secs, rate, same in rows:
        print(f"| {c:g} | {tokens} | {secs:.1f} | {rate:.1f} | {rate / first[1]:.2f}x | {same} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
