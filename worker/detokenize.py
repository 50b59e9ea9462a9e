"""Token ids -> text for streaming: whole UTF-8 characters only, and stop strings.

`IncrementalDetokenizer` decodes a sliding window of recent tokens with the tokenizer's own
`decode` and emits the growth of that window's text, holding it back while it ends in U+FFFD (an
incomplete UTF-8 sequence). This is the prefix/read-offset scheme of Hugging Face TGI and vLLM
(`detokenize_incrementally`). Because the tokenizer's own decoder does the work, it behaves the
same for byte-level BPE (GPT-2, Llama 3, Qwen) and for SentencePiece byte fallback (<0xNN> tokens,
"▁" spaces, the leading-space strip), where mlx-lm's streaming detokenizers each cover one family
and approximate `decode` at the edges (leading spaces, byte 0x00).

`StopStrings` ends the text before the first stop string and holds back a tail that could still
grow into one. `TextAssembler` chains the two for the engine.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

REPLACEMENT = "\ufffd"


def decoder_of(tokenizer: Any) -> Callable[[list[int]], str]:
    """`tokenizer.decode` as a function of a list of ids, without Python layers that change nothing.

    A Hugging Face fast tokenizer (also behind mlx-lm's `TokenizerWrapper`) decodes with its Rust
    backend, `backend_tokenizer.decode(ids, skip_special_tokens=False)`, then cleans up
    tokenization spaces when configured to; without the clean-up, the backend's call is the whole
    of `decode` and costs a fifth of it (the wrapper converts and checks its arguments each
    call), which matters at one call per session and engine iteration. Anything else (a slow
    tokenizer, clean-up on): `tokenizer.decode` itself.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer.decode
    return lambda ids: backend.decode(ids, skip_special_tokens=False)


class IncrementalDetokenizer:
    """Streams the text of a growing token sequence, one batch of ids at a time.

    The concatenation of everything `add` and `finalize` return equals
    `tokenizer.decode(all ids)` for tokenizers whose decoding of a sequence is the decoding of a
    recent window appended to the text before it: byte-level BPE always, SentencePiece as long as
    its byte tokens form valid UTF-8 (its ByteFallback decoder turns a whole run of byte tokens
    into U+FFFD when the run ends in an invalid byte, rewriting text already streamed). Not with
    `clean_up_tokenization_spaces=True`, which rewrites text across token boundaries.

    Args:
        tokenizer: anything with `decode(ids: list[int]) -> str` (a Hugging Face tokenizer or
            mlx-lm's `TokenizerWrapper`). Special tokens are rendered as `decode` renders them.

    Cost: two `decode` calls over a few tokens per `add` (one while text is held back), through
    the tokenizer's backend where that is the same (`decoder_of`).
    """

    def __init__(self, tokenizer: Any):
        self._decode = decoder_of(tokenizer)
        self.tokens: list[int] = []
        self._prefix = 0  # window start: tokens before it are emitted and no longer decoded
        self._read = 0  # tokens before it are emitted
        self._prefix_text = ""  # decode(tokens[_prefix:_read])

    def add(self, token_ids: Sequence[int]) -> str:
        """Appends ids; returns the newly complete text ("" while a character is incomplete)."""
        if not token_ids:
            return ""
        self.tokens.extend(token_ids)
        text = self._decode(self.tokens[self._prefix:])
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT):
            return ""
        return self._advance(text)

    def finalize(self) -> str:
        """Returns the held-back text, incomplete characters as U+FFFD (as `decode` gives them)."""
        if self._read == len(self.tokens):
            return ""
        text = self._decode(self.tokens[self._prefix:])
        return self._advance(text) if len(text) > len(self._prefix_text) else ""

    def _advance(self, text: str) -> str:
        new = text[len(self._prefix_text):]
        self._prefix, self._read = self._read, len(self.tokens)
        self._prefix_text = self._decode(self.tokens[self._prefix:self._read])
        return new


class StopStrings:
    """Cuts a text stream before the first occurrence of any stop string.

    `feed` returns the text that can be released now: everything up to a found stop string, or
    everything except the longest tail that is a prefix of some stop string (that tail may still
    become one, so it is held back). A stop string that spans several `feed` calls is found.

    Args:
        stops: the stop strings, each non-empty.

    Raises:
        ValueError: an empty stop string.
    """

    def __init__(self, stops: Sequence[str]):
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(stops)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Returns the releasable text; sets `stopped` when a stop string was found."""
        if not self._stops or self.stopped:
            return "" if self.stopped else text
        buf = self._held + text
        cut = min((i for i in (buf.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held, self.stopped = "", True
            return buf[:cut]
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """Returns the held-back tail at the end of the stream (no stop string followed)."""
        held, self._held = self._held, ""
        return held

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest tail of buf that is a proper prefix of a stop string. Only tails
        that start with some stop string's first character are tried (one `find` scan per stop),
        so ordinary text costs a few C-level scans per token, not one comparison per tail length."""
        best = 0
        for s in self._stops:
            end = len(buf) - best  # a tail must start before this to beat the best so far
            i = buf.find(s[0], max(len(buf) - len(s) + 1, 0), end)
            while i >= 0:
                if s.startswith(buf[i:]):
                    best = len(buf) - i  # the first hit is the longest tail for this stop string
                    break
                i = buf.find(s[0], i + 1, end)
        return best


class TextAssembler:
    """Token ids in, releasable text out: `IncrementalDetokenizer` then `StopStrings`.

    Args:
        tokenizer: see `IncrementalDetokenizer`.
        stops: stop strings (may be empty).

    Attributes:
        stopped: True once a stop string was found; later `add` calls return "".
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str] = ()):
        self._detok = IncrementalDetokenizer(tokenizer)
        self._decode_one = tokenizer.decode
        self._stops = StopStrings(stops)
        self._skip = 0  # characters the client already has (a resumed request), not yet released here

    def piece(self, token_id: int) -> str:
        """One token's text on its own (a token holding part of a UTF-8 character reads U+FFFD),
        for log-probability listings."""
        return self._decode_one([token_id])

    @property
    def stopped(self) -> bool:
        """True once a stop string was found."""
        return self._stops.stopped

    def resume(self, token_ids: Sequence[int], delivered: str) -> str:
        """Continues a stream another assembler began: `token_ids` were streamed with the text
        `delivered` (what the client has: a prefix of their text, since an assembler holds back
        incomplete characters and possible stop strings, and how much depends on how the ids
        were batched). Returns the text now due to the client; later calls release the rest.

        Raises:
            ValueError: `delivered` is not a prefix of the ids' text, or a stop string already
                ends it.
        """
        released = self.add(token_ids)
        if self.stopped:
            raise ValueError("the resumed output already reached a stop string")
        if released.startswith(delivered):
            return released[len(delivered):]
        if not delivered.startswith(released):
            raise ValueError("resume_text is not the text of resume_token_ids")
        self._skip = len(delivered) - len(released)
        return ""

    def add(self, token_ids: Sequence[int]) -> str:
        """Text released by these ids (complete characters, nothing at or after a stop string)."""
        return self._skipped(self._stops.feed(self._detok.add(token_ids)))

    def finish(self) -> str:
        """Text still held back at the end of generation (incomplete bytes as U+FFFD)."""
        text = self._stops.feed(self._detok.finalize())
        return self._skipped(text if self._stops.stopped else text + self._stops.flush())

    def _skipped(self, text: str) -> str:
        if self._skip and text:
            n = min(self._skip, len(text))
            self._skip -= n
            text = text[n:]
        return text
