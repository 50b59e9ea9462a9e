"""OpenAI's JSON shapes for the coordinator's HTTP API (coordinator/openai_api.py): request bodies
of /v1/chat/completions and /v1/completions turned into GenerateRequest protos, and responses,
stream chunks and errors built from flashfleet's. Pure functions, no I/O.

Mapping (OpenAI field -> GenerateRequest): model, messages (text content; "developer" turns are
system turns) / prompt (one string), max_completion_tokens or max_tokens, temperature (unset =
greedy, as in flashfleet's own API), top_p, seed, stop (a string or a list), response_format
(json_object, json_schema: decoded under a grammar), logprobs / top_logprobs, and for completions
echo (the prompt's text before the completion's; with logprobs, the prompt tokens'
log-probabilities first, the first one null, as lm-evaluation-harness's loglikelihood reads them;
max_tokens 0 then scores the prompt alone), and for chat tools / tool_choice / parallel_tool_calls
(rendered through the model's chat template, the answer parsed into `tool_calls` with the
model's tool-call format, flashfleet/tool_calls.py), presence_penalty, frequency_penalty,
logit_bias (token id -> bias) and n (choices, each a request of its own: `choice_requests`).
flashfleet's own fields ride along in the body (`extra_body` in the openai client): mode ("auto",
"plain", "draft", "dflash", "uag"), session_id (worker affinity across turns), timeout_s (the
request's deadline, seconds) and repetition_penalty (over prompt and output, as Hugging Face and
mlx-lm define it). Fields flashfleet cannot honour (best_of, the deprecated functions, ...) are
refused with 400 rather than ignored.
"""
from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from typing import Any

import grpc

from flashfleet.errors import InvalidArgument, short_details
from flashfleet import requests
from flashfleet.requests import MAX_CHOICES, MAX_TIMEOUT_S, MAX_TOP_LOGPROBS, build_request, choice_id
from flashfleet.tool_calls import FORMATS, ToolCall
from flashfleet.types import DECODE_MODE_NAMES, FINISH_REASONS, GenerationStats
from flashfleet.v1 import common_pb2, coordinator_pb2

# gRPC status of a failed request -> (HTTP status, OpenAI error type, error code).
HTTP_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_argument"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", "failed_precondition"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", "out_of_range"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "overloaded"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "unavailable"),
    # The client is still there: the server (a draining worker) ended the request.
    grpc.StatusCode.CANCELLED: (503, "server_error", "cancelled"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", "deadline_exceeded"),
}
# FINISH_REASON_CANCELLED (a worker stopped the request) has no OpenAI counterpart: "stop", with
# flashfleet's own reason in the `flashfleet` object.
OPENAI_FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}
# The body fields an InvalidArgument's message may start with: the `param` of its 400.
_PARAMS = re.compile(r"messages|tools|tool_choice|parallel_tool_calls|response_format")
PENALTY_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty")
# Request fields an INVALID_ARGUMENT message may be about, where it does not start with one.
NAMED_FIELDS = ("response_format", "logit_bias", *PENALTY_FIELDS, "top_logprobs", "temperature", "top_p",
                "seed", "max_tokens", "stop", "prompt_logprobs", "prompt", "messages")


OWN_FIELDS = ("mode", "session_id", "timeout_s")  # flashfleet's own body fields
_FIRST_WORD = re.compile(r"[a-z_]+")


def field_named(details: str) -> str | None:
    """The request field an InvalidArgument's message is about (the `param` of its 400): the one
    it starts with (`_PARAMS`, or any request field, flashfleet's own included), else the first
    of `NAMED_FIELDS` it names, else None."""
    field = _PARAMS.match(details)
    if field:
        return field[0]
    first = _FIRST_WORD.match(details)
    if first and (first[0] in REQUEST_FIELDS or first[0] in OWN_FIELDS):
        return first[0]
    if details.startswith("unknown mode"):
        return "mode"
    return next((name for name in NAMED_FIELDS if name in details), None)

# Every request field of OpenAI's /v1/chat/completions and /v1/completions, and what flashfleet
# does with it: SERVED (honoured), NOOP (accepted and has no effect, for the reason in docs/operations.md
# §12), or a tuple of "off" values: any other value is refused with 400 naming the field (a silently
# ignored penalty, tool list or response format would give answers the client did not ask for).
# Fields of neither endpoint (flashfleet's own `mode`, `session_id`, `timeout_s` aside) are ignored.
SERVED, NOOP = "served", "no-op"
REQUEST_FIELDS: dict[str, str | tuple] = {
    "model": SERVED, "messages": SERVED, "prompt": SERVED, "max_completion_tokens": SERVED,
    "max_tokens": SERVED, "temperature": SERVED, "top_p": SERVED, "seed": SERVED, "stop": SERVED,
    "stream": SERVED, "stream_options": SERVED,
    # Nothing is stored or moderated, every request has one service tier, and the worker's prompt
    # cache reuses prefixes by itself: these change nothing in the answer.
    "user": NOOP, "safety_identifier": NOOP, "metadata": NOOP, "store": NOOP, "service_tier": NOOP,
    "prompt_cache_key": NOOP, "prompt_cache_retention": NOOP, "prompt_cache_options": NOOP,
    "response_format": SERVED, "tools": SERVED, "tool_choice": SERVED, "parallel_tool_calls": SERVED,
    "n": SERVED, "best_of": (None, 1), "echo": SERVED, "suffix": (None, ""),
    "logprobs": SERVED, "top_logprobs": SERVED, "logit_bias": SERVED,
    "functions": (None, []), "function_call": (None, "none", "auto"),
    "presence_penalty": SERVED, "frequency_penalty": SERVED,
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
    "reasoning_effort": (None,), "verbosity": (None,), "web_search_options": (None,), "moderation": (None,),
}


class OpenAIError(Exception):
    """A request the HTTP API answers with an error in OpenAI's shape.

    Attributes:
        status: the HTTP status (400, 404, 429, 503, 504, 500...).
        message, type, param, code: the fields of OpenAI's {"error": {...}} object.
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        """{"error": {"message", "type", "param", "code"}}."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    @classmethod
    def from_status(cls, code: grpc.StatusCode, details: str) -> "OpenAIError":
        """The error for a request that failed with gRPC status `code` (HTTP_ERRORS; any other
        code is 500 server_error)."""
        status, kind, name = HTTP_ERRORS.get(code, (500, "server_error", code.name.lower()))
        param = "model" if code == grpc.StatusCode.NOT_FOUND else None
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            param = field_named(details)
        return cls(status, details, kind, param, name)


def bad(message: str, param: str | None = None) -> OpenAIError:
    """A 400 invalid_request_error naming `param`."""
    return OpenAIError(400, message, "invalid_request_error", param, "invalid_argument")


@dataclasses.dataclass
class ParsedRequest:
    """A request body read into flashfleet's terms.

    Attributes:
        request: the GenerateRequest (request_id set: "<hex>").
        chat: True for /v1/chat/completions, False for /v1/completions.
        stream: whether to answer with server-sent events.
        include_usage: stream_options.include_usage (a last chunk with `usage`).
        timeout_s: the request's deadline in seconds, or None.
        logprobs: whether the answer lists its tokens' log-probabilities.
        echo: the prompt's text to put before the completion's (completions' `echo`), or None.
        tools: the functions the answer may call (tools given, tool_choice not "none"); () = none.
        n: how many choices to generate (`choice_requests`).
    """

    request: common_pb2.GenerateRequest
    chat: bool
    stream: bool = False
    include_usage: bool = False
    timeout_s: float | None = None
    logprobs: bool = False
    echo: str | None = None
    tools: tuple[str, ...] = ()
    n: int = 1


def choice_requests(parsed: ParsedRequest) -> list[common_pb2.GenerateRequest]:
    """One GenerateRequest per choice (`flashfleet.requests.choice_requests`)."""
    return requests.choice_requests(parsed.request, parsed.n)


def _number(body: dict, key: str, kind=(int, float)):
    value = body.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
        names = "an integer" if kind is int else "a number"
        raise bad(f"{key} must be {names}, got {value!r}", key)
    return value


def _message_text(i: int, content) -> str:
    """A chat turn's content: a string, or a list of text parts ({"type": "text", "text": ...})."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad(f"messages[{i}].content: only text parts are served, got {part!r}",
                          f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content must be a string or a list of text parts, got {content!r}",
              f"messages[{i}].content")


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list of {'role': ..., 'content': ...}", "messages")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string 'role', got {m!r}", f"messages[{i}]")
        role = "system" if m["role"] == "developer" else m["role"]
        turn = {"role": role, "content": _message_text(i, m.get("content"))}
        for key in ("tool_calls", "tool_call_id"):  # checked by build_request
            if m.get(key) is not None:
                turn[key] = m[key]
        turns.append(turn)
    return turns


def _prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if not isinstance(prompt, str):
        raise bad("prompt must be one string (lists of several prompts and token-id prompts are not "
                  f"served), got {prompt!r:.80}", "prompt")
    return prompt


def parse_request(body: Any, chat: bool) -> ParsedRequest:
    """Reads a /v1/chat/completions (`chat`) or /v1/completions body.

    Raises:
        OpenAIError: 400 for a body that is not a JSON object, a missing or mistyped field, a
            field flashfleet cannot honour set to a value that asks for it (`REQUEST_FIELDS`),
            a timeout_s outside (0, `MAX_TIMEOUT_S`] seconds, or what
            `flashfleet.requests.build_request` refuses (InvalidArgument).
    """
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    for key, off in REQUEST_FIELDS.items():
        if isinstance(off, tuple) and key in body and body[key] not in off:
            raise bad(short_details(f"{key}={body[key]!r} is not supported by flashfleet (leave it unset)"), key)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model must be the name of a served model (GET /v1/models lists them)", "model")
    max_tokens = _number(body, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", int)
    temperature, top_p = _number(body, "temperature"), _number(body, "top_p")
    penalties = {name: _number(body, name) for name in PENALTY_FIELDS}
    seed = _number(body, "seed", int)
    timeout_s = _number(body, "timeout_s")
    if timeout_s is not None and not (0 < timeout_s <= MAX_TIMEOUT_S):  # NaN fails too; no float() of a huge int
        raise bad(short_details(f"timeout_s must be a number of seconds > 0 and at most {MAX_TIMEOUT_S:.0e}, "
                                f"got {timeout_s!r}"), "timeout_s")
    stream = body.get("stream") or False
    options = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise bad("stream must be true or false and stream_options an object", "stream")
    mode, session_id = body.get("mode", "auto"), body.get("session_id", "")
    top_logprobs = _top_logprobs(body, chat)
    echo = _echo(body, chat)
    if max_tokens == 0 and not echo:
        raise bad("max_tokens must be > 0 (0 is served with echo: true, which scores the prompt alone)", "max_tokens")
    prompt = None if chat else _prompt(body)
    # Echo with logprobs lists the prompt's tokens too; max_tokens 0 has the worker score the prompt
    # (nothing else to do), its logprobs read only when asked for.
    prompt_logprobs = top_logprobs if echo and top_logprobs is not None else 0 if echo and max_tokens == 0 else None
    n = _number(body, "n", int)
    if n is not None and not 1 <= n <= MAX_CHOICES:
        raise bad(f"n must be an integer in [1, {MAX_CHOICES}], got {n!r}", "n")
    if not chat:  # tools are a chat field; their "off" values pass, as elsewhere
        for key, off in (("tools", (None, [])), ("tool_choice", (None, "none", "auto"))):
            if body.get(key) not in off:
                raise bad(short_details(f"{key}={body[key]!r} is not supported on /v1/completions: send tools "
                                        "to /v1/chat/completions"), key)
    try:
        request = build_request(
            model, prompt, messages=_messages(body) if chat else None,
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
            stop=body.get("stop"), session_id=session_id, request_id=uuid.uuid4().hex, mode=mode,
            response_format=body.get("response_format"), top_logprobs=top_logprobs,
            prompt_logprobs=prompt_logprobs, tools=body.get("tools") if chat else None,
            tool_choice=body.get("tool_choice") if chat else None,
            parallel_tool_calls=body.get("parallel_tool_calls") if chat else None,
            logit_bias=body.get("logit_bias"), **penalties)
    except InvalidArgument as e:
        raise bad(e.details, field_named(e.details)) from None
    return ParsedRequest(request, chat, stream, bool(options.get("include_usage")), timeout_s,
                         top_logprobs is not None, prompt if echo else None, _tool_names(request), n or 1)


def _tool_names(request: common_pb2.GenerateRequest) -> tuple[str, ...]:
    if not request.HasField("tools"):
        return ()
    return tuple(t["function"]["name"] for t in json.loads(request.tools.tools_json))


def _echo(body: dict, chat: bool) -> bool:
    """Completions' `echo` (true/false; unset: false); chat has none."""
    echo = body.get("echo")
    if echo not in (None, True, False):
        raise bad(f"echo must be true or false, got {echo!r:.40}", "echo")
    if echo and chat:
        raise bad("echo is a /v1/completions field (chat has no echo)", "echo")
    return bool(echo)


def _top_logprobs(body: dict, chat: bool) -> int | None:
    """The alternatives a token's log-probabilities list, or None for none: chat's `logprobs`
    (true/false) and `top_logprobs` (0..20, with logprobs true); completions' `logprobs` (0..20)."""
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:
        if logprobs not in (None, True, False):
            raise bad(f"logprobs must be true or false, got {logprobs!r:.40}", "logprobs")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise bad(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top!r:.40}", "top_logprobs")
        if top and not logprobs:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        return (top or 0) if logprobs else None
    if top is not None:
        raise bad("top_logprobs is a chat field; completions take logprobs: N", "top_logprobs")
    if logprobs is None or logprobs is False:
        return None
    if isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise bad(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {logprobs!r:.40}", "logprobs")
    return logprobs


def _stats_dict(complete: common_pb2.Complete) -> dict:
    stats = dataclasses.asdict(GenerationStats.from_proto(complete.stats))
    stats["accepted_per_position"] = list(stats["accepted_per_position"])
    return stats


def flashfleet_fields(request_id: str, complete: common_pb2.Complete) -> dict:
    """flashfleet's own report of a finished request: request_id, worker_id, finish_reason
    ("stop", "length", "cancelled") and every `flashfleet.types.GenerationStats` field (mode,
    acceptance_length = tau, cycles, ttft_s, cached_tokens, queue_s, migrations...; seconds)."""
    return {"request_id": request_id, "worker_id": complete.worker_id,
            "finish_reason": FINISH_REASONS.get(complete.finish_reason, "unspecified"),
            **_stats_dict(complete)}


def usage(*completes: common_pb2.Complete) -> dict:
    """OpenAI's `usage` object from the final stats of a request's choices (one or more): the
    prompt counted once, as the first choice read it (its cached tokens in prompt_tokens_details;
    each choice's own count is in its `flashfleet` object), completion tokens summed."""
    first = completes[0].stats
    generated = sum(c.stats.generated_tokens for c in completes)
    return {"prompt_tokens": first.prompt_tokens, "completion_tokens": generated,
            "total_tokens": first.prompt_tokens + generated,
            "prompt_tokens_details": {"cached_tokens": first.cached_tokens}}


def finish_reason(complete: common_pb2.Complete) -> str:
    """OpenAI's finish_reason ("stop" or "length") of a finished request."""
    return OPENAI_FINISH.get(FINISH_REASONS.get(complete.finish_reason, "stop"), "stop")


def _top_dict(top) -> dict[str, float]:
    """Completions' {token text: logprob} of the most likely tokens (TopLogprob protos, most
    likely first); of tokens whose texts are equal, the key keeps the likeliest."""
    out: dict[str, float] = {}
    for t in top:
        out.setdefault(t.token, t.logprob)
    return out


class ResponseBuilder:
    """Builds the JSON objects of one choice of a request's answer, in OpenAI's shapes (one
    builder per choice: `builders`; `response` joins their choices).

    Args:
        parsed: the request (chat or completion; its request_id becomes the response id).
        tool_format: the served model's tool-call format (`flashfleet.tool_calls.FORMATS` key),
            for a request whose answer may hold tool calls: its text is parsed into `tool_calls`
            (whole, or streamed as `delta.tool_calls`); "" or None: the text is content as is.
        index: the choice's index (0 .. n-1).
        created: the response's creation time (Unix seconds; default now).
    """

    def __init__(self, parsed: ParsedRequest, tool_format: str | None = None, index: int = 0,
                 created: int | None = None):
        self.chat = parsed.chat
        self.model = parsed.request.model
        rid = parsed.request.request_id
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + rid
        self.index = index
        self.several = parsed.n > 1  # each choice then carries its own `flashfleet` object
        self.request_id = choice_id(rid, index) if self.several else rid
        self.created = int(time.time()) if created is None else created
        self.started = False  # whether a chunk with text went out (the first chat delta names the role)
        self.want_logprobs = parsed.logprobs
        self.offset = 0  # characters of completion text before the next token (completions' text_offset)
        self.echo = parsed.echo  # the prompt's text until it goes out before the first text (echo)
        self.prompt_listed = False  # whether the prompt's logprobs went out (a restarted stream repeats them)
        fmt = FORMATS.get(tool_format or "") if parsed.tools and parsed.chat else None
        self.parser = fmt.parser(parsed.tools) if fmt is not None else None
        self._held_logprobs: list = []  # logprobs of text the parser holds back, sent with the next content
        self._calls_sent = 0  # tool calls streamed so far (the next one's index)

    def _echoed(self, text: str) -> str:
        """`text`, after the prompt's text the first time (echo)."""
        if self.echo is None:
            return text
        text, self.echo = self.echo + text, None
        return text

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def finish_reason(self, complete: common_pb2.Complete) -> str:
        """OpenAI's finish_reason: "tool_calls" for an answer that ended on its own (EOS or a stop
        string) after tool calls, else `finish_reason(complete)`."""
        reason = finish_reason(complete)
        return "tool_calls" if reason == "stop" and self.parser is not None and self.parser.calls else reason

    def logprobs(self, items, prompt=()) -> dict | None:
        """OpenAI's `logprobs` object of some tokens (TokenLogprob protos), None when the request
        did not ask: chat's {"content": [{token, logprob, bytes, top_logprobs}]}; completions'
        {tokens, token_logprobs, top_logprobs, text_offset} (offsets in characters of the
        tokens' texts, counted on from the previous chunks'), the `prompt` tokens' first (echo:
        the first one's logprob and top_logprobs null; listed once, however often they come)."""
        if not self.want_logprobs:
            return None
        if self.chat:
            return {"content": [{"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token.encode()),
                                 "top_logprobs": [{"token": t.token, "logprob": t.logprob,
                                                   "bytes": list(t.token.encode())} for t in lp.top]}
                                for lp in items], "refusal": None}
        if prompt and not self.prompt_listed:
            items, self.prompt_listed = [*prompt, *items], True
        offsets = []
        for lp in items:
            offsets.append(self.offset)
            self.offset += len(lp.token)
        scored = [lp.HasField("logprob") for lp in items]
        return {"tokens": [lp.token for lp in items],
                "token_logprobs": [lp.logprob if has else None for lp, has in zip(items, scored)],
                "top_logprobs": [_top_dict(lp.top) if has else None
                                 for lp, has in zip(items, scored)], "text_offset": offsets}

    def choice(self, text: str, complete: common_pb2.Complete, logprobs=(), prompt_logprobs=()) -> dict:
        """The choice of an answer that was not streamed (with the tokens' log-probabilities when
        asked for; echo: the prompt's before; with tool calls parsed out of the text into
        `message.tool_calls`, content null when nothing else is said; its `flashfleet` object when
        the request has several choices)."""
        if self.chat:
            message: dict = {"role": "assistant", "content": text}
            if self.parser is not None:
                content, calls = self.parser.parse(text)
                if calls:
                    message = {"role": "assistant", "content": content or None,
                               "tool_calls": [c.openai() for c in calls]}
            choice = {"index": self.index, "message": message, "finish_reason": self.finish_reason(complete),
                      "logprobs": self.logprobs(logprobs)}
        else:
            choice = {"index": self.index, "text": self._echoed(text), "finish_reason": finish_reason(complete),
                      "logprobs": self.logprobs(logprobs, prompt_logprobs)}
        if self.several:
            choice["flashfleet"] = flashfleet_fields(self.request_id, complete)
        return choice

    def _chunk(self, choice: dict, include_usage: bool) -> dict:
        out = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if include_usage:
            out["usage"] = None
        return out

    def delta(self, text: str, include_usage: bool = False, logprobs=(), prompt_logprobs=()) -> dict:
        """A stream chunk carrying new text (the first chat chunk also carries the role; echo: the
        first completions chunk starts with the prompt's text) and its tokens' log-probabilities
        when asked for (echo: the prompt's first)."""
        if self.chat:
            delta = {"content": text} if self.started else {"role": "assistant", "content": text}
            choice = {"index": self.index, "delta": delta, "finish_reason": None, "logprobs": self.logprobs(logprobs)}
        else:
            choice = {"index": self.index, "text": self._echoed(text), "finish_reason": None,
                      "logprobs": self.logprobs(logprobs, prompt_logprobs)}
        self.started = True
        return self._chunk(choice, include_usage)

    def tool_call_deltas(self, call: ToolCall, include_usage: bool = False) -> list[dict]:
        """The stream chunks of one parsed call, as OpenAI streams one: `delta.tool_calls` with
        its index, id, type and name (arguments ""), then one with its arguments."""
        index, self._calls_sent = self._calls_sent, self._calls_sent + 1
        head = {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
        first = {"tool_calls": [head]} if self.started else {"role": "assistant", "content": None, "tool_calls": [head]}
        self.started = True
        rest = {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}
        return [self._chunk({"index": self.index, "delta": d, "finish_reason": None, "logprobs": None},
                            include_usage) for d in (first, rest)]

    def _said(self, events: list, include_usage: bool) -> list[dict]:
        out: list[dict] = []
        for e in events:
            if isinstance(e, ToolCall):
                out += self.tool_call_deltas(e, include_usage)
            else:
                out.append(self.delta(e, include_usage, self._held_logprobs))
                self._held_logprobs = []
        return out

    def chunks(self, text: str, include_usage: bool = False, logprobs=(), prompt_logprobs=()) -> list[dict]:
        """The stream chunks of a worker's chunk (its text and tokens' log-probabilities, echo's
        prompt ones): one delta, none for an empty one after the first; with tool calls, the
        content and calls the parser can tell so far (text that may be a call is held back, and
        its tokens' log-probabilities go out with the next content)."""
        if self.parser is None:
            return [self.delta(text, include_usage, logprobs, prompt_logprobs)] \
                if text or logprobs or not self.started else []
        self._held_logprobs.extend(logprobs)
        out = self._said(self.parser.feed(text), include_usage)
        if not self.started:
            out.append(self.delta("", include_usage, self._held_logprobs))
            self._held_logprobs = []
        return out

    def final(self, complete: common_pb2.Complete, include_usage: bool = False) -> list[dict]:
        """The choice's last stream chunks: what the tool-call parser still holds, then the one
        with finish_reason and the choice's `flashfleet` object (`usage_chunk` follows the last
        choice's)."""
        out = []
        if self.parser is not None:
            out = self._said(self.parser.close(), include_usage)
            if self._held_logprobs:
                out.append(self.delta("", include_usage, self._held_logprobs))
        if self.chat:
            delta = {} if self.started else {"role": "assistant", "content": ""}
            choice = {"index": self.index, "delta": delta, "finish_reason": self.finish_reason(complete),
                      "logprobs": None}
        else:
            # echo: a stream whose first message is its end still gives the prompt's text
            choice = {"index": self.index, "text": self._echoed(""), "finish_reason": finish_reason(complete),
                      "logprobs": None}
        last = self._chunk(choice, include_usage)
        last["flashfleet"] = flashfleet_fields(self.request_id, complete)
        out.append(last)
        return out

    def usage_chunk(self, completes: list[common_pb2.Complete]) -> dict:
        """The stream's last chunk with include_usage: no choices, the `usage` of every choice."""
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"),
                "choices": [], "usage": usage(*completes)}


def builders(parsed: ParsedRequest, tool_format: str | None = None) -> list[ResponseBuilder]:
    """One `ResponseBuilder` per choice of `parsed`, with one creation time."""
    created = int(time.time())
    return [ResponseBuilder(parsed, tool_format, i, created) for i in range(parsed.n)]


def response(choices: list[ResponseBuilder], results: list[tuple]) -> dict:
    """The whole answer of a request that was not streamed, from each choice's builder and its
    (text, Complete, TokenLogprob protos, echo's prompt TokenLogprob protos): its choices, the
    `usage` of all of them and the top-level `flashfleet` object (the first choice's)."""
    first = choices[0]
    completes = [r[1] for r in results]
    return {**first._head("chat.completion" if first.chat else "text_completion"),
            "choices": [b.choice(*r) for b, r in zip(choices, results)], "usage": usage(*completes),
            "flashfleet": flashfleet_fields(first.request_id, completes[0])}


def model_list(served: list[coordinator_pb2.ServedModel]) -> dict:
    """GET /v1/models: {"object": "list", "data": [model objects]} (`model_object`)."""
    return {"object": "list", "data": [model_object(m) for m in served]}


def model_object(served: coordinator_pb2.ServedModel) -> dict:
    """One model in OpenAI's shape, with flashfleet's details (workers serving it, decode modes,
    context length in tokens, the chat template's tool-call format or null when it has none:
    flashfleet/tool_calls.py) in a `flashfleet` object."""
    return {"id": served.info.name, "object": "model", "created": 0, "owned_by": "flashfleet",
            "flashfleet": {"workers": list(served.worker_ids),
                           "modes": [DECODE_MODE_NAMES.get(m, str(m)) for m in served.modes],
                           "max_context_tokens": served.info.max_context_tokens,
                           "tool_call_format": served.info.tool_call_format or None}}
