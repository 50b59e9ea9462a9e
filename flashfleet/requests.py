"""Builds and validates GenerateRequest protos (shared by the SDK and the coordinator)."""
from __future__ import annotations

import json
from typing import Any, Iterable, Mapping

from flashfleet.errors import InvalidArgument, short_details
from flashfleet.tool_calls import check_message_tool_calls, check_tool_choice, check_tools
from flashfleet.types import DECODE_MODES
from flashfleet.v1 import common_pb2

MAX_TEMPERATURE = 100.0
MAX_TOP_LOGPROBS = 20  # alternatives a token's log-probabilities list at most (OpenAI's bound)  # past this softmax(logits / T) is uniform to float precision for any model

# A worker's generation budget when a request leaves max_tokens unset (capped by the context left).
WORKER_DEFAULT_MAX_TOKENS = 256
# Metadata a coordinator sends with a resumed request (one whose stream's coordinator died) to
# ask a worker to re-attach to the session it kept, and to refuse (NOT_FOUND) rather than start
# it afresh when it keeps none (worker/servicer.py).
RESUME_ONLY_HEADER = "x-flashfleet-resume-only"
# Trailing metadata of every error status a coordinator's Generate ends with: its verdict on the
# request. A stream that breaks UNAVAILABLE without it lost its coordinator (the SDK resumes it).
COORDINATOR_VERDICT_HEADER = "x-flashfleet-verdict"

CHAT_ROLES = ("system", "user", "assistant", "tool")
# Most stop strings a request may carry: the worker checks every one against the text after each
# token on its engine thread (300,000 stops: 0.1 s a token with the tiny test model on a CPU,
# stalling every session of that worker).
MAX_STOP_STRINGS = 64
# Longest stop string, characters: the held-back text and the per-token search grow with it.
MAX_STOP_STRING_CHARS = 1024
# gRPC's default limit on a received message; larger requests are refused by the server.
MAX_REQUEST_BYTES = 4 * 1024 * 1024
# Longest request deadline, seconds: gRPC's deadline arithmetic overflows far below float's range
# (1e12 s ends a call at once).
MAX_TIMEOUT_S = 1e8  # about three years


def _utf8(name: str, text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgument(f"{name} is not valid text: {e.reason} at character {e.start} "
                              f"({text[e.start:e.end]!r})") from None
    return text


def _listed(values, name: str) -> list:
    """`values` as a list; InvalidArgument when it is not iterable."""
    try:
        return list(values)
    except TypeError:
        raise InvalidArgument(f"{name} must be a list, got {type(values).__name__}") from None


def build_request(
    model: str,
    prompt: str | None = None,
    *,
    messages: Iterable[Mapping[str, str]] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop: str | Iterable[str] = (),
    session_id: str = "",
    request_id: str = "",
    mode: str = "auto",
    response_format: Mapping[str, Any] | None = None,
    json_schema: Mapping[str, Any] | None = None,
    top_logprobs: int | None = None,
    tools: Iterable[Mapping[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
    prompt_logprobs: int | None = None,
) -> common_pb2.GenerateRequest:
    """Makes a GenerateRequest from keyword arguments.

    Exactly one of prompt (raw text) or messages (chat turns: dicts with "role" and "content")
    must be given; `stop` is one stop string or several (None: none). max_tokens None: the
    worker's default, `WORKER_DEFAULT_MAX_TOKENS` capped by the context the prompt leaves.
    Structured output: `json_schema` (a JSON Schema as a dict: the output is JSON valid against
    it), or `response_format` in OpenAI's shape ({"type": "text"}, {"type": "json_object"}, or
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}).
    top_logprobs (0..20): every chunk carries its tokens' log-probabilities with that many
    alternatives; None: none. prompt_logprobs (0..20): the first chunk carries the prompt tokens'
    log-probabilities (OpenAI's echo) with that many alternatives; max_tokens may then be 0.
    Tool calling, in OpenAI's shapes (flashfleet/tool_calls.py): `tools` (a list of
    {"type": "function", "function": {...}}), `tool_choice` ("none", "auto", "required" or
    {"type": "function", "function": {"name": ...}}; "none" sends no tools), `parallel_tool_calls`
    (default true); chat turns may carry `tool_calls` (an assistant's, OpenAI's shape) and
    `tool_call_id` (a "tool" turn's). The answer is the model's text in its tool-call format.
    Validation of values happens on the server (see validate_request); this converts and checks
    types.

    Raises:
        InvalidArgument: both or neither of prompt/messages, a model or prompt that is not a str,
            messages that is not a list of mappings with string role/content, a stop that is not a
            str or a list of them, a session_id or request_id that is not a str, text that is not
            valid Unicode (lone surrogates), a value out of its field's range (max_tokens beyond int32, seed outside [0, 2**64)), a request over
            4 MiB, an unknown mode, or a response_format / json_schema that is not one of the
            shapes above (both given, an unknown type, a schema that is not a JSON object);
            malformed tools, tool_choice or tool calls (`flashfleet.tool_calls`: the message
            starts with the field), or a response_format beside tools to call.
    """
    fmt = response_format_proto(response_format, json_schema)
    tool_spec = tools_proto(tools, tool_choice, parallel_tool_calls)
    if tool_spec is not None and fmt is not None:
        raise InvalidArgument("response_format: not served together with tools (a tool call is not the "
                              "format's JSON); leave one of them out, or set tool_choice 'none'")
    try:
        req = _build(model, prompt, messages, max_tokens, temperature, top_p, seed, stop,
                     session_id, request_id, mode)
    except (ValueError, TypeError, OverflowError) as e:  # protobuf range and type checks
        raise InvalidArgument(f"bad request field: {e} (max_tokens must fit int32, seed must be in "
                              "[0, 2**64), temperature/top_p must be numbers)") from None
    if fmt is not None:
        req.response_format.CopyFrom(fmt)
    if top_logprobs is not None:
        _set_number(req, "top_logprobs", top_logprobs, f"must be an int in [0, {MAX_TOP_LOGPROBS}]")
    if tool_spec is not None:
        req.tools.CopyFrom(tool_spec)
    if prompt_logprobs is not None:
        _set_number(req, "prompt_logprobs", prompt_logprobs, f"must be an int in [0, {MAX_TOP_LOGPROBS}]")
    size = req.ByteSize()
    if size > MAX_REQUEST_BYTES:
        raise InvalidArgument(f"request is {size} bytes; the limit is {MAX_REQUEST_BYTES} "
                              "(4 MiB): shorten the prompt")
    return req


RESPONSE_FORMATS = ("json_object", "json_schema")
TOOL_CHOICES = ("auto", "required", "function")  # a Tools proto's choice ("none" sends no tools)


def tools_proto(tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None) -> common_pb2.Tools | None:
    """The Tools proto of OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`; None when no
    tool may be called (no tools, an empty list, or tool_choice "none").

    Raises:
        InvalidArgument: malformed tools or tool_choice (`flashfleet.tool_calls.check_tools`,
            `check_tool_choice`), or a parallel_tool_calls that is not a bool.
    """
    checked = check_tools(tools) if tools is not None else []
    choice, function = check_tool_choice(tool_choice, checked)
    if parallel_tool_calls not in (None, True, False):
        raise InvalidArgument(f"parallel_tool_calls must be true or false, got {parallel_tool_calls!r:.40}")
    if choice == "none" or not checked:
        return None
    return common_pb2.Tools(tools_json=json.dumps(checked), choice=choice, function=function,
                            parallel_calls=parallel_tool_calls is not False)


def response_format_proto(response_format: Any, json_schema: Any = None) -> common_pb2.ResponseFormat | None:
    """The ResponseFormat proto of OpenAI's `response_format` object or of a bare JSON Schema
    (dicts); None for free text ({"type": "text"} or neither given).

    Raises:
        InvalidArgument: both given, a value that is not a dict, an unknown type, or a json_schema
            without a `schema` object; the message names the field.
    """
    if json_schema is not None:
        if response_format is not None:
            raise InvalidArgument("give response_format or json_schema, not both")
        response_format = {"type": "json_schema", "json_schema": {"schema": json_schema}}
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise InvalidArgument(f"response_format must be an object with a 'type', got {response_format!r:.80}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return common_pb2.ResponseFormat(type=kind)
    if kind != "json_schema":
        raise InvalidArgument(f"response_format.type must be one of text, json_object, json_schema; got {kind!r:.40}")
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, Mapping) else None
    if not isinstance(schema, Mapping):
        raise InvalidArgument("response_format.json_schema.schema must be a JSON Schema object "
                              "({'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}})")
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"response_format.json_schema.schema is not JSON: {e}") from None
    return common_pb2.ResponseFormat(type=kind, json_schema=text)


def _build(model, prompt, messages, max_tokens, temperature, top_p, seed, stop, session_id,
           request_id, mode) -> common_pb2.GenerateRequest:
    if (prompt is None) == (messages is None):
        raise InvalidArgument("give exactly one of prompt= (text) or messages= (chat turns)")
    if not isinstance(mode, str) or mode not in DECODE_MODES:
        raise InvalidArgument(f"unknown mode {mode!r}; use one of {sorted(DECODE_MODES)}")
    if not isinstance(model, str):
        raise InvalidArgument(f"model must be a str (a served model's name), got {type(model).__name__}")
    for name, value in (("session_id", session_id), ("request_id", request_id)):
        if not isinstance(value, str):
            raise InvalidArgument(f"{name} must be a str, got {type(value).__name__}")
    if stop is None or isinstance(stop, str):
        stops = [] if stop is None else [stop]
    elif isinstance(stop, (bytes, Mapping)) or not hasattr(stop, "__iter__"):
        stops = None
    else:
        stops = list(stop)
    if stops is None or not all(isinstance(s, str) for s in stops):
        raise InvalidArgument(f"stop must be a str or a list of str, got {stop!r}")
    stops = [_utf8(f"stop[{i}]", s) for i, s in enumerate(stops)]
    req = common_pb2.GenerateRequest(
        model=model, stop=stops, session_id=session_id,
        request_id=request_id,
        mode=DECODE_MODES[mode])
    if max_tokens is not None:
        _set_number(req, "max_tokens", max_tokens, "must be an int that fits int32 (and > 0)")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise InvalidArgument(f"prompt must be a str, got {type(prompt).__name__}"
                                  + (" (decode bytes first: prompt=data.decode())" if isinstance(prompt, bytes) else ""))
        req.prompt = _utf8("prompt", prompt)
    else:
        if isinstance(messages, (str, bytes, Mapping)):
            raise InvalidArgument("messages must be a list of chat turns "
                                  "[{'role': 'user', 'content': '...'}], got a " + type(messages).__name__)
        turns = []
        for i, m in enumerate(_listed(messages, "messages")):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) \
                    or not isinstance(m.get("content"), str):
                raise InvalidArgument(
                    f"messages[{i}] must be a dict with string 'role' and 'content', got {m!r}")
            turn = common_pb2.ChatMessage(role=m["role"], content=_utf8(f"messages[{i}].content", m["content"]))
            if m.get("tool_calls"):
                turn.tool_calls_json = _utf8(f"messages[{i}].tool_calls", json.dumps(
                    check_message_tool_calls(i, m["tool_calls"]), ensure_ascii=False))
            if m.get("tool_call_id") is not None:
                if not isinstance(m["tool_call_id"], str):
                    raise InvalidArgument(f"messages[{i}].tool_call_id must be a string, got {m['tool_call_id']!r:.40}")
                turn.tool_call_id = _utf8(f"messages[{i}].tool_call_id", m["tool_call_id"])
            turns.append(turn)
        req.messages.CopyFrom(common_pb2.ChatMessages(messages=turns))
    if temperature is not None:
        _set_number(req, "temperature", temperature, "must be a number (0 = greedy)")
    if top_p is not None:
        _set_number(req, "top_p", top_p, "must be a number in (0, 1]")
    if seed is not None:
        _set_number(req, "seed", seed, "must be an int in [0, 2**64)")
    return req


def _set_number(req, name: str, value, rule: str) -> None:
    """Sets a scalar field; protobuf's own range or type error becomes InvalidArgument naming
    the field and its rule."""
    try:
        setattr(req, name, value)
    except (ValueError, TypeError, OverflowError):  # OverflowError: an int past float's range
        raise InvalidArgument(short_details(f"{name} {rule}, got {value!r}")) from None


def validate_request(req: common_pb2.GenerateRequest) -> None:
    """Checks what can be checked without the model (the worker checks the context length).

    Raises:
        InvalidArgument: with a message that says what to fix.
    """
    if not req.model:
        raise InvalidArgument("model is empty; ListModels shows what the fleet serves")
    which = req.WhichOneof("input")
    if which is None:
        raise InvalidArgument("the request has neither prompt nor messages")
    if which == "prompt" and not req.prompt.strip():
        raise InvalidArgument("prompt is empty")
    if which == "messages":
        if not req.messages.messages:
            raise InvalidArgument("messages is empty: give at least one chat turn")
        for i, m in enumerate(req.messages.messages):
            if m.role not in CHAT_ROLES:
                raise InvalidArgument(
                    f"messages[{i}].role is {m.role!r}; use one of {', '.join(CHAT_ROLES)}")
        if not any(m.content.strip() or m.tool_calls_json for m in req.messages.messages):
            raise InvalidArgument("the prompt is empty: every chat message's content is blank")
    if req.HasField("max_tokens") and req.max_tokens < (0 if req.HasField("prompt_logprobs") else 1):
        raise InvalidArgument(f"max_tokens must be > 0 (0 only with prompt_logprobs), got {req.max_tokens}")
    if req.HasField("temperature") and not (0 <= req.temperature <= MAX_TEMPERATURE):  # NaN fails too
        raise InvalidArgument(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {req.temperature:.6g}")
    if req.HasField("top_p") and not (0 < req.top_p <= 1):
        raise InvalidArgument(f"top_p must be in (0, 1], got {req.top_p:.6g}")
    if any(s == "" for s in req.stop):
        raise InvalidArgument("stop strings must not be empty")
    if len(req.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"{len(req.stop):,} stop strings; at most {MAX_STOP_STRINGS} are served")
    longest = max((len(s) for s in req.stop), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        raise InvalidArgument(f"a stop string of {longest:,} characters; at most {MAX_STOP_STRING_CHARS:,} are served")
    if req.mode not in DECODE_MODES.values():
        raise InvalidArgument(f"unknown decode mode {req.mode}")
    for name in ("top_logprobs", "prompt_logprobs"):
        if req.HasField(name) and not 0 <= getattr(req, name) <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {getattr(req, name)}")
    if req.HasField("response_format"):
        fmt = req.response_format
        if fmt.type not in RESPONSE_FORMATS:
            raise InvalidArgument(f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}, got {fmt.type!r:.40}")
        if (fmt.type == "json_schema") != bool(fmt.json_schema):
            raise InvalidArgument("response_format.json_schema is required with type json_schema, and only with it")
    if req.HasField("tools"):
        tools = req.tools
        if tools.choice not in TOOL_CHOICES:
            raise InvalidArgument(f"tools.choice must be one of {', '.join(TOOL_CHOICES)}, got {tools.choice!r:.40}")
        if (tools.choice == "function") != bool(tools.function):
            raise InvalidArgument("tools.function is required with choice 'function', and only with it")
        if req.HasField("response_format"):
            raise InvalidArgument("response_format: not served together with tools")
