"""The requests of `bench/soak.py`: what each kind asks for, and one request through gRPC (the SDK's
AsyncClient) or HTTP (aiohttp against the OpenAI-compatible API), classified by how it ended.

Kinds:
  short      a short prompt, 16-32 output tokens.
  long       a long prompt (about --long-prompt-tokens) with a few output tokens, or a short prompt
             with --long-output-tokens output tokens (half each).
  cancelled  --long-output-tokens streamed; the client gives up after a random delay (0-2 s):
             gRPC cancels the call, HTTP closes the connection.
  bad        an invalid parameter (temperature -1, top_p 1.5, max_tokens 0, an unknown model):
             expected to end in a typed error.
  deadline   --long-output-tokens with a deadline of 0.3-3 s (`timeout_s`): ends in a completion
             or a deadline error.
  fill       (the warm-up's, counted as long) a long prompt with --long-output-tokens: the largest
             request of the mix, so a warm-up of these takes every worker to the memory its
             capacity allows.

Outcomes:
  completion   the stream ended with a finish reason (HTTP: `data: [DONE]`, or a 200 JSON answer).
  cancelled    the client left as planned (a `cancelled` request whose answer came first counts as
               a completion).
  typed_error  a gRPC status (`flashfleet.errors.FlashfleetError`, `error` = "grpc:CODE") or an
               HTTP error in OpenAI's JSON shape (`error` = "http:STATUS:code", or
               "http:sse:code" for an error event after the stream began).
  lost         anything else: another exception, a stream that ended without its end, or no end
               within the request's deadline + grace (`error` says which).
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

KINDS = ("short", "long", "cancelled", "bad", "deadline")
OUTCOMES = ("completion", "cancelled", "typed_error", "lost")
BAD_PARAMS = ("temperature", "top_p", "max_tokens", "model")


@dataclass
class Spec:
    """One request to send.

    Attributes:
        kind: one of KINDS.
        prompt: the user text (sent raw, or as one user turn with `chat`).
        max_tokens: output budget, tokens.
        timeout_s: the deadline sent with the request, seconds.
        cancel_after_s: the client gives up after this many seconds (None: it waits for the end).
        bad: the parameter made invalid (one of BAD_PARAMS), or None.
        temperature: 0 = greedy.
        chat: messages (chat template) rather than a raw prompt.
        stream: HTTP only: server-sent events rather than one JSON answer (gRPC always streams).
    """

    kind: str
    prompt: str
    max_tokens: int
    timeout_s: float
    cancel_after_s: float | None = None
    bad: str | None = None
    temperature: float = 0.0
    chat: bool = False
    stream: bool = True


@dataclass
class Record:
    """How one request ended.

    Attributes:
        kind, api: the request's kind and "grpc", "http-chat" or "http-completions".
        stream: whether it streamed.
        outcome: one of OUTCOMES; error: its kind ("" for a completion or a cancel).
        start_s: when it was sent, seconds after the soak's start.
        ttft_s: seconds to the first token (streams) or to the answer (HTTP without a stream);
            None when none came.
        total_s: seconds to its end.
        tokens: generated tokens the client received (gRPC: counted; HTTP: the answer's usage, 0
            for a stream left before its last chunk).
    """

    kind: str
    api: str
    stream: bool
    outcome: str
    error: str
    start_s: float
    ttft_s: float | None
    total_s: float
    tokens: int


@dataclass(frozen=True)
class Budgets:
    """Sizes and times of the request kinds (see the module docstring), tokens and seconds."""

    long_output_tokens: int = 256
    request_timeout_s: float = 300.0
    grace_s: float = 30.0


def make_spec(kind: str, rng: random.Random, short_prompts: list[str], long_prompts: list[str],
              budgets: Budgets) -> Spec:
    """A random request of `kind` (module docstring).

    Raises:
        ValueError: an unknown kind.
    """
    prompt, timeout = rng.choice(short_prompts), budgets.request_timeout_s
    common = dict(temperature=rng.choice((0.0, 0.0, 0.7)), chat=rng.random() < 0.5, stream=rng.random() < 0.7)
    if kind == "short":
        return Spec(kind, prompt, rng.randint(16, 32), timeout, **common)
    if kind == "long":
        if rng.random() < 0.5:
            return Spec(kind, rng.choice(long_prompts), rng.randint(16, 32), timeout, **common)
        return Spec(kind, prompt, budgets.long_output_tokens, timeout, **common)
    if kind == "cancelled":
        return Spec(kind, prompt, budgets.long_output_tokens, timeout, cancel_after_s=rng.uniform(0.0, 2.0),
                    **{**common, "stream": True})
    if kind == "bad":
        return Spec(kind, prompt, 16, timeout, bad=rng.choice(BAD_PARAMS), **common)
    if kind == "fill":
        return Spec("long", rng.choice(long_prompts), budgets.long_output_tokens, timeout, **common)
    if kind == "deadline":
        return Spec(kind, prompt, budgets.long_output_tokens, rng.uniform(0.3, 3.0), **common)
    raise ValueError(f"unknown request kind {kind!r}; kinds: {', '.join(KINDS)}")


def _params(spec: Spec, model: str) -> dict:
    """model, max_tokens, temperature, top_p of the request, with `spec.bad` made invalid."""
    p = {"model": model, "max_tokens": spec.max_tokens, "temperature": spec.temperature, "top_p": 1.0}
    if spec.bad == "model":
        p["model"] = model + "-no-such-model"
    elif spec.bad == "temperature":
        p["temperature"] = -1.0
    elif spec.bad == "top_p":
        p["top_p"] = 1.5
    elif spec.bad == "max_tokens":
        p["max_tokens"] = 0
    return p


class _Clock:
    """Times of one request: ttft and total seconds since it was sent."""

    def __init__(self):
        self.t0, self.ttft = time.perf_counter(), None

    def first(self) -> None:
        if self.ttft is None:
            self.ttft = time.perf_counter() - self.t0

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


async def _bounded(spec: Spec, budgets: Budgets, clock: _Clock, run, record):
    """Runs `run()` (returning (outcome, error, tokens)) within the client's patience: the cancel
    delay of a `cancelled` request, else its deadline + grace. Returns `record(outcome, error)`."""
    limit = spec.cancel_after_s if spec.cancel_after_s is not None else spec.timeout_s + budgets.grace_s
    try:
        async with asyncio.timeout(limit):
            outcome, error = await run()
    except TimeoutError:
        if spec.cancel_after_s is not None:
            outcome, error = "cancelled", ""
        else:
            outcome, error = "lost", f"lost:no end within {limit:.0f} s"
    except Exception as e:  # neither an end nor a typed error
        outcome, error = "lost", f"lost:{type(e).__name__}"
    return record(outcome, error)


async def grpc_request(client, model: str, spec: Spec, budgets: Budgets, start_s: float) -> Record:
    """Sends `spec` through `client` (flashfleet.client.AsyncClient) and classifies its end."""
    from flashfleet.errors import FlashfleetError

    clock, tokens = _Clock(), [0]

    async def run():
        p = _params(spec, model)
        text = {"messages": [{"role": "user", "content": spec.prompt}]} if spec.chat else {"prompt": spec.prompt}
        last = None
        try:
            async for chunk in client.generate(p.pop("model"), **text, **p, timeout_s=spec.timeout_s):
                if chunk.token_ids:
                    clock.first()
                    tokens[0] += len(chunk.token_ids)
                last = chunk
        except FlashfleetError as e:
            return "typed_error", f"grpc:{e.code.name}"
        if last is None or not last.finish_reason:
            return "lost", "lost:stream ended without a finish reason"
        return "completion", ""

    return await _bounded(spec, budgets, clock, run, lambda outcome, error: Record(
        spec.kind, "grpc", True, outcome, error, start_s, clock.ttft, clock.elapsed, tokens[0]))


def _error_kind(body, status: int) -> str | None:
    """"http:STATUS:code" for an OpenAI-shaped error body, else None."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict) or "type" not in err:
        return None
    return f"http:{status}:{err.get('code') or err['type']}"


async def http_request(session, base_url: str, model: str, spec: Spec, budgets: Budgets,
                       start_s: float) -> Record:
    """Sends `spec` to the OpenAI-compatible API at `base_url` ("http://host:port") with `session`
    (an aiohttp.ClientSession) and classifies its end."""
    clock, tokens = _Clock(), [0]
    api = "http-chat" if spec.chat else "http-completions"

    async def run():
        body = {**_params(spec, model), "stream": spec.stream, "timeout_s": spec.timeout_s}
        if spec.chat:
            body["messages"] = [{"role": "user", "content": spec.prompt}]
        else:
            body["prompt"] = spec.prompt
        if spec.stream:
            body["stream_options"] = {"include_usage": True}
        path = "/v1/chat/completions" if spec.chat else "/v1/completions"
        async with session.post(base_url + path, json=body) as resp:
            if resp.status != 200:
                try:
                    kind = _error_kind(await resp.json(content_type=None), resp.status)
                except ValueError:
                    kind = None
                return ("typed_error", kind) if kind else ("lost", f"lost:HTTP {resp.status} without an error body")
            if not spec.stream:
                answer = await resp.json()
                clock.first()
                tokens[0] = int(answer.get("usage", {}).get("completion_tokens", 0))
                return "completion", ""
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    return "completion", ""
                event = json.loads(payload)
                kind = _error_kind(event, 0)
                if kind:
                    return "typed_error", "http:sse:" + kind.split(":", 2)[2]
                for choice in event.get("choices") or ():
                    if choice.get("text") or (choice.get("delta") or {}).get("content"):
                        clock.first()
                if event.get("usage"):
                    tokens[0] = int(event["usage"].get("completion_tokens", 0))
            return "lost", "lost:stream ended without [DONE]"

    return await _bounded(spec, budgets, clock, run, lambda outcome, error: Record(
        spec.kind, api, spec.stream, outcome, error, start_s, clock.ttft, clock.elapsed, tokens[0]))
