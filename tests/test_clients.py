"""Real OpenAI-API clients against a live `flashfleet up` cluster serving SmolLM2 (its worker a
child process, OpenBLAS preloaded, as in production):

- litellm (`litellm.completion(model="openai/<name>", api_base=...)`): chat, streaming, and a
  json_schema response_format, each equal to what the fleet answers the gRPC SDK;
- lm-evaluation-harness (`lm_eval run`): `local-completions` on a multiple-choice task scored by
  loglikelihood (echo + logprobs) and a generation task, `local-chat-completions` on the
  generation task, both tasks local (tests/data/lm_eval/: `dataset_path: json` and local
  data_files, no hub). The harness's loglikelihoods equal the fleet's own prompt log-probabilities
  summed over each choice's tokens, and its generations the fleet's greedy answers.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest

from real_models import fetched

ROOT = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
TASKS = ROOT / "tests" / "data" / "lm_eval"
# Everything local: no hub, no downloaded model cost map.
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "LITELLM_LOCAL_MODEL_COST_MAP": "True"}

pytestmark = pytest.mark.real_model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """`flashfleet up` with one SmolLM2 worker and the HTTP API: (gRPC address, HTTP base URL
    ending in /v1, the model directory)."""
    model_dir = fetched(MODEL)
    logs = tmp_path_factory.mktemp("up-logs")
    proc = subprocess.Popen([sys.executable, "-m", "flashfleet.cli", "up", "--workers", "1", "--model", MODEL,
                             "--port", "0", "--http-port", str(_free_port()), "--log-dir", str(logs)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    address = url = None
    deadline = time.monotonic() + 180
    lines = []
    while time.monotonic() < deadline and url is None and proc.poll() is None:
        line = proc.stdout.readline()
        lines.append(line)
        if "cluster ready: coordinator at" in line:
            address = line.split(" at ")[-1].strip()
        if "OpenAI-compatible API:" in line:
            url = line.split("API:")[-1].strip()
    try:
        assert address and url, "".join(lines)
        yield address, url, model_dir
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


@pytest.fixture(scope="module")
def sdk(cluster):
    from flashfleet import Client

    with Client(cluster[0]) as client:
        yield client


@pytest.fixture(scope="module")
def litellm():
    os.environ.update({k: v for k, v in OFFLINE.items() if k.startswith("LITELLM")})
    import litellm

    return litellm


MESSAGES = [{"role": "user", "content": "Name three rivers of Europe."}]
CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                         "population": {"type": "integer", "minimum": 0, "maximum": 100000000}},
        "required": ["name", "population"], "additionalProperties": False}


def test_litellm_chat_streaming_and_json_schema(cluster, sdk, litellm):
    _, url, _ = cluster
    kw = dict(model=f"openai/{MODEL}", api_base=url, api_key="unused", temperature=0)
    want = sdk.complete(MODEL, messages=MESSAGES, max_tokens=24).text
    reply = litellm.completion(messages=MESSAGES, max_tokens=24, **kw)
    assert reply.choices[0].message.content == want
    assert reply.usage.completion_tokens > 0
    chunks = list(litellm.completion(messages=MESSAGES, max_tokens=24, stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    ask = [{"role": "user", "content": "Describe Paris as JSON with its name and population."}]
    reply = litellm.completion(messages=ask, max_tokens=64, response_format=fmt, **kw)
    text = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), CITY)
    assert text == sdk.complete(MODEL, messages=ask, max_tokens=64, json_schema=CITY).text


def _lm_eval(args: list[str], out: Path) -> tuple[dict, dict[str, list[dict]]]:
    """Runs `lm_eval run ARGS` from the repository root (the tasks' data_files are relative to
    it), offline; returns (its results by task, its logged samples by task)."""
    env = {**os.environ, **OFFLINE, "HF_DATASETS_CACHE": str(out / "hf-datasets")}
    proc = subprocess.run([sys.executable, "-m", "lm_eval", "run", *args, "--include_path", str(TASKS),
                           "--output_path", str(out), "--log_samples"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (results,) = glob.glob(str(out / "*" / "results_*.json"))
    samples = {}
    for path in glob.glob(str(out / "*" / "samples_*.jsonl")):
        task = Path(path).name[len("samples_"):].rsplit("_", 1)[0]
        samples[task] = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return json.loads(Path(results).read_text())["results"], samples


def test_lm_eval_local_completions_loglikelihood_and_generation(cluster, sdk, tmp_path):
    from transformers import AutoTokenizer

    _, url, model_dir = cluster
    results, samples = _lm_eval(
        ["--model", "local-completions", "--model_args",
         f"model={MODEL},base_url={url}/completions,tokenizer_backend=huggingface,tokenizer={model_dir},"
         "tokenized_requests=False,max_retries=1",
         "--tasks", "flashfleet_capitals_mc", "flashfleet_capitals_gen"], tmp_path)
    assert 0 <= results["flashfleet_capitals_mc"]["acc,none"] <= 1
    assert 0 <= results["flashfleet_capitals_gen"]["exact_match,none"] <= 1
    assert len(samples["flashfleet_capitals_mc"]) == 6 and len(samples["flashfleet_capitals_gen"]) == 6
    # Each choice's loglikelihood: the fleet's prompt log-probabilities of context + choice, summed
    # over the choice's tokens.
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    for sample in samples["flashfleet_capitals_mc"]:
        for args, resp in zip(sample["arguments"].values(), sample["resps"]):
            context, choice = args["arg_0"], args["arg_1"]
            scored = sdk.complete(MODEL, prompt=context + choice, max_tokens=0, prompt_logprobs=0).prompt_logprobs
            assert [lp.token_id for lp in scored] == tok.encode(context + choice)
            ctxlen = len(tok.encode(context))
            assert float(resp[0][0]) == pytest.approx(sum(lp.logprob for lp in scored[ctxlen:]), abs=1e-5)
    for sample in samples["flashfleet_capitals_gen"]:
        context = sample["arguments"]["gen_args_0"]["arg_0"]
        want = sdk.complete(MODEL, prompt=context, max_tokens=8, stop=["\n"]).text
        assert sample["resps"][0][0] == want


def test_lm_eval_local_chat_completions_generation(cluster, sdk, tmp_path):
    _, url, _ = cluster
    results, samples = _lm_eval(
        ["--model", "local-chat-completions", "--model_args",
         f"model={MODEL},base_url={url}/chat/completions,max_retries=1", "--apply_chat_template",
         "--tasks", "flashfleet_capitals_gen"], tmp_path)
    assert 0 <= results["flashfleet_capitals_gen"]["exact_match,none"] <= 1
    assert len(samples["flashfleet_capitals_gen"]) == 6
    for sample in samples["flashfleet_capitals_gen"]:
        (chat,) = sample["arguments"]["gen_args_0"]["arg_0"]  # the rendered request: the turns as JSON
        messages = json.loads(chat)
        want = sdk.complete(MODEL, messages=messages, max_tokens=8, stop=["\n"]).text
        assert sample["resps"][0][0] == want
