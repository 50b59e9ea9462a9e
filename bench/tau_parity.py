"""Decoding tau against teacher-forced tau on the same tokens: do training and inference agree?

    python bench/tau_parity.py TARGET_DIR DRAFT_DIR HELDOUT_JSONL [--per-corpus 1] [--max-tokens 128]

Training reports a teacher-forced acceptance estimate (`loss.acceptance_stats`, the `val:` lines):
every block sees the target's taps of the clean sequence before its anchor. Decoding builds the
draft's context one cycle at a time from the verify forwards' taps (`spec.dflash`). For each
held-out prompt this script decodes greedily with DFlash, then recomputes every cycle's block from
scratch (a fresh draft cache fed the taps of one full-sequence target forward) and counts how
many drafts match the decoded tokens:

- `tau decode`: tokens per cycle of the real decode loop (bonus included);
- `tau same anchors`: the teacher-forced count at the decode loop's own anchors; it equals
  `tau decode` when the incremental draft context holds what training assumes (a gap is a
  train/inference mismatch, not a weak draft);
- `tau all anchors`: the teacher-forced count with an anchor at every response position, as the
  `val:` lines average; it differs from `tau decode` only by where the anchors fall.

Prints one row per prompt and a pooled row. Runs on any MLX device (float32 on the CPU is exact
enough; a 1.5B target took about three minutes a prompt of 32 tokens on two cores).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
from mlx_lm.utils import load_model  # noqa: E402

from worker.capture import HiddenCapture  # noqa: E402
from worker.models.dflash_checkpoint import load_dflash_draft  # noqa: E402
from worker.sampling import greedy  # noqa: E402
from worker.spec.dflash import dflash_generate  # noqa: E402


def eos_ids(target_dir: Path) -> set[int]:
    """EOS ids from generation_config.json (else config.json)."""
    for name in ("generation_config.json", "config.json"):
        p = target_dir / name
        if p.exists():
            e = json.loads(p.read_text()).get("eos_token_id")
            if e is not None:
                return set(e if isinstance(e, list) else [e])
    raise SystemExit(f"no eos_token_id in {target_dir}")


def teacher_forced_accepts(draft, seq: list[int], taps: mx.array, anchor: int, width: int) -> int:
    """Drafts of the block anchored at `anchor` that match seq[anchor+1 : anchor+1+width] as a prefix.

    Args:
        draft: the bound DFlash draft.
        seq: token ids, prompt and answer.
        taps: (1, >= anchor, n_taps * D) target taps of seq's positions (one clean forward).
        anchor: the block's position (its first token is seq[anchor]); its context is a fresh
            draft cache fed taps[:, :anchor].
        width: drafts to compare (B - 1 or fewer); 0 gives 0.
    """
    if width < 1:
        return 0
    block = [seq[anchor]] + [int(draft.mask_token_id)] * width
    logits = draft(mx.array([block], dtype=mx.uint32), taps[:, :anchor] if anchor else None, draft.make_cache())
    guess = draft.draft_tokens(logits[0]).tolist()
    labels = seq[anchor + 1: anchor + 1 + width]
    n = 0
    while n < len(labels) and guess[n] == labels[n]:
        n += 1
    return n


def measure(target, draft, prompt: list[int], max_tokens: int, eos: set[int]) -> dict:
    """One prompt: decode, then the teacher-forced counts at the same and at all anchors.

    Returns:
        {cycles, decoded (drafts the loop accepted, summed), same (teacher-forced at its
        anchors), mismatched (cycles where the two differ), all_n / all (anchors at every answer
        position and their teacher-forced count), tokens (answer length)}.
    """
    steps = list(dflash_generate(prompt, max_tokens, greedy, eos, target=target, draft=draft))
    steps = [s for s in steps if s.tokens]
    out = [t for s in steps for t in s.tokens]
    seq = list(prompt) + out
    cap = HiddenCapture(target, draft.target_layer_ids)
    with cap:
        target(mx.array([seq[:-1]], dtype=mx.uint32))  # taps of every position a block can see
    taps = cap.hidden()
    mx.eval(taps)
    anchors, decoded, same = [], [], []
    pos = len(prompt) + len(steps[0].tokens) - 1  # the first cycle's block starts at the prefill's token
    for s in steps[1:]:
        anchors.append(pos)
        # A cycle cut at max_tokens or EOS keeps fewer tokens than it accepted: count what it kept.
        cap = s.drafted if len(s.tokens) == s.accepted + 1 else len(s.tokens) - 1
        decoded.append(min(s.accepted, cap))
        same.append(min(cap, teacher_forced_accepts(draft, seq, taps, pos, s.drafted)))
        pos += len(s.tokens)
    B1 = draft.block_size - 1
    every = [teacher_forced_accepts(draft, seq, taps, p, min(B1, len(seq) - 1 - p))
             for p in range(len(prompt) - 1 + len(steps[0].tokens), len(seq) - 1)]
    return {"cycles": len(anchors), "decoded": sum(decoded), "same": sum(same), "mismatched": sum(a != b for a, b in zip(decoded, same)),
            "all_n": len(every), "all": sum(every), "tokens": len(out)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target", type=Path)
    ap.add_argument("draft", type=Path)
    ap.add_argument("heldout", type=Path, help="heldout.jsonl of a training data cache (corpus, id, prompt_ids)")
    ap.add_argument("--per-corpus", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    a = ap.parse_args()
    target, _ = load_model(a.target)
    draft = load_dflash_draft(a.draft, target)
    eos = eos_ids(a.target)
    rows, seen = [], {}
    for line in a.heldout.read_text().splitlines():
        r = json.loads(line)
        if seen.get(r["corpus"], 0) < a.per_corpus:
            seen[r["corpus"]] = seen.get(r["corpus"], 0) + 1
            rows.append(r)
    print(f"target {a.target.name}  draft {a.draft}  max_tokens {a.max_tokens}  device {mx.default_device()}")
    print(f"{'corpus':<28} {'prompt':<22} {'cycles':>6} {'tau decode':>10} {'tau same anchors':>16} "
          f"{'cycles differing':>16} {'tau all anchors':>15} {'s':>5}")
    tot = {"cycles": 0, "decoded": 0, "same": 0, "mismatched": 0, "all_n": 0, "all": 0}
    for r in rows:
        t0 = time.perf_counter()
        m = measure(target, draft, r["prompt_ids"], a.max_tokens, eos)
        for k in tot:
            tot[k] += m[k]
        c = max(m["cycles"], 1)
        print(f"{r['corpus']:<28} {r['id'][:22]:<22} {m['cycles']:>6} {1 + m['decoded'] / c:>10.3f} "
              f"{1 + m['same'] / c:>16.3f} {m['mismatched']:>16} {1 + m['all'] / max(m['all_n'], 1):>15.3f} "
              f"{time.perf_counter() - t0:>5.0f}", flush=True)
    c = max(tot["cycles"], 1)
    print(f"{'all':<28} {'':<22} {tot['cycles']:>6} {1 + tot['decoded'] / c:>10.3f} {1 + tot['same'] / c:>16.3f} "
          f"{tot['mismatched']:>16} {1 + tot['all'] / max(tot['all_n'], 1):>15.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
