"""What callers send, checked before the engine thread sees it (the caller's thread, pure Python):
prompt encoding (raw text or chat messages) and request validation against the model.
"""
from __future__ import annotations

import json
import threading
from typing import Any, Mapping, Optional

from flashfleet.errors import InvalidArgument
from flashfleet.tool_calls import FORMATS, check_message_tool_calls, check_tools
from worker.detokenize import TextAssembler
from worker.engine.grammar import GrammarCompiler, schema_error
from worker.engine.modes import AUTO, Mode, resolve_mode
from worker.engine.penalties import validate_penalties
from worker.engine.scheduler import BATCHED_MODES, Scheduler
from worker.engine.types import MAX_TOP_LOGPROBS, GenerationRequest, InvalidRequest, ModelDescription
from worker.sampling import validate_sampling

CHAT_ROLES = ("system", "user", "assistant", "tool")
# Bytes of text per token that no tokenizer exceeds on real text (BPE tokens of mlx-lm's models
# hold at most a few dozen bytes; whitespace runs in code are the longest): a bound, not an estimate.
MAX_PROMPT_BYTES_PER_TOKEN = 64


class Intake:
    """Encodes prompts and validates requests for one engine.

    Args:
        tokenizer: a tokenizer instance for the callers' threads (the engine thread decodes with
            another); encoding, and decoding resume tokens, hold a lock of this object's.
        model: the served model (its name and context limit).
        vocab_size: the target's vocabulary size (None: unknown, token ids go unchecked).
        draft_kind: the loaded draft's kind ("", "draft", "dflash" or "uag").
        modes: the decoding-mode table (`worker.engine.modes.MODES` or a test's).
    """

    def __init__(self, tokenizer: Any, model: ModelDescription, vocab_size: Optional[int], draft_kind: str,
                 modes: Mapping[str, Mode | None]):
        self.tokenizer = tokenizer
        self.model = model
        self._vocab_size = vocab_size
        self._draft_kind = draft_kind
        self._modes = modes
        self._lock = threading.Lock()
        self._grammars: Optional[GrammarCompiler] = None  # built at the first constrained request
        self.tool_format = model.tool_call_format  # flashfleet/tool_calls.py; "": tools are refused

    def grammar(self, r: GenerationRequest) -> Optional[Any]:
        """The grammar matcher of a request with a response format (compiled here, on the
        caller's thread: worker/engine/grammar.py), or None for free text.

        Raises:
            InvalidRequest: a format or schema the grammar library cannot compile (why, in its words).
        """
        if r.response_format is None:
            return None
        if r.response_format.type == "tool_calls" and not self.tool_format:
            raise InvalidRequest(self._no_tools())
        with self._lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer._tokenizer,
                                                 self._vocab_size or len(self.tokenizer.vocab),
                                                 self.tokenizer.eos_token_ids, self.tool_format)
        return self._grammars.matcher(r.response_format)

    def _no_tools(self) -> str:
        return (f"tools: the chat template of model {self.model.name!r} has no tool-call format flashfleet "
                f"parses ({', '.join(FORMATS)}); send the request without tools")

    def _check_tools(self, tools: Any) -> list[dict]:
        """The tools a request renders, checked: OpenAI's shape (`flashfleet.tool_calls.check_tools`)
        and every parameters schema one the grammar library compiles (tool_choice "auto" decodes
        without a grammar, so this is where a broken schema is caught)."""
        if not self.tool_format:
            raise InvalidRequest(self._no_tools())
        try:
            tools = check_tools(tools)
        except InvalidArgument as e:
            raise InvalidRequest(e.details) from None
        for i, tool in enumerate(tools):
            error = schema_error(tool["function"].get("parameters") or {"type": "object"})
            if error:
                raise InvalidRequest(f"tools[{i}].function.parameters cannot be compiled: {error}")
        return tools

    def encode_prompt(self, prompt: str | None, messages: list[dict] | None,
                      tools: list[dict] | None = None) -> list[int]:
        """Tokenizes raw text (with the tokenizer's special tokens, e.g. BOS), or renders chat
        messages with the model's chat template (generation prompt appended) and tokenizes them.

        Args:
            prompt: raw text; exactly one of prompt and messages is given.
            messages: [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...]; an
                assistant turn may carry "tool_calls" (OpenAI's shape, arguments as objects), a
                tool turn its "tool_call_id".
            tools: OpenAI's tools list, rendered by the template (`tools=`), or None. Needs a
                template with a tool-call format (`flashfleet.tool_calls.detect_format`).

        Returns:
            Prompt token ids, non-empty.

        Raises:
            InvalidRequest: neither or both inputs, empty text, a malformed message (the message
                names its index and field), no chat template, or a template that rejects them;
                tools with a raw prompt, for a template without a tool-call format, or malformed
                (the message names the field: "tools[0].function.parameters cannot be compiled").
        """
        if (prompt is None) == (messages is None):
            raise InvalidRequest("give exactly one of prompt or messages")
        if tools is not None:
            if messages is None:
                raise InvalidRequest("tools: served with chat messages only, not with a raw prompt")
            tools = self._check_tools(tools)
        self._check_prompt_size(prompt, messages, tools)
        tok = self.tokenizer
        if prompt is not None:
            if not isinstance(prompt, str) or not prompt:
                raise InvalidRequest("prompt must be a non-empty string")
            with self._lock:
                ids = tok.encode(prompt)
        else:
            _check_messages(messages)
            if not getattr(tok, "chat_template", None):
                raise InvalidRequest(f"model {self.model.name!r} has no chat template; send a raw prompt")
            with self._lock:
                try:
                    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                   **({"tools": tools} if tools else {}))
                except Exception as e:  # jinja2.TemplateError and the template's raise_exception
                    raise InvalidRequest(f"the chat template rejected the messages: {e}") from e
                ids = tok.encode(text, add_special_tokens=False)
        if not ids:
            raise InvalidRequest("the prompt encodes to no tokens")
        return list(ids)

    def _check_prompt_size(self, prompt: Any, messages: Any, tools: Any = None) -> None:
        """Refuses text that cannot fit the context before tokenizing it (a multi-megabyte prompt
        would hold this worker's tokenizer for seconds and grow its memory for nothing): no
        tokenizer here makes fewer than one token of `MAX_PROMPT_BYTES_PER_TOKEN` bytes."""
        if isinstance(prompt, str):
            size = len(prompt.encode("utf-8", "surrogatepass"))
        elif isinstance(messages, list):
            size = sum(len(m["content"].encode("utf-8", "surrogatepass")) for m in messages
                       if isinstance(m, Mapping) and isinstance(m.get("content"), str))
            size += len(json.dumps(tools).encode()) if tools else 0
        else:
            return
        limit = MAX_PROMPT_BYTES_PER_TOKEN * self.model.max_context_tokens
        if size > limit:
            raise InvalidRequest(
                f"the prompt is {size:,} bytes; the model's context of {self.model.max_context_tokens:,} tokens "
                f"takes at most {limit:,} bytes of text: shorten the prompt")

    def validate(self, r: GenerationRequest, sched: Optional[Scheduler]) -> str:
        """Checks a request against the model and, once loaded, the KV budget of `sched` (read
        only: its sizes are fixed at load).

        Returns:
            The key of the mode that will serve it.

        Raises:
            InvalidRequest: empty request_id or prompt, token ids outside the vocabulary,
                max_tokens < 1 (< 0 with prompt_logprobs), prompt + max_tokens beyond the context
                or (batched modes) the KV budget, bad sampling parameters (penalties and logit_bias
                included), an empty stop string, a mode this worker cannot serve (a response
                format, log-probabilities or penalties in a mode other than plain and dflash), or
                resume tokens that are not fewer than max_tokens, hold an EOS or do not match
                resume_text.
        """
        if not r.request_id:
            raise InvalidRequest("request_id is empty")
        n = len(r.prompt_tokens)
        if n == 0:
            raise InvalidRequest("prompt is empty (no prompt tokens)")
        if self._vocab_size is not None and (min(r.prompt_tokens) < 0 or max(r.prompt_tokens) >= self._vocab_size):
            raise InvalidRequest(f"prompt token ids must be in [0, {self._vocab_size})")
        if r.max_tokens < (0 if r.prompt_logprobs >= 0 else 1):
            raise InvalidRequest(f"max_tokens must be >= 1 (0 only with prompt_logprobs), got {r.max_tokens}")
        if r.resume_tokens:
            if len(r.resume_tokens) >= r.max_tokens:
                raise InvalidRequest(f"resume_token_ids ({len(r.resume_tokens)}) must be fewer than "
                                     f"max_tokens ({r.max_tokens}): nothing is left to generate")
            if self._vocab_size is not None and not all(0 <= t < self._vocab_size for t in r.resume_tokens):
                raise InvalidRequest(f"resume_token_ids must be in [0, {self._vocab_size})")
            if set(self.tokenizer.eos_token_ids).intersection(r.resume_tokens):
                raise InvalidRequest("resume_token_ids contain an end-of-sequence token")
            try:  # the engine thread primes its own assembler the same way
                with self._lock:  # callers' threads share this tokenizer (a Rust tokenizer is not re-entrant)
                    TextAssembler(self.tokenizer, r.stop).resume(r.resume_tokens, r.resume_text)
            except ValueError as e:
                raise InvalidRequest(str(e)) from None
        elif r.resume_text:
            raise InvalidRequest("resume_text without resume_token_ids")
        ctx = self.model.max_context_tokens
        if n + r.max_tokens > ctx:
            raise InvalidRequest(
                f"prompt ({n} tokens) + max_tokens ({r.max_tokens}) = {n + r.max_tokens} tokens "
                f"exceeds the model's context of {ctx} tokens: "
                + (f"ask for max_tokens <= {ctx - n}, or leave it unset" if n < ctx else "shorten the prompt")
            )
        validate_sampling(r.sampling.temperature, r.sampling.top_p, r.sampling.seed)
        validate_penalties(r.sampling, self._vocab_size)
        if any(not isinstance(s, str) or not s for s in r.stop):
            raise InvalidRequest("stop strings must be non-empty strings")
        mode = resolve_mode(r.mode, self._draft_kind, self._modes)
        for name, value in (("top_logprobs", r.top_logprobs), ("prompt_logprobs", r.prompt_logprobs)):
            if not -1 <= value <= MAX_TOP_LOGPROBS:
                raise InvalidRequest(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {value}")
        fmt_name = "tool_choice" if r.response_format is not None and r.response_format.type == "tool_calls" \
            else "response_format"
        asks = [name for name, on in ((fmt_name, r.response_format is not None),
                                      ("logprobs", r.top_logprobs >= 0),
                                      ("prompt_logprobs", r.prompt_logprobs >= 0),
                                      ("penalties and logit_bias", r.sampling.penalized)) if on]
        if asks and mode not in BATCHED_MODES:
            if r.mode != AUTO:
                raise InvalidRequest(f"{' and '.join(asks)}: served in modes plain and dflash only, not {mode!r}")
            mode = "plain"  # this worker's draft decodes without grammars, log-probabilities and penalties
        if sched is not None and mode in BATCHED_MODES:
            positions = n + r.max_tokens + sched.max_block(mode)
            if not sched.fits_alone(mode, positions):
                need = sched.row_bytes(mode, positions)
                raise InvalidRequest(
                    f"prompt ({n} tokens) + max_tokens ({r.max_tokens}) needs {need / 1e6:.1f} MB of KV cache, "
                    f"more than this worker's KV budget of {sched.budget / 1e6:.1f} MB: "
                    "ask for fewer tokens, or raise the worker's --kv-cache-limit-bytes")
        return mode


def _check_messages(messages: Any) -> None:
    """Raises InvalidRequest naming the first malformed chat message and what is wrong with it."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {'role', 'content'} objects")
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise InvalidRequest(f"messages[{i}] must be an object with 'role' and 'content', got {type(msg).__name__}")
        role = msg.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {role!r}")
        if not isinstance(msg.get("content"), str):
            raise InvalidRequest(f"messages[{i}].content must be a string; got {type(msg.get('content')).__name__}")
        if msg.get("tool_calls") is not None:
            try:
                check_message_tool_calls(i, msg["tool_calls"])
            except InvalidArgument as e:
                raise InvalidRequest(e.details) from None
