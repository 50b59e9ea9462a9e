"""Prompts written by the target itself, for more (and more varied) draft-training data.

Magpie (Xu et al. 2024, "Magpie: Alignment Data Synthesis from Scratch by Prompting Aligned LLMs
with Nothing", arXiv 2406.08464): an instruction-tuned model given only its chat template's
prefix of a user turn (system turn included, if the template adds one) continues it with a
plausible user message. Sampling that prefix many times gives prompts from the target's own
idea of its users, and the target then answers them as usual (`answers.build_dataset`). A DFlash
draft must learn the target's distribution (paper §4.2 regenerates every answer with the
target), and the prompt files of a small deployment hold a few thousand prompts at most, so
a draft trained over many sessions sees the same answers again and again; these prompts add
new ones at the cost of generation time.

Openings: a bare user-turn prefix gives the target's idea of *all* its users (for
Qwen2.5-Coder-1.5B, 16% of 2,000 of its prompts mention code, docs/training.md). A deployment that serves code wants code prompts. Given openings (the
first words of the deployment's own training prompts, `opening_text`), each message starts with
one and the target writes the rest, so the prompts stay near the prompt files' distribution
while their content is new (Magpie itself conditions on the template alone; the openings are
this project's addition).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Optional, Sequence

from worker.training.data import DataError, Prompt
from worker.training.generation import generate_responses

SYNTHETIC_CORPUS = "synthetic"  # corpus name of the prompts the target writes itself
SENTINEL = "\u2063flashfleet-user-text\u2063"  # invisible separators: no template writes this itself


class SyntheticPromptError(ValueError):
    """The target's tokenizer cannot start a user turn (no chat template, or the template does
    not put a user's text into the conversation verbatim)."""


def user_turn_prefix(tokenizer) -> list[int]:
    """Token ids of the chat template up to where a user's first message starts.

    For Qwen2.5 that is the default system turn plus `<|im_start|>user\\n`; for SmolLM2 and Gemma 3
    the same idea with their own markers.

    Args:
        tokenizer: an mlx-lm `TokenizerWrapper` or a Hugging Face tokenizer with a chat template.

    Returns:
        The prefix's token ids (non-empty; special-token markers parsed as special tokens).

    Raises:
        SyntheticPromptError: no chat template, or the rendered template does not contain the
            user's text as given.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise SyntheticPromptError("the target's tokenizer has no chat template: a synthetic prompt needs the "
                                   "template's user-turn prefix; give prompt files only")
    text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False,
                                         add_generation_prompt=False)
    at = text.find(SENTINEL)
    if at < 0:
        raise SyntheticPromptError("the target's chat template does not put the user's text into the "
                                   "conversation verbatim; synthetic prompts are not possible with it")
    if at == 0:
        raise SyntheticPromptError("the target's chat template puts nothing before a user's text: there is no "
                                   "user-turn prefix to sample prompts after")
    return [int(i) for i in tokenizer.encode(text[:at], add_special_tokens=False)]


OPENING_CHARS_PER_WORD = 16  # caps an opening of text without spaces (Chinese, Japanese) at ~a phrase


def opening_text(text: str, words: int) -> str:
    """The opening of a prompt: its first words, as written.

    Args:
        text: a prompt.
        words: how many whitespace-separated words (>= 1).

    Returns:
        The first `words` words of `text` with the whitespace between them kept (a code prompt's
        newlines and indentation stay), all of it (stripped) when it has fewer; at most
        `OPENING_CHARS_PER_WORD * words` characters, so text written without spaces gives a
        phrase, not the whole prompt.

    Raises:
        ValueError: words < 1.
    """
    if words < 1:
        raise ValueError(f"an opening needs at least one word, got {words}")
    m = re.match(r"\s*((?:\S+\s+){%d}\S+)" % (words - 1), text)
    return (m.group(1) if m else text.strip())[: OPENING_CHARS_PER_WORD * words].rstrip()


def special_token_ids(tokenizer) -> set[int]:
    """Ids of the special tokens (EOS, turn markers, ...): the added tokens marked special, plus
    `all_special_ids` and the EOS ids (a converted tokenizer's config may list only a few of them
    as special; its added-token table still marks them). Added tokens not marked special (Qwen's
    tool-call tags, for one) are left in a prompt's text."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return ({int(i) for i, tok in added.items() if getattr(tok, "special", False)}
            | {int(i) for i in getattr(tokenizer, "all_special_ids", [])} | {int(i) for i in tokenizer.eos_token_ids})


def write_user_prompts(
    model,
    tokenizer,
    count: int,
    *,
    max_tokens: int = 128,
    temperature: float = 1.0,
    top_p: float = 0.95,
    seed: int = 0,
    batch_size: int = 64,
    min_chars: int = 16,
    max_seconds: Optional[float] = None,
    progress: Optional[Callable[[int], None]] = None,
    openings: Optional[Sequence[list[int]]] = None,
) -> list[str]:
    """User messages sampled from the target after its template's user-turn prefix (Magpie).

    A message ends at the first special token (the end of the turn, or a stray turn marker) or
    after `max_tokens` tokens; one cut by the cap is kept as it is (it reads like a pasted
    excerpt, and the target answers what it is given), less a character the cap split. Messages
    shorter than `min_chars` characters after stripping, and repeats, are dropped. The messages
    depend on `seed`: a later run with the same seed writes the same ones.

    Args:
        model, tokenizer: the mlx-lm target and its tokenizer.
        count: messages to sample (>= 0).
        max_tokens: cap on a message's length, tokens (>= 1).
        temperature / top_p: sampling (> 0; Magpie samples at 1.0).
        seed: MLX random seed.
        batch_size: messages sampled together.
        min_chars: shortest message kept.
        max_seconds: wall-time limit (`generate_responses`); messages not started come back
            empty and are dropped.
        progress: called with the number of messages of each finished batch.
        openings: optional token ids (no special tokens) that message i starts with, one list
            per message (`count` of them); the target continues each, and the message is the
            opening and its continuation decoded together (`max_tokens` counts the continuation
            only). None: every message starts right after the prefix.

    Returns:
        Distinct message texts (at most `count`), in sampling order.

    Raises:
        SyntheticPromptError: see `user_turn_prefix`.
        ValueError: temperature <= 0 (every message would be the same), max_tokens < 1, or
            `openings` not one per message.
    """
    if temperature <= 0:
        raise ValueError("synthetic prompts need a temperature > 0: greedy decoding writes one prompt only")
    if count <= 0:
        return []
    if openings is not None and len(openings) != count:
        raise ValueError(f"{len(openings)} openings for {count} messages: give one per message")
    starts = [[]] * count if openings is None else [[int(t) for t in o] for o in openings]
    prefix = user_turn_prefix(tokenizer)
    special = special_token_ids(tokenizer)
    rows = generate_responses(model, [prefix + o for o in starts], max_tokens, sorted(special),
                              batch_size=batch_size, temperature=temperature, top_p=top_p, seed=seed,
                              max_seconds=max_seconds, progress=progress)
    texts, seen = [], set()
    for start, ids in zip(starts, rows):
        cut = next((j for j, t in enumerate(ids) if t in special), len(ids))
        if start and not tokenizer.decode(ids[:cut]).strip():  # an opening alone is no prompt
            continue
        text = tokenizer.decode(start + ids[:cut]).rstrip("\ufffd").strip()  # a cap can split a character
        if len(text) >= min_chars and text not in seen:
            seen.add(text)
            texts.append(text)
    return texts


def check_synthetic_inputs(files: Sequence[Path], synthetic_temperature: float, tokenizer,
                           openings: Optional[tuple[int, Sequence[str]]] = None) -> None:
    """What `--synthetic-prompts` needs, checked before any generation (also by the launcher of
    `flashfleet draft train --processes N`, so a bad input is one message, not one per rank).

    Args:
        files: the prompt files; tokenizer: the target's (its chat template starts a user turn).
        openings: (words, corpora) of `--synthetic-openings` / `--synthetic-openings-from`, or None.

    Raises:
        DataError: a prompt file named synthetic.* (it would merge with the written prompts'
            corpus), a temperature <= 0, a tokenizer without a usable chat template, a negative
            opening length, or an openings corpus that no prompt file gives.
    """
    if any(Path(f).stem == SYNTHETIC_CORPUS for f in files):
        raise DataError(f"a prompt file named {SYNTHETIC_CORPUS}.* would merge with the prompts the target "
                        "writes (--synthetic-prompts); rename it")
    if synthetic_temperature <= 0:
        raise DataError("synthetic prompts need a temperature > 0 (--synthetic-temperature)")
    try:
        user_turn_prefix(tokenizer)
    except SyntheticPromptError as e:
        raise DataError(f"--synthetic-prompts: {e}") from None
    if openings is not None:
        words, corpora = openings
        if words < 0:
            raise DataError(f"--synthetic-openings must be >= 0 words, got {words}")
        known = sorted({Path(f).stem for f in files})
        unknown = sorted(set(corpora) - set(known))
        if unknown:
            raise DataError(f"--synthetic-openings-from {' '.join(unknown)}: no prompt file of that name "
                            f"(corpora here: {', '.join(known)})")
        if corpora and not words:
            raise DataError("--synthetic-openings-from needs --synthetic-openings WORDS > 0")


def synthetic_openings_pool(train_prompts: Sequence[Prompt], words: int, corpora: Sequence[str]) -> list[str]:
    """The openings synthetic prompts may start with (`--synthetic-openings`).

    Args:
        train_prompts: the training prompts (after `split_heldout`: no held-out prompt among them).
        words: words per opening (>= 1; `synthetic.opening_text`).
        corpora: corpus names to take them from (empty: all).

    Returns:
        One opening per training prompt of `corpora`, in `train_prompts`' order, repeats kept
        (a common opening is drawn more often, as in the files).

    Raises:
        DataError: no training prompt of those corpora (all held out, or empty files)."""
    pool = [opening_text(p.text, words) for p in train_prompts if not corpora or p.corpus in corpora]
    pool = [o for o in pool if o]
    if not pool:
        raise DataError(f"--synthetic-openings: no training prompt of {', '.join(corpora) or 'any corpus'} "
                        "to take openings from (all held out, or empty)")
    return pool
