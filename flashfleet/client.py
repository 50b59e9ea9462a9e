"""Client SDK: `Client` (blocking) and `AsyncClient` (asyncio) for the coordinator's public API.

Both speak flashfleet.v1.Coordinator, put an explicit deadline on every call, stream typed
dataclasses (flashfleet.types; list_models and cluster_status return the response protos, whose
fields are documented in protos/flashfleet/v1/coordinator.proto) and raise typed exceptions (flashfleet.errors) that keep the gRPC
status code and the server's message. A `generate` generator that is closed early (a `for` loop
left while it held the only reference, or `.close()` / `await .aclose()`) cancels the RPC, which
frees the worker.

Several coordinators: the address may name several ("host:port,host:port", a list, or a DNS name
with several records: gRPC connects to the first that answers, and to the next when it goes).
A call that finds a coordinator UNAVAILABLE goes to the next one. A `generate` stream that breaks
with UNAVAILABLE after tokens arrived (its coordinator died, or restarts at the same address) is
resumed: the same request,
under the same request id, with every token id and the text received so far
(`resume_token_ids`, `resume_text`), goes to the next coordinator (for up to `RESUME_WINDOW_S`),
which re-attaches to the worker still decoding it or resumes it elsewhere; the stream goes on
after those tokens, none lost or repeated.
"""
from __future__ import annotations

import asyncio
import inspect
import numbers
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Iterable, Iterator, Mapping, Sequence

import grpc

from flashfleet.auth import api_key_metadata, client_api_key, key_digest, with_metadata
from flashfleet.errors import InvalidArgument, from_rpc_error
from flashfleet.requests import COORDINATOR_VERDICT_HEADER, MAX_CHOICES, MAX_TIMEOUT_S, build_request, choice_id, \
    choice_seed
from flashfleet.transport import CHANNEL_OPTIONS
from flashfleet.types import FINISH_REASONS, Chunk, Completion, GenerationStats
from flashfleet.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

DEFAULT_GENERATE_TIMEOUT_S = 600.0
DEFAULT_CONTROL_TIMEOUT_S = 10.0
# A broken stream is resumed for up to this long (seconds from the break; within the call's
# deadline): a coordinator restarted at the same address takes seconds to come back, and a worker
# keeps a session that lost its coordinator for 30 s unless configured otherwise
# (docs/migration.md).
RESUME_WINDOW_S = 30.0
# Waits between resume attempts, seconds: the first is at once (another coordinator is up), then
# a quarter of a second apart (every coordinator may be restarting: one restarted at the same
# address is found within that of its listening; a try of a closed port costs a reset); the last
# value repeats.
RESUME_BACKOFF_S = (0.0, 0.05, 0.1, 0.25)


def _targets(address) -> list[str]:
    """The coordinator targets in `address`: "host:port", several joined by commas, or a list
    or tuple of such strings.

    Raises:
        TypeError: address is not a str (or a list or tuple of them), e.g. a bare port number.
        ValueError: it names no target.
    """
    items = address if isinstance(address, (list, tuple)) else [address]
    if not items or not all(isinstance(a, str) for a in items):
        raise TypeError(f"address must be a 'host:port' string, e.g. '127.0.0.1:50051' (several: a list, or "
                        f"joined by commas), got {type(address).__name__} {address!r}")
    targets = [t.strip() for a in items for t in a.split(",") if t.strip()]
    if not targets:
        raise ValueError(f"address names no coordinator: {address!r}")
    return targets


def _resumable(e: grpc.RpcError) -> bool:
    """A failure a call is tried again after: UNAVAILABLE from the transport (the coordinator or
    its connection is gone), not a coordinator's own verdict (`COORDINATOR_VERDICT_HEADER`: e.g.
    a worker failed and no other could resume the session)."""
    if e.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    trailing = e.trailing_metadata() if callable(getattr(e, "trailing_metadata", None)) else None
    return not any(k == COORDINATOR_VERDICT_HEADER for k, _ in trailing or ())


class _Resume:
    """What one `generate` stream received, and whether and when it is tried again.

    Args:
        request: the request (its request_id set).
        targets: how many coordinator targets the client has.
        deadline_s: the stream's deadline, as time.monotonic() seconds.
    """

    def __init__(self, request: common_pb2.GenerateRequest, targets: int, deadline_s: float):
        self.request, self.targets, self.deadline_s = request, targets, deadline_s
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.broke_s: float | None = None  # when the current break began
        self.attempts = 0  # tries since it

    def add(self, chunk: Chunk) -> None:
        """Records a chunk the caller got (the stream flows again: a later break starts afresh)."""
        self.token_ids.extend(chunk.token_ids)
        self.text.append(chunk.text)
        self.broke_s, self.attempts = None, 0

    def next_request(self) -> common_pb2.GenerateRequest:
        """The request to send now: the original, resumed after what arrived."""
        if not self.token_ids:
            return self.request
        resumed = common_pb2.GenerateRequest()
        resumed.CopyFrom(self.request)
        resumed.resume_token_ids.extend(self.token_ids)
        resumed.resume_text = "".join(self.text)
        return resumed

    def timeout_s(self) -> float:
        """Seconds left of the stream's deadline (at least a millisecond: gRPC then ends it)."""
        return max(self.deadline_s - time.monotonic(), 1e-3)

    def wait_s(self, e: grpc.RpcError) -> float | None:
        """Seconds to wait before trying again after `e`, or None to give up and raise it: only
        UNAVAILABLE is tried again; before any token, each other target once; after tokens,
        until `RESUME_WINDOW_S` after the break or the deadline."""
        if not _resumable(e):
            return None
        now = time.monotonic()
        if self.broke_s is None:
            self.broke_s = now
        self.attempts += 1
        if not self.token_ids:
            return 0.0 if self.attempts < self.targets else None
        wait = RESUME_BACKOFF_S[min(self.attempts - 1, len(RESUME_BACKOFF_S) - 1)]
        if now + wait - self.broke_s > RESUME_WINDOW_S or now + wait >= self.deadline_s:
            return None
        return wait


def _deadline(timeout_s: float | None, default_s: float) -> float:
    """The call's deadline in seconds: timeout_s, or the client's default when None.

    Raises:
        InvalidArgument: timeout_s is not a number of seconds in (0, MAX_TIMEOUT_S] (nan, 0,
            negative, inf, or so large that gRPC would end the call at once).
    """
    if timeout_s is None:
        return default_s
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real):
        raise InvalidArgument(f"timeout_s must be a number of seconds, got {timeout_s!r}")
    if not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise InvalidArgument(f"timeout_s must be > 0 and at most {MAX_TIMEOUT_S:.0e} seconds, "
                              f"got {timeout_s}")
    return float(timeout_s)


def _to_chunk(resp: common_pb2.GenerateResponse) -> Chunk:
    if resp.WhichOneof("kind") == "complete":
        c = resp.complete
        return Chunk(request_id=resp.request_id,
                     finish_reason=FINISH_REASONS.get(c.finish_reason, "unspecified"),
                     stats=GenerationStats.from_proto(c.stats), worker_id=c.worker_id,
                     served_by=tuple(c.served_by))
    return Chunk(request_id=resp.request_id, text=resp.chunk.text,
                 token_ids=tuple(resp.chunk.token_ids), logprobs=tuple(resp.chunk.logprobs),
                 prompt_logprobs=tuple(resp.chunk.prompt_logprobs))


def accumulate(chunks: Iterable[Chunk]) -> Completion:
    """One `Completion` of a stream's chunks (what `Client.complete` returns): their texts, token
    ids and log-probabilities joined, the prompt's log-probabilities once (a stream resumed on
    another worker repeats them), and the last chunk's finish reason, stats and workers. An empty
    stream gives an empty Completion."""
    text, ids, logprobs, prompt_logprobs, last = [], [], [], [], None
    for chunk in chunks:
        text.append(chunk.text)
        ids.extend(chunk.token_ids)
        logprobs.extend(chunk.logprobs)
        if chunk.prompt_logprobs and not prompt_logprobs:  # a stream restarted elsewhere repeats them
            prompt_logprobs = list(chunk.prompt_logprobs)
        last = chunk
    return Completion(request_id=last.request_id if last else "", text="".join(text),
                      token_ids=ids, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                      finish_reason=last.finish_reason or "" if last else "",
                      stats=last.stats if last else None, worker_id=last.worker_id if last else "",
                      served_by=last.served_by if last else ())


def _choice_kwargs(n: Any, kwargs: Mapping) -> list[dict]:
    """generate()'s keyword arguments of each of n choices of one request (OpenAI's `n`, as the
    coordinator's HTTP API derives them: `flashfleet.requests.choice_requests`): request ids
    "<id>-<i>", seeds `choice_seed(seed, i)`, one session_id (the request's, or its id).

    Raises:
        InvalidArgument: n is not an integer in [1, MAX_CHOICES].
    """
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise InvalidArgument(f"n must be an integer in [1, {MAX_CHOICES}], got {n!r}")
    if n == 1:
        return [dict(kwargs)]
    rid = kwargs.get("request_id") or uuid.uuid4().hex
    seed = kwargs.get("seed")
    derive = isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed
    return [{**kwargs, "request_id": choice_id(rid, i), "session_id": kwargs.get("session_id") or rid,
             "seed": choice_seed(seed, i) if derive else seed} for i in range(n)]


def _check_keywords(method: str, kwargs: Mapping) -> None:
    """TypeError naming `method` (not the generate() it forwards to) for an unknown keyword."""
    unknown = sorted(set(kwargs) - _GENERATE_KEYWORDS)
    if unknown:
        raise TypeError(f"{method}() got unexpected keyword argument(s) {', '.join(unknown)}; "
                        f"it takes generate()'s: {', '.join(sorted(_GENERATE_KEYWORDS))}")


class Client:
    """Blocking client.

    Args:
        address: coordinator "host:port"; several: a list, or joined by commas (module
            docstring: calls go to the next one when one is unavailable, and streams resume).
        timeout_s: default deadline of a generate call, seconds.
        credentials: grpc.ssl_channel_credentials(...) for a cluster that serves TLS
            (flashfleet.config.TLSConfig.channel_credentials()), or None for plaintext.
        api_key: sent on every call as metadata `authorization: Bearer <key>` (a coordinator
            with API keys refuses calls without one with Unauthenticated); None: env
            FLASHFLEET_API_KEY, else no key.

    Use as a context manager, or call close() (a later call opens a new channel).

    Raises:
        TypeError: address is not a str (or a list of them).
        ValueError: address names no coordinator.
        InvalidArgument: timeout_s is not a number of seconds in (0, 1e8].
    """

    def __init__(self, address: str | Sequence[str], timeout_s: float = DEFAULT_GENERATE_TIMEOUT_S,
                 credentials: grpc.ChannelCredentials | None = None, api_key: str | None = None):
        self._targets = _targets(address)
        self._credentials = credentials
        self._metadata = api_key_metadata(client_api_key(api_key))
        self._secure = credentials is not None
        self._channels: dict[int, grpc.Channel] = {}  # target index -> its channel, opened on first use
        self._stubs: dict[int, coordinator_pb2_grpc.CoordinatorStub] = {}
        self._current = 0  # the target calls go to; the next one after it fails UNAVAILABLE
        self.timeout_s = _deadline(timeout_s, DEFAULT_GENERATE_TIMEOUT_S)

    @property
    def _stub(self) -> coordinator_pb2_grpc.CoordinatorStub:
        i = self._current
        if i not in self._stubs:  # first use, or closed: a call after close() opens a new channel
            target = self._targets[i]
            self._channels[i] = (grpc.secure_channel(target, self._credentials, options=CHANNEL_OPTIONS)
                                 if self._credentials else grpc.insecure_channel(target, options=CHANNEL_OPTIONS))
            self._stubs[i] = with_metadata(coordinator_pb2_grpc.CoordinatorStub(self._channels[i]), self._metadata)
        return self._stubs[i]

    def _next_target(self) -> None:
        self._current = (self._current + 1) % len(self._targets)

    def _unary(self, call):
        """`call(stub)` on the current target, then on each other one while they are UNAVAILABLE."""
        for attempt in range(len(self._targets)):
            try:
                return call(self._stub)
            except grpc.RpcError as e:
                if not _resumable(e) or attempt == len(self._targets) - 1:
                    raise from_rpc_error(e, self._secure) from None
                self._next_target()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Closes the channels; calls still running on them are cancelled. The client can be used
        again afterwards (a new channel is made on the next call)."""
        channels, self._channels, self._stubs = self._channels, {}, {}
        for channel in channels.values():
            channel.close()

    def generate(self, model: str, prompt: str | None = None, *,
                 messages: Iterable[Mapping[str, str]] | None = None, max_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None,
                 seed: int | None = None, stop: str | Iterable[str] = (), session_id: str = "",
                 request_id: str = "", mode: str = "auto",
                 response_format: Mapping[str, Any] | None = None, json_schema: Mapping[str, Any] | None = None,
                 top_logprobs: int | None = None, prompt_logprobs: int | None = None,
                 presence_penalty: float | None = None, frequency_penalty: float | None = None,
                 repetition_penalty: float | None = None, logit_bias: Mapping[int, float] | None = None,
                 timeout_s: float | None = None) -> Iterator[Chunk]:
        """Streams a generation.

        Args:
            model: model name (see list_models()).
            prompt: raw prompt text; or messages: chat turns [{"role", "content"}], rendered with
                the model's chat template. Exactly one of the two.
            max_tokens: most tokens to generate (> 0; 0 with prompt_logprobs scores the prompt
                only); None (default) = 256, capped by the context the prompt leaves
                (`flashfleet.requests.WORKER_DEFAULT_MAX_TOKENS`).
            temperature: 0 or None = greedy; top_p in (0, 1]; seed makes sampling reproducible.
            stop: output ends before the first of these strings (one string, or several).
            session_id: requests of one session go to the same worker.
            request_id: the request's id (default: a new random one); a resumed stream keeps it.
            mode: "auto", "plain", "draft", "dflash" or "uag".
            json_schema: a JSON Schema (dict): the output is JSON valid against it (decoded under
                a grammar in modes plain and dflash); or response_format, OpenAI's object
                ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"schema": ...}}).
            top_logprobs: 0..20: each chunk's `logprobs` (one per token: its log-probability under
                the model and this many most likely alternatives); None: none.
            prompt_logprobs: 0..20: the first chunk's `prompt_logprobs`, one per prompt token
                (its log-probability given the tokens before it, and this many alternatives;
                modes plain and dflash; the prompt is prefilled in full); None: none.
            presence_penalty, frequency_penalty: in [-2, 2], subtracted from the logit of every
                token the output holds (once, or once per occurrence); repetition_penalty in
                (0, 10] divides the positive logits of the prompt's and output's tokens (1 = none);
                logit_bias: {token id: bias in [-100, 100]} added to those tokens' logits.
                Applied in modes plain and dflash (auto decodes plainly where the draft has no
                batched path); None: none.
            timeout_s: deadline of the whole stream, seconds (default: the client's).

        Yields:
            Chunk: text deltas; the last one carries finish_reason and stats.

        Raises:
            InvalidArgument: arguments `build_request` rejects, or timeout_s <= 0 (raised at the
                first iteration, before any RPC), or a request the server rejects (a schema the
                worker's grammar library cannot compile: the message says why).
            ModelNotFound: no worker serves `model` (or none has a draft for `mode`).
            Overloaded: every worker serving it is full and the coordinator's queue is full or
                its wait timed out.
            Unavailable: the coordinator or the worker is unreachable or draining (a stream
                that had tokens: also after `RESUME_WINDOW_S` of failed resumes).
            DeadlineExceeded: `timeout_s` passed before the stream ended.
            Cancelled: the call was cancelled.
            FlashfleetError: any other status code (e.g. INTERNAL), with the server's message.
        """
        req = build_request(model, prompt, messages=messages, max_tokens=max_tokens,
                            temperature=temperature, top_p=top_p, seed=seed, stop=stop,
                            session_id=session_id, request_id=request_id, mode=mode,
                            response_format=response_format, json_schema=json_schema,
                            top_logprobs=top_logprobs, prompt_logprobs=prompt_logprobs,
                            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                            repetition_penalty=repetition_penalty, logit_bias=logit_bias)
        req.request_id = req.request_id or uuid.uuid4().hex  # a resumed stream names the same request
        stream = _Resume(req, len(self._targets), time.monotonic() + _deadline(timeout_s, self.timeout_s))
        while True:
            call = self._stub.Generate(stream.next_request(), timeout=stream.timeout_s())
            try:
                for resp in call:
                    chunk = _to_chunk(resp)
                    stream.add(chunk)
                    yield chunk
                return
            except grpc.RpcError as e:
                wait = stream.wait_s(e)
                if wait is None:
                    raise from_rpc_error(e, self._secure) from None
            finally:
                call.cancel()  # no-op when the stream ended; frees the worker when the caller stops early
            self._next_target()
            time.sleep(wait)

    def complete(self, model: str, prompt: str | None = None, **kwargs) -> Completion:
        """Runs generate() to the end and returns the whole text, token ids and stats.

        Takes the same arguments and raises the same errors as generate() (TypeError, naming
        complete(), for a keyword generate() does not take).
        """
        _check_keywords("complete", kwargs)
        return accumulate(self.generate(model, prompt, **kwargs))

    def choices(self, model: str, prompt: str | None = None, *, n: int, **kwargs) -> list[Completion]:
        """n completions of one prompt (OpenAI's `n`), run together; choice i in the list's place i.

        With a seed, choice i samples with `flashfleet.requests.choice_seed(seed, i)` (choice 0
        with the seed itself), so every choice is reproducible and equal to the HTTP API's choice
        i; greedy choices are identical. The choices share a session_id (the one given, or the
        request id) and so go to one worker, where the later ones copy the first one's prompt
        caches instead of prefilling the prompt again. Request ids are "<request_id>-<i>".

        Takes generate()'s arguments and raises its errors (the first choice's to fail), and
        InvalidArgument for an n outside [1, 16].
        """
        _check_keywords("choices", kwargs)
        calls = _choice_kwargs(n, kwargs)
        with ThreadPoolExecutor(max_workers=len(calls)) as pool:
            return list(pool.map(lambda kw: accumulate(self.generate(model, prompt, **kw)), calls))

    def list_models(self, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S) -> list[coordinator_pb2.ServedModel]:
        """Models the fleet serves, with the workers serving each and their decode modes.

        Args:
            timeout_s: deadline of the call, seconds.

        Raises:
            FlashfleetError subclasses, as for generate() (Unavailable, DeadlineExceeded, ...).
        """
        timeout = _deadline(timeout_s, DEFAULT_CONTROL_TIMEOUT_S)
        return list(self._unary(lambda stub: stub.ListModels(coordinator_pb2.ListModelsRequest(),
                                                             timeout=timeout)).models)

    def cluster_status(self, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S) -> coordinator_pb2.ClusterStatus:
        """Workers, their load and heartbeat age (seconds), and the number of sessions.

        Args:
            timeout_s: deadline of the call, seconds.

        Raises:
            FlashfleetError subclasses, as for generate() (Unavailable, DeadlineExceeded, ...).
        """
        timeout = _deadline(timeout_s, DEFAULT_CONTROL_TIMEOUT_S)
        return self._unary(lambda stub: stub.GetClusterStatus(coordinator_pb2.GetClusterStatusRequest(),
                                                              timeout=timeout))

    def drain_worker(self, worker_id: str, timeout_s: float | None = DEFAULT_GENERATE_TIMEOUT_S
                     ) -> Iterator[coordinator_pb2.DrainProgress]:
        """Drains a worker: no new requests go to it, its sessions move to other workers, then it
        is told to leave. Yields its progress (DrainProgress: sessions_left, moved, state
        "draining" / "leaving" / "left") whenever it changes, ending once it has left.

        Args:
            worker_id: the worker's id.
            timeout_s: deadline of the whole drain, seconds (None: the client's default).

        Raises:
            ModelNotFound (code NOT_FOUND): no live worker has that id.
            FailedPrecondition: it runs sessions and no other worker serves its model.
            PermissionDenied: the coordinator has API keys and this client's key is not an admin key.
            FlashfleetError subclasses, as for generate() (Unauthenticated without a valid key, ...).
        """
        try:
            yield from self._stub.DrainWorker(coordinator_pb2.DrainWorkerRequest(worker_id=worker_id),
                                              timeout=_deadline(timeout_s, self.timeout_s))
        except grpc.RpcError as e:
            raise from_rpc_error(e, self._secure) from None

    def move_session(self, request_id: str, to_worker_id: str = "",
                     timeout_s: float | None = 60.0) -> coordinator_pb2.MoveSessionResponse:
        """Moves a running request to `to_worker_id` (empty: the worker the coordinator's
        migration policy predicts fastest for it); returns once it streams there.

        Raises:
            ModelNotFound (code NOT_FOUND): no such request is streaming, or no such worker.
            FailedPrecondition: no worker can take it (full, draining, another model, its own).
            FlashfleetError with code ABORTED: the destination refused; the request stays where it was.
            PermissionDenied: the coordinator has API keys and this client's key is not an admin key.
            FlashfleetError subclasses, as for generate().
        """
        timeout = _deadline(timeout_s, 60.0)
        return self._unary(lambda stub: stub.MoveSession(
            coordinator_pb2.MoveSessionRequest(request_id=request_id, to_worker_id=to_worker_id), timeout=timeout))

    def put_api_key(self, key: str, role: str = "client", timeout_s: float | None = None) -> None:
        """Has every coordinator sharing the fleet's state accept `key` in `role` ("client" or
        "admin"; replaces the key's earlier role). Only the key's SHA-256 digest is sent.

        Raises:
            InvalidArgument: an unknown role.
            PermissionDenied: the coordinator has API keys and this client's key is not an admin key.
            Unavailable: the coordinator, or the etcd behind it, did not answer.
            FlashfleetError subclasses, as for generate().
        """
        timeout = _deadline(timeout_s, DEFAULT_CONTROL_TIMEOUT_S)
        self._unary(lambda stub: stub.PutApiKey(
            coordinator_pb2.PutApiKeyRequest(sha256=key_digest(key), role=role), timeout=timeout))

    def delete_api_key(self, key: str, timeout_s: float | None = None) -> None:
        """Has every coordinator sharing the fleet's state stop accepting `key` (by its digest).

        Raises:
            ModelNotFound (code NOT_FOUND): no coordinator accepts that key.
            PermissionDenied: the coordinator has API keys and this client's key is not an admin key.
            FlashfleetError subclasses, as for generate().
        """
        timeout = _deadline(timeout_s, DEFAULT_CONTROL_TIMEOUT_S)
        self._unary(lambda stub: stub.DeleteApiKey(
            coordinator_pb2.DeleteApiKeyRequest(sha256=key_digest(key)), timeout=timeout))


# The keywords complete() forwards to generate().
_GENERATE_KEYWORDS = frozenset(inspect.signature(Client.generate).parameters) - {"self", "model", "prompt"}


class AsyncClient:
    """asyncio client; same arguments, results and errors as Client (several coordinators and
    resumed streams included).

        async with AsyncClient("localhost:50051") as client:
            async for chunk in client.generate("SmolLM2-135M-Instruct", prompt="Hi"):
                ...
    """

    def __init__(self, address: str | Sequence[str], timeout_s: float = DEFAULT_GENERATE_TIMEOUT_S,
                 credentials: grpc.ChannelCredentials | None = None, api_key: str | None = None):
        self._targets = _targets(address)
        self._credentials = credentials
        self._metadata = api_key_metadata(client_api_key(api_key))
        self._secure = credentials is not None
        self.timeout_s = _deadline(timeout_s, DEFAULT_GENERATE_TIMEOUT_S)
        # Made on first use, inside the event loop that runs the calls: a grpc.aio channel
        # belongs to the loop it was made in, and a client may be built before asyncio.run().
        self._channels: dict[int, grpc.aio.Channel] = {}
        self._stubs: dict[int, coordinator_pb2_grpc.CoordinatorStub] = {}
        self._current = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def _stub(self) -> coordinator_pb2_grpc.CoordinatorStub:
        loop = asyncio.get_running_loop()
        if self._loop is not None and self._channels and loop is not self._loop:
            raise RuntimeError("this AsyncClient is bound to the event loop of its first call; make "
                               "one AsyncClient per event loop (e.g. inside each asyncio.run)")
        i = self._current
        if i not in self._stubs:
            target = self._targets[i]
            self._channels[i] = (grpc.aio.secure_channel(target, self._credentials, options=CHANNEL_OPTIONS)
                                 if self._credentials else
                                 grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS))
            self._stubs[i] = with_metadata(coordinator_pb2_grpc.CoordinatorStub(self._channels[i]), self._metadata)
            self._loop = loop
        return self._stubs[i]

    def _next_target(self) -> None:
        self._current = (self._current + 1) % len(self._targets)

    async def _unary(self, call):
        """`await call(stub)` on the current target, then on each other one while they are UNAVAILABLE."""
        for attempt in range(len(self._targets)):
            try:
                return await call(self._stub)
            except grpc.RpcError as e:
                if not _resumable(e) or attempt == len(self._targets) - 1:
                    raise from_rpc_error(e, self._secure) from None
                self._next_target()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Closes the channels; calls still running on them are cancelled. The client can be used
        again afterwards (a new channel is made on the next call)."""
        channels, self._channels, self._stubs = self._channels, {}, {}
        for channel in channels.values():
            await channel.close()

    async def generate(self, model: str, prompt: str | None = None, *,
                       timeout_s: float | None = None, **kwargs) -> AsyncIterator[Chunk]:
        """Streams a generation; see Client.generate for arguments, chunks, resumption and errors."""
        req = build_request(model, prompt, **kwargs)
        req.request_id = req.request_id or uuid.uuid4().hex  # a resumed stream names the same request
        stream = _Resume(req, len(self._targets), time.monotonic() + _deadline(timeout_s, self.timeout_s))
        while True:
            call = self._stub.Generate(stream.next_request(), timeout=stream.timeout_s())
            try:
                async for resp in call:
                    chunk = _to_chunk(resp)
                    stream.add(chunk)
                    yield chunk
                return
            except grpc.RpcError as e:
                wait = stream.wait_s(e)
                if wait is None:
                    raise from_rpc_error(e, self._secure) from None
            finally:
                call.cancel()
            self._next_target()
            await asyncio.sleep(wait)

    async def complete(self, model: str, prompt: str | None = None, **kwargs) -> Completion:
        """Runs generate() to the end; see Client.complete (same arguments and errors)."""
        _check_keywords("complete", kwargs)
        return accumulate([c async for c in self.generate(model, prompt, **kwargs)])

    async def choices(self, model: str, prompt: str | None = None, *, n: int, **kwargs) -> list[Completion]:
        """n completions of one prompt, run together; see Client.choices (same arguments, seeds
        and errors)."""
        _check_keywords("choices", kwargs)
        tasks = [asyncio.ensure_future(self.complete(model, prompt, **kw)) for kw in _choice_kwargs(n, kwargs)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:  # after a failure: the other choices' calls end too
                t.cancel()

    async def list_models(self, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S) -> list[coordinator_pb2.ServedModel]:
        """See Client.list_models."""
        timeout = _deadline(timeout_s, DEFAULT_CONTROL_TIMEOUT_S)
        resp = await self._unary(lambda stub: stub.ListModels(coordinator_pb2.ListModelsRequest(), timeout=timeout))
        return list(resp.models)

    async def cluster_status(self, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S) -> coordinator_pb2.ClusterStatus:
        """See Client.cluster_status."""
        timeout = _deadline(timeout_s, DEFAULT_CONTROL_TIMEOUT_S)
        return await self._unary(lambda stub: stub.GetClusterStatus(coordinator_pb2.GetClusterStatusRequest(),
                                                                    timeout=timeout))
