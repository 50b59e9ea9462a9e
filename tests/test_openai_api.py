"""The coordinator's OpenAI-compatible HTTP API (coordinator/openai_api.py), through the official
`openai` client (sync and async, streamed and not) and curl, on live in-process clusters: a tiny
random-weight MLX model (its greedy text must equal the gRPC SDK's) and fake engines (errors,
deadlines, a client that disconnects)."""
from __future__ import annotations

import asyncio
import gzip
import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request
import zlib

import openai
import pytest

from flashfleet import Client
from fakes import FakeEngine
from harness import start_cluster, wait_until
from worker.engine.types import Overloaded as EngineOverloaded

MODEL = "tiny-llama"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."}]
PROMPT = "The river flows"


@pytest.fixture(scope="module")
def mlx_http(tiny_models):
    from worker.config import EngineConfig
    from worker.engine.thread import Engine

    cluster = start_cluster({"w1": Engine(EngineConfig(model_path=tiny_models.llama, model_name=MODEL,
                                                       capacity=4))}, http_port=0)
    yield cluster
    cluster.close()


@pytest.fixture
def fake_http():
    engine = FakeEngine(token_delay_s=0.02)
    cluster = start_cluster({"w1": engine}, http_port=0)
    yield cluster, engine
    cluster.close()


def base_url(cluster) -> str:
    return cluster.coordinator.http_url + "/v1"



def post(url: str, body: bytes, content_type="application/json", headers=None):
    """(status, parsed JSON body) of a POST, error statuses included."""
    req = urllib.request.Request(url, data=body, headers={"Content-Type": content_type, **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_sync_client_matches_the_grpc_sdk_streamed_and_not(mlx_http):
    client = openai.OpenAI(base_url=base_url(mlx_http), api_key="unused", max_retries=0)
    with Client(mlx_http.address) as sdk:
        want_chat = sdk.complete(MODEL, messages=CHAT, max_tokens=12, temperature=0)
        want_text = sdk.complete(MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert want_chat.text and want_text.text

    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == want_chat.text
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason == want_chat.finish_reason
    assert chat.usage.completion_tokens == len(want_chat.token_ids)
    assert chat.usage.prompt_tokens == want_chat.stats.prompt_tokens
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    ff = chat.model_extra["flashfleet"]
    assert ff["worker_id"] == "w1" and ff["mode"] == "plain" and ff["ttft_s"] > 0
    assert ff["generated_tokens"] == len(want_chat.token_ids)
    assert chat.model == MODEL and chat.id.startswith("chatcmpl-")

    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert text.choices[0].text == want_text.text
    assert text.usage.completion_tokens == len(want_text.token_ids)

    # max_completion_tokens is the newer name of max_tokens.
    short = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=3, temperature=0)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"

    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_chat.text
    assert chunks[0].choices[0].delta.role == "assistant"
    finished = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finished) == 1 and finished[0].choices[0].finish_reason == want_chat.finish_reason
    assert finished[0].model_extra["flashfleet"]["generated_tokens"] == len(want_chat.token_ids)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want_chat.token_ids)

    pieces = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in pieces) == want_text.text
    assert pieces[-1].choices[0].finish_reason == want_text.finish_reason
    assert all(c.usage is None for c in pieces)  # no include_usage: no usage chunk

    listed = client.models.list()
    assert [m.id for m in listed.data] == [MODEL]
    assert listed.data[0].model_extra["flashfleet"]["workers"] == ["w1"]
    assert client.models.retrieve(MODEL).id == MODEL


def test_n_choices_greedy_identical_seeded_reproducible_and_streamed_by_index(mlx_http):
    client = openai.OpenAI(base_url=base_url(mlx_http), api_key="unused", max_retries=0)
    turn = [{"role": "user", "content": "Name three lakes of the Alps, one per line."}]  # in no prompt cache yet
    many = client.chat.completions.create(model=MODEL, messages=turn, n=3, max_tokens=10)
    assert [c.index for c in many.choices] == [0, 1, 2]
    one = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=10)
    assert [c.message.content for c in many.choices] == [one.choices[0].message.content] * 3  # greedy
    assert many.usage.prompt_tokens == one.usage.prompt_tokens
    assert many.usage.completion_tokens == 3 * one.usage.completion_tokens
    extra = [c.model_extra["flashfleet"] for c in many.choices]
    assert len({ff["request_id"] for ff in extra}) == 3
    # The later choices did not prefill the prompt again: they copied a running choice's caches of
    # it (all but its last token), or, arriving after one finished, found it in the prompt cache.
    assert sum(ff["cached_tokens"] >= many.usage.prompt_tokens - 2 for ff in extra) >= 2, (many.usage, extra)

    sampled = dict(model=MODEL, prompt=PROMPT, n=4, max_tokens=8, temperature=1.0, seed=7)
    first = [c.text for c in client.completions.create(**sampled).choices]
    assert [c.text for c in client.completions.create(**sampled).choices] == first  # reproducible
    assert len(set(first)) > 1  # each choice draws with its own seed
    alone = client.completions.create(**{**sampled, "n": 1})
    assert alone.choices[0].text == first[0]  # choice 0 keeps the request's seed

    # The SDK derives the same seeds: its choices are the HTTP API's.
    from flashfleet import AsyncClient
    from flashfleet.errors import InvalidArgument

    with Client(mlx_http.address) as sdk:
        got = sdk.choices(MODEL, prompt=PROMPT, n=4, max_tokens=8, temperature=1.0, seed=7)
        assert [c.text for c in got] == first
        assert len({c.request_id for c in got}) == 4
        greedy = sdk.choices(MODEL, messages=turn, n=2, max_tokens=10)
        assert [c.text for c in greedy] == [one.choices[0].message.content] * 2
        with pytest.raises(InvalidArgument, match=r"n must be an integer in \[1, 16\]"):
            sdk.choices(MODEL, prompt=PROMPT, n=17)

    async def async_choices():
        async with AsyncClient(mlx_http.address) as sdk:
            return await sdk.choices(MODEL, prompt=PROMPT, n=4, max_tokens=8, temperature=1.0, seed=7)
    assert [c.text for c in asyncio.run(async_choices())] == first

    chunks = list(client.completions.create(**sampled, stream=True, stream_options={"include_usage": True}))
    texts = ["", "", "", ""]
    finished = []
    for c in chunks[:-1]:
        for choice in c.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finished.append(choice.index)
    assert texts == first and sorted(finished) == [0, 1, 2, 3]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4 * 8

    echoed = client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=4, echo=True, logprobs=1)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, echo=True, logprobs=1)
    for c in echoed.choices:  # each choice starts with the prompt, and lists its tokens first
        assert c.text == plain.choices[0].text and c.text.startswith(PROMPT)
        assert c.logprobs.tokens == plain.choices[0].logprobs.tokens and c.logprobs.token_logprobs[0] is None

    chat_chunks = list(client.chat.completions.create(model=MODEL, messages=turn, n=2, max_tokens=10, stream=True))
    roles = [c.choices[0].index for c in chat_chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]  # each choice's first delta names the role
    for i in (0, 1):
        got = "".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices and c.choices[0].index == i)
        assert got == one.choices[0].message.content


def test_penalties_and_logit_bias_over_http_and_grpc(mlx_http):
    from flashfleet.errors import InvalidArgument

    client = openai.OpenAI(base_url=base_url(mlx_http), api_key="unused", max_retries=0)
    with Client(mlx_http.address) as sdk:
        free = sdk.complete(MODEL, prompt=PROMPT, max_tokens=12)
        forced = next(t for t in range(5, 500) if t not in free.token_ids)
        biased = sdk.complete(MODEL, prompt=PROMPT, max_tokens=12, logit_bias={forced: 100})
        assert biased.token_ids == [forced] * 12
        banned = sdk.complete(MODEL, prompt=PROMPT, max_tokens=12, logit_bias={t: -100 for t in set(free.token_ids)})
        assert not set(banned.token_ids) & set(free.token_ids)
        penalised = sdk.complete(MODEL, prompt=PROMPT, max_tokens=12, frequency_penalty=2.0, presence_penalty=1.0,
                                 repetition_penalty=1.5)
        assert penalised.token_ids != free.token_ids
        for kwargs, fragment in ((dict(presence_penalty=3), "presence_penalty"),
                                 (dict(repetition_penalty=0), "repetition_penalty"),
                                 (dict(logit_bias={600: 1}), "logit_bias token ids must be integers in [0, 512)"),
                                 (dict(logit_bias={"a": 1}), "logit_bias")):
            with pytest.raises(InvalidArgument) as e:
                sdk.complete(MODEL, prompt=PROMPT, max_tokens=2, **kwargs)
            assert fragment in e.value.details

    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, logit_bias={str(forced): 100})
    assert text.choices[0].text == biased.text
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, frequency_penalty=2.0,
                                     presence_penalty=1.0, extra_body={"repetition_penalty": 1.5})
    assert text.choices[0].text == penalised.text
    with pytest.raises(openai.BadRequestError) as e:  # the worker's refusal, naming the field
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logit_bias={"600": 1})
    assert e.value.param == "logit_bias" and "[0, 512)" in e.value.message


def test_async_client_streamed_and_not_and_stop_strings(mlx_http):
    with Client(mlx_http.address) as sdk:
        want = sdk.complete(MODEL, messages=CHAT, max_tokens=10, temperature=0)
        stop = want.text[3:5]  # a stop string inside the greedy answer ends it there
        stopped = sdk.complete(MODEL, messages=CHAT, max_tokens=10, temperature=0, stop=[stop])
    assert stopped.text == want.text[:want.text.index(stop)]

    async def run():
        client = openai.AsyncOpenAI(base_url=base_url(mlx_http), api_key="unused", max_retries=0)
        whole = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
        stream = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0,
                                                      stream=True)
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream])
        cut = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0,
                                                   stop=stop)
        text = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                               stream=True)
        pieces = [c async for c in text]
        await client.close()
        return whole, streamed, cut, pieces

    whole, streamed, cut, pieces = asyncio.run(run())
    assert whole.choices[0].message.content == want.text == streamed
    assert cut.choices[0].message.content == stopped.text and cut.choices[0].finish_reason == "stop"
    assert pieces[-1].choices[0].finish_reason == "length"


def test_errors_have_openais_shape_and_status(fake_http):
    cluster, _ = fake_http
    client = openai.OpenAI(base_url=base_url(cluster), api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=CHAT)
    assert e.value.status_code == 404 and e.value.code == "model_not_found" and "fake-model" in e.value.message
    for kwargs, param in ((dict(n=17), "n"), (dict(n=0), "n"), (dict(temperature=-1), "temperature"),
                          (dict(top_logprobs=30, logprobs=True), "top_logprobs"),
                          (dict(messages=[]), "messages"), (dict(max_tokens=0), "max_tokens"),
                          (dict(presence_penalty=2.5), "presence_penalty"),
                          (dict(frequency_penalty=-3), "frequency_penalty"),
                          (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
                          (dict(logit_bias={"x": 1}), "logit_bias"), (dict(logit_bias={"1": 101}), "logit_bias"),
                          (dict(logit_bias=[1]), "logit_bias")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**{"model": "fake-model", "messages": CHAT, **kwargs})
        assert e.value.status_code == 400 and e.value.type == "invalid_request_error", kwargs
        assert e.value.param == param, kwargs
    with pytest.raises(openai.BadRequestError, match="mode"):
        client.completions.create(model="fake-model", prompt="x", extra_body={"mode": "warp"})

    url = base_url(cluster)
    status, body = post(url + "/chat/completions", b"{not json")
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "invalid_argument"  # as for every other bad request
    status, body = post(url + "/completions", json.dumps({"model": "fake-model", "prompt": [1, 2]}).encode())
    assert status == 400 and body["error"]["param"] == "prompt"
    status, body = post(url + "/embeddings", b"{}")
    assert status == 404 and "no such endpoint" in body["error"]["message"]
    # The server keeps serving after every refusal.
    assert client.completions.create(model="fake-model", prompt="abc", max_tokens=2).usage.completion_tokens == 2


# A value of each field that asks for something (refused fields) or changes nothing (no-ops).
ASKING = {
    "response_format": {"type": "json_object"}, "n": 2, "best_of": 2, "echo": True, "suffix": "x",
    "top_logprobs": 2, "logit_bias": {"1": 5}, "presence_penalty": 0.5, "frequency_penalty": 0.5,
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "functions": [{"name": "f", "parameters": {}}], "tool_choice": "required", "function_call": {"name": "f"},
    "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low", "verbosity": "low",
    "web_search_options": {}, "moderation": {"model": "omni-moderation-latest"},
    "user": "u", "safety_identifier": "s", "metadata": {"k": "v"}, "store": True, "service_tier": "auto",
    "prompt_cache_key": "k", "prompt_cache_retention": "24h", "prompt_cache_options": {},
    "parallel_tool_calls": False,
}


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_every_openai_request_field_is_served_a_no_op_or_refused_by_name(fake_http, chat):
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_params

    from coordinator.openai_format import NOOP, REQUEST_FIELDS, SERVED

    cluster, engine = fake_http
    params = (chat_params if chat else completion_create_params).CompletionCreateParamsBase
    fields = set(params.__annotations__) | {"stream"}
    assert fields <= set(REQUEST_FIELDS), fields - set(REQUEST_FIELDS)  # a new OpenAI field is placed
    url = base_url(cluster) + ("/chat/completions" if chat else "/completions")
    base = {"model": "fake-model", "max_tokens": 2, **({"messages": CHAT} if chat else {"prompt": "x"})}
    for name in sorted(fields):
        kind = REQUEST_FIELDS[name]
        if kind == SERVED:
            continue
        value = ASKING[name]
        status, answer = post(url, json.dumps({**base, name: value}).encode())
        if kind == NOOP:
            assert status == 200 and answer["usage"]["completion_tokens"] == 2, (name, answer)
        else:
            assert value not in kind
            assert status == 400 and answer["error"]["param"] == name, (name, answer)
            assert name in answer["error"]["message"] and "not supported" in answer["error"]["message"]
    assert len(engine.submitted) == sum(REQUEST_FIELDS[f] == NOOP for f in fields)


@pytest.mark.parametrize("body, content_type, fragment", [
    (b"[" * 100_000 + b"]" * 100_000, "application/json", "nested too deeply"),  # was a 500 (RecursionError)
    (b'{"model": "fake-model"}', "application/json; charset=no-such-charset", "charset 'no-such-charset'"),
    (json.dumps({"model": "fake-model", "prompt": "x", "temperature": 10**400}).encode(), "application/json",
     "temperature must be a number"),  # was a 500 (OverflowError)
    (json.dumps({"model": "fake-model", "prompt": "x", "timeout_s": 10**400}).encode(), "application/json",
     "timeout_s must be"),  # was a 500 (OverflowError)
    (json.dumps({"model": "fake-model", "prompt": "x", "timeout_s": 1e12}).encode(), "application/json",
     "at most 1e+08"),  # was a 504 at once: gRPC's deadline overflowed
], ids=["deep-nesting", "unknown-charset", "huge-int-temperature", "huge-int-timeout", "timeout-1e12"])
def test_bodies_that_once_failed_with_500_or_504_are_400(fake_http, body, content_type, fragment):
    cluster, engine = fake_http
    status, answer = post(base_url(cluster) + "/completions", body, content_type)
    assert status == 400 and fragment in answer["error"]["message"], answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert engine.submitted == []
    status, answer = post(base_url(cluster) + "/completions",
                          json.dumps({"model": "fake-model", "prompt": "x", "max_tokens": 2, "timeout_s": 1e8}).encode())
    assert status == 200 and answer["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_body_that_does_not_decode_as_its_content_encoding_is_400_every_time(fake_http, encoding):
    # Decoded by aiohttp's parser, such a body got a 500, a plain-text 400, or (deflate, about
    # one time in ten) no answer at all.
    cluster, engine = fake_http
    for _ in range(20):
        status, answer = post(base_url(cluster) + "/completions", b"[" * 100 + b"]" * 100,
                              headers={"Content-Encoding": encoding})
        assert status == 400 and f"Content-Encoding {encoding!r}" in answer["error"]["message"]
        assert answer["error"]["code"] == "invalid_argument"
    body = json.dumps({"model": "fake-model", "prompt": "x", "max_tokens": 2}).encode()
    for packed in (gzip.compress(body) if encoding == "gzip" else zlib.compress(body),):
        status, answer = post(base_url(cluster) + "/completions", packed, headers={"Content-Encoding": encoding})
        assert status == 200 and answer["usage"]["completion_tokens"] == 2
    status, answer = post(base_url(cluster) + "/completions", body, headers={"Content-Encoding": "br"})
    assert status == 415 and answer["error"]["code"] == "unsupported_content_encoding"
    assert len(engine.submitted) == 1


def test_decode_content_bounds_its_output_and_takes_raw_deflate():
    from coordinator.http_body import decode_content
    from coordinator.openai_format import OpenAIError

    assert decode_content(b"abc", None) == decode_content(b"abc", " Identity ") == b"abc"
    assert decode_content(gzip.compress(b"abc"), "x-gzip") == b"abc"
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    assert decode_content(raw.compress(b"abc") + raw.flush(), "deflate") == b"abc"
    for data, encoding, status in ((gzip.compress(b" " * 2000), "gzip", 413), (gzip.compress(b"abc") + b"x", "gzip", 400),
                                   (gzip.compress(b"abc")[:-4], "gzip", 400), (b"abc", "compress", 415)):
        with pytest.raises(OpenAIError) as e:
            decode_content(data, encoding, limit=1000)
        assert e.value.status == status, (encoding, e.value.message)


def test_overloaded_is_429_and_a_passed_deadline_504():
    cluster = start_cluster({"w1": FakeEngine(refuse=EngineOverloaded)}, http_port=0, max_queued=0)
    try:
        client = openai.OpenAI(base_url=base_url(cluster), api_key="unused", max_retries=0)
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model="fake-model", prompt="abc", max_tokens=2)
        assert e.value.status_code == 429 and e.value.code == "overloaded"
    finally:
        cluster.close()
    # The first token would come after 20 s: an answer well before it was ended by the 0.3 s
    # deadline, with room for a loaded host's slower coordinator.
    cluster = start_cluster({"w1": FakeEngine(token_delay_s=20.0)}, http_port=0)
    try:
        client = openai.OpenAI(base_url=base_url(cluster), api_key="unused", max_retries=0)
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="fake-model", prompt="abc", max_tokens=5, extra_body={"timeout_s": 0.3})
        assert e.value.status_code == 504 and e.value.code == "deadline_exceeded"
        assert time.monotonic() - t0 < 10.0  # ended by the deadline, not by the first token
        samples = {s.labels["outcome"]: s.value for m in cluster.coordinator_registry.collect()
                   if m.name == "flashfleet_coordinator_requests" for s in m.samples
                   if s.name.endswith("_total")}
        assert samples.get("deadline") == 1
    finally:
        cluster.close()


def test_a_client_that_disconnects_mid_stream_cancels_the_request(fake_http):
    cluster, engine = fake_http
    client = openai.OpenAI(base_url=base_url(cluster), api_key="unused", max_retries=0)
    stream = client.completions.create(model="fake-model", prompt="abc", max_tokens=400, stream=True)
    got = [next(iter(stream)) for _ in range(3)]
    assert all(c.choices[0].text for c in got)
    assert engine.load().active_sessions == 1
    stream.close()  # the HTTP connection closes
    assert wait_until(lambda: engine.load().active_sessions == 0)
    assert wait_until(lambda: cluster.coordinator_registry.get_sample_value(
        "flashfleet_coordinator_requests_total",
        {"model": "fake-model", "worker": "w1", "outcome": "cancelled"}) == 1)
    assert cluster.coordinator.registry.live()[0].in_flight == 0


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl(fake_http):
    cluster, _ = fake_http
    url = base_url(cluster)
    body = json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    out = subprocess.run(["curl", "-sS", url + "/chat/completions", "-H", "Content-Type: application/json",
                          "-d", body], capture_output=True, text=True, timeout=30, check=True).stdout
    answer = json.loads(out)
    assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] == 4
    with Client(cluster.address) as sdk:
        want = sdk.complete("fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert answer["choices"][0]["message"]["content"] == want.text

    streamed = json.dumps({**json.loads(body), "stream": True})
    out = subprocess.run(["curl", "-sSN", url + "/chat/completions", "-H", "Content-Type: application/json",
                          "-d", streamed], capture_output=True, text=True, timeout=30, check=True).stdout
    events = [line[len("data: "):] for line in out.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want.text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "flashfleet" in chunks[-1]
    models = json.loads(subprocess.run(["curl", "-sS", url + "/models"], capture_output=True, text=True,
                                       timeout=30, check=True).stdout)
    assert models["data"][0]["id"] == "fake-model"


def test_a_client_that_gives_up_before_the_first_token_cancels_the_request():
    engine = FakeEngine(token_delay_s=30.0)  # nothing to write for 30 s: only the disconnect tells
    cluster = start_cluster({"w1": engine}, http_port=0)
    try:
        client = openai.OpenAI(base_url=base_url(cluster), api_key="unused", max_retries=0, timeout=0.5)
        t0 = time.monotonic()
        with pytest.raises(openai.APITimeoutError):
            client.chat.completions.create(model="fake-model", messages=CHAT, max_tokens=3)
        assert wait_until(lambda: engine.load().active_sessions == 0, timeout=10.0)
        assert time.monotonic() - t0 < 15.0  # freed by the disconnect, not by the 30 s token
    finally:
        cluster.close()


def test_the_body_is_inflated_and_parsed_off_the_event_loop(fake_http, monkeypatch):
    # Inflating and parsing up to 8 MiB must not stall the loop that relays every stream.
    import threading

    from coordinator import http_body

    cluster, _ = fake_http
    threads = []
    decode = http_body.decode_content

    def spy(*args, **kwargs):
        threads.append(threading.get_ident())
        return decode(*args, **kwargs)

    monkeypatch.setattr(http_body, "decode_content", spy)
    body = gzip.compress(json.dumps({"model": "fake-model", "prompt": "hi", "max_tokens": 3}).encode())
    status, reply = post(base_url(cluster) + "/completions", body, headers={"Content-Encoding": "gzip"})
    assert status == 200, reply
    assert threads and cluster.loop.thread.ident not in threads


@pytest.mark.parametrize("extra, param", [({"mode": "turbo"}, "mode"), ({"session_id": 5}, "session_id"),
                                          ({"max_tokens": -1}, "max_tokens")])
def test_flashfleets_own_fields_are_named_in_their_400(fake_http, extra, param):
    cluster, engine = fake_http
    body = {"model": "fake-model", "max_tokens": 2, "messages": CHAT, **extra}
    status, answer = post(base_url(cluster) + "/chat/completions", json.dumps(body).encode())
    assert status == 400 and answer["error"]["param"] == param, answer
