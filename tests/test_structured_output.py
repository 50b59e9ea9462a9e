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
import os
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import jsonschema
import openai
import pytest

from harness import start_cluster
from real_models import fetched

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS = sorted((Path(__file__).parent / "data" / "schemas").glob("*.json"))
SMOL = "SmolLM2-135M-Instruct"
SHIPPED_DRAFT = Path(__file__).resolve().parent.parent / "flashfleet" / "drafts" / SMOL
MAX_TOKENS = 512  # above what any schema here needs on one line, so a "length" end is a failure
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


def run_engine(model_dir: str, draft_dir: str, part: str) -> dict:
    """The child process's work. Part "schemas": every schema in one batch per (mode,
    temperature), free-text rows beside the greedy ones, then each free-text row alone: {run:
    {request_id: [tokens, text, finish reason]}}, and a refused schema's message under "refused".
    Part "logprobs": greedy free text's log-probabilities in plain and DFlash rows, and mlx-lm's."""
    from worker.config import EngineConfig
    from worker.engine.thread import Engine
    from worker.engine.types import GenerationRequest, InvalidRequest, ResponseFormat

    out: dict = {}
    with Engine(EngineConfig(model_path=Path(model_dir), draft_path=Path(draft_dir), capacity=64,
                             prompt_cache_entries=0)) as engine:
        if part == "logprobs":
            for mode in ("plain", "dflash"):
                reqs = [replace(r, request_id=f"lp-{r.request_id}", top_logprobs=2)
                        for r in _requests(engine, mode, 0.0, True) if r.response_format is None]
                out[f"logprobs-{mode}"] = {r.request_id: [[lp.logprob for lp in lps], tokens]
                                           for r in reqs for tokens, lps in [_run_logprobs(engine, r)]}
            out["logprobs-mlx-lm"] = _mlx_lm_logprobs(model_dir, [r.prompt_tokens for r in reqs])
            return out
        for mode in ("plain", "dflash"):
            for temperature in (0.0, 0.8):
                out[f"{mode}-{temperature}"] = _run_batch(engine, _requests(engine, mode, temperature, temperature == 0))
            for r in _requests(engine, mode, 0.0, True):
                if r.response_format is None:
                    out[f"{mode}-alone-{r.request_id}"] = _run_batch(engine, [r])
        prompt = tuple(engine.encode_prompt("{", None))
        out["refused"] = []
        for schema in ('{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}', '{"type": "strin"}',
                       "[1, 2]", "{not json"):
            try:
                engine.submit(GenerationRequest("bad", prompt, 8, response_format=ResponseFormat("json_schema", schema)),
                              lambda e: None)
                out["refused"].append("")
            except InvalidRequest as e:
                out["refused"].append(str(e))
        try:
            engine.submit(GenerationRequest("bad", prompt, 8, mode="uag", response_format=ResponseFormat("json_object")),
                          lambda e: None)
        except InvalidRequest as e:
            out["refused"].append(str(e))
    return out


def _run_logprobs(engine, request) -> tuple[list[int], list]:
    """(token ids, TokenLogprobs) of one request run alone."""
    from worker.engine.types import TokenEvent

    tokens, lps, done = [], [], threading.Event()

    def emit(e):
        if isinstance(e, TokenEvent):
            tokens.extend(e.token_ids)
            lps.extend(e.logprobs)
        else:
            done.set()

    engine.submit(request, emit)
    assert done.wait(600)
    return tokens, lps


def _mlx_lm_logprobs(model_dir: str, prompts) -> list[list]:
    """mlx-lm's own greedy decoding of each prompt (`generate_step`, the model loaded as the
    engine loads it: `worker.loading.load_target`, its compute dtype, in the engine's process):
    [[the chosen tokens' logprobs], [tokens]] per prompt, 24 tokens."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from worker.loading import load_target

    model, _ = load_target(model_dir)
    out = []
    for prompt in prompts:
        tokens, lps = [], []
        for token, logprobs in generate_step(mx.array(list(prompt)), model, max_tokens=24):
            tokens.append(int(token))
            lps.append(logprobs[int(token)].item())
        out.append([lps, tokens])
    return out


def _child(part: str) -> dict:
    """`run_engine(part)` on SmolLM2 and its shipped draft, in a child process with the workers'
    environment (OpenBLAS preloaded on Linux, as workers run)."""
    if not SHIPPED_DRAFT.is_dir():
        pytest.skip(f"no shipped DFlash draft for {SMOL}")
    from flashfleet.cli.up import worker_env

    model_dir = fetched(SMOL)
    env = {**worker_env(), "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    proc = subprocess.run([sys.executable, __file__, str(model_dir), str(SHIPPED_DRAFT), part], env=env,
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def smol_runs():
    return _child("schemas")


@pytest.fixture(scope="module")
def smol_logprobs():
    return _child("logprobs")


@pytest.mark.real_model
@pytest.mark.timeout(1600)
def test_fifty_schemas_validate_plain_and_dflash_greedy_and_sampled_and_greedy_modes_agree(smol_runs):
    docs, failed = _docs(), []
    for mode in ("plain", "dflash"):
        for temperature in (0.0, 0.8):
            results = smol_runs[f"{mode}-{temperature}"]
            for i, doc in enumerate(docs):
                tokens, text, reason = results[f"{mode}-{temperature}-{i}"]
                try:
                    assert reason == "stop", reason
                    jsonschema.validate(json.loads(text), doc["schema"])
                except (AssertionError, ValueError, jsonschema.ValidationError) as e:
                    failed.append((mode, temperature, SCHEMAS[i].name, str(e)[:80], text[:120]))
    assert not failed, failed  # every failing output at once, not only the first
    plain, dflash = smol_runs["plain-0.0"], smol_runs["dflash-0.0"]
    for rid, (tokens, _, _) in plain.items():
        assert dflash[rid.replace("plain", "dflash", 1)][0] == tokens, rid
    # Unconstrained rows decode in a batch of constrained ones as they do alone.
    for mode, batch in (("plain", plain), ("dflash", dflash)):
        for i in range(len(FREE_PROMPTS)):
            rid = f"{mode}-free-{i}"
            assert smol_runs[f"{mode}-alone-{rid}"][rid][0] == batch[rid][0], rid


@pytest.mark.real_model
@pytest.mark.timeout(1600)
def test_greedy_logprobs_equal_between_plain_and_dflash_and_mlx_lm(smol_logprobs):
    runs = smol_logprobs
    plain, dflash, ref = runs["logprobs-plain"], runs["logprobs-dflash"], runs["logprobs-mlx-lm"]
    assert len(plain) == len(ref) == len(FREE_PROMPTS)
    for i, (ref_lps, ref_tokens) in enumerate(ref):
        lps, tokens = plain[f"lp-plain-free-{i}"]
        d_lps, d_tokens = dflash[f"lp-dflash-free-{i}"]
        n = len(tokens)  # an EOS ends the engine's stream without an entry
        assert n >= 8 and tokens == ref_tokens[:n] == d_tokens
        assert lps == pytest.approx(ref_lps[:n], abs=1e-4)
        assert d_lps == pytest.approx(lps, abs=1e-4)


@pytest.mark.real_model
@pytest.mark.timeout(1600)
def test_a_schema_the_library_cannot_compile_is_refused_with_its_reason(smol_runs):
    ref, typo, array, not_json, uag = smol_runs["refused"]
    assert "cannot be compiled" in ref and "cannot be compiled" in typo
    assert "must be a JSON object" in array and "not valid JSON" in not_json
    assert "uag" in uag  # refused: this worker has no draft for the mode, whatever the format


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


if __name__ == "__main__":  # the child process of the real-model tests: MODEL_DIR DRAFT_DIR PART
    print(json.dumps(run_engine(sys.argv[1], sys.argv[2], sys.argv[3])))
