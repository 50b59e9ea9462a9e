"""worker.detokenize: whole UTF-8 characters only, output == tokenizer.decode, stop strings."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from tiny_models import CASES_DIR
from worker.detokenize import IncrementalDetokenizer, StopStrings, TextAssembler, decoder_of

EMOJI = " 🙂👍🏽🇵🇱 ok"


def polish_texts(n: int = 25) -> list[str]:
    """Real Polish rows from tests/data/*pl*.jsonl, each with emoji appended."""
    rows = []
    for path in sorted(Path(CASES_DIR).glob("*pl*.jsonl")):
        with path.open(encoding="utf-8") as f:
            rows += [json.loads(line)["prompt"][:300] for _, line in zip(range(n), f)]
    assert rows, f"no *pl*.jsonl rows in {CASES_DIR}"
    return [r + EMOJI for r in rows]


@pytest.fixture(scope="module", params=["bpe", "spm"])
def tokenizer(request, tiny_models):
    path = tiny_models.llama if request.param == "bpe" else tiny_models.spm_tokenizer
    return AutoTokenizer.from_pretrained(str(path))


def stream(tokenizer, ids, chunk_sizes):
    detok, pieces, i = IncrementalDetokenizer(tokenizer), [], 0
    while i < len(ids):
        n = next(chunk_sizes)
        pieces.append(detok.add(ids[i:i + n]))
        i += n
    pieces.append(detok.finalize())
    return pieces


@pytest.mark.parametrize("chunk", [1, 3])
def test_polish_and_emoji_stream_whole_characters(tokenizer, chunk):
    texts = polish_texts()
    assert any(ord(c) > 0xFFFF for c in texts[0])
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        pieces = stream(tokenizer, ids, iter(lambda: chunk, None))
        assert all("\ufffd" not in p for p in pieces), pieces
        assert "".join(pieces) == tokenizer.decode(ids) == text


def test_incomplete_character_is_held_back(tokenizer):
    ids = tokenizer.encode("a🙂", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    outs = [detok.add([t]) for t in ids]
    assert len(ids) >= 3  # the emoji takes several byte tokens in both tokenizers
    assert "".join(outs) == "a🙂"
    assert "🙂" in outs[-1] and all("\ufffd" not in o for o in outs)


def test_random_ids_match_decode(tokenizer):
    """Random token soup, byte tokens included. SentencePiece's ByteFallback decoder is not
    prefix-stable on invalid byte runs (<0xC5><0x9B> is "ś", one more invalid byte turns all three
    into U+FFFD), so there the soup is random non-byte tokens plus whole encoded characters."""
    rng = random.Random(0)
    vocab = len(tokenizer)
    if tokenizer.backend_tokenizer.model.byte_fallback:
        byte_ids = {i for t, i in tokenizer.get_vocab().items() if t.startswith("<0x")}
        plain_ids = [i for i in range(vocab) if i not in byte_ids]
    else:
        plain_ids = list(range(vocab))
    chars = [tokenizer.encode(c, add_special_tokens=False) for c in "żółćęśąźń🙂👍€"]
    for _ in range(30):
        ids = []
        for _ in range(rng.randrange(1, 30)):
            ids += rng.choice(chars) if rng.random() < 0.3 else [rng.choice(plain_ids)]
        sizes = iter(lambda: rng.randrange(1, 4), None)
        assert "".join(stream(tokenizer, ids, sizes)) == tokenizer.decode(ids)


def test_decoder_of_equals_decode_and_falls_back_when_decode_cleans_up(tokenizer, tiny_models):
    """The backend's decode stands in for `decode` (special tokens and byte tokens included),
    also behind mlx-lm's TokenizerWrapper; with clean-up on, `decode` itself is used."""
    from mlx_lm.utils import load_tokenizer

    rng = random.Random(1)
    wrapped = load_tokenizer(tiny_models.llama)
    for tok in (tokenizer, wrapped):
        fast = decoder_of(tok)
        assert fast is not tok.decode
        for _ in range(50):
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 12))]
            assert fast(ids) == tok.decode(ids)
    tokenizer.clean_up_tokenization_spaces = True
    try:
        assert decoder_of(tokenizer) == tokenizer.decode
    finally:
        tokenizer.clean_up_tokenization_spaces = False


def test_stop_string_within_and_across_chunks():
    s = StopStrings(["STOP"])
    assert s.feed("abc S") == "abc "  # "S" may start STOP
    assert s.feed("TO") == ""
    assert s.feed("Pxyz") == "" and s.stopped
    assert s.feed("more") == ""

    s = StopStrings(["\n\n", "END"])
    assert s.feed("one\ntwo END three\n\n") == "one\ntwo " and s.stopped


def test_stop_prefix_released_when_it_does_not_complete():
    s = StopStrings(["</answer>"])
    assert s.feed("x </ans") == "x "
    assert s.feed("wer") == ""
    assert s.feed("!") == "</answer!"
    assert s.feed("tail </") == "tail "
    assert s.flush() == "</" and not s.stopped


def _naive_stream_cut(chunks, stops):
    """The released text of a stream cut before its first stop string, from the whole text."""
    text = "".join(chunks)
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[:min(cuts)] if cuts else text


@settings(max_examples=300, deadline=None, derandomize=True)
@given(chunks=st.lists(st.text(alphabet="ab</>", max_size=6), max_size=12),
       stops=st.lists(st.text(alphabet="ab</>", min_size=1, max_size=5), min_size=1, max_size=4))
def test_stop_strings_release_exactly_the_text_before_the_first_stop(chunks, stops):
    s = StopStrings(stops)
    released = []
    for c in chunks:
        out = s.feed(c)
        released.append(out)
        # Held back: at most the longest tail that could still start a stop string.
        assert len(s._held) < max(map(len, stops))
    if not s.stopped:
        released.append(s.flush())
    assert "".join(released) == _naive_stream_cut(chunks, stops)


def test_stop_strings_validation_and_passthrough():
    with pytest.raises(ValueError):
        StopStrings(["ok", ""])
    s = StopStrings([])
    assert s.feed("anything") == "anything" and s.flush() == ""


def test_text_assembler_stops_before_stop_string(tokenizer):
    text = "Zażółć gęślą jaźń 🙂 koniec"
    ids = tokenizer.encode(text, add_special_tokens=False)
    asm = TextAssembler(tokenizer, ["jaźń"])
    out = "".join(asm.add([t]) for t in ids)
    assert asm.stopped and out == "Zażółć gęślą "
    asm = TextAssembler(tokenizer, ["nope"])
    out = "".join(asm.add([t]) for t in ids) + asm.finish()
    assert not asm.stopped and out == text


def test_resume_continues_a_stream_from_any_batching_and_stop_hold_back(tokenizer):
    """A migrated stream: the client saw the first tokens (batched arbitrarily, so with more or less
    text held back); a fresh assembler primed by `resume` releases exactly the rest, stop strings
    included."""
    text = polish_texts(1)[0]
    ids = tokenizer.encode(text, add_special_tokens=False)
    stops = ("jaźń", "łódź") if "jaźń" in text else ("ok",)
    full = TextAssembler(tokenizer, stops)
    want = "".join(full.add([t]) for t in ids) + full.finish()
    rng = random.Random(3)
    for cut in range(1, len(ids) - 1, max(1, len(ids) // 9)):
        first = TextAssembler(tokenizer, stops)
        seen, i = "", 0
        while i < cut and not first.stopped:  # the first worker's batches
            n = min(rng.randint(1, 4), cut - i)
            seen += first.add(ids[i:i + n])
            i += n
        if first.stopped:
            break
        second = TextAssembler(tokenizer, stops)
        rest = second.resume(ids[:i], seen)
        for t in ids[i:]:
            rest += second.add([t])
            if second.stopped:
                break
        rest += second.finish()
        assert seen + rest == want, (cut, seen, rest)


def test_resume_rejects_text_that_is_not_the_tokens_and_a_finished_stream(tokenizer):
    ids = tokenizer.encode("Hello there, general Kenobi", add_special_tokens=False)
    with pytest.raises(ValueError, match="not the text of resume_token_ids"):
        TextAssembler(tokenizer).resume(ids, "Goodbye")
    with pytest.raises(ValueError, match="already reached a stop string"):
        TextAssembler(tokenizer, ("there",)).resume(ids, "Hello ")
