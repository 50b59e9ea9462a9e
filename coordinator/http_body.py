"""Reads the JSON body of an HTTP API request (coordinator/openai_api.py), Content-Encoding included.

The HTTP API runs aiohttp with its parser's own decompression off (`auto_decompress=False`): that
parser decompresses while it reads the socket, so a body that does not decode as its
Content-Encoding says gets aiohttp's plain-text 400 or, for a deflate body it takes for a
truncated stream, at times no answer at all (the client waits out its own timeout); an encoding
it lacks a library for (br, zstd) gets a plain-text 400 too. Here the raw body (at most the app's
`client_max_size`) is decoded once read: identity, gzip or deflate, at most `MAX_DECODED_BYTES`
of output, every refusal an `OpenAIError` in OpenAI's shape.
"""
from __future__ import annotations

import asyncio
import json
import zlib
from typing import Any

from aiohttp import web

from coordinator.openai_format import OpenAIError
from flashfleet.errors import short_details
from flashfleet.requests import MAX_REQUEST_BYTES

# Largest decoded body, bytes: flashfleet's request limit plus room for JSON escapes (the size
# aiohttp's client_max_size allows an uncompressed body).
MAX_DECODED_BYTES = 2 * MAX_REQUEST_BYTES
# Content-Encoding -> zlib wbits of the formats tried, in order ("deflate" is zlib-wrapped per
# RFC 9110; some clients send raw deflate).
_WBITS = {"gzip": (16 + zlib.MAX_WBITS,), "x-gzip": (16 + zlib.MAX_WBITS,),
          "deflate": (zlib.MAX_WBITS, -zlib.MAX_WBITS)}


def decode_content(data: bytes, encoding: str | None, limit: int = MAX_DECODED_BYTES) -> bytes:
    """`data` decoded as `encoding` (a Content-Encoding value; None, "" and "identity": as is).

    Raises:
        OpenAIError: 415 for an encoding other than identity, gzip, x-gzip or deflate; 413 when
            the decoded body would pass `limit` bytes; 400 when `data` is not a complete stream
            of that encoding (or has bytes after its end).
    """
    name = (encoding or "identity").strip().lower()
    if name in ("", "identity"):
        return data
    if name not in _WBITS:
        raise OpenAIError(415, short_details(f"Content-Encoding {encoding!r} is not served: send the body as "
                                             "is, gzip or deflate"), "invalid_request_error", None,
                          "unsupported_content_encoding")
    for wbits in _WBITS[name]:
        inflater = zlib.decompressobj(wbits)
        try:
            out = inflater.decompress(data, limit + 1)
        except zlib.error:
            continue
        if len(out) > limit:
            raise OpenAIError(413, f"the request body decodes to more than {limit:,} bytes", "invalid_request_error",
                              None, "request_too_large")
        if inflater.eof and not inflater.unused_data:
            return out
    raise OpenAIError(400, short_details(f"the request body does not decode as its Content-Encoding {encoding!r} "
                                         "says"), code="invalid_argument")


async def read_json(request: web.Request) -> Any:
    """The request's body as JSON, decoded by its Content-Encoding (`decode_content`) and its
    charset (UTF-8 when none). The decoding runs on a worker thread (`asyncio.to_thread`):
    inflating and parsing up to `MAX_DECODED_BYTES` takes tens of milliseconds, which the event
    loop that relays every stream and heartbeat must not spend.

    Raises:
        OpenAIError: `decode_content`'s refusals; 400 when the body is not JSON, not in its
            declared charset (or one Python does not know), or nested too deep for the parser.
        web.HTTPRequestEntityTooLarge: the raw body passes the app's client_max_size.
    """
    data = await request.read()
    return await asyncio.to_thread(parse_json, data, request.headers.get("Content-Encoding"), request.charset)


def parse_json(data: bytes, encoding: str | None, charset: str | None) -> Any:
    """`data` (a request body) decoded by its Content-Encoding and charset, parsed as JSON
    (`read_json`, which documents the refusals)."""
    data = decode_content(data, encoding)
    try:
        return json.loads(data.decode(charset or "utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise OpenAIError(400, short_details(f"the request body is not JSON: {e}"), code="invalid_argument") from None
    except LookupError:
        raise OpenAIError(400, short_details(f"the request body's charset {charset!r} is unknown: "
                                             "send UTF-8 JSON"), code="invalid_argument") from None
    except RecursionError:
        raise OpenAIError(400, "the request body's JSON is nested too deeply", code="invalid_argument") from None
