"""Property-based fuzzing (hypothesis) of the coordinator's public APIs on one live cluster: a
coordinator with API keys and the OpenAI-compatible HTTP API, and two workers serving the tiny
random-weight llama (one plain, one with a DFlash draft).

gRPC: GenerateRequest messages built from valid and invalid values of every field, corrupted
and random bytes sent as the request payload (a generic call with identity serializers), and
right, wrong and missing API keys. Every call ends in a completion or in a status from the
documented set with a message; never UNKNOWN / INTERNAL, never a hang (each call has a deadline).

HTTP: bodies shaped like OpenAI requests with bad values, wrong types, missing and extra fields,
bodies that are not JSON, odd content types, streamed and not, bad bearer tokens, unknown paths
and methods. Every answer is a 200 with a valid completion (an SSE stream ending in [DONE]) or a
documented error status with OpenAI's error object; never a 500, never a dropped connection.

Besides: client cancels and hang-ups mid-stream, concurrent bursts past the workers' slots, the
other Coordinator methods, and the workers' own Generate (the coordinator's calls, session
migration's resume fields included). Every `CHECK_EVERY` cases and at the end, the cluster still
gives a normal greedy request its reference tokens, and its workers hold no session and no
session KV bytes within a few seconds.

CI: examples are derandomized (the same inputs on every run; outcomes near a short deadline may
differ) and bounded; the file took 16 s on two CPU cores. For a longer hunt, raise max_examples
and set derandomize=False in FUZZ.
"""
from __future__ import annotations

import concurrent.futures
import gzip
import http.client
import json
import math
import urllib.parse
import zlib

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from flashfleet.requests import CHAT_ROLES
from flashfleet.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from harness import start_cluster, wait_until

MODEL = "tiny-llama"
KEY = "sk-fuzz-right-key"
GENERATE = "/flashfleet.v1.Coordinator/Generate"
WORKER_GENERATE = "/flashfleet.v1.Worker/Generate"
GENEROUS_S = 30.0  # a call with this deadline that still runs past it is a hang
SHORT_MAX_S = 0.3  # deadlines up to this long may run out: DEADLINE_EXCEEDED is then an answer
CHECK_EVERY = 40  # cases between two checks that the cluster still serves and holds no session
FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])

# gRPC statuses a request may end with on a healthy cluster (README's error table; the servicers'
# docstrings). UNAUTHENTICATED and DEADLINE_EXCEEDED are checked against the case's key and deadline.
GRPC_ANSWERS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAUTHENTICATED,
                grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE}
# HTTP statuses of refusals (coordinator/openai_format.py HTTP_ERRORS, coordinator/http_body.py's
# 413/415, aiohttp's own 404/405/413);
# 504 only for a request with a short timeout_s.
HTTP_ERRORS = {400, 401, 404, 405, 413, 415, 429}


@pytest.fixture(scope="module")
def cluster(tiny_models, dflash_dir):
    from worker.config import EngineConfig
    from worker.engine.thread import Engine

    llama = tiny_models.llama
    engines = {"plain": Engine(EngineConfig(model_path=llama, model_name=MODEL, capacity=4)),
               "dflash": Engine(EngineConfig(model_path=llama, model_name=MODEL, capacity=4,
                                             draft_path=dflash_dir))}
    running = start_cluster(engines, http_port=0, api_keys=(KEY,))
    yield running
    running.close()


@pytest.fixture(scope="module")
def channel(cluster):
    with grpc.insecure_channel(cluster.address) as ch:
        yield ch


class Checker:
    """Counts cases and, every CHECK_EVERY of them, checks that the cluster is healthy."""

    def __init__(self, cluster, channel, want: list[int]):
        self.cluster, self.channel, self.want, self.cases = cluster, channel, want, 0

    def tick(self) -> None:
        self.cases += 1
        if self.cases % CHECK_EVERY == 0:
            assert_healthy(self.cluster, self.channel, self.want)


@pytest.fixture(scope="module")
def checker(cluster, channel, reference):
    return Checker(cluster, channel, reference)


# ----- gRPC ------------------------------------------------------------------------------------


def generate(channel, payload: bytes, metadata, timeout: float, method: str = GENERATE,
             cancel_after: int | None = None):
    """(responses, RpcError or None) of one Generate call sent as raw bytes; with
    `cancel_after`, the client cancels the call once it has that many responses (then
    (responses, None))."""
    call = channel.unary_stream(method)(payload, metadata=metadata, timeout=timeout)  # bytes in, bytes out
    responses = []
    try:
        if cancel_after == 0:
            call.cancel()
            return responses, None
        for raw in call:
            responses.append(common_pb2.GenerateResponse.FromString(raw))
            if len(responses) == cancel_after:
                call.cancel()
                return responses, None
    except grpc.RpcError as e:
        if cancel_after is not None and e.code() == grpc.StatusCode.CANCELLED:
            return responses, None
        return responses, e
    return responses, None


def worker_loads(cluster) -> list[worker_pb2.WorkerLoad]:
    loads = []
    for w in cluster.workers:
        with grpc.insecure_channel(w.advertise_address) as ch:
            loads.append(worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest(), timeout=5))
    return loads


NORMAL = common_pb2.GenerateRequest(model=MODEL, prompt="The river flows", max_tokens=6, temperature=0.0)


def greedy_ids(channel, method: str = GENERATE, metadata=(("authorization", f"Bearer {KEY}"),)) -> list[int]:
    """The token ids of NORMAL (greedy) through `method`."""
    responses, error = generate(channel, NORMAL.SerializeToString(), metadata, GENEROUS_S, method=method)
    assert error is None, f"{error.code()}: {error.details()}"
    assert responses[-1].WhichOneof("kind") == "complete"
    return [t for r in responses[:-1] for t in r.chunk.token_ids]


@pytest.fixture(scope="module")
def reference(cluster) -> list[int]:
    """NORMAL's greedy token ids, from each worker before any fuzzing (the DFlash worker's greedy
    output equals the plain one's)."""
    answers = []
    for w in cluster.workers:
        with grpc.insecure_channel(w.advertise_address) as ch:
            answers.append(greedy_ids(ch, WORKER_GENERATE, ()))
    assert answers[0] and all(a == answers[0] for a in answers), answers
    return answers[0]


def assert_healthy(cluster, channel, want: list[int]) -> None:
    """A normal request gives the greedy tokens `want`, and within a few seconds every worker
    holds no session and no session KV bytes."""
    assert greedy_ids(channel) == want
    assert wait_until(lambda: all(load.active_sessions == 0 and load.kv_cache_bytes == 0
                                  for load in worker_loads(cluster)), timeout=5.0), worker_loads(cluster)


def surrogate_free(text: str) -> str:
    return text.encode("utf-8", "replace").decode("utf-8")


texts = st.one_of(
    st.text(max_size=40).map(surrogate_free),
    st.sampled_from(["", " ", "\n\t ", "\x00", "hello", "\ufffd" * 3, "\U0001f600 emoji"]),
    st.integers(1000, 6000).map(lambda n: "long " * n),
)
# Strings protobuf refuses to serialize (lone surrogates) are sent as field bytes that are not UTF-8.
not_utf8 = st.sampled_from([b"\xff\xfe", b"abc\xc3", b"\xed\xa0\x80", b"\xc0\xaf", b"ok\x80ok"])
floats_any = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                       st.sampled_from([0.0, 0.5, 1.0, -0.0, -1.0, 1e-45, 100.0, 100.5, 1e38]))
int32s = st.one_of(st.integers(1, 4), st.sampled_from([0, -1, -(2**31), 2**31 - 1, 512, 10_000]),
                   st.integers(-(2**31), 2**31 - 1))
messages = st.lists(st.builds(common_pb2.ChatMessage,
                              role=st.one_of(st.sampled_from(CHAT_ROLES + ("", "bogus", "developer", "USER"))),
                              content=texts), max_size=4)


GRPC_FIELDS = ("model", "input", "max_tokens", "temperature", "top_p", "seed", "stop", "session_id",
               "request_id", "mode", "resume_token_ids", "resume_text")
words = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
chat = st.lists(st.builds(common_pb2.ChatMessage, role=st.sampled_from(CHAT_ROLES),
                          content=st.sampled_from(["Name a river.", "Be brief.", "Hi"])), min_size=1, max_size=3)


@st.composite
def generate_requests(draw) -> tuple[common_pb2.GenerateRequest, bool]:
    """(a GenerateRequest, whether it is valid): a valid request (a served model, a prompt or
    chat turns, max_tokens 1-4, sane sampling, non-empty stops, a served mode) whose drawn
    subset of fields, often empty, is then set to arbitrary values, invalid ones included."""
    req = common_pb2.GenerateRequest(model=MODEL, max_tokens=draw(st.integers(1, 4)),
                                     session_id=draw(st.one_of(st.just(""), words)),
                                     request_id=draw(st.one_of(st.just(""), st.sampled_from(["fuzz-id-1", "fuzz-id-2"]))),
                                     mode=draw(st.sampled_from([0, 1, 3])))
    if draw(st.booleans()):
        req.prompt = draw(st.sampled_from(["Once upon a time", "The river flows", "def f(x):"]))
    else:
        req.messages.CopyFrom(common_pb2.ChatMessages(messages=draw(chat)))
    if draw(st.booleans()):
        req.temperature = draw(st.floats(0, 2, width=32))
    if draw(st.booleans()):
        req.top_p = draw(st.floats(0.125, 1, width=32))
    if draw(st.booleans()):
        req.seed = draw(st.integers(0, 2**64 - 1))
    req.stop.extend(draw(st.lists(words, max_size=2)))
    corrupt = draw(st.sets(st.sampled_from(GRPC_FIELDS), max_size=3))
    for name in sorted(corrupt):  # sets of str iterate in a per-process order
        if name == "model":
            req.model = draw(texts)
        elif name == "input":
            kind = draw(st.sampled_from(["prompt", "messages", "none"]))
            if kind == "prompt":
                req.prompt = draw(texts)
            elif kind == "messages":  # a few turns, or more than the tiny model's 512-token context
                req.messages.CopyFrom(common_pb2.ChatMessages(messages=draw(st.one_of(
                    messages, st.integers(500, 600).map(lambda n: [common_pb2.ChatMessage(role="user", content="x")] * n)))))
            else:
                req.ClearField("prompt")
                req.ClearField("messages")
        elif name == "max_tokens":
            if draw(st.booleans()):
                req.ClearField("max_tokens")  # the worker's default budget
            else:
                req.max_tokens = draw(int32s)
        elif name in ("temperature", "top_p"):
            setattr(req, name, draw(floats_any))
        elif name == "seed":
            req.seed = draw(st.integers(0, 2**64 - 1))
        elif name == "stop":
            req.stop[:] = draw(st.one_of(st.lists(texts, max_size=3),
                                         st.integers(60, 70).map(lambda n: [f"s{i}" for i in range(n)])))
        elif name == "session_id":
            req.session_id = draw(texts)
        elif name == "request_id":
            req.request_id = draw(texts)
        elif name == "mode":
            req.mode = draw(st.one_of(st.integers(0, 4), st.integers(-(2**31), 2**31 - 1)))
        elif name == "resume_token_ids":  # set by the coordinator only
            req.resume_token_ids.extend(draw(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=4)))
        else:
            req.resume_text = draw(st.text(min_size=1, max_size=20).map(surrogate_free))
    return req, not corrupt


@st.composite
def payloads(draw) -> tuple[bytes, bool]:
    """(request bytes, whether they are a plainly valid request): a serialized GenerateRequest,
    one with a string field that is not UTF-8, a truncated or corrupted one, or random bytes."""
    req, valid = draw(generate_requests())
    data = req.SerializeToString()
    how = draw(st.sampled_from(["proto", "proto", "proto", "not_utf8", "truncated", "flipped", "random"]))
    if how == "proto":
        return data, valid
    if how == "not_utf8":  # field 1 (model), 2 (prompt), 9 (session_id) or 10 (request_id)
        field, raw = draw(st.sampled_from([1, 2, 9, 10])), draw(not_utf8)
        return data + bytes([field << 3 | 2, len(raw)]) + raw, False
    if how == "truncated" and data:
        return data[: draw(st.integers(0, len(data) - 1))], False
    if how == "flipped" and data:
        i = draw(st.integers(0, len(data) - 1))
        return data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1:], False
    return draw(st.binary(max_size=300)), False


KEYS = st.sampled_from([
    ((("authorization", f"Bearer {KEY}"),), True),
    ((("authorization", f"bearer  {KEY} "),), True),
    ((), False),
    ((("authorization", "Bearer sk-wrong"),), False),
    ((("authorization", f"Basic {KEY}"),), False),
    ((("authorization", KEY),), False),
    ((("authorization", "Bearer "),), False),
    ((("authorization", f"Bearer {KEY}x"),), False),
])
KEYS_MOSTLY_RIGHT = st.one_of(st.just(((("authorization", f"Bearer {KEY}"),), True)), KEYS)
DEADLINES = st.one_of(st.just(GENEROUS_S), st.just(GENEROUS_S), st.floats(0.001, SHORT_MAX_S))


def check_grpc_outcome(responses, error, *, authorized: bool, timeout: float, valid: bool, request_id=None):
    """A completion, or a documented status with a message that fits the case."""
    if error is None:
        assert authorized, "a call without the right key was served"
        assert responses and responses[-1].WhichOneof("kind") == "complete", responses
        assert all(r.WhichOneof("kind") == "chunk" for r in responses[:-1])
        if request_id:
            assert {r.request_id for r in responses} == {request_id}
        return
    code, details = error.code(), error.details()
    assert code in GRPC_ANSWERS, f"{code}: {details}"
    assert details, f"{code} without a message"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        assert timeout <= SHORT_MAX_S, f"a call with a {timeout} s deadline hung: {details}"
    elif not authorized:
        assert code == grpc.StatusCode.UNAUTHENTICATED, f"{code}: {details}"
    reused = "already in flight" in details or "is already running" in details
    if valid and timeout > SHORT_MAX_S and authorized and not reused:
        # (a client that cancels and at once reuses the id may find the first call still in flight,
        # at the coordinator or at the worker whose engine has not ended it yet)
        pytest.fail(f"a valid request failed: {code}: {details}")


@FUZZ
@given(case=payloads(), key=KEYS_MOSTLY_RIGHT, timeout=DEADLINES,
       cancel_after=st.one_of(st.none(), st.none(), st.none(), st.integers(0, 2)))
def test_grpc_generate_answers_every_request_with_a_completion_or_a_documented_status(cluster, channel, checker,
                                                                                      case, key, timeout,
                                                                                      cancel_after):
    # cancel_after: the client cancels after that many responses (its sessions must not leak:
    # `checker` looks every CHECK_EVERY cases).
    payload, valid = case
    metadata, authorized = key
    responses, error = generate(channel, payload, metadata, timeout, cancel_after=cancel_after)
    event("cancelled by the client" if cancel_after is not None and error is None
          else "completed" if error is None else error.code().name)
    if cancel_after is None or error is not None:
        check_grpc_outcome(responses, error, authorized=authorized, timeout=timeout, valid=valid)
    checker.tick()


@settings(FUZZ, max_examples=20)
@given(cases=st.lists(st.tuples(payloads(), DEADLINES, st.one_of(st.none(), st.integers(0, 2))),
                      min_size=8, max_size=24))
def test_grpc_generate_concurrent_bursts_end_well_and_leave_no_session(cluster, channel, reference, cases):
    # More requests at once than the two workers' 8 slots: the admission queue, concurrent
    # duplicates of an id, cancels and deadlines mid-burst.
    meta = (("authorization", f"Bearer {KEY}"),)
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        futures = [pool.submit(generate, channel, payload, meta, timeout, GENERATE, cancel_after)
                   for (payload, _), timeout, cancel_after in cases]
        outcomes = [f.result(timeout=2 * GENEROUS_S) for f in futures]
    for ((_, valid), timeout, cancel_after), (responses, error) in zip(cases, outcomes):
        if cancel_after is not None and error is None:
            continue
        check_grpc_outcome(responses, error, authorized=True, timeout=timeout, valid=valid)
    assert_healthy(cluster, channel, reference)


OTHER_METHODS = ("/flashfleet.v1.Coordinator/ListModels", "/flashfleet.v1.Coordinator/GetClusterStatus")


@settings(FUZZ, max_examples=100)
@given(method=st.sampled_from(OTHER_METHODS + ("/flashfleet.v1.Coordinator/NoSuchMethod",)),
       payload=st.one_of(st.just(b""), st.binary(max_size=100)), key=KEYS_MOSTLY_RIGHT)
def test_grpc_other_methods_answer_random_payloads(channel, method, payload, key):
    metadata, authorized = key
    call = channel.unary_unary(method)  # bytes in, bytes out
    try:
        call(payload, metadata=metadata, timeout=GENEROUS_S)
    except grpc.RpcError as e:
        event(e.code().name)
        want = ({grpc.StatusCode.UNIMPLEMENTED} if method not in OTHER_METHODS
                else {grpc.StatusCode.INVALID_ARGUMENT} if authorized else {grpc.StatusCode.UNAUTHENTICATED})
        assert e.code() in want, f"{e.code()}: {e.details()}"
        assert e.details()
    else:
        event("answered")
        assert authorized and method in OTHER_METHODS


VOCAB = 512  # tests/tiny_models.py's BPE tokenizer


@st.composite
def worker_requests(draw) -> bytes:
    """A GenerateRequest as the coordinator sends a worker, resume fields (session migration)
    included: token ids in and out of the vocabulary, text that does and does not match them."""
    req, _ = draw(generate_requests())
    if draw(st.booleans()):
        req.max_tokens = draw(st.integers(1, 8))
        req.resume_token_ids[:] = draw(st.lists(st.one_of(st.integers(0, VOCAB - 1), st.integers(0, 2**32 - 1)),
                                                max_size=7))
        req.resume_text = draw(st.one_of(st.just(""), texts))
    data = req.SerializeToString()
    if draw(st.integers(0, 5)) == 0:
        i = draw(st.integers(0, max(0, len(data) - 1)))
        data = data[:i]
    return data


@FUZZ
@given(payload=worker_requests(), which=st.integers(0, 1), timeout=DEADLINES)
def test_worker_generate_answers_every_request_with_a_completion_or_a_documented_status(cluster, checker, payload,
                                                                                        which, timeout):
    # A worker's own API (the coordinator's calls): its resume fields reach the engine here.
    with grpc.insecure_channel(cluster.workers[which].advertise_address) as ch:
        responses, error = generate(ch, payload, (), timeout, method=WORKER_GENERATE)
    event("completed" if error is None else error.code().name)
    if error is None:
        assert responses and responses[-1].WhichOneof("kind") == "complete"
    else:
        assert error.code() in {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                                grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}, \
            f"{error.code()}: {error.details()}"
        assert error.details()
        if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            assert timeout <= SHORT_MAX_S, error.details()
    checker.tick()


def test_grpc_duplicate_request_id_in_flight_is_invalid_argument_and_the_first_completes(cluster, channel):
    meta = (("authorization", f"Bearer {KEY}"),)
    # 400 tokens: about 0.7 s on a CPU, the second call comes well before the first ends
    req = common_pb2.GenerateRequest(model=MODEL, prompt="A long road", max_tokens=400, request_id="dup-id",
                                     mode=common_pb2.DECODE_MODE_PLAIN)
    first = channel.unary_stream(GENERATE)(req.SerializeToString(), metadata=meta, timeout=GENEROUS_S)
    head = common_pb2.GenerateResponse.FromString(next(first))  # in flight from here
    assert head.request_id == "dup-id"
    again = common_pb2.GenerateRequest(model=MODEL, prompt="Other", max_tokens=2, request_id="dup-id")
    responses, error = generate(channel, again.SerializeToString(), meta, GENEROUS_S)
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "already in flight" in error.details()
    rest = [common_pb2.GenerateResponse.FromString(raw) for raw in first]
    assert rest[-1].WhichOneof("kind") == "complete"


# ----- HTTP ------------------------------------------------------------------------------------

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                         st.sampled_from([10**400, -(10**400), 2**63, 2**64]),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12).map(surrogate_free))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)
chat_turns = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(CHAT_ROLES + ("developer", "bogus", "")),
                           "content": st.one_of(texts, st.none(),
                                                st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                                "text": texts}), max_size=2),
                                                json_values)}),
    json_values), max_size=4)


def field(valid, junk_weight: int = 1):
    return st.one_of(valid, *([json_values] * junk_weight))


OPENAI_FIELDS = {
    "model": field(st.just(MODEL)),
    "messages": field(st.one_of(st.just([{"role": "user", "content": "Name a river."}]), chat_turns)),
    "prompt": field(st.one_of(st.just("The river flows"), texts, st.lists(texts, max_size=2))),
    "max_tokens": field(st.integers(1, 4)),
    "max_completion_tokens": field(st.integers(-3, 4)),
    "temperature": field(st.floats(0, 2)),
    "top_p": field(st.floats(0, 1)),
    "seed": field(st.integers(0, 2**64 - 1)),
    "stop": field(st.one_of(texts, st.lists(texts, max_size=3))),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "timeout_s": field(st.one_of(st.floats(0.001, SHORT_MAX_S), st.just(GENEROUS_S))),
    "mode": field(st.sampled_from(["auto", "plain", "dflash", "draft", "uag", "bogus"])),
    "session_id": field(texts),
    "n": field(st.sampled_from([1, 2])),
    "logprobs": field(st.booleans()),
    "presence_penalty": field(st.floats(-2, 2)),
    "tools": field(st.just([])),
    "user": json_values,
    "top_k": json_values,  # not OpenAI's: ignored as any unknown field
    "extra_field": json_values,
}
openai_bodies = st.fixed_dictionaries({}, optional=OPENAI_FIELDS)


@st.composite
def good_bodies(draw, chat: bool) -> tuple[dict, bool]:
    """(a request body, whether it is valid): a valid one (the model, one user turn or a prompt,
    a few tokens, streamed or not, sane sampling) with a drawn subset of fields, often empty,
    set to arbitrary values or removed."""
    body = {"model": MODEL, "max_tokens": draw(st.integers(1, 4)), "stream": draw(st.booleans()),
            **draw(st.fixed_dictionaries({}, optional={
                "seed": st.integers(0, 2**64 - 1), "temperature": st.floats(0, 2), "top_p": st.floats(0.125, 1),
                "stop": st.lists(words, max_size=2), "mode": st.sampled_from(["auto", "plain", "dflash"]),
                "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
                "session_id": words, "user": st.text(max_size=5)}))}
    if chat:
        body["messages"] = [{"role": "user", "content": "Name a river."}]
    else:
        body["prompt"] = "The river flows"
    corrupt = draw(st.sets(st.sampled_from(sorted(OPENAI_FIELDS)), max_size=3))
    for name in sorted(corrupt):  # sets of str iterate in a per-process order
        if name in body and draw(st.integers(0, 3)) == 0:
            del body[name]
        else:
            body[name] = draw(OPENAI_FIELDS[name])
    return body, not corrupt


CONTENT_TYPES = st.sampled_from(["application/json", "application/json", "application/json; charset=utf-8",
                                 "text/plain", "", "application/x-www-form-urlencoded",
                                 "multipart/form-data; boundary=x", "application/json; charset=latin-1",
                                 "application/json; charset=bogus-charset"])
AUTHS = st.sampled_from([f"Bearer {KEY}", f"Bearer {KEY}", f"Bearer {KEY}", None, "Bearer sk-wrong", KEY,
                         "Bearer", f"Basic {KEY}"])
AUTHS_MOSTLY_RIGHT = st.one_of(st.just(f"Bearer {KEY}"), AUTHS)
GEN_PATHS = ("/v1/chat/completions", "/v1/completions")
JSON = {"Content-Type": "application/json"}


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@st.composite
def http_requests(draw):
    """(method, path, body bytes, headers (Content-Type, Content-Encoding), authorization header
    or None, the body sent as JSON or None, whether the request is valid)."""
    auth = draw(AUTHS_MOSTLY_RIGHT)
    target = draw(st.sampled_from(["gen"] * 6 + ["models", "model", "other"]))
    if target == "models":
        return "GET", "/v1/models", b"", {}, auth, None, True
    if target == "model":
        name = draw(st.one_of(st.just(MODEL), st.text(min_size=1, max_size=20).map(surrogate_free)))
        return "GET", "/v1/models/" + urllib.parse.quote(name, safe=""), b"", {}, auth, None, name == MODEL
    if target == "other":
        method = draw(st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "POST", "OPTIONS", "HEAD"]))
        path = draw(st.sampled_from(["/", "/v1", "/v1/", "/v1/embeddings", "/v1/chat/completions",
                                     "/v1/models", "/v1/completions/x", "/v2/completions", "/%ff%fe"]))
        if method == "POST" and path in ("/v1/chat/completions", "/v1/models"):
            method = "GET"  # a wrong method on a known path
        return method, path, b"{}", {"Content-Type": "application/json"}, auth, None, False
    path = draw(st.sampled_from(GEN_PATHS))
    shape = draw(st.sampled_from(["good"] * 4 + ["openai", "json", "bytes", "nested"]))
    body, valid, content_type = None, False, "application/json"
    if shape == "good":
        body, valid = draw(good_bodies(path == GEN_PATHS[0]))
        if draw(st.integers(0, 3)) == 0:
            content_type = draw(CONTENT_TYPES)
            valid = False
    else:
        content_type = draw(CONTENT_TYPES)
        if shape == "openai":
            body = draw(openai_bodies)
        elif shape == "json":
            body = draw(json_values)
    if body is not None:
        data = json.dumps(body).encode()
    elif shape == "bytes":
        data = draw(st.one_of(st.binary(max_size=200), st.sampled_from([b"", b"{", b'{"model": }', b"\xff\xfe{}",
                                                                        b'{"model": "\xff"}', b"null"])))
    else:
        data = nested(draw(st.sampled_from([100, 5000, 100_000])))
    headers = {"Content-Type": content_type} if content_type else {}
    encoding = draw(st.sampled_from([None] * 6 + ["gzip", "gzip", "deflate", "deflate", "identity", "br", "bogus"]))
    if encoding is not None:
        headers["Content-Encoding"] = encoding
        if encoding in ("gzip", "deflate") and draw(st.booleans()):
            data = gzip.compress(data) if encoding == "gzip" else zlib.compress(data)
        elif encoding != "identity":
            valid = False  # a body that does not decode as it says, or an encoding not served
    return "POST", path, data, headers, auth, body, valid


def http_call(cluster, method: str, path: str, data: bytes, headers: dict, auth: str | None,
              hang_up_after: int | None = None):
    """(status, headers, body bytes) of one request on a fresh connection; a dropped connection
    or a stream that does not end raises. With `hang_up_after`, the client closes the connection
    after reading that many bytes of the body (then the body is those bytes)."""
    port = urllib.parse.urlsplit(cluster.coordinator.http_url).port
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=GENEROUS_S)
    headers = dict(headers)
    if auth is not None:
        headers["Authorization"] = auth
    try:
        conn.request(method, path, body=data if method not in ("GET", "HEAD") or data else None, headers=headers)
        resp = conn.getresponse()
        if hang_up_after is not None:
            return resp.status, resp.headers, resp.read(hang_up_after)
        return resp.status, resp.headers, resp.read()
    finally:
        conn.close()


def short_timeout(body) -> bool:
    t = body.get("timeout_s") if isinstance(body, dict) else None
    return isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and 0 < t <= SHORT_MAX_S


def assert_openai_error(status: int, raw: bytes) -> dict:
    body = json.loads(raw)
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    assert isinstance(err["message"], str) and err["message"], body
    assert isinstance(err["type"], str) and err["type"], body
    assert err["param"] is None or isinstance(err["param"], str), body
    assert err["code"] is None or isinstance(err["code"], str), body
    return err


def assert_completion(obj: dict, chat: bool) -> None:
    choice = obj["choices"][0]
    assert obj["object"] == ("chat.completion" if chat else "text_completion")
    text = choice["message"]["content"] if chat else choice["text"]
    assert isinstance(text, str)
    assert choice["finish_reason"] in ("stop", "length")
    usage = obj["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 1 <= usage["completion_tokens"]


def assert_sse(raw: bytes, chat: bool, may_time_out: bool) -> None:
    events = [line[len(b"data: "):] for line in raw.split(b"\n\n") if line.startswith(b"data: ")]
    assert events, raw[:500]
    if events[-1] != b"[DONE]":  # a failure after the first chunk: one error event ends the stream
        err = assert_openai_error(200, events[-1])
        assert may_time_out and err["code"] == "deadline_exceeded", err
        return
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks and all(c["object"] == ("chat.completion.chunk" if chat else "text_completion")
                          for c in chunks)
    assert any(c["choices"] and c["choices"][0]["finish_reason"] in ("stop", "length") for c in chunks)


def check_http_outcome(method, path, status, headers, raw, auth, body, valid):
    """A 200 with a valid answer, or a documented error status with OpenAI's error object."""
    authorized = auth in (f"Bearer {KEY}",)
    if valid and authorized:
        assert status == 200, (method, path, status, raw[:2000])
    if method == "HEAD":  # no body to read
        assert status == 200 or status in HTTP_ERRORS, status
        return
    if status == 200:
        assert authorized, f"served without the right key: {method} {path}"
        if path == "/v1/models":
            assert [m["id"] for m in json.loads(raw)["data"]] == [MODEL]
        elif path.startswith("/v1/models/"):
            assert json.loads(raw)["id"] == MODEL
        else:
            assert path in GEN_PATHS and method == "POST"
            chat = path == GEN_PATHS[0]
            if headers.get("Content-Type", "").startswith("text/event-stream"):
                assert_sse(raw, chat, short_timeout(body))
            else:
                assert_completion(json.loads(raw), chat)
        return
    allowed = HTTP_ERRORS | ({504} if short_timeout(body) else set())
    assert status in allowed, (status, raw[:2000])
    assert_openai_error(status, raw)
    if not authorized:
        assert status in (401, 404, 405), (status, raw[:500])


@FUZZ
@given(case=http_requests(), hang_up_after=st.one_of(st.none(), st.none(), st.none(), st.integers(0, 300)))
def test_http_api_answers_every_request_with_a_completion_or_an_openai_error(cluster, checker, case, hang_up_after):
    # hang_up_after: the client closes the connection after that many bytes of the answer (its
    # sessions must not leak: `checker` looks every CHECK_EVERY cases).
    method, path, data, request_headers, auth, body, valid = case
    status, headers, raw = http_call(cluster, method, path, data, request_headers, auth, hang_up_after)
    event(f"{status} {headers.get('Content-Type', '').split(';')[0]}"
          + (" (client hung up)" if hang_up_after is not None else ""))
    if hang_up_after is None:
        check_http_outcome(method, path, status, headers, raw, auth, body, valid)
    else:
        assert status == 200 or status in HTTP_ERRORS | {504}, status
    checker.tick()


def test_http_body_over_the_size_limit_is_413_in_openai_shape(cluster):
    body = json.dumps({"model": MODEL, "prompt": "x" * (9 * 1024 * 1024), "max_tokens": 2}).encode()
    status, _, raw = http_call(cluster, "POST", "/v1/completions", body, JSON, f"Bearer {KEY}")
    assert status == 413
    error = assert_openai_error(status, raw)
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
    assert "larger than 8,388,608 bytes (8 MiB)" in error["message"]  # the limit, not only a reason phrase


def test_http_prompt_over_the_request_limit_is_400(cluster):
    body = json.dumps({"model": MODEL, "prompt": "x" * (5 * 1024 * 1024), "max_tokens": 2}).encode()
    status, _, raw = http_call(cluster, "POST", "/v1/completions", body, JSON, f"Bearer {KEY}")
    assert status == 400
    assert "4 MiB" in assert_openai_error(status, raw)["message"]


def test_grpc_request_over_the_message_limit_is_resource_exhausted(cluster, channel):
    req = common_pb2.GenerateRequest(model=MODEL, prompt="x" * (5 * 1024 * 1024), max_tokens=2)
    _, error = generate(channel, req.SerializeToString(), (("authorization", f"Bearer {KEY}"),), GENEROUS_S)
    assert error is not None and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and error.details()


def test_cluster_still_serves_and_holds_no_session_after_the_fuzzing(cluster, channel, reference):
    assert_healthy(cluster, channel, reference)
    status, headers, raw = http_call(cluster, "POST", GEN_PATHS[0],
                                     json.dumps({"model": MODEL, "max_tokens": 3, "messages": [
                                         {"role": "user", "content": "Name a river."}]}).encode(),
                                     JSON, f"Bearer {KEY}")
    assert status == 200
    assert_completion(json.loads(raw), chat=True)
