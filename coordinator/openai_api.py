"""The coordinator's OpenAI-compatible HTTP API (aiohttp, on the coordinator's event loop beside
its gRPC server): POST /v1/chat/completions, POST /v1/completions (streamed as server-sent events
with "stream": true, else one JSON answer), GET /v1/models and GET /v1/models/{model}.

Every request goes through `CoordinatorServicer.generate`, the path of gRPC's Generate: the same
routing, admission queue, retries, migration, deadlines and metrics; a request for n > 1 choices
is n such requests (`coordinator.openai_format.choice_requests`), run together, their chunks
interleaved as they come, each naming its choice's index. A client that disconnects
cancels its handler (aiohttp's handler cancellation), which closes the generator: the worker call
is cancelled and the worker frees the session. Shapes and field mapping: coordinator/openai_format.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any, AsyncIterator

from aiohttp import web

from coordinator.http_body import read_json
from coordinator.openai_format import OpenAIError, ParsedRequest, ResponseBuilder, builders, choice_requests, \
    model_list, model_object, parse_request, response
from coordinator.servicer import CoordinatorServicer, GenerateFailed
from flashfleet.auth import BAD_KEY, ApiKeys, bearer
from flashfleet.requests import MAX_REQUEST_BYTES

log = logging.getLogger("flashfleet.coordinator.http")

_SERVICER = web.AppKey("servicer", CoordinatorServicer)
# Status of aiohttp's own refusals (unknown path, wrong method, body too large) -> error type.
_HTTP_TYPES = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}
_HTTP_CODES = {413: "request_too_large"}  # ... -> error code (as http_body.py's decoded-size refusal)
MAX_BODY_BYTES = 2 * MAX_REQUEST_BYTES  # a raw body's limit (client_max_size): the request limit plus JSON escapes
# ... -> what to fix, where aiohttp's reason phrase alone would not say
_HTTP_MESSAGES = {413: f"the request body is larger than {MAX_BODY_BYTES:,} bytes ({MAX_BODY_BYTES >> 20} MiB): "
                       "send a shorter prompt"}


def _error_response(e: OpenAIError) -> web.Response:
    return web.json_response(e.body(), status=e.status)


@web.middleware
async def _openai_errors(request: web.Request, handler):
    """Answers every error in OpenAI's JSON shape, aiohttp's own refusals included."""
    try:
        return await handler(request)
    except OpenAIError as e:
        return _error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = (f"no such endpoint: {request.method} {request.path}" if e.status == 404
                   else _HTTP_MESSAGES.get(e.status, e.reason))
        return _error_response(OpenAIError(e.status, message,
                                           _HTTP_TYPES.get(e.status, "invalid_request_error"), None,
                                           _HTTP_CODES.get(e.status)))


def _deadline_error(parsed: ParsedRequest) -> OpenAIError:
    return OpenAIError(504, f"the request's deadline (timeout_s={parsed.timeout_s}) passed", "server_error", None,
                       "deadline_exceeded")


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _tool_format(servicer: CoordinatorServicer, parsed: ParsedRequest) -> str:
    """The tool-call format of the requested model as its workers report it ("" when no tool
    may be called, or no live worker serves the model: the request then fails on its own)."""
    if not parsed.tools:
        return ""
    return next((m.info.tool_call_format for m in servicer.served_models() if m.info.name == parsed.request.model), "")


async def _merged(streams: list) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, message) of every choice's response stream as they arrive. A failure of
    one stream is raised here; leaving (or failing) closes every stream, which cancels their
    worker calls."""
    if len(streams) == 1:  # one choice: its stream as it is
        async with contextlib.aclosing(streams[0]):
            async for msg in streams[0]:
                yield 0, msg
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, responses) -> None:
        try:
            async with contextlib.aclosing(responses):
                async for msg in responses:
                    await queue.put((index, msg, None))
        except Exception as e:  # handed to the reader, which raises it
            await queue.put((index, None, e))
            return
        await queue.put((index, None, None))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, msg, error = await queue.get()
            if error is not None:
                raise error
            if msg is None:
                running -= 1
            else:
                yield index, msg
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    parsed = parse_request(await read_json(request), chat)
    servicer = request.app[_SERVICER]
    deadline = None if parsed.timeout_s is None else time.monotonic() + parsed.timeout_s
    remaining = (lambda: None) if deadline is None else (lambda: deadline - time.monotonic())
    responses = _merged([servicer.generate(r, remaining) for r in choice_requests(parsed)])
    out = builders(parsed, _tool_format(servicer, parsed))
    async with contextlib.aclosing(responses):
        if parsed.stream:
            return await _stream(request, parsed, responses, out)
        text = [[] for _ in range(parsed.n)]
        logprobs = [[] for _ in range(parsed.n)]
        prompt_logprobs = [[] for _ in range(parsed.n)]
        complete = [None] * parsed.n
        try:
            async with asyncio.timeout(parsed.timeout_s):
                async for index, resp in responses:
                    if resp.WhichOneof("kind") == "complete":
                        complete[index] = resp.complete
                    else:
                        text[index].append(resp.chunk.text)
                        logprobs[index].extend(resp.chunk.logprobs)
                        prompt_logprobs[index] = prompt_logprobs[index] or list(resp.chunk.prompt_logprobs)
        except GenerateFailed as e:
            raise OpenAIError.from_status(e.code, e.details) from None
        except TimeoutError:
            raise _deadline_error(parsed) from None
    if any(c is None for c in complete):
        raise OpenAIError(503, "the worker ended the stream without finishing it", "server_error", None,
                          "unavailable")
    return web.json_response(response(out, list(zip(("".join(t) for t in text), complete, logprobs,
                                                    prompt_logprobs))))


async def _stream(request: web.Request, parsed: ParsedRequest, responses, out: list[ResponseBuilder]
                  ) -> web.StreamResponse:
    """Writes the choices' `responses` ((index, message) pairs) as server-sent events, each chunk
    naming its choice's index (`out`: the choices' builders); the usage chunk (include_usage) and
    [DONE] follow the last choice's end. The HTTP status is sent with the first message, so a
    request refused before any (unknown model, overloaded...) gets its own status; a failure
    after it is one `data: {"error": ...}` event that ends the stream."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    completes = [None] * parsed.n
    try:
        async with asyncio.timeout(parsed.timeout_s):
            async for index, msg in responses:
                if not resp.prepared:
                    await resp.prepare(request)
                if msg.WhichOneof("kind") == "complete":
                    completes[index] = msg.complete
                    for chunk in out[index].final(msg.complete, parsed.include_usage):
                        await resp.write(_sse(chunk))
                    if all(c is not None for c in completes):
                        if parsed.include_usage:
                            await resp.write(_sse(out[0].usage_chunk(completes)))
                        await resp.write(b"data: [DONE]\n\n")
                else:
                    for chunk in out[index].chunks(msg.chunk.text, parsed.include_usage, msg.chunk.logprobs,
                                                   msg.chunk.prompt_logprobs):
                        await resp.write(_sse(chunk))
    except (GenerateFailed, TimeoutError) as e:
        err = OpenAIError.from_status(e.code, e.details) if isinstance(e, GenerateFailed) else _deadline_error(parsed)
        if not resp.prepared:
            raise err from None
        await resp.write(_sse(err.body()))
    except ConnectionResetError:  # the client left between two chunks: the generators close
        log.info("client of %s disconnected", parsed.request.request_id)
        return resp
    if not resp.prepared:
        raise OpenAIError(503, "the worker ended the stream without a message", "server_error", None,
                          "unavailable")
    await resp.write_eof()
    return resp


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    return await _generate(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    return await _generate(request, chat=False)


async def models(request: web.Request) -> web.Response:
    """GET /v1/models: the models live workers serve."""
    return web.json_response(model_list(request.app[_SERVICER].served_models()))


async def model(request: web.Request) -> web.Response:
    """GET /v1/models/{model}: one served model, or 404."""
    name = request.match_info["model"]
    for served in request.app[_SERVICER].served_models():
        if served.info.name == name:
            return web.json_response(model_object(served))
    raise OpenAIError(404, f"model {name!r} is not served", "invalid_request_error", "model", "model_not_found")


def _require_key(api_keys: ApiKeys):
    """Middleware: while `api_keys` holds any key, a request without `Authorization: Bearer
    <an accepted key>` gets 401."""
    @web.middleware
    async def require_key(request: web.Request, handler):
        if api_keys and api_keys.role(bearer(request.headers.get("Authorization"))) is None:
            raise OpenAIError(401, BAD_KEY, "invalid_request_error", None, "invalid_api_key")
        return await handler(request)
    return require_key


def build_app(servicer: CoordinatorServicer, api_keys: ApiKeys | None = None) -> web.Application:
    """The aiohttp application of the OpenAI-compatible API over `servicer` (request bodies up
    to flashfleet's 4 MiB request limit plus room for JSON escapes). While `api_keys` holds any
    key (it is read at every request: keys added later count), every request must carry
    `Authorization: Bearer <key>` for one of them, else 401."""
    middlewares = [_openai_errors] + ([_require_key(api_keys)] if api_keys is not None else [])
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app[_SERVICER] = servicer
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)
    return app


async def start_http(servicer: CoordinatorServicer, host: str, port: int, shutdown_timeout_s: float,
                     ssl_context=None, api_keys: ApiKeys | None = None) -> tuple[web.AppRunner, int]:
    """Serves the API on host:port (0 = a free port) on the running event loop.

    Args:
        shutdown_timeout_s: how long `runner.cleanup()` lets open requests finish, seconds.
        ssl_context: an ssl.SSLContext to serve HTTPS (`TLSConfig.server_ssl_context`), or None
            for plain HTTP.
        api_keys: the keys a request must carry one of (`build_app`); None or empty: none.

    Returns:
        (the runner: `await runner.cleanup()` stops it, the bound port).

    Raises:
        RuntimeError: the port could not be bound.
    """
    # auto_decompress off: request bodies are decoded by coordinator/http_body.py, not while parsing.
    runner = web.AppRunner(build_app(servicer, api_keys), handler_cancellation=True, access_log=None,
                           shutdown_timeout=shutdown_timeout_s, auto_decompress=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise RuntimeError(f"could not bind the HTTP API to {host}:{port}: {e.strerror or e}") from None
    return runner, runner.addresses[0][1]
