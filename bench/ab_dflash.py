"""A/B of the DFlash decode loop: this checkout's `worker/spec/dflash.py` against the same file at
another git revision, in one process on the same model and prompts (rounds alternate the order),
for changes to the loop itself (what a cycle queues when, how it syncs):

    python bench/ab_dflash.py --rev HEAD~1 --target MODEL_DIR --draft DFLASH_DIR \
        [--prompts 3] [--max-tokens 64] [--rounds 3] [--dtype float32]

`--file PATH` instead of `--rev` compares against a saved copy of the file (a machine without
the git history: `git show REV:worker/spec/dflash.py > PATH` beforehand).

Prints tokens/s of both per round (whole requests, prefill included; mean over the prompts), the
per-round ratio, and whether the greedy outputs are identical (they must be). Nothing runs between
Steps here: a change whose gain is overlap with the caller's work per Step (the engine's
detokenizing and streaming, other sessions) needs the engine to measure it.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def load_revision(rev: str | None, file: Path | None = None):
    """`worker/spec/dflash.py` as of git revision `rev` (or the copy in `file`), imported as its
    own module."""
    if file is not None:
        if not file.is_file():
            raise SystemExit(f"ab_dflash.py: --file {file}: no such file")
        src = file.read_text()
    else:
        try:
            src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:worker/spec/dflash.py"], check=True,
                                 capture_output=True, text=True).stdout
        except (OSError, subprocess.CalledProcessError) as e:
            raise SystemExit(f"ab_dflash.py: --rev {rev}: {getattr(e, 'stderr', '') or e}".strip()) from None
    path = Path(tempfile.mkdtemp()) / "dflash_rev.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("dflash_rev", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--rev", help="git revision to compare against (e.g. HEAD~1)")
    which.add_argument("--file", type=Path, help="a saved worker/spec/dflash.py to compare against")
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True, help="DFlash draft directory")
    ap.add_argument("--cases", type=Path, default=ROOT / "bench" / "prompts")
    ap.add_argument("--prompts", type=int, default=3, help="first N prompts of humaneval.jsonl")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "as-stored"), default="float32")
    a = ap.parse_args(argv)
    if min(a.prompts, a.max_tokens, a.rounds) < 1:
        ap.error("--prompts, --max-tokens and --rounds: at least 1")
    other = load_revision(a.rev, a.file)
    label = a.rev or "other file"

    import mlx.core as mx
    from mlx_lm import load

    import worker.spec.dflash as ours
    from worker.models.dflash_checkpoint import load_dflash_draft

    target, tok = load(a.target)
    dtype = None if a.dtype == "as-stored" else getattr(mx, a.dtype)
    if dtype is not None:
        target.set_dtype(dtype)
    draft = load_dflash_draft(a.draft, target, dtype=dtype)
    rows = [json.loads(line)["prompt"] for line in open(a.cases / "humaneval.jsonl")][:a.prompts]
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in rows]

    def greedy(x):
        return mx.argmax(x, axis=-1)

    def run(mod, prompt):
        # The whole request, prefill included: a loop that moves work to before a yield (the
        # first Step's, say) would otherwise hide it outside a decode-only window.
        t0, n, out = time.perf_counter(), 0, []
        for s in mod.dflash_generate(prompt, a.max_tokens, greedy, tok.eos_token_ids, target=target, draft=draft):
            n += len(s.tokens)
            out += s.tokens
        return n / max(time.perf_counter() - t0, 1e-9), out

    for p in ids:  # warm-up: kernels, caches
        run(ours, p), run(other, p)
    tps = {"this checkout": [], label: []}
    outs = {}
    for r in range(a.rounds):
        order = [("this checkout", ours), (label, other)]
        for name, mod in order if r % 2 == 0 else order[::-1]:
            got = [run(mod, p) for p in ids]
            tps[name].append(sum(t for t, _ in got) / len(got))
            outs[name] = [o for _, o in got]
    print(f"target {a.target}, draft {a.draft}, {a.dtype}, {a.prompts} prompts x {a.max_tokens} tokens, "
          f"device {mx.default_device()}")
    for name, v in tps.items():
        print(f"{name:>16}: " + " ".join(f"{x:7.2f}" for x in v) + "  tok/s per round")
    ratios = [x / y for x, y in zip(tps["this checkout"], tps[label])]
    print(f"{'ratio':>16}: " + " ".join(f"{x:7.3f}" for x in ratios))
    same = outs["this checkout"] == outs[label]
    print("greedy outputs identical:", same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
