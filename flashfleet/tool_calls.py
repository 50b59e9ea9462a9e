"""Tool calling (OpenAI's `tools`): the checks of a request's tools, and the tool-call formats of
chat templates, each with its parser (model text -> OpenAI tool calls, whole or streamed) and its
grammar (the Lark text, for llguidance, that forces calls for tool_choice "required" or a named
function).

The worker renders the tools through the model's own chat template (transformers'
`apply_chat_template(tools=...)`), finds the template's format (`detect_format`) and reports it in
its ModelInfo; the coordinator's HTTP API parses the answer with that format's parser. Formats:

- "hermes" (Qwen2.5, Hermes 2/3 and the templates mlx-lm's `json_tools` parser serves): each call
  is `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; several in a row are
  parallel calls; text before them is the answer's content.
- "llama3" (Llama 3.1-3.3 custom tools): the whole answer is one JSON object
  `{"name": ..., "parameters": {...}}`, after an optional `<|python_tag|>`; several joined by
  ";" are parallel calls.

In both, an answer that is only JSON call objects naming the request's tools is calls (small
models, Qwen2.5-Coder-0.5B among them, write the hermes JSON without its markers).

Pure Python (no MLX, no grammar library): the coordinator and the worker both import it.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping, Sequence

from flashfleet.errors import InvalidArgument

# OpenAI's rule for a function's name.
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CHOICES = ("none", "auto", "required")
# JSON of a call as the grammar writes it: one line, Python's json.dumps separators (free whitespace
# lets a model fill its budget with newlines; worker/engine/grammar.py does the same for schemas).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolCall:
    """One parsed call.

    Attributes:
        name: the function's name.
        arguments: its arguments, JSON text of an object (OpenAI's `function.arguments`).
        id: "call_<hex>", unique per call.
    """

    name: str
    arguments: str
    id: str = ""

    def openai(self) -> dict:
        """OpenAI's `tool_calls` item: {"id", "type": "function", "function": {"name", "arguments"}}."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call(name: Any, arguments: Any) -> ToolCall | None:
    """A ToolCall from a parsed name and arguments (an object, or JSON text of one); None when
    they are not a call."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}")


def _held_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (text to hold back: the marker
    may be arriving)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


FENCE = "```"


def _fenced_json_start(head: str) -> bool | None:
    """Whether an answer opening with a markdown fence (```json or ```) holds JSON: None while
    the fence's first line or the next character has not arrived."""
    newline = head.find("\n")
    body = head[newline + 1:].lstrip() if newline >= 0 else ""
    return body.startswith("{") if body else None


def _unfenced(text: str) -> str:
    """`text` without a markdown code fence around it (```json ... ```), else as it is."""
    if text.startswith(FENCE) and text.endswith(FENCE) and "\n" in text and len(text) > 2 * len(FENCE):
        return text[text.index("\n") + 1:-len(FENCE)].strip()
    return text


def _bare_calls(text: str, names: Collection[str], tag: str = "") -> list[ToolCall] | None:
    """The calls of an answer that is only JSON call objects ({"name", "arguments" or
    "parameters"}), after an optional `tag`, joined by ";" or whitespace, optionally inside one
    markdown code fence (small models often fence them); None when it is anything else, or (with
    `names`) names a function that is not among them."""
    text = _unfenced(text.strip())
    if tag and text.startswith(tag):
        text = text[len(tag):]
    decoder, calls, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or (calls and text[i] == ";")):
            i += 1
        if i == len(text):
            return calls or None
        try:
            obj, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        call = _call(obj.get("name"), obj.get("arguments", obj.get("parameters"))) if isinstance(obj, dict) else None
        if call is None or (names and call.name not in names):
            return None
        calls.append(call)


class ToolCallParser:
    """Splits a model's streamed text into content and tool calls.

    `feed` takes each new piece of text and returns what can be said so far: strings (content)
    and `ToolCall`s, in order; text that may still become a call is held back. `close` returns
    the rest at the end of the answer. Text that looked like a call but does not parse as one is
    content, as written. An answer that is only JSON call objects (`{"name": ..., "arguments":
    ...}`, the shape small models write without their format's markers, bare or in one markdown
    code fence) is calls when each names one of the request's tools. `calls` counts the calls
    returned.

    Args:
        names: the request's function names (bare JSON naming another function is content).
    """

    TAG = ""  # a marker that may open an answer of bare JSON calls

    def __init__(self, names: Collection[str] = ()):
        self.names = frozenset(names)
        self.calls = 0
        self._buf = ""
        self._state = ""  # "": undecided, "bare": held to the end as bare JSON calls, "text": the format's own

    def _opening(self, text: str) -> list[str | ToolCall] | None:
        """Decides, from the answer's start, whether it may be bare JSON calls: None while
        undecided (all held), [] when it may (held to the end), else what `_text` says of it."""
        head = self._buf.lstrip()
        if not head or (self.TAG and self.TAG.startswith(head) and head != self.TAG):
            return None
        fenced = None
        if head.startswith(FENCE):
            fenced = _fenced_json_start(head)
            if fenced is None:
                return None
        elif FENCE.startswith(head):
            return None
        if fenced or head.startswith("{") or (self.TAG and head.startswith(self.TAG)):
            self._state = "bare"
            return []
        self._state, rest, self._buf = "text", self._buf, ""
        return self._text(rest)

    def feed(self, text: str) -> list[str | ToolCall]:
        if self._state == "text":
            return self._text(text)
        self._buf += text
        if self._state == "bare":
            return []
        return self._opening(text) or []

    def close(self) -> list[str | ToolCall]:
        if self._state == "text":
            return self._close_text()
        rest, self._buf, self._state = self._buf, "", "text"
        calls = _bare_calls(rest, self.names, self.TAG) if rest.strip() else None
        if calls:
            self.calls += len(calls)
            return list(calls)
        return self._text(rest) + self._close_text()  # not bare calls: the format's own parse of it

    def _text(self, text: str) -> list[str | ToolCall]:
        """The format's own parse of answer text that is not bare JSON (content, by default)."""
        return [text] if text else []

    def _close_text(self) -> list[str | ToolCall]:
        return []

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole answer -> (its content, its calls)."""
        events = self.feed(text) + self.close()
        return "".join(e for e in events if isinstance(e, str)), [e for e in events if isinstance(e, ToolCall)]


class HermesParser(ToolCallParser):
    """Parser of the "hermes" format: `<tool_call>{json}</tool_call>` blocks among content.
    Whitespace next to a call (the newlines between calls, before the first) is not content."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, names: Collection[str] = ()):
        super().__init__(names)
        self._inside = False
        self._space = ""  # trailing whitespace of the content so far, said only if content follows

    def _content(self, text: str, before_call: bool = False) -> list[str | ToolCall]:
        text = self._space + text
        body = text.rstrip()
        self._space = "" if before_call else text[len(body):]
        return [body] if body else []

    def _block(self, body: str) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        return _call(obj.get("name"), obj.get("arguments", obj.get("parameters"))) if isinstance(obj, dict) else None

    def _text(self, text: str) -> list[str | ToolCall]:
        self._buf += text
        out: list[str | ToolCall] = []
        while True:
            if self._inside:
                end = self._buf.find(self.END)
                if end < 0:
                    return out
                body, self._buf, self._inside = self._buf[:end], self._buf[end + len(self.END):], False
                call = self._block(body)
                if call is None:
                    out += self._content(self.START + body + self.END)
                else:
                    self.calls += 1
                    out.append(call)
            else:
                start = self._buf.find(self.START)
                if start < 0:
                    cut = len(self._buf) - _held_suffix(self._buf, self.START)
                    out += self._content(self._buf[:cut])
                    self._buf = self._buf[cut:]
                    return out
                out += self._content(self._buf[:start], before_call=True)
                self._buf, self._inside = self._buf[start + len(self.START):], True

    def _close_text(self) -> list[str | ToolCall]:
        rest, self._buf = self._buf, ""
        if self._inside:  # an unclosed block: a call if its JSON is whole (an EOS for the closing tag)
            self._inside = False
            call = self._block(rest)
            if call is None:
                return [self.START + rest]
            self.calls += 1
            return [call]
        text = self._space + rest
        self._space = ""
        if self.calls:
            text = text.rstrip()
        return [text] if text else []


class Llama3Parser(ToolCallParser):
    """Parser of the "llama3" format: an answer that is JSON call objects ({"name",
    "parameters"}), after an optional `<|python_tag|>` and joined by ";", is calls; any other
    answer is content."""

    TAG = "<|python_tag|>"


def _lark_literal(text: str, special: Callable[[str], bool]) -> str:
    """A Lark terminal for `text`: the token itself (`<tool_call>`) where the tokenizer has it as
    one added token (llguidance matches added tokens only by name), else the quoted string."""
    return text if special(text) and text.startswith("<") and text.endswith(">") else json.dumps(text)


def _call_schema(tool: Mapping, arguments_key: str) -> dict:
    fn = tool["function"]
    return {"type": "object", "properties": {"name": {"const": fn["name"]},
                                              arguments_key: fn.get("parameters") or {"type": "object"}},
            "required": ["name", arguments_key], "additionalProperties": False}


def _calls_json(tools: Sequence[Mapping], function: str, arguments_key: str) -> str:
    """The %json rule's schema: a call of `function`, or of any of the tools."""
    chosen = [t for t in tools if not function or t["function"]["name"] == function]
    schema = {"anyOf": [_call_schema(t, arguments_key) for t in chosen], "x-guidance": JSON_LAYOUT}
    return json.dumps(schema)


class ToolFormat:
    """One family of chat templates' tool calls.

    Attributes:
        name: the format's name (ModelInfo.tool_call_format).
    """

    name = ""

    def detect(self, template: str) -> bool:
        """Whether a chat template (Jinja text) writes calls in this format."""
        raise NotImplementedError

    def parser(self, names: Collection[str] = ()) -> ToolCallParser:
        """A fresh parser for one answer; `names`: the request's function names."""
        raise NotImplementedError

    def grammar(self, tools: Sequence[Mapping], function: str, parallel: bool,
                special: Callable[[str], bool]) -> str:
        """Lark text (llguidance's dialect) of an answer that is calls only: one call of
        `function` when it is given, else one call (or, with `parallel`, one or more) of any of
        `tools`, each call's arguments valid against its tool's `parameters` schema.

        Args:
            tools: checked OpenAI tools (`check_tools`).
            function: the one function to call, or "".
            parallel: several calls allowed (without `function`).
            special: whether the tokenizer has a text as one added token.
        """
        raise NotImplementedError


class HermesFormat(ToolFormat):
    """`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` (Qwen2.5, Hermes)."""

    name = "hermes"

    def detect(self, template: str) -> bool:
        # mlx-lm's json_tools rule; "<tool_call>\n<function=" templates (Qwen3-Coder) write XML.
        return "<tool_call>" in template and "tool_call.name" in template and "<function=" not in template

    def parser(self, names: Collection[str] = ()) -> ToolCallParser:
        return HermesParser(names)

    def grammar(self, tools, function, parallel, special) -> str:
        start, end = (_lark_literal(t, special) for t in (HermesParser.START, HermesParser.END))
        # Calls follow one another with nothing between them: with a newline allowed there, small
        # models (Qwen2.5-Coder-0.5B) write one more call after each, to their token budget.
        top = "start: call\n" if function or not parallel else "start: call+\n"
        return (top + f'call: {start} "\\n" args "\\n" {end}\n'
                f"args: %json {_calls_json(tools, function, 'arguments')}\n")


class Llama3Format(ToolFormat):
    """`{"name": ..., "parameters": ...}` as the whole answer (Llama 3.1-3.3)."""

    name = "llama3"

    def detect(self, template: str) -> bool:
        return "<|python_tag|>" in template or ("Environment: ipython" in template and '"parameters"' in template)

    def parser(self, names: Collection[str] = ()) -> ToolCallParser:
        return Llama3Parser(names)

    def grammar(self, tools, function, parallel, special) -> str:
        top = "start: call\n" if function or not parallel else 'start: call ("; " call)*\n'
        return top + f"call: %json {_calls_json(tools, function, 'parameters')}\n"


# Detection order: the first format whose `detect` accepts a template.
FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HermesFormat(), Llama3Format())}


def detect_format(chat_template: Any) -> str:
    """The tool-call format of a chat template (a FORMATS key), or "" when it renders no tools
    flashfleet can parse (or is not text: no template, or a callable one)."""
    if not isinstance(chat_template, str) or "tools" not in chat_template:
        return ""
    return next((name for name, f in FORMATS.items() if f.detect(chat_template)), "")


def check_tools(tools: Any) -> list[dict]:
    """OpenAI's `tools` list, checked: each {"type": "function", "function": {"name", optional
    "description", "parameters" (a JSON Schema object), "strict"}}, names unique.

    Raises:
        InvalidArgument: the message starts with the field at fault ("tools[1].function.name ...").
    """
    if not isinstance(tools, list):
        raise InvalidArgument(f"tools must be a list of {{'type': 'function', 'function': {{...}}}}, got {tools!r:.80}")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise InvalidArgument(f"{at}.type must be 'function' (the only tool type served), got {tool!r:.80}")
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise InvalidArgument(f"{at}.function must be an object with a 'name', got {fn!r:.80}")
        name = fn.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise InvalidArgument(f"{at}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r:.80}")
        if name in names:
            raise InvalidArgument(f"{at}.function.name {name!r} names two tools")
        names.add(name)
        if not isinstance(fn.get("description", ""), str):
            raise InvalidArgument(f"{at}.function.description must be a string")
        params = fn.get("parameters")
        if params is not None and (not isinstance(params, Mapping) or params.get("type", "object") != "object"):
            raise InvalidArgument(f"{at}.function.parameters must be a JSON Schema of an object "
                                  f"({{'type': 'object', 'properties': {{...}}}}), got {params!r:.80}")
        if fn.get("strict") not in (None, True, False):
            raise InvalidArgument(f"{at}.function.strict must be true or false")
    return [dict(t) for t in tools]


def check_tool_choice(choice: Any, tools: Sequence[Mapping]) -> tuple[str, str]:
    """OpenAI's `tool_choice` -> (choice, function): ("none" | "auto" | "required", "") or
    ("function", name). Unset: "auto" with tools, "none" without.

    Raises:
        InvalidArgument: an unknown value, a named function that is not among `tools`, or a
            choice other than none/auto without tools (messages start with "tool_choice").
    """
    if choice is None:
        return ("auto" if tools else "none"), ""
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise InvalidArgument(f"tool_choice must be one of {', '.join(CHOICES)} or "
                                  f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r:.40}")
        if choice == "required" and not tools:
            raise InvalidArgument("tool_choice 'required' needs tools")
        return choice, ""
    fn = choice.get("function") if isinstance(choice, Mapping) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str):
        raise InvalidArgument(f"tool_choice must be one of {', '.join(CHOICES)} or "
                              f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r:.80}")
    if name not in {t["function"]["name"] for t in tools}:
        raise InvalidArgument(f"tool_choice names function {name!r:.70}, which is not among the tools")
    return "function", name


def check_message_tool_calls(i: int, calls: Any) -> list[dict]:
    """An assistant turn's `tool_calls` (OpenAI's shape, `function.arguments` JSON text of an
    object) -> the same with arguments parsed, as chat templates render them.

    Raises:
        InvalidArgument: a malformed call; the message starts with its field
            ("messages[2].tool_calls[0].function.arguments ...").
    """
    if not isinstance(calls, list):
        raise InvalidArgument(f"messages[{i}].tool_calls must be a list of calls, got {calls!r:.80}")
    out = []
    for j, call in enumerate(calls):
        at = f"messages[{i}].tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or call.get("type", "function") != "function" \
                or not isinstance(fn.get("name"), str) or not isinstance(call.get("id", ""), str):
            raise InvalidArgument(f"{at} must be {{'id': ..., 'type': 'function', 'function': {{'name': ..., "
                                  f"'arguments': '<JSON>'}}}}, got {call!r:.80}")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError as e:
                raise InvalidArgument(f"{at}.function.arguments is not JSON: {e}") from None
        if not isinstance(args, dict):
            raise InvalidArgument(f"{at}.function.arguments must be JSON text of an object, got {args!r:.80}")
        out.append({"id": call.get("id", ""), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out
