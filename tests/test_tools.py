"""Tool calling (flashfleet/tool_calls.py and its path through the HTTP API).

Parsers of each format, whole and streamed in pieces split at every character (inside the markers,
the JSON, the whitespace); format detection; the checks of tools, tool_choice and tool calls; the
grammar of a forced call, run through llguidance on a real tokenizer. Then the API on a tiny
random-weight model whose template writes calls in the hermes format (a forced call is valid
whatever the weights), and on the real Qwen2.5-Coder-0.5B-Instruct (`real_model`): a call, its
result, the final answer; tool_choice "required" always a valid call, plain and DFlash.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashfleet.errors import InvalidArgument
from flashfleet.tool_calls import (FORMATS, HermesParser, Llama3Parser, ToolCall, check_message_tool_calls,
                                   check_tool_choice, check_tools, detect_format)

# A ChatML template that renders tools and calls in the hermes format (written for these tests, in
# the layout of Qwen2.5's: tools in the system turn, calls as <tool_call> blocks, results as
# <tool_response> blocks in a user turn; each tool as its name and parameters only, for the tiny
# model's 512-token context).
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
    "({{ t.function.parameters.properties | list | join(', ') }}){% endfor %}. Call one as <tool_call>\n"
    '{"name": ..., "arguments": {...}}\n</tool_call><|im_end|>\n{% endif %}'
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% elif message.tool_calls %}<|im_start|>assistant{% for tool_call in message.tool_calls %}"
    "{% set tool_call = tool_call.function %}"
    '\n<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The markers a Llama 3.1 template writes with tools (written for this test).
LLAMA3_TEMPLATE = (
    "{% if tools %}Environment: ipython\nRespond in the format "
    '{"name": function name, "parameters": dictionary of argument name and its value}.{% endif %}'
    "{% for message in messages %}{{ message.content }}<|eot_id|>{% endfor %}"
)
CHATML = "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>{% endfor %}"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}},
                                       "required": ["utc"], "additionalProperties": False}}}


def _streamed(parser, text: str, cuts) -> list:
    """Feeds `text` cut at `cuts`; returns every event (adjacent content strings joined)."""
    events, last = [], 0
    for cut in list(cuts) + [len(text)]:
        events += parser.feed(text[last:cut])
        last = cut
    events += parser.close()
    merged: list = []
    for e in events:
        if isinstance(e, str) and merged and isinstance(merged[-1], str):
            merged[-1] += e
        else:
            merged.append(e)
    return merged


def _shape(events) -> list:
    """Events with calls as (name, arguments as an object): ids differ from run to run."""
    return [(e.name, json.loads(e.arguments)) if isinstance(e, ToolCall) else e for e in events]


HERMES_CASES = [
    # (answer, its events)
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {"utc": true}}\n</tool_call>',
     ["Let me check.", ("get_weather", {"city": "Paris"}), ("get_time", {"utc": True})]),
    ('<tool_call>{"name": "get_time", "arguments": {"utc": false}}</tool_call><tool_call>\n'
     '{"name": "get_time", "parameters": {"utc": true}}\n</tool_call>\n',
     [("get_time", {"utc": False}), ("get_time", {"utc": True})]),
    # No call: the content is the answer exactly, its whitespace and lookalikes of the marker included.
    ("if a < b and c <tool or <tool_cal:\n  return  \n\n", ["if a < b and c <tool or <tool_cal:\n  return  \n\n"]),
    # A block that is not a call stays content, as written.
    ("<tool_call>\nnot json\n</tool_call> after", ["<tool_call>\nnot json\n</tool_call> after"]),
    # The closing tag never came (an EOS after the JSON): still a call; a cut-off one is content.
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n',
     [("get_weather", {"city": "Oslo"})]),
    ('Sure <tool_call>\n{"name": "get_weather", "arguments": {"ci', ["Sure<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"ci"]),
    # Bare JSON naming a tool (what small models write without the markers) is a call; other JSON is content.
    (' {"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}',
     [("get_weather", {"city": "Rome", "unit": "celsius"})]),
    ('{"name": "send_mail", "arguments": {}}', ['{"name": "send_mail", "arguments": {}}']),
    ('{"city": "Rome"} is what you asked', ['{"city": "Rome"} is what you asked']),
    ('{"city": "Rome"}\n<tool_call>\n{"name": "get_time", "arguments": {"utc": true}}\n</tool_call>',
     ['{"city": "Rome"}', ("get_time", {"utc": True})]),
    # The same in a markdown fence (Qwen2.5-Coder-0.5B's greedy answer with auto); fenced code or
    # other fenced JSON is content, as written.
    ('```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
     [("get_weather", {"city": "Paris"})]),
    ("```python\nprint(1)\n```", ["```python\nprint(1)\n```"]),
    ('```json\n{"name": "send_mail", "arguments": {}}\n```', ['```json\n{"name": "send_mail", "arguments": {}}\n```']),
    ("`x` and ``", ["`x` and ``"]),
]


@pytest.mark.parametrize("text, want", HERMES_CASES)
def test_hermes_parser_whole_and_split_at_every_character(text, want):
    names = ("get_weather", "get_time")
    assert _shape(_streamed(HermesParser(names), text, [])) == want
    for cut in range(1, len(text)):
        assert _shape(_streamed(HermesParser(names), text, [cut])) == want, cut
    assert _shape(_streamed(HermesParser(names), text, range(1, len(text)))) == want  # one character a time


def test_hermes_parser_says_content_before_the_answer_ends_and_holds_only_a_possible_marker():
    parser = HermesParser(("get_weather",))
    assert parser.feed("The weather") == ["The weather"]
    assert parser.feed(" is <tool") == [" is"]  # "<tool" may open a call; the space waits for what follows
    assert parser.feed("ing> fine") == [" <tooling> fine"]
    said = parser.feed('\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert _shape(said) == [("get_weather", {"city": "Oslo"})] and parser.calls == 1
    assert parser.close() == []
    assert said[0].id.startswith("call_") and said[0].openai()["type"] == "function"


LLAMA3_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "get_time", "parameters": {"utc": true}}; {"name": "get_weather", "parameters": '
     '{"city": "Lima"}}', [("get_time", {"utc": True}), ("get_weather", {"city": "Lima"})]),
    ("The capital of France is Paris.", ["The capital of France is Paris."]),
    ('{"name": "get_weather", "parameters": {"city": "Pa', ['{"name": "get_weather", "parameters": {"city": "Pa']),
    ("<|python", ["<|python"]),
    ('```\n{"name": "get_time", "parameters": {"utc": true}}\n```', [("get_time", {"utc": True})]),
]


@pytest.mark.parametrize("text, want", LLAMA3_CASES)
def test_llama3_parser_whole_and_split_at_every_character(text, want):
    names = ("get_weather", "get_time")
    for cuts in ([], *([c] for c in range(1, len(text))), range(1, len(text))):
        assert _shape(_streamed(Llama3Parser(names), text, cuts)) == want, cuts


def test_llama3_parser_streams_a_text_answer_at_once():
    parser = Llama3Parser(("get_weather",))
    assert parser.feed("  ") == [] and parser.feed("It is") == ["  It is"]
    assert parser.feed(" sunny") == [" sunny"] and parser.close() == []


def test_formats_are_detected_from_the_chat_template():
    assert detect_format(HERMES_TEMPLATE) == "hermes"
    assert detect_format(LLAMA3_TEMPLATE) == "llama3"
    assert detect_format(CHATML) == "" and detect_format(None) == ""
    # Qwen3-Coder's <tool_call><function=...> XML is another format, not parsed here.
    assert detect_format("{% if tools %}<tool_call>\n<function={{ tool_call.name }}>{% endif %}") == ""


@pytest.mark.parametrize("tools, field", [
    ("get_weather", "tools must be a list"),
    ([{"type": "retrieval"}], "tools[0].type"),
    ([{"type": "function"}], "tools[0].function"),
    ([WEATHER, {"type": "function", "function": {"name": "bad name"}}], "tools[1].function.name"),
    ([WEATHER, WEATHER], "tools[1].function.name 'get_weather' names two tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], "tools[0].function.description"),
])
def test_bad_tools_are_refused_naming_the_field(tools, field):
    with pytest.raises(InvalidArgument) as e:
        check_tools(tools)
    assert e.value.details.startswith(field.split(" ")[0]) and field in e.value.details


def test_tool_choice_and_tool_calls_of_messages():
    tools = check_tools([WEATHER, TIME])
    assert check_tool_choice(None, tools) == ("auto", "") and check_tool_choice(None, []) == ("none", "")
    assert check_tool_choice("required", tools) == ("required", "")
    assert check_tool_choice({"type": "function", "function": {"name": "get_time"}}, tools) == ("function", "get_time")
    for choice, fragment in (("always", "tool_choice must be"), ({"type": "function", "function": {"name": "nope"}},
                                                                 "not among the tools"),
                             ({"type": "function"}, "tool_choice must be")):
        with pytest.raises(InvalidArgument, match=fragment):
            check_tool_choice(choice, tools)
    with pytest.raises(InvalidArgument, match="tool_choice 'required' needs tools"):
        check_tool_choice("required", [])
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"utc": true}'}}]
    assert check_message_tool_calls(2, calls)[0]["function"]["arguments"] == {"utc": True}
    for bad, fragment in (([{"function": {"name": "f", "arguments": "{x"}}], r"messages\[2\].tool_calls\[0\].function.arguments is not JSON"),
                          ([{"function": {"name": "f", "arguments": "[1]"}}], "must be JSON text of an object"),
                          ([{"id": 1, "function": {"name": "f"}}], r"messages\[2\].tool_calls\[0\] must be"),
                          ("call", "must be a list")):
        with pytest.raises(InvalidArgument, match=fragment):
            check_message_tool_calls(2, bad)


def _matcher(tokenizer_dir, grammar: str):
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    lt = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=[tok.eos_token_id])
    g = llguidance.LLMatcher.grammar_from_lark(grammar)
    assert llguidance.LLMatcher.validate_grammar(g, lt) == ""
    return tok, lambda: llguidance.LLMatcher(lt, g)


def _accepts(tok, new, text: str) -> bool:
    m = new()
    ids = tok.encode(text, add_special_tokens=False)
    return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()


def test_the_grammar_of_a_forced_call_takes_valid_calls_only(tiny_models):
    tools = check_tools([WEATHER, TIME])
    hermes, llama3 = FORMATS["hermes"], FORMATS["llama3"]
    tok, new = _matcher(tiny_models.llama, hermes.grammar(tools, "", True, lambda t: False))
    one = '<tool_call>\n{"name": "get_time", "arguments": {"utc": true}}\n</tool_call>'
    two = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
    assert _accepts(tok, new, one) and _accepts(tok, new, one + two)
    for bad in ('<tool_call>\n{"name": "get_time", "arguments": {"utc": "yes"}}\n</tool_call>',  # schema
                '<tool_call>\n{"name": "get_time", "arguments": {"utc": true, "x": 1}}\n</tool_call>',  # additional
                '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "celsius"}}\n</tool_call>',  # required
                '<tool_call>\n{"name": "send", "arguments": {}}\n</tool_call>',  # no such tool
                '<tool_call>\n{"name":"get_time", "arguments": {"utc": true}}\n</tool_call>',  # layout: one line, ", " and ": "
                "Sure! " + one, one + "\n" + one):
        assert not _accepts(tok, new, bad), bad
    tok, new = _matcher(tiny_models.llama, hermes.grammar(tools, "get_weather", True, lambda t: False))
    assert _accepts(tok, new, two) and not _accepts(tok, new, one) and not _accepts(tok, new, two + two)
    tok, new = _matcher(tiny_models.llama, hermes.grammar(tools, "", False, lambda t: False))
    assert _accepts(tok, new, one) and not _accepts(tok, new, one + one)
    tok, new = _matcher(tiny_models.llama, llama3.grammar(tools, "", True, lambda t: False))
    assert _accepts(tok, new, '{"name": "get_time", "parameters": {"utc": false}}')
    assert _accepts(tok, new, '{"name": "get_time", "parameters": {"utc": false}}; {"name": "get_weather", '
                              '"parameters": {"city": "Oslo"}}')
    assert not _accepts(tok, new, '{"name": "get_time", "arguments": {"utc": false}}')


# ----------------------------------------------------------------------------- the HTTP API, tiny model

TINY = "tiny-tools"
PLAIN_TINY = "tiny-llama"
# Arguments a random-weight model cannot run on with (no free string): its forced calls end.
SWITCH = {"type": "function", "function": {
    "name": "set_light", "description": "Turn a light on or off",
    "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}, "room": {"enum": ["hall", "kitchen"]}},
                   "required": ["on", "room"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What time is it in UTC? And light the hall."}]


@pytest.fixture(scope="module")
def tool_cluster(tiny_models, dflash_dir, tmp_path_factory):
    """A coordinator with the HTTP API and two workers: the tiny llama with the hermes template
    and its random DFlash draft ("tiny-tools"), and the tiny llama with a ChatML template
    without tools ("tiny-llama")."""
    import shutil

    from harness import start_cluster
    from worker.config import EngineConfig
    from worker.engine.thread import Engine

    model_dir = tmp_path_factory.mktemp("tools") / "tiny-tools"
    shutil.copytree(tiny_models.llama, model_dir)
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": HERMES_TEMPLATE}))
    cluster = start_cluster({
        "w1": Engine(EngineConfig(model_path=model_dir, model_name=TINY, draft_path=dflash_dir, capacity=4)),
        "w2": Engine(EngineConfig(model_path=tiny_models.llama, model_name=PLAIN_TINY, capacity=2))}, http_port=0)
    yield cluster
    cluster.close()


def openai_client(http_url: str):
    import openai

    return openai.OpenAI(base_url=http_url + "/v1", api_key="unused", max_retries=0)


def _client(cluster):
    return openai_client(cluster.coordinator.http_url)


def _assembled(stream) -> tuple[list[dict], str, str | None]:
    """(calls {"id", "name", "arguments"} by index, content, finish_reason) of a streamed answer;
    checks each call's first delta carries its id and name and later ones only arguments."""
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
        content += delta.content or ""
        for tc in delta.tool_calls or ():
            if tc.index not in calls:
                assert tc.id and tc.type == "function" and tc.function.name, tc
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments or ""}
            else:
                assert tc.id is None and not tc.function.name, tc
                calls[tc.index]["arguments"] += tc.function.arguments or ""
    return [calls[i] for i in sorted(calls)], content, finish


def test_forced_calls_are_valid_plain_and_dflash_streamed_and_not(tool_cluster):
    import jsonschema

    client = _client(tool_cluster)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (TIME, SWITCH)}
    seen = {}
    for mode in ("plain", "dflash"):
        for choice in ("required", {"type": "function", "function": {"name": "set_light"}}):
            args = dict(model=TINY, messages=ASK, tools=[TIME, SWITCH], tool_choice=choice, max_tokens=160,
                        parallel_tool_calls=False, extra_body={"mode": mode})
            done = client.chat.completions.create(**args)
            choice_out = done.choices[0]
            assert choice_out.finish_reason == "tool_calls" and done.model_extra["flashfleet"]["mode"] == mode
            assert choice_out.message.content is None and len(choice_out.message.tool_calls) == 1
            call = choice_out.message.tool_calls[0]
            assert call.id.startswith("call_") and call.type == "function"
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            if isinstance(choice, dict):
                assert call.function.name == "set_light"
            calls, content, finish = _assembled(client.chat.completions.create(**args, stream=True))
            assert content == "" and finish == "tool_calls"
            assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]
            seen[mode, str(choice)] = (call.function.name, call.function.arguments)
    # Greedy: DFlash commits the target's own choices, so the calls are the plain ones.
    assert {k[1]: v for k, v in seen.items() if k[0] == "plain"} == {k[1]: v for k, v in seen.items() if k[0] == "dflash"}


def test_each_of_n_choices_parses_its_own_calls_streamed_and_not(tool_cluster):
    client = _client(tool_cluster)
    args = dict(model=TINY, messages=ASK, tools=[TIME, SWITCH], tool_choice="required", max_tokens=160,
                parallel_tool_calls=False, n=2, temperature=1.0, seed=3)
    done = client.chat.completions.create(**args)
    assert [c.index for c in done.choices] == [0, 1]
    whole = [(c.message.tool_calls[0].function.name, c.message.tool_calls[0].function.arguments)
             for c in done.choices]
    assert all(c.finish_reason == "tool_calls" for c in done.choices)
    by_index: dict[int, list] = {0: [], 1: []}
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            by_index[c.index].append(chunk.model_copy(update={"choices": [c]}))
    for i in (0, 1):
        calls, content, finish = _assembled(by_index[i])
        assert finish == "tool_calls" and [(c["name"], c["arguments"]) for c in calls] == [whole[i]]


def test_calls_and_results_in_the_history_render_and_none_renders_no_tools(tool_cluster):
    client = _client(tool_cluster)
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"utc": true}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    sizes = {}
    for name, messages, tools in (("ask", ASK, None), ("ask+tools", ASK, [TIME, SWITCH]),
                                  ("history+tools", history, [TIME, SWITCH])):
        for choice in (("none", "auto") if tools else (None,)):
            kw = {"tools": tools, "tool_choice": choice} if tools else {}
            done = client.chat.completions.create(model=TINY, messages=messages, max_tokens=4, **kw)
            sizes[name, choice] = done.usage.prompt_tokens
    assert sizes["ask+tools", "none"] == sizes["ask", None]  # "none" renders no tools
    assert sizes["ask+tools", "auto"] > sizes["ask", None]
    # The call and its result are in the prompt: a tool turn's content and the call's JSON.
    assert sizes["history+tools", "auto"] > sizes["ask+tools", "auto"] + len("12:00 get_time utc") // 4
    formats = {m.id: m.model_extra["flashfleet"]["tool_call_format"] for m in client.models.list().data}
    assert formats == {TINY: "hermes", PLAIN_TINY: None}


def test_held_back_text_keeps_its_logprobs_and_auto_without_a_call_is_the_text(tool_cluster):
    client = _client(tool_cluster)
    args = dict(model=TINY, messages=ASK, tools=[TIME, SWITCH], max_tokens=160, logprobs=True,
                parallel_tool_calls=False)
    done = client.chat.completions.create(**args, tool_choice="required")
    listed = [lp.token for lp in done.choices[0].logprobs.content]
    assert done.choices[0].message.tool_calls and len(listed) == done.usage.completion_tokens - 1  # EOS unlisted
    streamed = [lp.token for c in client.chat.completions.create(**args, tool_choice="required", stream=True)
                if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert streamed == listed  # every token's, once, in order, though the calls' text was held back
    # auto: the random model writes no call, so the answer is its text as written, every token listed.
    free = client.chat.completions.create(**{**args, "max_tokens": 12}, tool_choice="auto")
    assert free.choices[0].message.tool_calls is None and free.choices[0].finish_reason == "length"
    assert free.choices[0].message.content == "".join(lp.token for lp in free.choices[0].logprobs.content)


@pytest.mark.parametrize("body, param, fragment", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}]}, None,
     "tools[0].function.parameters cannot be compiled"),
    ({"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "set_light"}}}, "tool_choice",
     "not among the tools"),
    ({"tools": [TIME], "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [TIME], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "parallel_tool_calls must be"),
    ({"tools": [TIME], "response_format": {"type": "json_object"}}, "response_format", "not served together"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]},
                   {"role": "user", "content": "x"}]}, "messages", "messages[0].tool_calls[0].function.arguments"),
    ({"model": PLAIN_TINY, "tools": [TIME]}, None, "has no tool-call format"),
])
def test_bad_tool_requests_are_400_naming_the_field(tool_cluster, body, param, fragment):
    from test_openai_api import post

    url = tool_cluster.coordinator.http_url + "/v1/chat/completions"
    status, answer = post(url, json.dumps({"model": TINY, "messages": ASK, "max_tokens": 4, **body}).encode())
    assert status == 400, answer
    assert fragment in answer["error"]["message"]
    if param is not None:
        assert answer["error"]["param"] == param


def test_tools_on_completions_are_refused(tool_cluster):
    from test_openai_api import post

    url = tool_cluster.coordinator.http_url + "/v1/completions"
    status, answer = post(url, json.dumps({"model": TINY, "prompt": "x", "tools": [TIME]}).encode())
    assert status == 400 and answer["error"]["param"] == "tools"


# ----------------------------------------------------------------------------- Qwen2.5-Coder-0.5B

QWEN = "Qwen2.5-Coder-0.5B-Instruct"
QWEN_DRAFT = Path(__file__).resolve().parent.parent / "flashfleet" / "drafts" / QWEN
FORCED_PROMPTS = ["What's the weather like in Tokyo right now?", "Is it raining in London? Use fahrenheit.",
                  "Tell me a joke about cats."]


@pytest.fixture(scope="module")
def qwen_http(tmp_path_factory):
    """`flashfleet up`'s cluster of one Qwen2.5-Coder-0.5B worker process (with its shipped
    DFlash draft where the checkout has it) and the HTTP API."""
    from etcd_server import free_port
    from flashfleet.cli.up import LocalCluster
    from real_models import fetched

    fetched(QWEN)
    with LocalCluster(QWEN, workers=1, capacity=1, draft="dflash" if QWEN_DRAFT.is_dir() else None,
                      http_port=free_port(), log_dir=tmp_path_factory.mktemp("logs")) as cluster:
        yield cluster


@pytest.mark.real_model
def test_qwen_calls_a_tool_and_answers_from_its_result(qwen_http):
    client = openai_client(qwen_http.http_url)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=QWEN, messages=ask, tools=[WEATHER], max_tokens=40,
                                           extra_body={"mode": "plain"})
    assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].message.content is None
    [call] = first.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris"
    result = json.dumps({"city": "Paris", "temperature_c": 22, "sky": "sunny"})
    history = ask + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": result}]
    final = client.chat.completions.create(model=QWEN, messages=history, tools=[WEATHER], max_tokens=40,
                                           extra_body={"mode": "plain"})
    # The call and its result are rendered; the 0.5B model answers by restating them (measured).
    assert final.usage.prompt_tokens > first.usage.prompt_tokens + len(result) // 4
    assert final.choices[0].finish_reason == "stop" and final.choices[0].message.tool_calls is None
    assert "22" in final.choices[0].message.content


@pytest.mark.real_model
def test_qwen_required_always_calls_validly_plain_and_dflash(qwen_http):
    import jsonschema

    client = openai_client(qwen_http.http_url)
    modes = ("plain", "dflash") if QWEN_DRAFT.is_dir() else ("plain",)
    calls = {}
    for prompt in FORCED_PROMPTS:
        for mode in modes:
            done = client.chat.completions.create(model=QWEN, messages=[{"role": "user", "content": prompt}],
                                                  tools=[WEATHER, TIME], tool_choice="required", max_tokens=48,
                                                  extra_body={"mode": mode})
            choice = done.choices[0]
            assert choice.finish_reason == "tool_calls", (prompt, mode, choice)
            assert done.model_extra["flashfleet"]["mode"] == mode
            assert choice.message.content is None and choice.message.tool_calls
            for c in choice.message.tool_calls:
                schema = {"get_weather": WEATHER, "get_time": TIME}[c.function.name]["function"]["parameters"]
                jsonschema.validate(json.loads(c.function.arguments), schema)
            calls[prompt, mode] = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    for prompt in FORCED_PROMPTS:  # greedy: the same calls in both modes
        assert len({json.dumps(calls[prompt, m]) for m in modes}) == 1, prompt
