"""Log-probabilities of generated tokens (worker/engine/batch.py `logprobs_of`) through the HTTP
API (chat and completions formats, streamed and not) and the gRPC SDK, on the tiny random-weight
model. Equality with mlx-lm's own log-probabilities and between plain and DFlash rows is tested
on SmolLM2 in tests/test_structured_output.py's child run."""
from __future__ import annotations

import math

import openai
import pytest

from harness import start_cluster

MODEL = "tiny-llama"
CHAT = [{"role": "user", "content": "Name a river."}]


@pytest.fixture(scope="module")
def tiny_cluster(tiny_models):
    from worker.config import EngineConfig
    from worker.engine.thread import Engine

    cluster = start_cluster({"w1": Engine(EngineConfig(model_path=tiny_models.llama, model_name=MODEL,
                                                       capacity=4))}, http_port=0)
    yield cluster
    cluster.close()


def _check_entry(token: str, logprob: float, top: list[tuple[str, float]], n: int) -> None:
    assert logprob <= 0 and math.isfinite(logprob)
    assert len(top) == n
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    if n:  # greedy: the chosen token is the most likely one
        assert top[0] == (token, pytest.approx(logprob, abs=1e-6))


def test_chat_logprobs_streamed_and_not(tiny_cluster):
    client = openai.OpenAI(base_url=tiny_cluster.coordinator.http_url + "/v1", api_key="unused", max_retries=0)
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens - (whole.choices[0].finish_reason == "stop")
    assert "".join(c.token for c in content) == whole.choices[0].message.content
    for c in content:
        assert bytes(c.bytes) == c.token.encode()
        _check_entry(c.token, c.logprob, [(t.token, t.logprob) for t in c.top_logprobs], 3)
    streamed = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, logprobs=True,
                                              top_logprobs=3, stream=True)
    parts = [c for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
             for c in chunk.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in parts] == [(c.token, c.logprob) for c in content]
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == whole.choices[0].message.content
    only = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, logprobs=True)
    assert all(c.top_logprobs == [] for c in only.choices[0].logprobs.content)
    for bad in (dict(top_logprobs=2), dict(logprobs=True, top_logprobs=21), dict(logprobs=3)):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, **bad)


def test_completions_logprobs_and_the_sdk(tiny_cluster):
    from flashfleet import Client

    client = openai.OpenAI(base_url=tiny_cluster.coordinator.http_url + "/v1", api_key="unused", max_retries=0)
    done = client.completions.create(model=MODEL, prompt="The river flows", max_tokens=10, logprobs=2)
    lp = done.choices[0].logprobs
    assert "".join(lp.tokens) == done.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        _check_entry(token, value, sorted(top.items(), key=lambda p: -p[1]), len(top))
        assert 1 <= len(top) <= 2  # two alternatives; tokens whose text is equal share one key
    streamed = client.completions.create(model=MODEL, prompt="The river flows", max_tokens=10, logprobs=2, stream=True)
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens

    with Client(tiny_cluster.coordinator.address) as sdk:
        same = sdk.complete(MODEL, prompt="The river flows", max_tokens=10, top_logprobs=2)
        assert [x.token_id for x in same.logprobs] == same.token_ids[: len(same.logprobs)]
        assert [x.logprob for x in same.logprobs] == pytest.approx(lp.token_logprobs, abs=1e-6)
        assert all(len(x.top) == 2 and x.top[0].token_id == x.token_id for x in same.logprobs)
