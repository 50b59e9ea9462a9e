"""Acceptance length tau of a DFlash draft on held-out prompts (one job: measure, greedy).

tau = tokens committed per draft/verify cycle, bonus token included (the paper's tau, Chen et al.
2026, arXiv 2602.06036, §5; design note /work/shared/research/dflash.md §5.1). It is measured by
decoding with the real decode loop, `worker.spec.dflash.dflash_generate`, greedy: per cycle the
target accepts `accepted` drafts plus one bonus, so tau = mean(accepted + 1) over cycles. The
prefill's first token is not a cycle and is not counted. A draft that is always wrong gives
tau = 1; the maximum is the block size B.
"""
from __future__ import annotations

import time
from typing import Iterable, Optional, Sequence

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
        {"per_corpus": {corpus: {"tau", "prompts", "cycles", "tokens"}}, "all": {same},
         "max_new_tokens", "block_size", "seconds"}; "tau" is None where no cycle ran. tau is
        tokens per cycle (>= 1, <= B); "all" pools every cycle of every prompt.
    """
    from tqdm import tqdm

    eos = frozenset(int(e) for e in eos_ids)
    order = interleave_by_corpus(prompts, lambda p: p["corpus"])
    rows: dict[str, list[dict]] = {p["corpus"]: [] for p in order}
    t0 = time.perf_counter()
    for p in tqdm(order, desc=desc, unit="prompt", disable=not progress, dynamic_ncols=True):
        if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
            break
        rows[p["corpus"]].append(acceptance_on_prompt(target, draft, p["prompt_ids"], max_new_tokens, eos,
                                                      block_size))
    return {
        "per_corpus": {c: _summary(r) for c, r in rows.items()},
        "all": _summary([x for r in rows.values() for x in r]),
        "max_new_tokens": max_new_tokens,
        "block_size": int(block_size or draft.block_size),
        "seconds": round(time.perf_counter() - t0, 1),
    }
