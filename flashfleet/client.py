"""Client SDK: `Client` (blocking) and `AsyncClient` (asyncio) for the coordinator's public API.

Both speak flashfleet.v1.Coordinator, put an explicit deadline on every call, stream typed
dataclasses (flashfleet.types; list_models and cluster_status return the response protos, whose
fields are documented in protos/flashfleet/v1/coordinator.proto) and raise typed exceptions (flashfleet.errors) that keep the gRPC
status code and the server's message. A `generate` generator that is closed early (a `for` loop
left while it held the only reference, or `.close()` / `await .aclose()`) cancels the RPC, which
frees the worker.
"""
from __future__ import annotations

import asyncio
import inspect
import numbers
from typing import Any, AsyncIterator, Iterable, Iterator, Mapping

import grpc

from flashfleet.auth import api_key_metadata, client_api_key, with_metadata
from flashfleet.errors import InvalidArgument, from_rpc_error
from flashfleet.requests import MAX_TIMEOUT_S, build_request
from flashfleet.transport import CHANNEL_OPTIONS
from flashfleet.types import FINISH_REASONS, Chunk, Completion, GenerationStats
from flashfleet.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

DEFAULT_GENERATE_TIMEOUT_S = 600.0
DEFAULT_CONTROL_TIMEOUT_S = 10.0


def _check_address(address) -> None:
    """Raises TypeError for an address that is not a "host:port" string (e.g. a bare port number)."""
    if not isinstance(address, str):
        raise TypeError(f"address must be a 'host:port' string, e.g. '127.0.0.1:50051', "
                        f"got {type(address).__name__} {address!r}")


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
                     stats=GenerationStats.from_proto(c.stats), worker_id=c.worker_id)
    return Chunk(request_id=resp.request_id, text=resp.chunk.text,
                 token_ids=tuple(resp.chunk.token_ids), logprobs=tuple(resp.chunk.logprobs))


def _accumulate(chunks: Iterable[Chunk]) -> Completion:
    text, ids, logprobs, last = [], [], [], None
    for chunk in chunks:
        text.append(chunk.text)
        ids.extend(chunk.token_ids)
        logprobs.extend(chunk.logprobs)
        last = chunk
    return Completion(request_id=last.request_id if last else "", text="".join(text),
                      token_ids=ids, logprobs=logprobs, finish_reason=last.finish_reason or "" if last else "",
                      stats=last.stats if last else None, worker_id=last.worker_id if last else "")


def _check_keywords(method: str, kwargs: Mapping) -> None:
    """TypeError naming `method` (not the generate() it forwards to) for an unknown keyword."""
    unknown = sorted(set(kwargs) - _GENERATE_KEYWORDS)
    if unknown:
        raise TypeError(f"{method}() got unexpected keyword argument(s) {', '.join(unknown)}; "
                        f"it takes generate()'s: {', '.join(sorted(_GENERATE_KEYWORDS))}")


class Client:
    """Blocking client.

    Args:
        address: coordinator "host:port".
        timeout_s: default deadline of a generate call, seconds.
        credentials: grpc.ssl_channel_credentials(...) for a cluster that serves TLS
            (flashfleet.config.TLSConfig.channel_credentials()), or None for plaintext.
        api_key: sent on every call as metadata `authorization: Bearer <key>` (a coordinator
            with API keys refuses calls without one with Unauthenticated); None: env
            FLASHFLEET_API_KEY, else no key.

    Use as a context manager, or call close() (a later call opens a new channel).

    Raises:
        TypeError: address is not a str.
        InvalidArgument: timeout_s is not a number of seconds in (0, 1e8].
    """

    def __init__(self, address: str, timeout_s: float = DEFAULT_GENERATE_TIMEOUT_S,
                 credentials: grpc.ChannelCredentials | None = None, api_key: str | None = None):
        _check_address(address)
        self._address, self._credentials = address, credentials
        self._metadata = api_key_metadata(client_api_key(api_key))
        self._secure = credentials is not None
        self._channel: grpc.Channel | None = None
        self._open()
        self.timeout_s = _deadline(timeout_s, DEFAULT_GENERATE_TIMEOUT_S)

    def _open(self) -> None:
        self._channel = (grpc.secure_channel(self._address, self._credentials, options=CHANNEL_OPTIONS)
                         if self._credentials else grpc.insecure_channel(self._address, options=CHANNEL_OPTIONS))
        self._stub_cache = with_metadata(coordinator_pb2_grpc.CoordinatorStub(self._channel), self._metadata)

    @property
    def _stub(self) -> coordinator_pb2_grpc.CoordinatorStub:
        if self._channel is None:  # closed: a call after close() opens a new channel
            self._open()
        return self._stub_cache

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Closes the channel; calls still running on it are cancelled. The client can be used
        again afterwards (a new channel is made on the next call)."""
        if self._channel is not None:
            channel, self._channel = self._channel, None
            channel.close()

    def generate(self, model: str, prompt: str | None = None, *,
                 messages: Iterable[Mapping[str, str]] | None = None, max_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None,
                 seed: int | None = None, stop: str | Iterable[str] = (), session_id: str = "",
                 request_id: str = "", mode: str = "auto",
                 response_format: Mapping[str, Any] | None = None, json_schema: Mapping[str, Any] | None = None,
                 top_logprobs: int | None = None, timeout_s: float | None = None) -> Iterator[Chunk]:
        """Streams a generation.

        Args:
            model: model name (see list_models()).
            prompt: raw prompt text; or messages: chat turns [{"role", "content"}], rendered with
                the model's chat template. Exactly one of the two.
            max_tokens: most tokens to generate (> 0); None (default) = 256, capped by the
                context the prompt leaves (`flashfleet.requests.WORKER_DEFAULT_MAX_TOKENS`).
            temperature: 0 or None = greedy; top_p in (0, 1]; seed makes sampling reproducible.
            stop: output ends before the first of these strings (one string, or several).
            session_id: requests of one session go to the same worker.
            mode: "auto", "plain", "draft", "dflash" or "uag".
            json_schema: a JSON Schema (dict): the output is JSON valid against it (decoded under
                a grammar in modes plain and dflash); or response_format, OpenAI's object
                ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"schema": ...}}).
            top_logprobs: 0..20: each chunk's `logprobs` (one per token: its log-probability under
                the model and this many most likely alternatives); None: none.
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
            Unavailable: the coordinator or the worker is unreachable or draining.
            DeadlineExceeded: `timeout_s` passed before the stream ended.
            Cancelled: the call was cancelled.
            FlashfleetError: any other status code (e.g. INTERNAL), with the server's message.
        """
        req = build_request(model, prompt, messages=messages, max_tokens=max_tokens,
                            temperature=temperature, top_p=top_p, seed=seed, stop=stop,
                            session_id=session_id, request_id=request_id, mode=mode,
                            response_format=response_format, json_schema=json_schema,
                            top_logprobs=top_logprobs)
        call = self._stub.Generate(req, timeout=_deadline(timeout_s, self.timeout_s))
        try:
            for resp in call:
                yield _to_chunk(resp)
        except grpc.RpcError as e:
            raise from_rpc_error(e, self._secure) from None
        finally:
            call.cancel()  # no-op when the stream ended; frees the worker when the caller stops early

    def complete(self, model: str, prompt: str | None = None, **kwargs) -> Completion:
        """Runs generate() to the end and returns the whole text, token ids and stats.

        Takes the same arguments and raises the same errors as generate() (TypeError, naming
        complete(), for a keyword generate() does not take).
        """
        _check_keywords("complete", kwargs)
        return _accumulate(self.generate(model, prompt, **kwargs))

    def list_models(self, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S) -> list[coordinator_pb2.ServedModel]:
        """Models the fleet serves, with the workers serving each and their decode modes.

        Args:
            timeout_s: deadline of the call, seconds.

        Raises:
            FlashfleetError subclasses, as for generate() (Unavailable, DeadlineExceeded, ...).
        """
        try:
            return list(self._stub.ListModels(coordinator_pb2.ListModelsRequest(),
                                              timeout=_deadline(timeout_s, DEFAULT_CONTROL_TIMEOUT_S)).models)
        except grpc.RpcError as e:
            raise from_rpc_error(e, self._secure) from None

    def cluster_status(self, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S) -> coordinator_pb2.ClusterStatus:
        """Workers, their load and heartbeat age (seconds), and the number of sessions.

        Args:
            timeout_s: deadline of the call, seconds.

        Raises:
            FlashfleetError subclasses, as for generate() (Unavailable, DeadlineExceeded, ...).
        """
        try:
            return self._stub.GetClusterStatus(coordinator_pb2.GetClusterStatusRequest(),
                                               timeout=_deadline(timeout_s, DEFAULT_CONTROL_TIMEOUT_S))
        except grpc.RpcError as e:
            raise from_rpc_error(e, self._secure) from None

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
        try:
            return self._stub.MoveSession(coordinator_pb2.MoveSessionRequest(request_id=request_id,
                                                                              to_worker_id=to_worker_id),
                                          timeout=_deadline(timeout_s, 60.0))
        except grpc.RpcError as e:
            raise from_rpc_error(e, self._secure) from None


# The keywords complete() forwards to generate().
_GENERATE_KEYWORDS = frozenset(inspect.signature(Client.generate).parameters) - {"self", "model", "prompt"}


class AsyncClient:
    """asyncio client; same arguments, results and errors as Client.

        async with AsyncClient("localhost:50051") as client:
            async for chunk in client.generate("SmolLM2-135M-Instruct", prompt="Hi"):
                ...
    """

    def __init__(self, address: str, timeout_s: float = DEFAULT_GENERATE_TIMEOUT_S,
                 credentials: grpc.ChannelCredentials | None = None, api_key: str | None = None):
        _check_address(address)
        self._address, self._credentials = address, credentials
        self._metadata = api_key_metadata(client_api_key(api_key))
        self._secure = credentials is not None
        self.timeout_s = _deadline(timeout_s, DEFAULT_GENERATE_TIMEOUT_S)
        # Made on first use, inside the event loop that runs the calls: a grpc.aio channel
        # belongs to the loop it was made in, and a client may be built before asyncio.run().
        self._channel: grpc.aio.Channel | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def _stub(self) -> coordinator_pb2_grpc.CoordinatorStub:
        loop = asyncio.get_running_loop()
        if self._channel is None:
            self._channel = (grpc.aio.secure_channel(self._address, self._credentials, options=CHANNEL_OPTIONS)
                             if self._credentials else
                             grpc.aio.insecure_channel(self._address, options=CHANNEL_OPTIONS))
            self._stub_cache = with_metadata(coordinator_pb2_grpc.CoordinatorStub(self._channel), self._metadata)
            self._loop = loop
        elif loop is not self._loop:
            raise RuntimeError("this AsyncClient is bound to the event loop of its first call; make "
                               "one AsyncClient per event loop (e.g. inside each asyncio.run)")
        return self._stub_cache

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Closes the channel; calls still running on it are cancelled. The client can be used
        again afterwards (a new channel is made on the next call)."""
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await channel.close()

    async def generate(self, model: str, prompt: str | None = None, *,
                       timeout_s: float | None = None, **kwargs) -> AsyncIterator[Chunk]:
        """Streams a generation; see Client.generate for arguments, chunks and errors."""
        req = build_request(model, prompt, **kwargs)
        call = self._stub.Generate(req, timeout=_deadline(timeout_s, self.timeout_s))
        try:
            async for resp in call:
                yield _to_chunk(resp)
        except grpc.RpcError as e:
            raise from_rpc_error(e, self._secure) from None
        finally:
            call.cancel()

    async def complete(self, model: str, prompt: str | None = None, **kwargs) -> Completion:
        """Runs generate() to the end; see Client.complete (same arguments and errors)."""
        _check_keywords("complete", kwargs)
        return _accumulate([c async for c in self.generate(model, prompt, **kwargs)])

    async def list_models(self, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S) -> list[coordinator_pb2.ServedModel]:
        """See Client.list_models."""
        try:
            resp = await self._stub.ListModels(coordinator_pb2.ListModelsRequest(),
                                               timeout=_deadline(timeout_s, DEFAULT_CONTROL_TIMEOUT_S))
        except grpc.RpcError as e:
            raise from_rpc_error(e, self._secure) from None
        return list(resp.models)

    async def cluster_status(self, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S) -> coordinator_pb2.ClusterStatus:
        """See Client.cluster_status."""
        try:
            return await self._stub.GetClusterStatus(coordinator_pb2.GetClusterStatusRequest(),
                                                     timeout=_deadline(timeout_s, DEFAULT_CONTROL_TIMEOUT_S))
        except grpc.RpcError as e:
            raise from_rpc_error(e, self._secure) from None
