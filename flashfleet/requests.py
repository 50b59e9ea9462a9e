"""Builds and validates GenerateRequest protos (shared by the SDK and the coordinator)."""
from __future__ import annotations

import json
from typing import Any, Iterable, Mapping

from flashfleet.errors import InvalidArgument, short_details
from flashfleet.tool_calls import check_message_tool_calls, check_tool_choice, check_tools
from flashfleet.types import DECODE_MODES
from flashfleet.v1 import common_pb2

MAX_TEMPERATURE = 100.0  # past this softmax(logits / T) is uniform to float precision for any model
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2] (OpenAI's range)
MAX_REPETITION_PENALTY = 10.0  # repetition_penalty lies in (0, 10]; 1 = none
MAX_LOGIT_BIAS = 100.0  # a logit_bias value lies in [-100, 100] (OpenAI's range)
MAX_LOGIT_BIAS_TOKENS = 1024  # tokens one logit_bias may name
SEED_LIMIT = 2**64  # seeds lie in [0, 2**64) (uint64; mx.random.key takes one)
MAX_CHOICES = 16  # most choices (OpenAI's `n`) one request may ask for
# Choice i's seed is the request's plus i times this odd constant (2**64 / golden ratio), mod 2**64.
CHOICE_SEED_STRIDE = 0x9E3779B97F4A7C15
MAX_TOP_LOGPROBS = 20  # alternatives a token's log-probabilities list at most (OpenAI's bound)

# A worker's generation budget when a request leaves max_tokens unset (capped by the context left).
WORKER_DEFAULT_MAX_TOKENS = 256
# Metadata a coordinator sends with a resumed request (one whose stream's coordinator died) to
# ask a worker to re-attach to the session it kept, and to refuse (NOT_FOUND) rather than start
# it afresh when it keeps none (worker/servicer.py).
RESUME_ONLY_HEADER = "x-flashfleet-resume-only"
# Generate metadata naming the worker's Subscribe stream that carries the call's responses.
SUBSCRIPTION_HEADER = "x-flashfleet-subscription"
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
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repetition_penalty: float | None = None,
    logit_bias: Mapping[int | str, float] | None = None,
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
    Penalties (worker/engine/penalties.py): presence_penalty and frequency_penalty in [-2, 2]
    (OpenAI's, over the output), repetition_penalty in (0, 10] (over prompt and output; 1 = none);
    logit_bias maps token ids (ints, or their decimal strings as JSON writes them) to a bias in
    [-100, 100] added to the token's logit.
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
            starts with the field), or a response_format beside tools to call; a penalty that is
            not a number, or a logit_bias that is not a mapping of token ids to numbers.
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
    additive = f"must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]"
    for name, value, rule in (("presence_penalty", presence_penalty, additive),
                              ("frequency_penalty", frequency_penalty, additive),
                              ("repetition_penalty", repetition_penalty,
                               f"must be a number in (0, {MAX_REPETITION_PENALTY:g}]")):
        if value is not None:
            if isinstance(value, bool):
                raise InvalidArgument(f"{name} {rule}, got {value!r}")
            _set_number(req, name, value, rule)
    if logit_bias is not None:
        _set_logit_bias(req, logit_bias)
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


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request for several choices seeded with `seed`: the seed
    itself for choice 0 (one choice and several agree on it), a distinct derived one for each
    other choice, in [0, 2**64)."""
    return (seed + index * CHOICE_SEED_STRIDE) % SEED_LIMIT


def choice_id(request_id: str, index: int) -> str:
    """The request id of choice `index` of request `request_id` (several choices)."""
    return f"{request_id}-{index}"


def choice_requests(request: common_pb2.GenerateRequest, n: int) -> list[common_pb2.GenerateRequest]:
    """The GenerateRequests of n choices of one request (OpenAI's `n`): the request itself when
    n = 1; else copies with request ids `choice_id(request_id, i)`, seeds `choice_seed(seed, i)`
    when it has a seed (unseeded choices each draw their own), and its session_id, or its
    request_id when it has none, so that the choices go to one worker, where the later ones copy
    the first one's prompt caches instead of prefilling the prompt again."""
    if n == 1:
        return [request]
    out = []
    for i in range(n):
        r = common_pb2.GenerateRequest()
        r.CopyFrom(request)
        r.request_id = choice_id(request.request_id, i)
        r.session_id = request.session_id or request.request_id
        if request.HasField("seed"):
            r.seed = choice_seed(request.seed, i)
        out.append(r)
    return out


def _set_logit_bias(req: common_pb2.GenerateRequest, logit_bias: Any) -> None:
    """Fills req.logit_bias from {token id: bias}; ids may be ints or decimal strings (JSON's keys).

    Raises:
        InvalidArgument: not a mapping, an id that is not a non-negative integer of 32 bits, or a
            bias that is not a number; the message names logit_bias.
    """
    if not isinstance(logit_bias, Mapping):
        raise InvalidArgument(f"logit_bias must be an object of token id -> bias, got {logit_bias!r:.80}")
    if len(logit_bias) > MAX_LOGIT_BIAS_TOKENS:
        raise InvalidArgument(f"logit_bias has {len(logit_bias):,} tokens; "
                              f"at most {MAX_LOGIT_BIAS_TOKENS:,} are served")
    for key, value in logit_bias.items():
        token = key
        if isinstance(key, str) and key.isascii() and key.isdigit():
            token = int(key)
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < 2**32:
            raise InvalidArgument(f"logit_bias keys must be token ids (non-negative integers), got {key!r:.40}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidArgument(f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                  f"got {value!r:.40} for token {token}")
        try:
            req.logit_bias[token] = value
        except (ValueError, TypeError, OverflowError):
            raise InvalidArgument(f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                  f"got {value!r:.40} for token {token}") from None


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
        raise InvalidArgument(f"max_tokens must be > 0 (0 only when scoring the prompt: prompt_logprobs, or "
                              f"echo with logprobs over HTTP), got {req.max_tokens}")
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
    for name in ("presence_penalty", "frequency_penalty"):
        if req.HasField(name) and not -MAX_PENALTY <= getattr(req, name) <= MAX_PENALTY:  # NaN fails too
            raise InvalidArgument(f"{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], "
                                  f"got {getattr(req, name):.6g}")
    if req.HasField("repetition_penalty") and not 0 < req.repetition_penalty <= MAX_REPETITION_PENALTY:
        raise InvalidArgument(f"repetition_penalty must be a number in (0, {MAX_REPETITION_PENALTY:g}] (1 = none), "
                              f"got {req.repetition_penalty:.6g}")
    if len(req.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
        raise InvalidArgument(f"logit_bias has {len(req.logit_bias):,} tokens; "
                              f"at most {MAX_LOGIT_BIAS_TOKENS:,} are served")
    for token, value in req.logit_bias.items():
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise InvalidArgument(f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                  f"got {value:.6g} for token {token}")
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
