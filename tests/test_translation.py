"""Byte-level token translation (`worker.decoding.translation`) on the tiny BPE / SentencePiece-style
tokenizers of tests/tiny_models.py, and on real catalog models' tokenizers (fetched into the model
cache by the first test that needs them)."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from real_models import fetched
from worker.decoding.translation import (
    ByteVocab,
    char_start,
    common_prefix,
    complete_utf8_prefix,
    context_window,
    encode_continuation,
    encode_naive,
    prompt_for_draft,
    translate,
    word_boundary,
)

REAL = ("SmolLM2-135M-Instruct", "Qwen2.5-Coder-0.5B-Instruct", "Gemma-3-270M")  # catalog models
TEXTS = [
    "Zażółć gęślą jaźń. Pchnąć w tę łódź jeża!",
    "Emoji 🙂👍🏽 and café naïve",
    "def f(x):\n\t  return  x  \n\n\n    # trailing\t\n",
    "  leading spaces and <|im_end|> marker",
]


@pytest.fixture(scope="module")
def vocabs(tiny_models):
    bpe = ByteVocab.from_tokenizer(AutoTokenizer.from_pretrained(str(tiny_models.llama)))
    spm = ByteVocab.from_tokenizer(AutoTokenizer.from_pretrained(str(tiny_models.spm_tokenizer)))
    return bpe, spm


def test_kinds_and_byte_tokens(vocabs):
    bpe, spm = vocabs
    assert bpe.kind == "byte_level" and spm.kind == "sentencepiece"
    assert spm.bytes_of[spm.tokenizer.convert_tokens_to_ids("<0xC5>")] == b"\xc5"
    # byte-level stores "ż" (C5 BC) as "Å¼": the table gives the raw bytes back
    assert bpe.to_bytes(bpe.encode("ż")) == "ż".encode()
    assert {bpe.tokenizer.convert_tokens_to_ids("<|im_end|>")} <= bpe.special_ids


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_bytes(vocabs, text):
    bpe, spm = vocabs
    assert bpe.to_bytes(bpe.encode(text)) == text.encode()
    got = spm.to_bytes(spm.encode(text))
    assert got in (text.encode(), b" " + text.encode())  # Metaspace dummy prefix


def test_utf8_helpers():
    s = "aż🙂".encode()
    assert complete_utf8_prefix(s) == len(s)
    assert complete_utf8_prefix(s[:-1]) == 3  # inside the 4-byte emoji
    assert complete_utf8_prefix(s[:2]) == 1  # first byte of "ż"
    assert complete_utf8_prefix(b"") == 0
    assert char_start("ż".encode(), 1) == 2
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2, 3], [1, 2, 4], start=1) == 2
    assert common_prefix([1, 2], [1, 2, 4], start=5) == 2


@pytest.mark.parametrize("split", [3, 7, 11, 20, 25])
def test_context_encoding_matches_whole_text(vocabs, split):
    """Context-aware: the tokens of the new part equal the whole text's tokens after the boundary,
    whenever the whole text's tokenization has a boundary there."""
    text = "Zażółć gęślą jaźń, pchnąć łódź 🙂 def f():\n\treturn 1".encode()
    for vocab in vocabs:
        whole = vocab.encode(text.decode())
        pieces = [vocab.bytes_of[i] for i in whole]
        extra = sum(map(len, pieces)) - len(text)
        cut, pos = None, 0
        for i, p in enumerate(pieces):
            if pos - extra >= split:
                cut = (i, pos - extra)
                break
            pos += len(p)
        if cut is None:
            continue
        i, at = cut
        out = encode_continuation(vocab, text[:at], text[at:])
        assert out.aligned and out.ids == whole[i:], (vocab.kind, at)
        assert out.consumed == len(text) - at and sum(out.lengths) == out.consumed


def test_mid_word_fragment_spm_has_no_dummy_space(vocabs):
    _, spm = vocabs
    ctx, new = "Pchną".encode(), "ć łódź".encode()
    naive = encode_naive(spm, new)
    ctx_out = encode_continuation(spm, ctx, new)
    assert spm.to_bytes(naive.ids).startswith(b" ")  # the dummy prefix glued a space on
    assert naive.consumed == len(new) and sum(naive.lengths) == len(new)
    if ctx_out.aligned:
        assert spm.to_bytes(ctx_out.ids) == new


def test_straddling_token_is_not_aligned(vocabs):
    bpe, _ = vocabs
    # "th" | "e": byte-level BPE merges "the" across the boundary
    out = encode_continuation(bpe, b" th", b"e quick")
    if not out.aligned:
        assert out.ids == [] and out.consumed == 0
    full = translate(bpe, b" the quick", 3, "context")
    assert full.ids  # falls back to naive, never empty for complete text


def test_incomplete_utf8_is_held_back(vocabs):
    for vocab in vocabs:
        new = "ab ż".encode()[:-1]  # ends with the lead byte of "ż"
        out = encode_continuation(vocab, b"x.", new)
        assert out.consumed == len(new) - 1
        assert vocab.to_bytes(out.ids).endswith(b"ab ")
        assert encode_naive(vocab, b"\xc5").ids == []


def test_word_boundary():
    t = b"ab  cd\n\tef(g).\n x"
    assert [p for p in range(len(t) + 1) if word_boundary(t, p)] == [0, 2, 6]
    assert not word_boundary(b"ab", 2)  # the end: what follows is unknown


@pytest.mark.parametrize("name", ["tiny-bpe", "tiny-spm", *(
    pytest.param(n, marks=pytest.mark.real_model) for n in REAL)])
def test_word_boundary_is_a_token_boundary(name, vocabs):
    """Encoding the text after a word boundary (context-aware, with the text before it as
    context) gives the whole text's tokens from there: what the draft's re-sync relies on."""
    vocab = {"tiny-bpe": vocabs[0], "tiny-spm": vocabs[1]}.get(name)
    if vocab is None:
        vocab = ByteVocab.from_tokenizer(AutoTokenizer.from_pretrained(str(fetched(name))))
    text = ("Konstantynopolitańczykowianeczka jest długa.\nunbelievable_identifier(x) = 12  # ok\n"
            "def f(x):\n    return  x \n\n\tżółw, 🙂 end").encode()
    whole = vocab.encode(text.decode())
    for p in range(1, len(text)):
        if word_boundary(text, p):
            out = encode_continuation(vocab, text[:p], text[p:])
            assert out.aligned and out.ids == whole[len(whole) - len(out.ids):], (name, p)


def test_context_window():
    t = "alpha beta gamma żółw".encode()
    w = context_window(t, len(t), 12)
    assert t.endswith(w) and w.decode()  # valid UTF-8, a suffix
    assert context_window(b"", 0) == b"\n"


def test_prompt_for_draft_keeps_text(vocabs):
    bpe, spm = vocabs
    ids = bpe.encode("<|im_start|>user\nCześć 🙂<|im_end|>\n")
    out = prompt_for_draft(ids, bpe, spm)
    assert "Cześć 🙂".encode() in spm.to_bytes(out)


@pytest.mark.real_model
@pytest.mark.parametrize("name", REAL)
def test_real_tokenizers_round_trip(name):
    vocab = ByteVocab.from_tokenizer(AutoTokenizer.from_pretrained(str(fetched(name))))
    for text in TEXTS:
        assert vocab.to_bytes(vocab.encode(text)) == text.encode(), name
    ids = vocab.encode("Zażółć gęślą jaźń")
    out = encode_continuation(vocab, vocab.to_bytes(ids[:2]), vocab.to_bytes(ids[2:]))
    assert not out.aligned or out.ids == ids[2:]
