"""Cross-tokenizer speculative decoding (`worker.decoding.cross_tokenizer`): greedy output must equal the
target's plain greedy output, whatever the draft and its tokenizer.

Tiny pairs: a byte-level BPE model (tests/tiny_models.py) with a model built here on the
SentencePiece-style byte-fallback tokenizer, both directions, plus a scripted draft that knows the
target's output text (high acceptance: exercises acceptance, re-sync and translation, not just
rejection). Real pairs (`real_model`): SmolLM2-135M-Instruct and Gemma-3-270M drafting for
Qwen2.5-Coder-0.5B-Instruct, fetched into the model cache when absent (tests/real_models.py).
"""
from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx_lm import load

from real_models import fetched
from tiny_models import CASES_DIR, build_model_dir, model_config
from worker.loading import load_target
from worker.sampling import greedy, make_sampler
from worker.decoding import plain
from worker.decoding.cross_tokenizer import UagStep, byte_vocab, generate
from worker.decoding.translation import encode_continuation
from worker.decoding.uag_cost import UagCostModel, UagPolicy



def case(name: str, i: int = 0) -> str:
    """The first 300 characters of row i of tests/data/NAME."""
    with (CASES_DIR / name).open(encoding="utf-8") as f:
        rows = [json.loads(line)["prompt"] for _, line in zip(range(i + 1), f)]
    return rows[i][:300]


PROMPTS = [
    case("dataset_build_pl.jsonl"),  # Polish diacritics
    case("humaneval.jsonl"),  # code, indentation
    "Emoji 🙂👍🏽 i tabulatory:\t\t  koniec  \n\n",
]


@pytest.fixture(scope="module")
def pairs(tiny_models, tmp_path_factory):
    """(bpe model, bpe tokenizer), (spm model, spm tokenizer)."""
    spm_tok = load(str(tiny_models.llama))[1]  # warm the loader
    root = tmp_path_factory.mktemp("uag")
    from transformers import AutoTokenizer
    spm_vocab = len(AutoTokenizer.from_pretrained(str(tiny_models.spm_tokenizer)))
    cfg = model_config("llama", spm_vocab, 2, layers=2, max_position_embeddings=512)
    spm_dir = build_model_dir(root / "spm_llama", cfg, tiny_models.spm_tokenizer, seed=7)
    bpe = load(str(tiny_models.qwen2))
    spm = load(str(spm_dir))
    del spm_tok
    return bpe, spm


def plain_tokens(model, tok, prompt, n, sampler=greedy):
    return [t for s in plain.generate(prompt, n, sampler, set(tok.eos_token_ids), model=model) for t in s.tokens]


def uag_tokens(model, tok, draft, dtok, prompt, n, **kw):
    sampler = kw.pop("sampler", greedy)
    steps = [s for s in generate(prompt, n, sampler, set(tok.eos_token_ids), model=model, tokenizer=tok,
                                 draft_model=draft, draft_tokenizer=dtok, **kw)
             if s.tokens]  # prefill chunks of a long prompt carry no token
    assert all(isinstance(s, UagStep) and s.tokens for s in steps)
    return [t for s in steps for t in s.tokens], steps


@pytest.mark.parametrize("direction", ["bpe_target", "spm_target"])
@pytest.mark.parametrize("translation", ["context", "naive"])
def test_tiny_greedy_equals_plain(pairs, direction, translation):
    (bm, bt), (sm, st) = pairs
    (tm, tt), (dm, dt) = ((bm, bt), (sm, st)) if direction == "bpe_target" else ((sm, st), (bm, bt))
    for text in PROMPTS:
        prompt = tt.encode(text)
        ref = plain_tokens(tm, tt, prompt, 24)
        for k in (1, 4):
            got, _ = uag_tokens(tm, tt, dm, dt, prompt, 24, num_draft_tokens=k, translation=translation)
            assert got == ref, (direction, translation, k, text[:30])


class ScriptedLM:
    """A fake mlx-lm model that "knows" one text: after the prompt it proposes the next token of
    that text in its vocabulary, from wherever the fed bytes leave off (a plain next-token
    guess when they end mid-token); wrong every `miss_every`-th call (0 = never)."""

    def __init__(self, vocab, prompt_len, text: bytes, miss_every: int = 0):
        self.v, self.prompt_len, self.text, self.miss_every = vocab, prompt_len, text, miss_every
        self.calls = 0
        self.miss_id = vocab.encode("Q")[-1]

    def __call__(self, x, cache):
        ids = x.reshape(-1).tolist()
        self.calls += 1
        miss = self.miss_every and self.calls % self.miss_every == 0
        logits = mx.full((1, len(ids), len(self.v.bytes_of)), -1.0)
        for i in range(len(ids)):  # every position's next token, as a verify forward needs
            cache[0].fed.append(ids[i])
            gen = self.v.to_bytes(cache[0].fed[self.prompt_len:])
            nxt = self.miss_id
            if self.text.startswith(gen) and len(gen) < len(self.text) and not miss:
                # One context rule for every step ("\n" + the text so far): with only the text, a
                # SentencePiece dummy prefix can merge the first token with the next ("d" +
                # "ef" -> "▁def" after a "d" chosen behind "\n"), and the script stalls.
                out = encode_continuation(self.v, b"\n" + gen, self.text[len(gen):])
                nxt = out.ids[0] if out.ids else self.miss_id
            logits[0, i, nxt] = 1.0
        return logits


class ListCache:
    def __init__(self):
        self.fed: list[int] = []
        self.state = mx.zeros((1,))

    def is_trimmable(self):
        return True

    def trim(self, n):
        n = min(n, len(self.fed))
        if n:
            del self.fed[-n:]
        return n


SCRIPTS = ["Zażółć gęślą jaźń, pchnąć łódź 🙂👍🏽 teraz.", "def f(x):\n\t  return  x  # żółw\n\n    pass"]


@pytest.mark.parametrize("direction", ["bpe_target", "spm_target"])
@pytest.mark.parametrize("translation", ["context", "naive"])
def test_scripted_pair_accepts_and_stays_lossless(pairs, direction, translation):
    """A target whose greedy output is real text (Polish, emoji, code) and a draft that mostly
    knows it, in the other tokenizer: many accepted tokens, output identical to plain greedy."""
    (_, bt), (_, st) = pairs
    tt, dt = (bt, st) if direction == "bpe_target" else (st, bt)
    tv, dv = byte_vocab(tt), byte_vocab(dt)
    accepted = {}
    for text in SCRIPTS:
        data = text.encode()
        prompt, dprompt = tv.encode("prompt\n"), dv.encode("prompt\n")
        n = len(tv.encode(text))
        ref = [t for s in plain.generate(prompt, n, greedy, set(), model=ScriptedLM(tv, len(prompt), data),
                                         cache=[ListCache()]) for t in s.tokens]
        assert tv.to_bytes(ref).startswith(data[:20])
        target = ScriptedLM(tv, len(prompt), data)
        draft = ScriptedLM(dv, len(dprompt), data, miss_every=6)
        steps = list(generate(prompt, n, greedy, set(), model=target, tokenizer=tt, draft_model=draft,
                              draft_tokenizer=dt, num_draft_tokens=4, translation=translation,
                              draft_prompt_tokens=dprompt, cache=[ListCache()], draft_cache=[ListCache()]))
        got = [t for s in steps for t in s.tokens]
        assert got == ref, (text, tv.to_bytes(got))
        accepted[text] = sum(s.accepted for s in steps)
        assert len(steps) < len(ref)
    assert sum(accepted.values()) > 0


class MissLM:
    """A draft that always proposes the token "Q" (never right), so every round commits exactly
    the target's next token, and that records the draft tokens of the generated text it holds
    at every call (the result of each re-sync)."""

    def __init__(self, vocab, prompt_len):
        self.v, self.prompt_len = vocab, prompt_len
        self.miss_id = vocab.encode("Q")[-1]
        self.seen: list[list[int]] = []

    def __call__(self, x, cache):
        ids = x.reshape(-1).tolist()
        cache[0].fed.extend(ids)
        if len(cache[0].fed) > self.prompt_len:
            self.seen.append(cache[0].fed[self.prompt_len:])
        logits = mx.full((1, len(ids), len(self.v.bytes_of)), -1.0)
        logits[0, -1, self.miss_id] = 1.0
        return logits


SPLIT_TEXT = "Zażółć gęślą jaźń: unbelievable, niewiarygodnie tokenize_identifier(x) \n"


def resync_tokens_by_mode(tt, dt, text):
    """Decodes `text` (the target's greedy output, scripted) with a draft that is always wrong
    and k = 1: the committed text grows by one target token per round, so words are split
    across rounds wherever the two tokenizers split them differently. Returns {mode: the
    draft's tokens after each re-sync} and checks that both modes give plain greedy output."""
    tv, dv = byte_vocab(tt), byte_vocab(dt)
    data = text.encode()
    prompt, dprompt = tv.encode("prompt\n"), dv.encode("prompt\n")
    n = len(tv.encode(text))
    ref = [t for s in plain.generate(prompt, n, greedy, set(), model=ScriptedLM(tv, len(prompt), data),
                                     cache=[ListCache()]) for t in s.tokens]
    assert tv.to_bytes(ref).startswith(data)
    seen = {}
    for translation in ("naive", "context"):
        draft = MissLM(dv, len(dprompt))
        steps = list(generate(prompt, n, greedy, set(), model=ScriptedLM(tv, len(prompt), data), tokenizer=tt,
                              draft_model=draft, draft_tokenizer=dt, num_draft_tokens=1,
                              translation=translation, draft_prompt_tokens=dprompt,
                              cache=[ListCache()], draft_cache=[ListCache()]))
        assert [t for s in steps for t in s.tokens] == ref, translation
        seen[translation] = draft.seen
    return seen, dv


def is_canonical(dv, ids):
    """The draft tokenizer's own tokenization of the (complete UTF-8) text the ids spell."""
    return ids == dv.encode(dv.to_bytes(ids).decode("utf-8"))


def test_context_resync_gives_the_draft_its_own_tokenization(pairs):
    """A word split across rounds: naive re-sync encodes each new piece alone (e.g. " u" + "n"
    instead of " un"), context-aware re-sync re-encodes from the word start and trims the draft
    cache back to the common prefix, so after every round the draft holds exactly its own
    tokenization of the committed text (held-back partial UTF-8 excluded)."""
    (_, bt), (_, st) = pairs
    seen, dv = resync_tokens_by_mode(st, bt, SPLIT_TEXT)  # SentencePiece-style target, byte-level draft
    assert len(seen["context"]) > 20
    assert all(is_canonical(dv, ids) for ids in seen["context"])
    assert not all(is_canonical(dv, ids) for ids in seen["naive"])


@pytest.mark.real_model
@pytest.mark.parametrize("target,draft", [("Qwen2.5-Coder-0.5B-Instruct", "SmolLM2-135M-Instruct")])
def test_context_resync_real_tokenizers(target, draft):
    """The same with the real tokenizers (Qwen2.5 target, SmolLM2 draft, fetched when absent)."""
    paths = [fetched(name) for name in (target, draft)]
    from transformers import AutoTokenizer
    tt, dt = (AutoTokenizer.from_pretrained(str(p)) for p in paths)
    text = ("Konstantynopolitańczykowianeczka jest niewiarygodnie długim słowem; "
            "unbelievably_long_identifier = 1\n")
    seen, dv = resync_tokens_by_mode(tt, dt, text)
    assert all(is_canonical(dv, ids) for ids in seen["context"])
    assert not all(is_canonical(dv, ids) for ids in seen["naive"])


def test_sampling_is_seeded_and_runs(pairs):
    (bm, bt), (sm, st) = pairs
    prompt = bt.encode(PROMPTS[0])
    a, _ = uag_tokens(bm, bt, sm, st, prompt, 16, sampler=make_sampler(0.8, seed=3))
    b, _ = uag_tokens(bm, bt, sm, st, prompt, 16, sampler=make_sampler(0.8, seed=3))
    assert a == b and 1 <= len(a) <= 16


def test_policy_and_max_tokens(pairs):
    (bm, bt), (sm, st) = pairs
    prompt = bt.encode(PROMPTS[1])
    ref = plain_tokens(bm, bt, prompt, 30)
    policy = UagPolicy(4)
    got, steps = uag_tokens(bm, bt, sm, st, prompt, 30, num_draft_tokens=4, policy=policy)
    assert got == ref and len(got) <= 30
    assert policy.decision is not None
    one, _ = uag_tokens(bm, bt, sm, st, prompt, 1)
    assert one == ref[:1]


def test_close_early_and_errors(pairs):
    (bm, bt), (sm, st) = pairs
    prompt = bt.encode("abc")
    gen = generate(prompt, 20, greedy, set(), model=bm, tokenizer=bt, draft_model=sm, draft_tokenizer=st)
    next(gen)
    gen.close()
    with pytest.raises(ValueError):
        next(generate([], 5, greedy, set(), model=bm, tokenizer=bt, draft_model=sm, draft_tokenizer=st))
    with pytest.raises(ValueError):
        next(generate(prompt, 5, greedy, set(), model=bm, tokenizer=bt, draft_model=sm,
                      draft_tokenizer=st, translation="bogus"))


def test_cost_model_prefers_plain_when_acceptance_is_low():
    m = UagCostModel(prior_acceptance=0.1)
    for _ in range(10):
        m.observe_round(4, 4, 0)
        m.observe_costs(4, 4, draft_s=0.04, translate_s=0.001, verify_s=0.12)
        m.observe_costs(0, 0, 0.0, 0.0, verify_s=0.1)
    assert m.decide([1, 2, 4]).k == 0
    good = UagCostModel(prior_acceptance=0.9)
    for k in (1, 2, 4):
        for _ in range(5):
            good.observe_round(k, k, k)
            good.observe_costs(k, k, draft_s=0.005 * k, translate_s=0.0005, verify_s=0.1 + 0.002 * k)
    good.observe_costs(0, 0, 0.0, 0.0, verify_s=0.1)
    d = good.decide([1, 2, 4])
    assert d.k == 4 and d.tokens_per_s > d.plain_tokens_per_s


REAL_PAIRS = [("SmolLM2-135M-Instruct", 0), ("Gemma-3-270M", 1)]


@pytest.fixture(scope="module")
def qwen():
    return load_target(fetched("Qwen2.5-Coder-0.5B-Instruct"))  # the worker's dtype, not the stored one


@pytest.mark.real_model
@pytest.mark.parametrize("draft_name,prompt_i", REAL_PAIRS)
def test_real_pair_greedy_equals_plain(qwen, draft_name, prompt_i):
    path = fetched(draft_name)
    tm, tt = qwen
    dm, dt = load_target(path)
    text = ["Napisz krótko, czym jest żółw błotny.", "Write a Python function that adds two numbers."][prompt_i]
    prompt = tt.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    ref = plain_tokens(tm, tt, prompt, 16)
    got, steps = uag_tokens(tm, tt, dm, dt, prompt, 16, num_draft_tokens=3)
    assert got == ref
    assert sum(s.drafted for s in steps) > 0
