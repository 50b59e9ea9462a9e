"""Two drafts' held-out tau side by side, with how sure the difference is (the shipping decision).

Reads two training cards (`training_card.json`, as `flashfleet draft train` writes them; the
"trained" evaluation of each), or the output of `flashfleet draft eval --json` (one evaluation), of
drafts for one target, evaluated on the same held-out prompts,
and prints, for all prompts and for the chosen corpora together: each draft's pooled tau with its
95% bootstrap interval over prompts, and, where both cards hold per-prompt results (cards written
since 2026-12-02), the paired difference new - old with its interval
(`worker.training.evaluate.paired_tau_difference`). Cards without per-prompt results get the
pooled tau only:

    python bench/compare_drafts.py NEW/training_card.json OLD/training_card.json \
        [--corpora code_requests code_tasks humaneval]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CODE = ("code_requests", "code_tasks", "humaneval")


def _eval(path: str) -> dict:
    card = json.loads(Path(path).read_text())
    if "per_corpus" in card:  # `draft eval --json`: the evaluation itself
        return card
    ev = (card.get("eval") or {}).get("trained")
    if not ev:
        raise ValueError(f"{path}: no 'trained' evaluation in the card (nor a `draft eval --json` result)")
    return ev


def _pooled(ev: dict, corpora) -> tuple[float | None, list | None, int]:
    from worker.training.evaluate import pooled_tau_interval

    rows = [r for r in ev.get("per_prompt") or () if corpora is None or r["corpus"] in corpora]
    if rows:
        cyc = sum(r["cycles"] for r in rows)
        tau = (sum(r["accepted"] for r in rows) + cyc) / cyc if cyc else None
        return tau, pooled_tau_interval(rows), len(rows)
    parts = [v for c, v in ev["per_corpus"].items() if corpora is None or c in corpora]  # an older card
    cyc = sum(v["cycles"] for v in parts)
    tau = sum(v["tau"] * v["cycles"] for v in parts if v["tau"] is not None) / cyc if cyc else None
    return tau, None, sum(v["prompts"] for v in parts)


def main(argv=None) -> int:
    from worker.training.evaluate import paired_tau_difference

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("new")
    ap.add_argument("old")
    ap.add_argument("--corpora", nargs="+", default=list(CODE), help="a group reported together (default: code)")
    a = ap.parse_args(argv)
    try:
        new, old = _eval(a.new), _eval(a.old)
    except (OSError, ValueError) as e:
        print(f"compare_drafts: {e}", file=sys.stderr)
        return 2
    for key in ("block_size", "max_new_tokens"):
        if new.get(key) != old.get(key):
            print(f"compare_drafts: warning: {key} differs ({new.get(key)} against {old.get(key)}): "
                  "the taus are not measured alike", file=sys.stderr)
    fmt = lambda t, iv: "-" if t is None else f"{t:.3f}" + (f" ({iv[0]:.2f}-{iv[1]:.2f})" if iv else "")  # noqa: E731
    print(f"new {a.new}\nold {a.old}")
    print("| prompts | n | new tau (95%) | old tau (95%) | paired new - old (95%) |\n|---|---|---|---|---|")
    for label, corpora in (("all", None), ("+".join(a.corpora), set(a.corpora))):
        (tn, ivn, nn), (to, ivo, _) = _pooled(new, corpora), _pooled(old, corpora)
        d = paired_tau_difference(new, old, sorted(corpora) if corpora else None)
        if d is None:
            paired = ("- (no prompt measured by both)" if new.get("per_prompt") and old.get("per_prompt")
                      else "- (a card without per-prompt results)")
        elif d["difference"] is None:
            paired = f"- (no cycles on one side), {d['prompts']} shared"
        else:
            iv = d["interval"]
            paired = (f"{d['difference']:+.3f}" + (f" ({iv[0]:+.3f} to {iv[1]:+.3f})" if iv else " (one prompt)")
                      + f", {d['prompts']} shared")
        print(f"| {label} | {nn} | {fmt(tn, ivn)} | {fmt(to, ivo)} | {paired} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
