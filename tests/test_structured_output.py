"""Structured output (worker/engine/grammar.py): JSON constrained by a grammar in plain and DFlash
rows, through the engine, the gRPC SDK and the HTTP API.

The engine tests run SmolLM2-135M-Instruct with its shipped DFlash draft on the CPU in float32:
every one of the 50 schemas of tests/data/schemas (real API shapes, each file names its source)
decoded greedy and sampled, plain and DFlash, in one batch each; every output parses and
validates, greedy output is equal between the modes token for token, and unconstrained rows in
the same batch decode as they do alone. The API tests use the tiny random-weight model.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

import jsonschema
import openai
import pytest

from harness import start_cluster
from real_models import fetched

SCHEMAS = sorted((Path(__file__).parent / "data" / "schemas").glob("*.json"))
SMOL = "SmolLM2-135M-Instruct"
SHIPPED_DRAFT = Path(__file__).resolve().parent.parent / "flashfleet" / "drafts" / SMOL
MAX_TOKENS = 160
FREE_PROMPTS = ["Name three rivers of Europe.", "Write a haiku about rain."]


def _docs() -> list[dict]:
    return [json.loads(p.read_text()) for p in SCHEMAS]


def test_the_schemas_are_fifty_real_shapes_with_their_source_and_a_valid_example():
    docs = _docs()
    assert len(docs) == 50
    for path, doc in zip(SCHEMAS, docs):
        assert doc["source"].strip(), path.name
        jsonschema.Draft202012Validator.check_schema(doc["schema"])
        jsonschema.validate(doc["example"], doc["schema"])


def _run_batch(engine, requests) -> dict[str, tuple[list[int], str, str]]:
    """Submits every (request, ...) at once; returns request_id -> (tokens, text, finish reason)."""
    from worker.engine.types import DoneEvent, TokenEvent

    out: dict[str, list] = {r.request_id: [[], [], None] for r in requests}
    done = threading.Event()
    left = [len(requests)]
    lock = threading.Lock()

    def emit(e):
        slot = out[e.request_id]
        if isinstance(e, TokenEvent):
            slot[0] += e.token_ids
            slot[1].append(e.text)
            return
        slot[2] = e.finish_reason if isinstance(e, DoneEvent) else f"error: {e.error}"
        with lock:
            left[0] -= 1
            if not left[0]:
                done.set()

    for r in requests:
        engine.submit(r, emit)
    assert done.wait(1200)
    return {rid: (tokens, "".join(text), reason) for rid, (tokens, text, reason) in out.items()}


@pytest.fixture(scope="module")
def smol_engine():
    if not SHIPPED_DRAFT.is_dir():
        pytest.skip(f"no shipped DFlash draft for {SMOL}")
    from worker.config import EngineConfig
    from worker.engine.thread import Engine

    engine = Engine(EngineConfig(model_path=fetched(SMOL), draft_path=SHIPPED_DRAFT, capacity=64,
                                 prompt_cache_entries=0))
    yield engine
    engine.close()


def _requests(engine, mode: str, temperature: float, with_free: bool):
    from worker.engine.types import GenerationRequest, ResponseFormat, SamplingParams

    reqs = []
    for i, doc in enumerate(_docs()):
        schema = json.dumps(doc["schema"])
        prompt = engine.encode_prompt(None, [{"role": "user", "content": f"Reply in JSON matching: {schema}"}])
        reqs.append(GenerationRequest(f"{mode}-{temperature}-{i}", tuple(prompt), MAX_TOKENS,
                                      SamplingParams(temperature=temperature, seed=i), mode=mode,
                                      response_format=ResponseFormat("json_schema", schema)))
    if with_free:
        for i, text in enumerate(FREE_PROMPTS):
            prompt = engine.encode_prompt(None, [{"role": "user", "content": text}])
            reqs.append(GenerationRequest(f"{mode}-free-{i}", tuple(prompt), 24, mode=mode))
    return reqs


@pytest.mark.real_model
def test_fifty_schemas_validate_plain_and_dflash_greedy_and_sampled_and_greedy_modes_agree(smol_engine):
    docs = _docs()
    greedy = {}
    for mode in ("plain", "dflash"):
        for temperature in (0.0, 0.8):
            results = _run_batch(smol_engine, _requests(smol_engine, mode, temperature, with_free=temperature == 0))
            for i, doc in enumerate(docs):
                tokens, text, reason = results[f"{mode}-{temperature}-{i}"]
                assert reason == "stop", (mode, temperature, SCHEMAS[i].name, reason, text)
                jsonschema.validate(json.loads(text), doc["schema"])
            if temperature == 0:
                greedy[mode] = results
    for rid, (tokens, _, _) in greedy["plain"].items():
        assert greedy["dflash"][rid.replace("plain", "dflash", 1)][0] == tokens, rid
    # Unconstrained rows decode in a batch of constrained ones as they do alone.
    for mode in ("plain", "dflash"):
        free = [r for r in _requests(smol_engine, mode, 0.0, with_free=True) if r.response_format is None]
        for r in free:
            alone = _run_batch(smol_engine, [r])[r.request_id][0]
            assert alone == greedy[mode][r.request_id][0], r.request_id


@pytest.mark.real_model
def test_a_schema_the_library_cannot_compile_is_refused_with_its_reason(smol_engine):
    from worker.engine.types import GenerationRequest, InvalidRequest, ResponseFormat

    prompt = tuple(smol_engine.encode_prompt("{", None))
    for schema, fragment in (('{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}', "cannot be compiled"),
                             ('{"type": "strin"}', "cannot be compiled"),
                             ("[1, 2]", "must be a JSON object"),
                             ("{not json", "not valid JSON")):
        with pytest.raises(InvalidRequest, match=fragment):
            smol_engine.submit(GenerationRequest("bad", prompt, 8, response_format=ResponseFormat("json_schema", schema)),
                               lambda e: None)
    with pytest.raises(InvalidRequest, match="plain and dflash"):
        smol_engine.submit(GenerationRequest("bad", prompt, 8, mode="uag",
                                             response_format=ResponseFormat("json_object")), lambda e: None)


# ----- the APIs, on the tiny random-weight model ----------------------------------------------------

MODEL = "tiny-llama"
WEATHER = json.loads(SCHEMAS[0].read_text())["schema"]


@pytest.fixture(scope="module")
def tiny_cluster(tiny_models):
    from worker.config import EngineConfig
    from worker.engine.thread import Engine

    cluster = start_cluster({"w1": Engine(EngineConfig(model_path=tiny_models.llama, model_name=MODEL,
                                                       capacity=4))}, http_port=0)
    yield cluster
    cluster.close()


def test_response_format_over_http_chat_and_completions_streamed_and_not(tiny_cluster):
    client = openai.OpenAI(base_url=tiny_cluster.coordinator.http_url + "/v1", api_key="unused", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                          max_tokens=200, response_format=fmt)
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content), WEATHER)
    streamed = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                              max_tokens=200, response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat.choices[0].message.content
    done = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=200,
                                     extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(done.choices[0].text), dict)

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
                "a": {"$ref": "#/nowhere"}}}}})
    assert e.value.status_code == 400 and "cannot be compiled" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "yaml"})
    assert e.value.param == "response_format"


def test_json_schema_through_the_grpc_sdk(tiny_cluster):
    from flashfleet import Client
    from flashfleet.errors import InvalidArgument

    with Client(tiny_cluster.coordinator.address) as client:
        done = client.complete(MODEL, messages=[{"role": "user", "content": "Weather?"}], max_tokens=200,
                               json_schema=WEATHER)
        jsonschema.validate(json.loads(done.text), WEATHER)
        same = client.complete(MODEL, messages=[{"role": "user", "content": "Weather?"}], max_tokens=200,
                               response_format={"type": "json_schema", "json_schema": {"schema": WEATHER}})
        assert same.text == done.text
        with pytest.raises(InvalidArgument, match="cannot be compiled"):
            client.complete(MODEL, prompt="x", json_schema={"type": "strin"})
        with pytest.raises(InvalidArgument, match="not both"):
            client.complete(MODEL, prompt="x", json_schema=WEATHER, response_format={"type": "json_object"})
