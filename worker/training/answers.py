"""The training sequences: the target answers the training prompts (`build_dataset`).

The target answers with its own chat template (`encode_prompt`), batched
(`generation.generate_responses`: static left-padded batches); a response keeps its EOS token so
the draft learns to end. Further passes sample more answers to the same prompts, the target may
write prompts itself first (`synthetic`), and earlier runs' data (`extra_data`) replaces answers
that would be generated again. Everything is cached (`data_cache`): a rerun with the same key
loads the cache and skips generation.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
from tqdm import tqdm

from worker.capture import target_vocab_size
from worker.training.data import (DataError, encode_prompt, interleave_by_corpus, read_prompt_files, sampled_pass_order,
                                  split_heldout)
from worker.training.data_cache import DataSplit, dataset_key, load_cache, save_cache
from worker.training.extra_data import extra_data_key, load_extra_data, shard_of
from worker.training.generation import generate_responses
from worker.training.sequences import TokenDataset
from worker.training.synthetic import (SYNTHETIC_CORPUS, check_synthetic_inputs, synthetic_openings_pool,
                                       write_user_prompts)

SYNTHETIC_STREAM = 7919  # seeds the synthetic prompts apart from every answer pass


def build_dataset(
    model,
    tokenizer,
    prompt_files: Sequence[str | Path],
    cache_dir: str | Path,
    *,
    max_per_file: Optional[int] = None,
    max_prompt_tokens: int = 256,
    max_new_tokens: int = 256,
    heldout_per_corpus: int = 8,
    heldout_fraction: float = 0.1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    gen_batch_size: int = 64,
    gen_max_seconds: Optional[float] = None,
    samples: int = 1,
    sample_temperature: float = 0.8,
    synthetic: int = 0,
    synthetic_max_tokens: int = 128,
    synthetic_temperature: float = 1.0,
    synthetic_top_p: float = 0.95,
    synthetic_openings: Optional[tuple[int, Sequence[str]]] = None,
    target_fingerprint: str = "",
    extra_data: Sequence[str | Path] = (),
    regenerate: bool = False,
    shard: tuple[int, int] = (0, 1),
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> DataSplit:
    """Builds (or loads from `cache_dir`) the training sequences and the held-out prompts.

    The cache key covers the prompt files' contents, every setting above and the target's
    fingerprint; a matching `cache_dir/meta.json` means `train.jsonl` and `heldout.jsonl` are
    reused and the target generates nothing.

    Args:
        model, tokenizer: the mlx-lm target and its tokenizer.
        prompt_files: .jsonl / text prompt files (`read_prompt_files`).
        cache_dir: where the cache lives (created).
        max_per_file: prompts read per file (None: all).
        max_prompt_tokens: cap on a prompt's own tokens (`encode_prompt`).
        max_new_tokens: cap on a response's length, tokens.
        heldout_per_corpus / heldout_fraction: the held-out split (`split_heldout`).
        temperature / top_p / seed: the target's sampling (temperature 0: greedy).
        gen_batch_size: rows generated concurrently.
        gen_max_seconds: wall-time limit of generation (`generate_responses`), over all passes;
            not part of the cache key.
        samples: answers per training prompt (>= 1). Pass 1 answers every prompt at
            `temperature`; passes 2.. answer every prompt again, sampled at `sample_temperature`
            (a seed derived from seed and pass), in `sampled_pass_order` (so a time-capped pass covers other prompts
            under another seed): more sequences from the same prompts, still the target's own
            distribution. Held-out prompts are never answered.
        synthetic: prompts the target writes itself (`synthetic.write_user_prompts`, Magpie),
            split over the ranks, after the first pass: each rank samples its share (within a
            third of the time left), keeps the distinct ones and answers them as the first pass
            does. Their corpus is "synthetic"; none is held out. 0: none.
        synthetic_max_tokens / synthetic_temperature / synthetic_top_p: how they are sampled.
        synthetic_openings: (words, corpora): each synthetic prompt starts with the first `words`
            words of a training prompt of `corpora` (all when empty), drawn at random (seeded),
            and the target writes the rest (`synthetic_openings_pool`); None or words 0: Magpie
            from the bare user-turn prefix.
        target_fingerprint: identifies the target weights (part of the key).
        extra_data: earlier runs' data cache directories of the same target
            (`extra_data.load_extra_data`): their greedy answers to this run's training prompts
            are reused instead of generated (first pass, when it is greedy), their other
            sequences are added (each rank takes every world-th); held-out prompts and repeats
            are dropped. Their training files' hashes are part of the key.
        regenerate: generate even when the cache matches (e.g. after a time-capped run).
        shard: (rank, world size) of data-parallel training: this process answers every
            world-th prompt of each pass's order from position rank, and its cache holds only
            those (give each rank its own `cache_dir`). The held-out split is the same on every
            rank. The key does not depend on the shard.
        progress: show the generation bar.
        log: progress messages.

    Returns:
        A `DataSplit`. Responses shorter than 2 tokens are dropped (no anchor fits).

    Raises:
        DataError: no training prompts, no usable sequences after generation, or unusable
            --extra-data (another target's, missing files).
    """
    cache_dir = Path(cache_dir)
    files = [Path(p) for p in prompt_files]
    key, settings = dataset_key(files, max_per_file=max_per_file, max_prompt_tokens=max_prompt_tokens,
                                max_new_tokens=max_new_tokens, heldout_per_corpus=heldout_per_corpus,
                                heldout_fraction=heldout_fraction, temperature=temperature, top_p=top_p,
                                seed=seed, samples=samples, sample_temperature=sample_temperature,
                                target_fingerprint=target_fingerprint, synthetic=synthetic,
                                synthetic_max_tokens=synthetic_max_tokens,
                                synthetic_temperature=synthetic_temperature, synthetic_top_p=synthetic_top_p,
                                synthetic_openings=synthetic_openings,
                                extra=extra_data_key(extra_data) if extra_data else None)
    if not regenerate and (cached := load_cache(cache_dir, key, shard, log)) is not None:
        return cached

    prompts = read_prompt_files(files, max_per_file)
    for f in files:
        if not any(p.corpus == f.stem for p in prompts):
            log(f"data: {f} holds no prompts; skipped")
    if synthetic:  # fail now, not after the first pass
        check_synthetic_inputs(files, synthetic_temperature, tokenizer, synthetic_openings)
    known_texts = {" ".join(p.text.split()) for p in prompts}  # a synthetic prompt must not repeat one
    train_p, held_p = split_heldout(prompts, heldout_per_corpus, heldout_fraction)
    train_p = interleave_by_corpus(train_p)  # a time-capped generation still covers every corpus
    if not train_p:
        raise DataError("no training prompts (all held out, or the files are empty)")
    pool = (synthetic_openings_pool(train_p, *synthetic_openings)  # fails now, not after the first pass
            if synthetic and synthetic_openings and synthetic_openings[0] else None)
    enc = [encode_prompt(tokenizer, p.text, max_prompt_tokens) for p in train_p]
    heldout = [{"corpus": p.corpus, "id": p.id, "prompt_ids": encode_prompt(tokenizer, p.text, max_prompt_tokens)}
               for p in held_p]
    log(f"data: {len(train_p)} training prompts, {len(held_p)} held out; the target answers "
        f"(up to {max_new_tokens} tokens, batch {gen_batch_size}, "
        f"{'greedy' if temperature <= 0 else f'T={temperature}'}"
        + (f", then {samples - 1} more sampled at T={sample_temperature}" if samples > 1 else "") + ")")
    if samples < 1:
        raise DataError("samples must be >= 1")
    if synthetic < 0:
        raise DataError("synthetic must be >= 0")
    t0 = time.perf_counter()
    ds, generated = TokenDataset(), 0
    rank, world_size = shard
    if not 0 <= rank < world_size:
        raise ValueError(f"shard {shard}: need 0 <= rank < world size")
    extra = load_extra_data(extra_data, target_fingerprint=target_fingerprint, max_new_tokens=max_new_tokens,
                            answered=enc if temperature <= 0 else [], eos_ids=tokenizer.eos_token_ids,
                            heldout_prompt_ids=[h["prompt_ids"] for h in heldout],
                            heldout_ids=[h["id"] for h in heldout], vocab_size=target_vocab_size(model))
    reused = 0  # greedy answers taken from --extra-data instead of generated
    share = len(range(rank, len(enc), world_size))  # prompts this rank answers per pass
    my_synthetic = len(range(rank, synthetic, world_size))
    written = 0

    def add(rows: list[tuple[str, str, list[int]]], responses: list[list[int]]) -> None:
        for (corpus, pid, ids), r in zip(rows, responses):
            if len(r) >= 2:
                ds.prompt_ids.append(ids)
                ds.response_ids.append(r)
                ds.corpus.append(corpus)
                ds.ids.append(pid)

    def answer_synthetic(left: Optional[float]) -> int:
        """Writes this rank's synthetic prompts (a third of the time left at most), answers them at
        `temperature`; returns the tokens generated."""
        nonlocal written
        start = time.perf_counter()
        openings = None
        if pool:
            picks = np.random.default_rng([seed, SYNTHETIC_STREAM, rank, 2]).integers(len(pool), size=my_synthetic)
            openings = [tokenizer.encode(pool[i], add_special_tokens=False) for i in picks.tolist()]
        texts = write_user_prompts(model, tokenizer, my_synthetic, max_tokens=synthetic_max_tokens,
                                   temperature=synthetic_temperature, top_p=synthetic_top_p,
                                   seed=int(np.random.SeedSequence([seed, SYNTHETIC_STREAM, rank]).generate_state(1)[0]),
                                   batch_size=gen_batch_size, max_seconds=None if left is None else left / 3,
                                   openings=openings)
        new = [t for t in texts if " ".join(t.split()) not in known_texts]  # held-out ones above all
        written = len(new)
        took = time.perf_counter() - start
        # Say when the limit, not repeats, cut the count: a short --gen-max-minutes leaves a third
        # of it to writing, which may be one batch (e.g. 967 of 8000 prompts).
        cut = (f"; writing stopped at its limit, a third of the generation time left ({left / 3:.0f} s): "
               "give --gen-max-minutes more for more prompts") if left is not None and took >= left / 3 else ""
        begun = (f", each begun with {synthetic_openings[0]} words of a training prompt"
                 + (f" of {', '.join(synthetic_openings[1])}" if synthetic_openings[1] else "")) if openings else ""
        log(f"data: the target wrote {len(new)} distinct new prompts of {my_synthetic} sampled{begun} "
            f"({len(texts) - len(new)} repeated a prompt file's; {took:.1f} s{cut})")
        texts = new
        bar.total += len(texts)
        bar.refresh()
        left = None if left is None else left - (time.perf_counter() - start)
        rows = [(SYNTHETIC_CORPUS, f"{SYNTHETIC_CORPUS}/{rank}/{i}", encode_prompt(tokenizer, t, max_prompt_tokens))
                for i, t in enumerate(texts)]
        noise = seed if world_size == 1 else int(np.random.SeedSequence([seed, SYNTHETIC_STREAM, rank, 1])
                                                 .generate_state(1)[0])
        responses = generate_responses(model, [r[2] for r in rows], max_new_tokens, sorted(tokenizer.eos_token_ids),
                                       batch_size=gen_batch_size, top_p=top_p, seed=noise, temperature=temperature,
                                       max_seconds=left, progress=bar.update)
        add(rows, responses)
        return sum(len(r) for r in responses)

    with tqdm(total=share * samples, desc="generate", unit="answer", dynamic_ncols=True, disable=not progress) as bar:
        for k in range(samples):
            left = None if gen_max_seconds is None else gen_max_seconds - (time.perf_counter() - t0)
            if k and left is not None and left <= 0:  # the greedy pass always answers a first batch
                break
            # Pass k's seed comes from (seed, k), so --seed s pass 2 does not repeat --seed s+1 pass 1.
            # The order is the same on every rank (their shares must split it); the sampling
            # noise is each rank's own.
            pass_seed = seed if k == 0 else int(np.random.SeedSequence([seed, k]).generate_state(1)[0])
            noise_seed = pass_seed if world_size == 1 else int(
                np.random.SeedSequence([seed, k, rank]).generate_state(1)[0])
            order = list(range(len(enc))) if k == 0 else sampled_pass_order([p.corpus for p in train_p], pass_seed)
            order = order[rank::world_size]
            if k == 0 and extra.greedy:  # answers an earlier run already wrote greedily
                known = [i for i in order if tuple(enc[i]) in extra.greedy]
                add([(train_p[i].corpus, train_p[i].id, enc[i]) for i in known],
                    [extra.greedy[tuple(enc[i])] for i in known])
                reused = len(known)
                order = [i for i in order if tuple(enc[i]) not in extra.greedy]
                bar.update(reused)
            responses = generate_responses(model, [enc[i] for i in order], max_new_tokens,
                                           sorted(tokenizer.eos_token_ids),
                                           batch_size=gen_batch_size, top_p=top_p, seed=noise_seed,
                                           temperature=temperature if k == 0 else sample_temperature,
                                           max_seconds=left, progress=bar.update)
            generated += sum(len(r) for r in responses)
            add([(train_p[i].corpus, train_p[i].id if k == 0 else f"{train_p[i].id}#sample{k}", enc[i])
                 for i in order], responses)
            if k == 0 and synthetic:
                left = None if gen_max_seconds is None else gen_max_seconds - (time.perf_counter() - t0)
                if left is None or left > 0:
                    generated += answer_synthetic(left)
                else:
                    log("data: no generation time left for synthetic prompts after the first pass")
    gen_s = time.perf_counter() - t0
    added = shard_of(extra.added, rank, world_size)
    for name in ("prompt_ids", "response_ids", "corpus", "ids"):
        getattr(ds, name).extend(getattr(added, name))
    if extra_data:
        src = extra.sources
        log(f"data: --extra-data: {reused} greedy answers reused instead of generated and {len(added)} sequences added"
            + (f" on this rank ({sum(x['reused_offered'] for x in src)} and {len(extra.added)} over all ranks)"
               if world_size > 1 else "")
            + f"; dropped: {sum(x['heldout_dropped'] for x in src)} held out, {sum(x['repeats_dropped'] for x in src)} "
            f"repeated or too short, {sum(x['superseded'] for x in src)} incomplete answers this run wrote again")
    if not len(ds):
        raise DataError("the target produced no response of 2 or more tokens")
    eos = set(tokenizer.eos_token_ids)
    meta = {"key": key, "settings": settings, "train_sequences": len(ds), "heldout_prompts": len(heldout),
            "train_tokens": ds.num_tokens, "response_tokens": ds.num_response_tokens,
            "ended_with_eos": sum(1 for r in ds.response_ids if r[-1] in eos),
            "generation_s": round(gen_s, 1),
            "generation_stopped_by_time_limit": bool(gen_max_seconds is not None and gen_s >= gen_max_seconds),
            "generation_tokens_per_s": round(generated / max(gen_s, 1e-9), 1),
            "corpora": {c: ds.corpus.count(c) for c in sorted(set(ds.corpus))}, "shard": list(shard),
            "synthetic_prompts_written": written, "extra_greedy_reused": reused, "extra_added": len(added),
            "extra_data": extra.sources, "extra_corpora": extra.corpora}
    split = DataSplit(ds, heldout, meta)
    save_cache(cache_dir, split)
    speed = (f"{generated} generated in {gen_s:.1f} s ({meta['generation_tokens_per_s']} tok/s)" if generated
             else "none generated (all from --extra-data)")
    log(f"data: {len(ds)} sequences, {ds.num_response_tokens} response tokens, {speed}; cached in {cache_dir}")
    return split
