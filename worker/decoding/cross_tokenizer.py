"""Cross-tokenizer speculative decoding (Universal Assisted Generation, "uag" mode).

The draft has its own tokenizer. Sources: Timor et al. 2025, "Accelerating LLM Inference with
Lossless Speculative Decoding Algorithms for Heterogeneous Vocabularies" (arXiv:2502.05202, the
SLEM method); Hugging Face blog "Universal Assisted Generation" (Intel Labs + HF, October 2024,
transformers `AssistedCandidateGeneratorDifferentTokenizers`); mlx-lm PR #1025 (naive vs
context-aware translation); Leviathan et al. 2023 for the speculative round itself. docs/uag.md
describes the method.

One round:
  1. re-sync the draft: keep the draft tokens whose bytes still spell the committed text and
     encode the rest of it into draft tokens (`worker.decoding.translation`). Context-aware: back
     off to the start of the word the new text continues (`word_boundary`) and re-encode from
     there with the preceding text as context, so the draft holds its own tokenization of the
     text (" unbelievable", not " unbel" + "ie" + "v" + "able" when the target committed the
     word in pieces over several rounds); naive: encode the new text alone. Then trim the
     draft's KV cache to the longest common prefix with the new sequence and feed the rest
     (transformers' UAG `remove_from_pkv`). An incomplete trailing UTF-8 character waits for
     the next round;
  2. the draft proposes k tokens greedily in its own vocabulary (sequential forwards);
  3. their bytes (cut before a draft special token, e.g. its EOS) are translated into m target
     tokens (an incomplete trailing UTF-8 character is held back);
  4. the target scores [y, v_0..v_{m-1}] in one forward; the sampler picks t_0..t_m; the round
     commits t_0..t_n where n = the longest prefix with v_i == t_i (accept iff the proposal
     equals the target's own choice: argmax under greedy, its sample under sampling). Every
     committed token is the target's, so the output equals plain decoding under greedy and
     follows the target's distribution under sampling (lossless); translation only changes
     acceptance. With no proposal (m = 0) the round is a plain target step.

Prompts: the target gets `prompt_tokens` (its own chat template, as the engine renders it). The
draft gets `draft_prompt_tokens` when the caller rendered the conversation with the draft's own
template; otherwise the raw text of the target prompt re-encoded by the draft tokenizer
(`translation.prompt_for_draft`: ChatML markers become the draft's special tokens when it knows
them, plain text otherwise). Only the generated text is translated each round.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from worker.decoding.base import Sampler, Step, accept_prefix, release_buffer_cache
from worker.caches.padded import make_target_cache
from worker.decoding.plain import CLEAR_CACHE_EVERY_TOKENS, prefill_steps
from worker.decoding.translation import (
    DEFAULT_WINDOW_BYTES,
    ByteVocab,
    common_prefix,
    prompt_for_draft,
    translate,
    word_boundary,
)
from worker.decoding.uag_cost import UagPolicy

_VOCABS: dict[int, tuple[Any, ByteVocab]] = {}


def byte_vocab(tokenizer: Any) -> ByteVocab:
    """`ByteVocab.from_tokenizer`, cached per tokenizer object (built once per process)."""
    hit = _VOCABS.get(id(tokenizer))
    if hit is None or hit[0] is not tokenizer:
        hit = (tokenizer, ByteVocab.from_tokenizer(tokenizer))
        _VOCABS[id(tokenizer)] = hit
    return hit[1]


@dataclass(frozen=True)
class UagStep(Step):
    """A `Step` with cross-tokenizer details (a subclass: code reading `Step` is unaffected).

    `drafted` / `accepted` count TARGET tokens (proposed after translation / accepted), so
    acceptance rates are comparable with the other modes.

    Attributes:
        draft_tokens: tokens the draft generated in its own vocabulary this round (k).
        translate_s: CPU time of both translations and the re-sync bookkeeping, seconds.
        resync_tokens: draft tokens fed to re-synchronise the draft this round.
    """

    draft_tokens: int = 0
    translate_s: float = 0.0
    resync_tokens: int = 0


def generate(
    prompt_tokens: list[int],
    max_tokens: int,
    sampler: Sampler,
    eos_ids: set[int],
    *,
    model: nn.Module,
    tokenizer: Any,
    draft_model: nn.Module,
    draft_tokenizer: Any,
    num_draft_tokens: int = 4,
    translation: str = "context",
    draft_prompt_tokens: Optional[list[int]] = None,
    policy: Optional[UagPolicy] = None,
    max_proposed_tokens: Optional[int] = None,
    window_bytes: int = DEFAULT_WINDOW_BYTES,
    cache: Optional[list[Any]] = None,
    draft_cache: Optional[list[Any]] = None,
    prefill_step_tokens: int = 512,
    stream: Any = generation_stream,
) -> Iterator[UagStep]:
    """Decodes by draft + translate + verify rounds (the `decoding.base` decoding-generator contract).

    Args:
        prompt_tokens: target prompt ids, non-empty.
        max_tokens: most tokens to yield, >= 1.
        sampler: the target's token choice, logits (N, V) -> ids (N,) uint32, N = m + 1.
        eos_ids: target ids that end the generation; the EOS token itself is yielded.
        model: the target mlx-lm model.
        tokenizer: the target's tokenizer (Hugging Face fast tokenizer or mlx-lm wrapper).
        draft_model: an mlx-lm model with any vocabulary; it drafts greedily.
        draft_tokenizer: the draft's tokenizer.
        num_draft_tokens: draft tokens per round k (the largest k when `policy` is given), >= 1.
        translation: "context" (encode with the preceding text as context, aligned on bytes;
            the draft's re-sync re-encodes from the start of the current word) or "naive"
            (encode the new text alone), for both directions.
        draft_prompt_tokens: the draft's prompt ids (e.g. the conversation rendered with the
            draft's template); None re-encodes the target prompt's text.
        policy: chooses k per round, 0 meaning a plain step (`UagPolicy`); None = fixed k.
        max_proposed_tokens: cap on target tokens per round (default 2·k + 2).
        window_bytes: context window of the context-aware translation, bytes.
        cache / draft_cache: the models' cache lists, updated in place (made here when None).
        prefill_step_tokens: prompt tokens per prefill forward (both models).
        stream: MLX stream, entered around each piece of work and never across a `yield`.

    Yields:
        One `UagStep` per round (tokens t_0..t_n, cut after an EOS; times in seconds). Draft and
        verify times each end with a host sync (the draft's ids are needed on the host to
        translate them), so draft_s includes the draft's device time.

    Raises:
        ValueError: empty prompt, max_tokens < 1, num_draft_tokens < 1, unknown translation, or
            a cache that cannot be trimmed.
    """
    if not prompt_tokens:
        raise ValueError("prompt_tokens is empty")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    if translation not in ("context", "naive"):
        raise ValueError(f"translation must be 'context' or 'naive', got {translation!r}")
    # Padded caches: every round verifies k+1 tokens at a new key length, and MLX's CUDA build
    # compiles attention for each new length (worker.caches.padded.PaddedKVCache).
    cache = make_target_cache(model) if cache is None else cache
    draft_cache = make_target_cache(draft_model) if draft_cache is None else draft_cache
    for name, c in (("target", cache), ("draft", draft_cache)):
        if not can_trim_prompt_cache(c):
            raise ValueError(f"uag speculative decoding needs a trimmable {name} cache")
    tv, dv = byte_vocab(tokenizer), byte_vocab(draft_tokenizer)
    dprompt = list(draft_prompt_tokens) if draft_prompt_tokens else prompt_for_draft(prompt_tokens, tv, dv)

    yield from prefill_steps(draft_model, draft_cache, mx.array(dprompt, mx.uint32),
                             prefill_step_tokens, stream)
    y = yield from prefill_steps(model, cache, mx.array(prompt_tokens, mx.uint32),
                                 prefill_step_tokens, stream)
    dcached: list[int] = dprompt[:-1]  # tokens in the draft cache
    dgen: list[int] = []  # draft-side tokens of the generated text
    dlen: list[int] = []  # bytes of the committed text each of them stands for
    text = bytearray()  # committed generated text, bytes (target tokens)
    ntoks = 0

    checked = [0, 0]  # (tokens, bytes): a prefix of dgen already found to spell the text

    def _matched() -> tuple[int, int]:
        """(draft tokens, bytes) of dgen that still spell a prefix of the committed text
        (checked from `checked` on: the committed text only grows)."""
        j, pos = checked
        while j < len(dgen):
            n = dlen[j]
            tail = dv.bytes_of[dgen[j]][-n:] if n else b""
            if pos + n > len(text) or text[pos:pos + n] != tail:
                break
            pos += n
            j += 1
        return j, pos

    def _anchor(j: int, pos: int) -> tuple[int, int]:
        """Where context-aware re-sync re-encodes from: back from the end of the matched draft
        tokens (j, pos) to the start of the word the new text continues (a `word_boundary` at
        a draft token start, at most `window_bytes` back; else one token back), so the
        draft gets its own tokenization of the whole word, not of its pieces."""
        if pos >= len(text):
            return j, pos  # nothing new to encode
        i, p = j, pos
        while not word_boundary(text, p) and i > 0 and pos - p < window_bytes:
            i -= 1
            p -= dlen[i]
        if word_boundary(text, p):
            return i, p
        return (j - 1, pos - dlen[j - 1]) if j > 0 else (j, pos)

    context = translation == "context"
    try:
        while True:
            left = max_tokens - ntoks
            k = policy.next_k() if policy is not None else num_draft_tokens
            k = min(k, num_draft_tokens, max(left - 1, 0))
            draft_s = translate_s = 0.0
            proposal: list[int] = []
            resync = 0
            if k > 0:
                # 1. re-sync the draft with the committed text.
                t0 = time.perf_counter()
                j, pos = _matched()
                if context:
                    j, pos = _anchor(j, pos)
                checked[:] = j, pos
                tr = translate(dv, bytes(text), pos, translation, window_bytes)
                dgen, dlen = dgen[:j] + tr.ids, dlen[:j] + tr.lengths
                synced = pos + tr.consumed
                seq = dprompt + dgen
                # dcached and dprompt + dgen (before this re-sync) agree on their common length
                keep = min(common_prefix(dcached, seq, len(dprompt) + j), len(seq) - 1)
                feed = seq[keep:]
                resync = len(feed)
                translate_s += time.perf_counter() - t0
                # 2. draft k tokens greedily.
                t0 = time.perf_counter()
                with mx.stream(stream):
                    trim_prompt_cache(draft_cache, len(dcached) - keep)
                    x = mx.array(feed, mx.uint32)
                    drafts = []
                    for i in range(k):
                        logits = draft_model(x[None], cache=draft_cache)[:, -1, :]
                        x = mx.argmax(logits, axis=-1).astype(mx.uint32)
                        mx.async_eval(x)
                        drafts.append(x)
                    dids = mx.concatenate(drafts).tolist()
                dcached = seq + dids[:-1]
                draft_s = time.perf_counter() - t0
                # 3. translate the draft's text into target tokens.
                t0 = time.perf_counter()
                for i, d in enumerate(dids):
                    if d in dv.special_ids:
                        dids = dids[:i]
                        break
                dgen, dlen = dgen + dids, dlen + [len(dv.bytes_of[d]) for d in dids]
                full = bytes(text[:synced]) + dv.to_bytes(dids)
                if len(full) > len(text) and full[: len(text)] == text:
                    out = translate(tv, full, len(text), translation, window_bytes)
                    cap = max_proposed_tokens or 2 * k + 2
                    proposal = out.ids[: min(cap, left - 1)]
                translate_s += time.perf_counter() - t0
            # 4. verify (a plain step when nothing was proposed).
            m = len(proposal)
            t0 = time.perf_counter()
            with mx.stream(stream):
                inp = mx.concatenate([y, mx.array(proposal, mx.uint32)]) if m else y
                logits = model(inp[None], cache=cache)[0]  # (m+1, V)
                chosen = sampler(logits).tolist()
            verify_s = time.perf_counter() - t0
            n, committed = accept_prefix(proposal, chosen, eos_ids)
            c = len(committed)
            trim_prompt_cache(cache, m - (c - 1))
            text += tv.to_bytes(committed)
            ntoks += c
            if policy is not None:
                policy.observe(k, m, min(n, c), draft_s, translate_s, verify_s)
            step = UagStep(committed, drafted=m, accepted=min(n, c), draft_s=draft_s, verify_s=verify_s,
                           draft_tokens=k, translate_s=translate_s, resync_tokens=resync)
            y = mx.array(committed[-1:], mx.uint32)
            if ntoks // CLEAR_CACHE_EVERY_TOKENS != (ntoks - c) // CLEAR_CACHE_EVERY_TOKENS:
                release_buffer_cache(stream)
            yield step
            if committed[-1] in eos_ids or ntoks >= max_tokens:
                return
    finally:
        # The target cache never holds uncommitted tokens here; trim the draft's to the part
        # that still spells the committed text.
        j, _ = _matched()
        keep = common_prefix(dcached, dprompt + dgen[:j], len(dprompt) + j)
        trim_prompt_cache(draft_cache, len(dcached) - keep)


def start_uag(m: Any, cfg: Any, req: Any, sampler: Sampler) -> tuple[Iterator[UagStep], list[Any]]:
    """`worker.engine.modes.StartFn` for mode "uag": needs `m.draft` and `m.draft_tokenizer`
    (`LoadedModels`), uses cfg.num_draft_tokens as the largest k with the adaptive `UagPolicy`
    (plain steps when drafting does not pay). Padded caches, as in draft-model decoding: trimming
    them by any amount is O(1), and the attention key length changes once per 256 positions."""
    cache, draft_cache = make_target_cache(m.target), make_target_cache(m.draft)
    steps = generate(
        list(req.prompt_tokens), req.max_tokens, sampler, m.eos_ids, model=m.target,
        tokenizer=m.tokenizer, draft_model=m.draft, draft_tokenizer=m.draft_tokenizer,
        num_draft_tokens=cfg.num_draft_tokens, policy=UagPolicy(cfg.num_draft_tokens),
        cache=cache, draft_cache=draft_cache, prefill_step_tokens=cfg.prefill_step_tokens)
    return steps, cache + draft_cache
