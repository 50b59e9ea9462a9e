"""Structured output: a grammar matcher per constrained row, and its token masks.

A request with a response format (JSON of a schema, or any JSON object), or whose tools must be
called (tool_choice "required" or a named function: the Lark grammar of its model's tool-call
format, flashfleet/tool_calls.py), decodes under a grammar:
at each position only the tokens the grammar allows there can be chosen. The grammar library is
llguidance (Microsoft; chosen by measurement, docs/benchmarks.md): `GrammarCompiler` turns a
response format into an `llguidance.LLMatcher` on the caller's thread (compiling it and computing
its first mask there, so a schema it cannot compile is refused before the engine sees it), and
the engine thread keeps one `RowGrammar` per constrained row.

A row's matcher holds the grammar state after its committed tokens. A plain step masks the row's
logits with the mask of that state. A DFlash iteration (worker/engine/batch.py) walks the draft
block: each drafted token is the draft's best legal token in the state the tokens before it reach
(`RowGrammar.draft`, among the draft's best candidates at each position), so the draft proposes
only legal tokens and where the grammar allows one token (a key, a bracket, the tail of an enum
value) the draft proposes exactly it, a draft the
target's masked choice accepts by construction. The verify masks position j of the block with
the state after the block's first j drafted tokens, and the matcher then advances by the
committed tokens only (the walk is rolled back). Every committed token is therefore the target's
own choice (argmax or draw) among the legal tokens at its position, in plain and DFlash rows alike.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import llguidance
import llguidance.hf
import llguidance.numpy
import mlx.core as mx
import numpy as np

from flashfleet.tool_calls import FORMATS
from worker.engine.types import InvalidRequest, ResponseFormat

# Any JSON object: what OpenAI's {"type": "json_object"} asks for.
ANY_OBJECT = {"type": "object"}
# JSON on one line, separators as Python's json.dumps writes them: with free whitespace a model can
# fill its whole budget with newlines between two legal tokens (and no whitespace choice leaves
# more of the output forced: the draft's free tokens). A schema's own "x-guidance" overrides it.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def schema_error(schema: Any) -> str:
    """Why the grammar library cannot compile a JSON Schema (a dict), or "" when it can."""
    try:
        return llguidance.LLMatcher.validate_grammar(
            llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)) or ""
    except Exception as e:  # the compiler's ValueError / RuntimeError on a schema it rejects
        return str(e) or type(e).__name__


class GrammarCompiler:
    """Compiles response formats into matchers for one tokenizer; any thread.

    Args:
        hf_tokenizer: the target's Hugging Face tokenizer (mlx-lm's `TokenizerWrapper._tokenizer`).
        vocab_size: rows of the target's logits, V (>= the tokenizer's vocabulary).
        eos_ids: the ids that end a generation; the grammar allows them once its text is complete.
        tool_format: the chat template's tool-call format (`flashfleet.tool_calls.FORMATS` key),
            for "tool_calls" formats; "" when it has none.
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_ids: Sequence[int], tool_format: str = ""):
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_ids))
        self.tool_format = tool_format
        self._added = frozenset(hf_tokenizer.get_added_vocab())  # tokens llguidance matches by name only

    def _tool_grammar(self, fmt: ResponseFormat) -> str:
        """The grammar of an answer of tool calls (flashfleet/tool_calls.py)."""
        if self.tool_format not in FORMATS:
            raise InvalidRequest("tool_choice: this model's chat template has no tool-call format")
        try:
            tools = json.loads(fmt.tools)
        except ValueError as e:
            raise InvalidRequest(f"tools is not valid JSON: {e}") from None
        if fmt.function and fmt.function not in {t.get("function", {}).get("name") for t in tools}:
            raise InvalidRequest(f"tool_choice names function {fmt.function!r:.70}, which is not among the tools")
        lark = FORMATS[self.tool_format].grammar(tools, fmt.function, fmt.parallel_calls, self._added.__contains__)
        return llguidance.LLMatcher.grammar_from_lark(lark)

    def matcher(self, fmt: ResponseFormat) -> llguidance.LLMatcher:
        """A fresh matcher for `fmt`, its first mask computed.

        Raises:
            InvalidRequest: an unknown format type, a schema that is not a JSON object, or one
                the library cannot compile (the message carries the library's reason).
        """
        if fmt.type == "tool_calls":
            grammar = self._tool_grammar(fmt)
            return self._matcher(grammar, "tools: a parameters schema cannot be compiled")
        if fmt.type == "json_object":
            schema: Any = ANY_OBJECT
        elif fmt.type == "json_schema":
            try:
                schema = json.loads(fmt.json_schema)
            except ValueError as e:
                raise InvalidRequest(f"response_format's json_schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise InvalidRequest("response_format's json_schema must be a JSON object (a JSON Schema)")
        else:
            raise InvalidRequest(f"unknown response_format type {fmt.type!r}; use json_object or json_schema")
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except Exception as e:  # the compiler's ValueError / RuntimeError on a schema it rejects
            raise InvalidRequest(f"response_format's json_schema cannot be compiled: {e}") from None
        return self._matcher(grammar, "response_format's json_schema cannot be compiled")

    def _matcher(self, grammar: str, refusal: str) -> llguidance.LLMatcher:
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise InvalidRequest(f"{refusal}: {error}")
        m = llguidance.LLMatcher(self.tokenizer, grammar)
        m.compute_bitmask()  # builds the lexer here, on the caller's thread
        if m.is_error():
            raise InvalidRequest(f"{refusal}: {m.get_error()}")
        return m


def allowed(bitmasks: np.ndarray, vocab_size: int) -> mx.array:
    """Bit masks (..., W) int32 (token t allowed iff bit t % 32 of word t // 32 is set) -> a
    boolean (..., V) mlx array."""
    words = mx.array(bitmasks.view(np.uint32))
    bits = (words[..., None] >> mx.arange(32, dtype=mx.uint32)) & 1
    return bits.reshape(*words.shape[:-1], -1)[..., :vocab_size].astype(mx.bool_)


def _unpacked(bitmask: np.ndarray) -> np.ndarray:
    """One (W,) int32 bit mask -> (W * 32,) bool, on the host."""
    return np.unpackbits(bitmask.view(np.uint8), bitorder="little").astype(bool)


@dataclass
class RowGrammar:
    """One constrained row's matcher on the engine thread.

    Attributes:
        matcher: the grammar state after the row's committed tokens.
        vocab_size: V, rows of the target's logits.
        eos_ids: the ids that end the row (never consumed: the row ends with them).
    """

    matcher: llguidance.LLMatcher
    vocab_size: int
    eos_ids: frozenset[int]
    _walk: Optional[tuple[list[int], list[np.ndarray]]] = None  # the last `draft`'s tokens and masks

    def _mask(self) -> np.ndarray:
        out = llguidance.numpy.allocate_token_bitmask(1, self.vocab_size)
        llguidance.numpy.fill_next_token_bitmask(self.matcher, out, 0)
        return out[0]

    def masks(self) -> np.ndarray:
        """(1, W) int32: the mask of the next token."""
        return self._mask()[None]

    def draft(self, candidates: np.ndarray, scores: np.ndarray) -> list[int]:
        """The draft's block under the grammar: at each position the best-scored candidate the
        grammar allows after the tokens drafted before it, or, when none of them is legal, the
        first legal token (where the grammar forces one token, that token). The masks met on the
        way are kept for `verify_masks`; the matcher is left where it was.

        Args:
            candidates: (L-1, C) target ids, the draft's C best tokens at each drafted position.
            scores: (L-1, C) float32, their logits.

        Returns:
            The L-1 drafted target ids.
        """
        masks = [self._mask()]
        tokens: list[int] = []
        n = candidates.shape[0]
        for j in range(n):
            legal = _unpacked(masks[-1])[: self.vocab_size]
            ok = legal[candidates[j]]
            if ok.any():
                token = int(candidates[j][np.argmax(np.where(ok, scores[j], -np.inf))])
            else:
                allowed_ids = np.flatnonzero(legal)
                if not allowed_ids.size:  # nothing is legal (a matcher in error): the verify rejects here
                    tokens += [int(candidates[j][0])] * (n - j)
                    break
                token = int(allowed_ids[0])
            tokens.append(token)
            if token in self.eos_ids:  # the row ends here: later positions never commit
                tokens += [token] * (n - 1 - j)
                break
            self.matcher.consume_token(token)
            masks.append(self._mask())
        if len(masks) > 1:
            self.matcher.rollback(len(masks) - 1)
        self._walk = (tokens, masks)
        return tokens

    def verify_masks(self, drafted: Sequence[int]) -> np.ndarray:
        """(L, W) int32 masks of a verify of the block [b, *drafted]: position j's is the state's
        after the first j drafted tokens. Past the first drafted token the grammar refuses (or an
        EOS) the masks repeat: no token there can commit. The matcher is left where it was."""
        drafted = list(drafted)
        walk, self._walk = self._walk, None
        if walk is not None and walk[0] == drafted:
            masks = walk[1]
        else:
            masks = [self._mask()]
            for t in drafted:
                if t in self.eos_ids or not self.matcher.validate_tokens([t]):
                    break
                self.matcher.consume_token(t)
                masks.append(self._mask())
            if len(masks) > 1:
                self.matcher.rollback(len(masks) - 1)
        masks = masks + [masks[-1]] * (len(drafted) + 1 - len(masks))
        return np.stack(masks)

    def advance(self, tokens: Sequence[int]) -> None:
        """Commits a row's new tokens (each legal by construction).

        Raises:
            RuntimeError: the matcher refused one (its error message).
        """
        tokens = [t for t in tokens if t not in self.eos_ids]  # an EOS ends the row
        if tokens and not self.matcher.consume_tokens(tokens):
            raise RuntimeError(f"the grammar refused a committed token: {self.matcher.get_error()}")
