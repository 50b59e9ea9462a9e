"""Acceptance length tau of a DFlash draft on held-out prompts (one job: measure, greedy).

tau = tokens committed per draft/verify cycle, bonus token included (the paper's tau, Chen et al.
2026, arXiv 2602.06036, §5; design note /work/shared/research/dflash.md §5.1). It is measured by
decoding with the real decode loop, `worker.spec.dflash.dflash_generate`, greedy: per cycle the
target accepts `accepted` drafts plus one bonus, so tau = mean(accepted + 1) over cycles. The
prefill's first token is not a cycle and is not counted. A draft that is always wrong gives
tau = 1; the maximum is the block size B.
"""
from __future__ import annotations

import hashlib
import time
from typing import Iterable, Optional, Sequence

import numpy as np

from worker.sampling import greedy
from worker.spec.dflash import dflash_generate
from worker.training.data import interleave_by_corpus


def acceptance_on_prompt(
    target, draft, prompt_ids: Sequence[int], max_new_tokens: int, eos_ids: Iterable[int],
    block_size: Optional[int] = None,
) -> dict:
    """Decodes one prompt greedily with the draft and counts its cycles.

    Args:
        target: the mlx-lm target.
        draft: a bound DFlash draft (`worker.models.dflash.Model`).
        prompt_ids: templated prompt token ids (non-empty).
        max_new_tokens: generation cap, tokens (> 0).
        eos_ids: generation ends at the first of these.
        block_size: B for decoding (default the draft's).

    Returns:
        {"cycles": n, "accepted": sum of accepted drafts, "tokens": tokens generated}; tau of the
        prompt is (accepted + cycles) / cycles.
    """
    cycles = accepted = tokens = 0
    for step in dflash_generate(list(prompt_ids), max_new_tokens, greedy, eos_ids, target=target,
                                draft=draft, block_size=block_size):
        tokens += len(step.tokens)
        if step.drafted:
            cycles += 1
            accepted += step.accepted
    return {"cycles": cycles, "accepted": accepted, "tokens": tokens}


BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0  # fixed: the same results give the same interval


def prompt_key(prompt_ids: Sequence[int]) -> str:
    """A held-out prompt's identity across runs: the first 12 hex digits of the SHA-1 of its
    templated token ids (int32), so two drafts' evaluations of one target pair up by prompt."""
    return hashlib.sha1(np.asarray(prompt_ids, dtype=np.int32).tobytes()).hexdigest()[:12]


def pooled_tau_interval(rows: Sequence[dict], level: float = 0.95) -> Optional[list[float]]:
    """Percentile bootstrap interval of the pooled tau (sum(accepted + cycles) / sum(cycles)),
    resampling prompts with replacement (`BOOTSTRAP_RESAMPLES`, seeded): how far the tau of these
    prompts' kind could move with other prompts of it (Efron & Tibshirani 1993, ch. 13). None
    with fewer than two prompts or no cycle.

    Args:
        rows: per-prompt results ({"cycles", "accepted"}), e.g. `evaluate_tau`'s "per_prompt".
    """
    cyc = np.array([r["cycles"] for r in rows], dtype=np.float64)
    acc = np.array([r["accepted"] for r in rows], dtype=np.float64)
    if len(rows) < 2 or cyc.sum() == 0:
        return None
    idx = np.random.default_rng(BOOTSTRAP_SEED).integers(0, len(rows), (BOOTSTRAP_RESAMPLES, len(rows)))
    c = cyc[idx].sum(axis=1)
    taus = (acc[idx].sum(axis=1) + c) / np.maximum(c, 1)
    lo, hi = np.quantile(taus[c > 0], [(1 - level) / 2, (1 + level) / 2])
    return [round(float(lo), 4), round(float(hi), 4)]


def paired_tau_difference(new: dict, old: dict, corpora: Optional[Sequence[str]] = None,
                          level: float = 0.95) -> Optional[dict]:
    """Pooled tau of `new` minus that of `old` over the prompts both measured, with a paired
    percentile bootstrap interval (the same resampled prompts for both): far narrower than two
    separate intervals, since most of the spread is the prompts, which both drafts share.

    Args:
        new, old: `evaluate_tau` results with "per_prompt" (runs on the same held-out prompts of
            one target: they pair by `prompt_key`).
        corpora: only these corpora's prompts (None: all).

    Returns:
        {"prompts", "new", "old", "difference", "interval"} (taus pooled over the shared
        prompts), or None when either has no per-prompt results or they share no prompt.
    """
    if not new.get("per_prompt") or not old.get("per_prompt"):
        return None
    keep = (lambda r: r["corpus"] in corpora) if corpora else (lambda r: True)  # noqa: E731
    a = {r["key"]: r for r in new["per_prompt"] if keep(r)}
    b = {r["key"]: r for r in old["per_prompt"] if keep(r)}
    shared = sorted(set(a) & set(b))
    if not shared:
        return None
    arr = lambda rows, f: np.array([rows[k][f] for k in shared], dtype=np.float64)  # noqa: E731
    ca, aa, cb, ab = arr(a, "cycles"), arr(a, "accepted"), arr(b, "cycles"), arr(b, "accepted")
    tau = lambda acc, cyc: float((acc.sum() + cyc.sum()) / max(cyc.sum(), 1))  # noqa: E731
    idx = np.random.default_rng(BOOTSTRAP_SEED).integers(0, len(shared), (BOOTSTRAP_RESAMPLES, len(shared)))
    sa, sb = np.maximum(ca[idx].sum(axis=1), 1), np.maximum(cb[idx].sum(axis=1), 1)
    diffs = (aa[idx].sum(axis=1) + sa) / sa - (ab[idx].sum(axis=1) + sb) / sb
    lo, hi = np.quantile(diffs, [(1 - level) / 2, (1 + level) / 2])
    return {"prompts": len(shared), "new": round(tau(aa, ca), 4), "old": round(tau(ab, cb), 4),
            "difference": round(tau(aa, ca) - tau(ab, cb), 4), "interval": [round(float(lo), 4), round(float(hi), 4)]}


def _summary(rows: list[dict]) -> dict:
    cycles = sum(r["cycles"] for r in rows)
    accepted = sum(r["accepted"] for r in rows)
    return {
        "tau": round((accepted + cycles) / cycles, 4) if cycles else None,
        "prompts": len(rows),
        "cycles": cycles,
        "tokens": sum(r["tokens"] for r in rows),
    }


def evaluate_tau(
    target,
    draft,
    prompts: Sequence[dict],
    max_new_tokens: int,
    eos_ids: Iterable[int],
    *,
    block_size: Optional[int] = None,
    max_seconds: Optional[float] = None,
    progress: bool = True,
    desc: str = "eval tau",
) -> dict:
    """tau per corpus and overall, greedy, on held-out prompts.

    Prompts are visited round-robin over corpora, so a time limit still leaves every corpus
    measured on about the same number of prompts.

    Args:
        target / draft: as `acceptance_on_prompt`.
        prompts: dicts with "corpus" and "prompt_ids" (the held-out split of `build_dataset`).
        max_new_tokens: generation cap per prompt, tokens.
        eos_ids: EOS ids of the target's tokenizer.
        block_size: B for decoding (default the draft's).
        max_seconds: stop starting new prompts after this much wall time (None: no limit).
        progress: show a tqdm bar.

    Returns:
        {"per_corpus": {corpus: {"tau", "prompts", "cycles", "tokens"}}, "all": {same, and
         "interval": the 95% bootstrap interval of its tau over prompts, `pooled_tau_interval`},
         "per_prompt": [{"corpus", "key" (`prompt_key`), "cycles", "accepted", "tokens"}] in the
         order measured, "max_new_tokens", "block_size", "seconds"}; "tau" is None where no
        cycle ran. tau is tokens per cycle (>= 1, <= B); "all" pools every cycle of every prompt.
    """
    from tqdm import tqdm

    eos = frozenset(int(e) for e in eos_ids)
    order = interleave_by_corpus(prompts, lambda p: p["corpus"])
    rows: dict[str, list[dict]] = {p["corpus"]: [] for p in order}
    per_prompt = []
    t0 = time.perf_counter()
    for p in tqdm(order, desc=desc, unit="prompt", disable=not progress, dynamic_ncols=True):
        if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
            break
        r = acceptance_on_prompt(target, draft, p["prompt_ids"], max_new_tokens, eos, block_size)
        rows[p["corpus"]].append(r)
        per_prompt.append({"corpus": p["corpus"], "key": prompt_key(p["prompt_ids"]), **r})
    pooled = _summary(per_prompt)
    pooled["interval"] = pooled_tau_interval(per_prompt)
    return {
        "per_corpus": {c: _summary(r) for c, r in rows.items()},
        "all": pooled,
        "per_prompt": per_prompt,
        "max_new_tokens": max_new_tokens,
        "block_size": int(block_size or draft.block_size),
        "seconds": round(time.perf_counter() - t0, 1),
    }
