"""Acceptance length tau of a DFlash draft on held-out prompts (one job: measure, greedy).

tau = tokens committed per draft/verify cycle, bonus token included (the paper's tau, Chen et al.
2026, arXiv 2602.06036, §5). It is measured by
decoding with the worker's own functions for one sequence (`worker.engine.one_sequence.decode`),
greedy: per cycle the target accepts `accepted` drafts plus one bonus, so tau = mean(accepted + 1)
over cycles (iterations that drafted; a last iteration of one token drafts nothing and is not
counted). A draft that is always wrong gives tau = 1; the maximum is the block size B.
"""
from __future__ import annotations

import hashlib
import time
from typing import Iterable, Optional, Sequence

import numpy as np

from worker.engine.one_sequence import decode
from worker.sampling import greedy
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
    for step in decode(target, list(prompt_ids), max_new_tokens, greedy, eos_ids, draft=draft,
                       block_size=block_size):
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
            one target: they pair by corpus and `prompt_key`; a prompt held twice counts as the
            sum of its rows).
        corpora: only these corpora's prompts (None: all).

    Returns:
        {"prompts", "new", "old", "difference", "interval"} (taus pooled over the shared
        prompts; a tau is None without cycles, the interval None with fewer than two shared
        prompts or no resample with cycles on both sides), or None when either has no per-prompt
        results or they share no prompt.
    """
    if not new.get("per_prompt") or not old.get("per_prompt"):
        return None

    def by_prompt(rows):
        out: dict[tuple, list[float]] = {}
        for r in rows:
            if corpora is None or r["corpus"] in corpora:
                acc = out.setdefault((r["corpus"], r["key"]), [0.0, 0.0])
                acc[0] += r["cycles"]
                acc[1] += r["accepted"]
        return out

    a, b = by_prompt(new["per_prompt"]), by_prompt(old["per_prompt"])
    shared = sorted(set(a) & set(b))
    if not shared:
        return None
    ca, aa = np.array([a[k] for k in shared]).T
    cb, ab = np.array([b[k] for k in shared]).T
    tau = lambda acc, cyc: float((acc.sum() + cyc.sum()) / cyc.sum()) if cyc.sum() else None  # noqa: E731
    tn, to = tau(aa, ca), tau(ab, cb)
    interval = None
    if len(shared) >= 2:
        idx = np.random.default_rng(BOOTSTRAP_SEED).integers(0, len(shared), (BOOTSTRAP_RESAMPLES, len(shared)))
        sa, sb = ca[idx].sum(axis=1), cb[idx].sum(axis=1)
        ok = (sa > 0) & (sb > 0)  # a resample without cycles on one side has no tau there
        if ok.any():
            diffs = (aa[idx].sum(axis=1)[ok] + sa[ok]) / sa[ok] - (ab[idx].sum(axis=1)[ok] + sb[ok]) / sb[ok]
            lo, hi = np.quantile(diffs, [(1 - level) / 2, (1 + level) / 2])
            interval = [round(float(lo), 4), round(float(hi), 4)]
    return {"prompts": len(shared), "new": None if tn is None else round(tn, 4),
            "old": None if to is None else round(to, 4),
            "difference": None if tn is None or to is None else round(tn - to, 4), "interval": interval}


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
        max_seconds: stop starting new prompts after this much wall time, counted from the end
            of the first prompt (whose time on a cold GPU is mostly MLX compiling kernels: 150 s
            of a 180 s limit on an H200); None: no limit.
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
    t0 = None  # the clock starts after the first prompt: on a cold GPU it is mostly kernel compiles
    for p in tqdm(order, desc=desc, unit="prompt", disable=not progress, dynamic_ncols=True):
        if max_seconds is not None and t0 is not None and time.perf_counter() - t0 > max_seconds:
            break
        r = acceptance_on_prompt(target, draft, p["prompt_ids"], max_new_tokens, eos, block_size)
        rows[p["corpus"]].append(r)
        per_prompt.append({"corpus": p["corpus"], "key": prompt_key(p["prompt_ids"]), **r})
        if t0 is None:
            t0 = time.perf_counter()
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
