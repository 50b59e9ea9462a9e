"""Requests that do not parse get INVALID_ARGUMENT, not UNKNOWN.

grpc's asyncio server deserializes a request before the servicer sees it; when protobuf cannot
parse the bytes (a `string` field that is not UTF-8, a truncated or corrupt message: clients in
other languages can send both) it answers UNKNOWN "Unexpected <class DecodeError>" and logs a
traceback. `RejectUndecodable`, a server interceptor on every flashfleet server, wraps each
single-request method's deserializer so that a parse error becomes INVALID_ARGUMENT with a
message saying what to fix; the servicer and every other stream are untouched. Methods whose
requests stream in (grpc reflection) and synchronous behaviors are left as they are.
"""
from __future__ import annotations

import inspect

import grpc
from google.protobuf.message import DecodeError


class _Undecodable:
    """Stands in for a request that did not parse; the wrapped method aborts on it."""

    __slots__ = ("error",)

    def __init__(self, error: Exception):
        self.error = error


def _lenient(deserialize):
    def run(data: bytes):
        try:
            return deserialize(data)
        except DecodeError as e:
            return _Undecodable(e)
    return run


def _message(method: str, error: Exception) -> str:
    return (f"the request to {method} is not a valid protobuf message ({error}): string fields must "
            "be valid UTF-8 and the message must match flashfleet's protos/")


class RejectUndecodable(grpc.aio.ServerInterceptor):
    """Turns a request that protobuf cannot parse into INVALID_ARGUMENT (unary-request methods)."""

    def __init__(self):
        self._wrapped: dict[str, tuple[object, object]] = {}  # method -> (its handler, the wrapped one)

    async def intercept_service(self, continuation, handler_call_details):
        """The method's handler with a lenient deserializer: a request that fails to parse
        reaches a wrapper that aborts the call with INVALID_ARGUMENT (naming the method and what
        to fix). Streaming-request and synchronous handlers are returned unchanged. A method's
        wrapper is made once (grpc hands the same handler for every call of a method)."""
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(handler, method)
        if handler is not None:
            self._wrapped[method] = (handler, wrapped)
        return wrapped

    @staticmethod
    def _wrap(handler, method: str):
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        kind = "unary_stream" if handler.response_streaming else "unary_unary"
        inner = getattr(handler, kind)
        if not (inspect.isasyncgenfunction(inner) or inspect.iscoroutinefunction(inner)):
            return handler  # a synchronous behavior (none in flashfleet): left as grpc runs it
        if inspect.isasyncgenfunction(inner):  # yields its responses
            async def behavior(request, context):
                if isinstance(request, _Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(method, request.error))
                async for response in inner(request, context):
                    yield response
        else:  # returns its response, or writes a stream with context.write
            async def behavior(request, context):
                if isinstance(request, _Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(method, request.error))
                return await inner(request, context)
        return handler._replace(request_deserializer=_lenient(handler.request_deserializer), **{kind: behavior})
