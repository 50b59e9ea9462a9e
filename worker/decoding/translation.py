"""Token translation between two vocabularies, done on raw bytes (for cross-tokenizer drafting).

Used by `worker.decoding.cross_tokenizer` (Universal Assisted Generation, Timor et al. 2025,
arXiv:2502.05202 "SLEM", and the Hugging Face blog "Universal Assisted Generation", 2024): draft
tokens become text, the text becomes target tokens, and accepted target text goes back to draft
tokens.

Why bytes and not `tokenizer.decode`:
  - byte-level BPE (GPT-2, Qwen2.5, SmolLM2) stores "ż" as "Å¼" and " " as "Ġ";
  - SentencePiece stores the character itself, "▁" for a space and `<0xC5>` byte-fallback tokens;
  - `decode` of a chunk strips SentencePiece's leading space, turns half a UTF-8 character into
    U+FFFD and may "clean up" spaces. `ByteVocab` maps every id to its exact bytes instead, so
    decoding is a concatenation and two tokenizers are compared byte for byte.

Context-aware encoding (`encode_continuation`): the new text is encoded together with a window of
the text before it, and only the tokens that start at the window's end are kept (aligned on byte
offsets). A word split across the boundary ("hel" | "lo") is then tokenized as it would be inside
the whole text, and a SentencePiece dummy-prefix space is never glued to a mid-word fragment.
Naive encoding (`encode_naive`) encodes the new text alone (mlx-lm PR #1025's "naive" mode).

Everything here is plain Python on token ids and `bytes` (no MLX).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
DEFAULT_WINDOW_BYTES = 48  # context window for context-aware encoding, bytes


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE vocabularies use it)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


def hf_tokenizer(tokenizer: Any) -> Any:
    """The Hugging Face tokenizer inside an mlx-lm `TokenizerWrapper` (or the argument itself)."""
    if type(tokenizer).__name__ == "TokenizerWrapper":
        return tokenizer._tokenizer
    return tokenizer


def complete_utf8_prefix(data: bytes) -> int:
    """Length of the longest prefix of `data` that does not end inside a UTF-8 sequence.

    Only the tail is inspected (at most 3 bytes); invalid bytes earlier are not this function's
    concern. Returns len(data) when the last character is complete.
    """
    n = len(data)
    for back in range(1, min(4, n) + 1):
        b = data[n - back]
        if b < 0x80:  # ASCII: complete
            return n
        if b >= 0xC0:  # lead byte of a sequence of `need` bytes
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return n if back >= need else n - back
    return n  # only continuation bytes: leave them to the decoder (invalid anyway)


def char_start(data: bytes, pos: int) -> int:
    """The first position >= pos that is not a UTF-8 continuation byte (snaps a window start)."""
    while pos < len(data) and 0x80 <= data[pos] < 0xC0:
        pos += 1
    return pos


@dataclass
class ByteVocab:
    """Exact bytes of every token id of one tokenizer.

    Attributes:
        tokenizer: the Hugging Face tokenizer (fast), used for encoding.
        bytes_of: bytes_of[id] = the token's bytes. Special tokens (BOS, EOS, ChatML markers...)
            map to their literal text ("<|im_end|>") and are listed in `special_ids`.
        special_ids: ids of special (control) tokens; a draft proposal stops before one.
        kind: "byte_level" (GPT-2 byte alphabet) or "sentencepiece" ("▁" + <0xNN> fallback).
    """

    tokenizer: Any
    bytes_of: list[bytes]
    special_ids: frozenset[int]
    kind: str

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> "ByteVocab":
        """Builds the table from a Hugging Face fast tokenizer or an mlx-lm `TokenizerWrapper`.

        The kind is read from the backend decoder: a `ByteLevel` decoder means the GPT-2 byte
        alphabet; anything else is treated as SentencePiece-style ("▁" -> space, `<0xNN>` -> that
        byte, other characters as UTF-8). Cost: one pass over the vocabulary (about 0.3 s for
        Gemma's 262144 ids).
        """
        tok = hf_tokenizer(tokenizer)
        decoder = ""
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is not None and backend.decoder is not None:
            decoder = repr(backend.decoder) + str(getattr(backend.decoder, "__getstate__", lambda: "")())
        kind = "byte_level" if "ByteLevel" in decoder else "sentencepiece"
        n = max(len(tok), getattr(tok, "vocab_size", 0))
        pieces = tok.convert_ids_to_tokens(list(range(n)))
        added = {i: t for i, t in getattr(tok, "added_tokens_decoder", {}).items()}
        special = frozenset(i for i, t in added.items() if getattr(t, "special", False)) | frozenset(
            i for i in getattr(tok, "all_special_ids", []) if i is not None)
        table: list[bytes] = []
        for i, piece in enumerate(pieces):
            if piece is None:
                table.append(b"")
            elif i in added:
                table.append(str(added[i]).encode("utf-8"))
            elif kind == "byte_level":
                try:
                    table.append(bytes(_BYTE_DECODER[c] for c in piece))
                except KeyError:
                    table.append(piece.encode("utf-8"))
            else:
                m = _BYTE_TOKEN.match(piece)
                table.append(bytes([int(m.group(1), 16)]) if m else piece.replace("▁", " ").encode("utf-8"))
        return cls(tok, table, special, kind)

    def to_bytes(self, ids: Sequence[int]) -> bytes:
        """Concatenated bytes of `ids` (special tokens as their literal text)."""
        return b"".join(self.bytes_of[i] for i in ids)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` without BOS/EOS (special-token strings in it are parsed)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))


@dataclass(frozen=True)
class Translation:
    """Result of encoding new text into one vocabulary.

    Attributes:
        ids: the new tokens.
        lengths: bytes of the new text each token stands for (sum = consumed). Equals the
            token's own byte length, except that a dummy-prefix space the tokenizer added to a
            naive encoding is not counted.
        consumed: bytes of the new text the ids cover; the rest (an incomplete UTF-8 character,
            or text that did not align) is left for the next round.
        aligned: False when the context-aware alignment failed (a token straddles the boundary,
            or the tokenizer rewrote the text, e.g. NFC) and the result is empty.
    """

    ids: list[int]
    lengths: list[int]
    consumed: int
    aligned: bool = True


def encode_continuation(vocab: ByteVocab, context: bytes, new: bytes) -> Translation:
    """Context-aware encoding: the tokens of `new` as `vocab` tokenizes `context + new`.

    Encodes context + new (cut at the last complete UTF-8 character), maps the tokens back to
    bytes, strips the bytes the tokenizer prepended (a SentencePiece dummy-prefix "▁"), and keeps
    the tokens from the one that starts exactly at len(context). `context` must start at a
    character boundary; it may end inside a character that `new` completes.

    Args:
        vocab: the tokenizer to encode with.
        context: the preceding text, bytes (a window, e.g. the last 48 bytes of the text).
        new: the text to translate, bytes.

    Returns:
        A `Translation`; empty with aligned=False when a token straddles the boundary or the
        encoding does not reproduce the input bytes, empty with aligned=True when no complete
        character of `new` is available yet.
    """
    full = context + new
    end = complete_utf8_prefix(full)
    if end <= len(context):
        return Translation([], [], 0)
    try:
        text = full[:end].decode("utf-8")
    except UnicodeDecodeError:
        return Translation([], [], 0, aligned=False)
    ids = vocab.encode(text)
    pieces = [vocab.bytes_of[i] for i in ids]
    got = b"".join(pieces)
    extra = len(got) - end
    if extra < 0 or got[extra:] != full[:end]:
        return Translation([], [], 0, aligned=False)
    boundary = len(context) + extra
    pos = 0
    for i, p in enumerate(pieces):
        if pos == boundary:
            lengths = [len(q) for q in pieces[i:]]
            return Translation(ids[i:], lengths, end - len(context))
        if pos > boundary:
            break
        pos += len(p)
    return Translation([], [], 0, aligned=False)


def encode_naive(vocab: ByteVocab, new: bytes) -> Translation:
    """Naive encoding: `new` alone (decode -> encode without context), as PR #1025's naive mode.

    A mid-word fragment is tokenized as a word start, and a SentencePiece tokenizer with a dummy
    prefix adds a space, so the result may differ from the target's own tokens (lower
    acceptance, never wrong output). An incomplete trailing UTF-8 character is left over.
    """
    end = complete_utf8_prefix(new)
    if end == 0:
        return Translation([], [], 0)
    text = new[:end].decode("utf-8", errors="replace")
    ids = vocab.encode(text)
    lengths = [len(vocab.bytes_of[i]) for i in ids]
    extra = sum(lengths) - end
    if ids and extra > 0 and vocab.bytes_of[ids[0]][:extra].isspace():
        lengths[0] = max(lengths[0] - extra, 0)  # the dummy-prefix space stands for no input
    return Translation(ids, lengths, end)


def context_window(text: bytes, end: int, window_bytes: int = DEFAULT_WINDOW_BYTES) -> bytes:
    """The context for new text starting at `end`: up to `window_bytes` bytes of text[:end].

    The window starts at a character boundary, and preferably at a space or newline (a word
    start, where byte-level BPE pre-tokenizers and SentencePiece pieces never merge across).
    An empty text gets "\\n" (generated text follows the chat template's newline), so a
    SentencePiece dummy prefix never lands on the first generated word.
    """
    if end == 0:
        return b"\n"
    start = char_start(text, max(0, end - window_bytes))
    if start > 0:
        ws = max(text.rfind(b" ", start, end), text.rfind(b"\n", start, end))
        if ws > start and ws < end - 1:
            start = ws
    return text[start:end]


def translate(vocab: ByteVocab, text: bytes, start: int, mode: str = "context",
              window_bytes: int = DEFAULT_WINDOW_BYTES) -> Translation:
    """Encodes text[start:] into `vocab`, with text[:start] as the context in "context" mode.

    "context" falls back to naive encoding when alignment fails, so the caller always gets the
    longest translation available. Raises ValueError for an unknown mode.
    """
    if mode == "naive":
        return encode_naive(vocab, text[start:])
    if mode != "context":
        raise ValueError(f"translation must be 'context' or 'naive', got {mode!r}")
    ctx = context_window(text, start, window_bytes)
    out = encode_continuation(vocab, ctx, text[start:])
    if not out.aligned:
        naive = encode_naive(vocab, text[start:])
        return Translation(naive.ids, naive.lengths, naive.consumed, aligned=False)
    return out


_BLANK = frozenset(b" \t")
_NEWLINE = frozenset(b"\r\n")
_SPACE = _BLANK | _NEWLINE


def _wordy(b: int) -> bool:
    return b >= 0x80 or chr(b).isalnum()


def word_boundary(text: bytes, pos: int) -> bool:
    """True when tokenizers do not merge across byte `pos` of `text`, whatever follows it.

    Boundaries: the start of the text; a space or tab right after a non-whitespace byte (GPT-2
    and Qwen pre-tokenizers start a new chunk at " word", SentencePiece pieces at "▁word"); a
    newline right after a letter or digit (not after punctuation: Qwen's pre-tokenizer glues
    ".\n" into one chunk). Elsewhere a token may straddle `pos` (inside a word, or a space
    glued to the next word), so the split there depends on the neighbouring text. A heuristic
    for tokenizers without a pre-tokenizer (Gemma): `encode_continuation` checks alignment.
    """
    if pos <= 0:
        return True
    if pos >= len(text):
        return False
    b, prev = text[pos], text[pos - 1]
    return (b in _BLANK and prev not in _SPACE) or (b in _NEWLINE and _wordy(prev))


def common_prefix(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """Length of the longest common prefix of two id sequences, comparing from `start` on (the
    caller knows a[:start] == b[:start])."""
    n = min(len(a), len(b))
    i = min(start, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i


def prompt_for_draft(prompt_ids: Sequence[int], target: ByteVocab, draft: ByteVocab) -> list[int]:
    """The draft's prompt as the raw text of the target's prompt, re-encoded by the draft.

    The target's rendered prompt (chat template included) is turned into text, special tokens
    as their literal strings, and encoded by the draft tokenizer, which maps marker strings it
    knows (e.g. ChatML "<|im_start|>" for SmolLM2) to its own special tokens and reads the
    others as plain text. Callers that hold the conversation should render the draft's own
    template instead and pass `draft_prompt_tokens` to the generator.
    """
    data = target.to_bytes(prompt_ids)
    ids = draft.encode(data.decode("utf-8", errors="replace"))
    return ids or [0]
