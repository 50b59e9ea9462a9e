"""Checks that DFlash decoding with a shipped draft gives the target's plain greedy output.

    python bench/check_shipped_drafts.py MODEL [MAX_TOKENS]

MODEL is a catalog name whose fetched directory is in the model cache and whose draft ships in
flashfleet/drafts/. One held-out prompt per corpus (code, English, Polish; chat template);
prints equal / DIFFER at position, the acceptance length tau and both wall times. Meant for
real targets too large for the test suite (the suite checks SmolLM2 in
tests/test_shipped_drafts.py).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlx_lm import load  # noqa: E402

from flashfleet.models import resolve_model  # noqa: E402
from flashfleet.models.drafts import shipped_draft_dir  # noqa: E402
from worker.models.dflash_checkpoint import load_dflash_draft  # noqa: E402
from worker.sampling import greedy  # noqa: E402
from worker.spec import plain  # noqa: E402
from worker.spec.dflash import dflash_generate  # noqa: E402
from worker.training.data import encode_prompt, read_prompt_files, split_heldout  # noqa: E402

CASES = ROOT / "bench" / "prompts"


def main(name: str, max_tokens: int = 32) -> int:
    target, tok = load(str(resolve_model(name)))
    draft = load_dflash_draft(shipped_draft_dir(name), target)
    eos = set(tok.eos_token_ids)
    bad = 0
    for f in ("humaneval.jsonl", "enwiki_en.jsonl", "dataset_build_pl.jsonl"):
        row = split_heldout(read_prompt_files([CASES / f], 450), 8, 0.1)[1][0]
        p = encode_prompt(tok, row.text, 256)
        t0 = time.perf_counter()
        ref = [t for s in plain.generate(p, max_tokens, greedy, eos, model=target) for t in s.tokens]
        t1 = time.perf_counter()
        steps = list(dflash_generate(p, max_tokens, greedy, eos, target=target, draft=draft))
        t2 = time.perf_counter()
        out = [t for s in steps for t in s.tokens]
        diff = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), None)
        same = out == ref
        bad += not same
        print(f"{name} {f}: {'equal' if same else f'DIFFER at {diff}'}, tau {len(out) / max(1, len(steps) - 1):.2f}, "
              f"plain {t1 - t0:.1f} s, dflash {t2 - t1:.1f} s", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], *map(int, sys.argv[2:3])))
