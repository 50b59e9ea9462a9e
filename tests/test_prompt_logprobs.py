"""Prompt log-probabilities (`GenerateRequest.prompt_logprobs`; /v1/completions' `echo` with
`logprobs`, what lm-evaluation-harness's loglikelihood reads) equal mlx-lm's own: one forward of
the whole prompt through the model as a worker loads it (`worker.loading.load_target`, float32),
log-softmax per position. On the tiny random-weight model through the HTTP API and the SDK, with
a small prefill chunk so a prompt spans several chunks, in modes plain and dflash; on SmolLM2
through the engine, a prompt longer than one scored chunk."""
from __future__ import annotations

import json
import queue
from pathlib import Path

import openai
import pytest

from harness import start_cluster
from real_models import fetched

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny-llama"
PROMPT = "The river flows past the old mill, under the bridge and on to the sea."
TOL = 1e-4  # float32: a chunked prefill and one whole forward differ in summation order only


def reference(model_dir, prompt_ids: list[int], k: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """mlx-lm's log-probabilities of prompt_ids[1:], each given the tokens before it, and the k
    most likely tokens at each position (id, logprob), most likely first; position n-1 (the
    first generated token's) last."""
    import mlx.core as mx

    from worker.loading import load_target

    model, _ = load_target(model_dir)
    logits = model(mx.array(prompt_ids)[None])[0].astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    order = mx.argsort(-lp, axis=-1)[:, :k]
    top_ids, top_lp = order.tolist(), mx.take_along_axis(lp, order, axis=-1).tolist()
    following = mx.array(prompt_ids[1:] + [0])[:, None]
    picked = mx.take_along_axis(lp, following, axis=-1)[:, 0].tolist()
    return [(picked[i] if i + 1 < len(prompt_ids) else None, list(zip(top_ids[i], top_lp[i])))
            for i in range(len(prompt_ids))]


@pytest.fixture(scope="module")
def cluster(tiny_models, dflash_dir):
    from worker.config import EngineConfig
    from worker.engine.thread import Engine

    engine = Engine(EngineConfig(model_path=tiny_models.llama, draft_path=dflash_dir, model_name=MODEL,
                                 capacity=4, prefill_step_tokens=8))
    c = start_cluster({"w1": engine}, http_port=0)
    yield c
    c.close()


@pytest.fixture(scope="module")
def http(cluster):
    return openai.OpenAI(base_url=cluster.coordinator.http_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def ref(tiny_models):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(tiny_models.llama)).encode(PROMPT)
    assert len(ids) > 2 * 8, "the prompt must span several prefill chunks"
    return ids, reference(tiny_models.llama, ids, 3)


@pytest.mark.parametrize("mode", ["plain", "dflash"])
def test_echo_logprobs_equal_mlx_lm_forward(http, ref, mode):
    ids, expected = ref
    done = http.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=3,
                                   extra_body={"mode": mode})
    choice = done.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert done.usage.prompt_tokens == len(ids) and done.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    for got, top, (want, want_top) in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], expected):
        assert got == pytest.approx(want, abs=TOL)
        # the 3 most likely (tokens whose texts are equal share one key of the dict)
        assert max(top.values()) == pytest.approx(want_top[0][1], abs=TOL)
        assert all(any(abs(v - w) <= TOL for _, w in want_top) for v in top.values())


def test_echo_with_generation_streamed_and_not(http, ref):
    ids, expected = ref
    whole = http.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, echo=True, logprobs=1)
    choice = whole.choices[0]
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + whole.usage.completion_tokens
    assert "".join(lp.tokens) == choice.text
    # the first generated token: the forward's last position, its greedy choice
    first_value, first_top = expected[-1]
    assert first_value is None and lp.token_logprobs[len(ids)] == pytest.approx(first_top[0][1], abs=TOL)
    assert lp.token_logprobs[1: len(ids)] == pytest.approx([v for v, _ in expected[:-1]], abs=TOL)
    streamed = list(http.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, echo=True, logprobs=1,
                                            stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text
    assert streamed[0].choices[0].text == PROMPT  # the prompt's chunk comes first
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    values = [v for c in streamed if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert tokens == lp.tokens and values == lp.token_logprobs
    # Echo without logprobs: the text only; a repeated prompt is scored in full, not from the prompt cache.
    bare = http.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, echo=True)
    assert bare.choices[0].text == choice.text and bare.choices[0].logprobs is None
    again = http.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].logprobs.token_logprobs == lp.token_logprobs[: len(ids)]


def test_echo_refusals(http):
    for body, param in ((dict(prompt="x", max_tokens=0), "max_tokens"), (dict(prompt="x", echo="yes"), "echo")):
        with pytest.raises(openai.BadRequestError) as e:
            http.completions.create(model=MODEL, **body)
        assert e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError, match="echo is a /v1/completions field"):
        http.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], extra_body={"echo": True})


def test_sdk_prompt_logprobs(cluster, ref):
    from flashfleet import Client
    from flashfleet.errors import InvalidArgument

    ids, expected = ref
    with Client(cluster.coordinator.address) as sdk:
        done = sdk.complete(MODEL, prompt=PROMPT, max_tokens=0, prompt_logprobs=2)
        assert [x.token_id for x in done.prompt_logprobs] == ids and done.token_ids == []
        assert not done.prompt_logprobs[0].HasField("logprob")
        assert [x.logprob for x in done.prompt_logprobs[1:]] == pytest.approx([v for v, _ in expected[:-1]], abs=TOL)
        assert all([t.token_id for t in x.top] == [t for t, _ in want[:2]]
                   for x, (_, want) in zip(done.prompt_logprobs[1:], expected))
        with pytest.raises(InvalidArgument, match="max_tokens"):
            sdk.complete(MODEL, prompt=PROMPT, max_tokens=0)
        with pytest.raises(InvalidArgument, match="prompt_logprobs"):
            sdk.complete(MODEL, prompt=PROMPT, max_tokens=1, prompt_logprobs=21)


@pytest.mark.real_model
def test_smollm2_prompt_logprobs_equal_mlx_lm_forward():
    from worker.config import EngineConfig
    from worker.engine.scheduler import SCORED_PREFILL_TOKENS
    from worker.engine.thread import Engine
    from worker.engine.types import DoneEvent, GenerationRequest, TokenEvent

    model_dir = fetched("SmolLM2-135M-Instruct")
    text = json.loads((ROOT / "tests" / "data" / "enwiki_en.jsonl").read_text().splitlines()[0])["prompt"]
    with Engine(EngineConfig(model_path=model_dir, capacity=2)) as engine:  # scored chunks of 128 tokens
        ids = engine.encode_prompt(text, None)
        assert len(ids) > SCORED_PREFILL_TOKENS
        events: queue.Queue = queue.Queue()
        engine.submit(GenerationRequest("smol", tuple(ids), 0, prompt_logprobs=5), events.put)
        scored = []
        while not isinstance(ev := events.get(timeout=300), DoneEvent):
            assert isinstance(ev, TokenEvent), ev
            scored.extend(ev.prompt_logprobs)
    expected = reference(model_dir, ids, 5)
    assert [x.token_id for x in scored] == ids and scored[0].logprob is None
    assert [x.logprob for x in scored[1:]] == pytest.approx([v for v, _ in expected[:-1]], abs=TOL)
    for x, (_, top) in zip(scored[1:], expected):
        assert [v for _, v in x.top] == pytest.approx([v for _, v in top], abs=TOL)


@pytest.mark.parametrize("scoring", [True, False])
def test_an_ending_eos_is_listed_when_scoring(tiny_models, scoring):
    """With prompt_logprobs (echo), the listed tokens are the whole sequence: the EOS that ends a
    generation is listed last (not in the text or token ids), as lm-evaluation-harness drops the
    last listed token as the generated one; without, it is not listed."""
    from transformers import AutoTokenizer

    from worker.decoding.base import Step
    from worker.detokenize import TextAssembler
    from worker.engine.session import Session, new_stats
    from worker.engine.types import GenerationRequest, TokenLogprob

    tok = AutoTokenizer.from_pretrained(str(tiny_models.llama))
    eos, word = tok.eos_token_id, tok.encode("river")[0]
    req = GenerationRequest("r", (word,), 8, top_logprobs=1, prompt_logprobs=1 if scoring else -1)
    events = []
    session = Session(req, events.append, iter(()), [], TextAssembler(tok), frozenset({eos}), 0.0,
                      new_stats(req, "plain"))
    session.on_step(Step([word, eos], 0, 0, logprobs=(TokenLogprob(word, -1.5, ((word, -1.5),)),
                                                      TokenLogprob(eos, -0.5, ((eos, -0.5),)))), 1.0)
    assert session.done_reason == "stop"
    (event,) = events
    assert event.token_ids == (word,) and event.text == tok.decode([word])
    assert [(lp.token_id, lp.logprob) for lp in event.logprobs] == [(word, -1.5)] + [(eos, -0.5)] * scoring
