"""A session state on the wire (ExportSession / ImportSession, protos/flashfleet/v1/worker.proto).

A state travels as one `SessionStateHeader` (format version, model and draft fingerprints, mode,
token ids, positions, every cache's layout, the payload size), then `SessionStateData` chunks of
at most `CHUNK_BYTES` each (one cache's keys or values, a byte range of its raw C-order data,
with the CRC-32 of those bytes), cache by cache in header order, keys before values, then one
`SessionStateTrailer` holding the SHA-256 of every chunk's bytes in stream order. `StateReceiver`
checks all of it on the way in.
"""
from __future__ import annotations

import hashlib
import zlib
from typing import Iterator

import numpy as np

from flashfleet.v1 import worker_pb2
from worker.engine.kv_transfer import CacheBytes, Layout, SessionState
from worker.engine.types import CorruptState, InvalidRequest

CHUNK_BYTES = 2 << 20  # bytes of array data per message (gRPC's default message cap is 4 MiB)


def header_proto(state: SessionState) -> worker_pb2.SessionStateHeader:
    """The header message of a state (no array data)."""
    return worker_pb2.SessionStateHeader(
        format_version=state.format_version, model_fingerprint=state.model_fingerprint,
        draft_fingerprint=state.draft_fingerprint, mode=state.mode, token_ids=state.tokens,
        positions=state.positions, payload_bytes=state.payload_bytes, request_id=state.request_id,
        caches=[worker_pb2.CacheLayout(part=lay.part, layer=lay.layer, dtype=lay.dtype,
                                       key_shape=lay.key_shape, value_shape=lay.value_shape)
                for lay in state.layouts])


def state_chunks(state: SessionState, chunk_bytes: int = CHUNK_BYTES) -> Iterator[worker_pb2.SessionStateChunk]:
    """The messages of a state in stream order: header, data chunks, trailer."""
    yield worker_pb2.SessionStateChunk(header=header_proto(state))
    digest = hashlib.sha256()
    for i, c in enumerate(state.caches):
        for values, raw in ((False, c.keys), (True, c.values)):
            view = memoryview(np.ascontiguousarray(raw)).cast("B")
            for off in range(0, len(view), chunk_bytes):
                data = bytes(view[off: off + chunk_bytes])
                digest.update(data)
                yield worker_pb2.SessionStateChunk(data=worker_pb2.SessionStateData(
                    cache=i, values=values, offset=off, data=data, crc32=zlib.crc32(data)))
    yield worker_pb2.SessionStateChunk(trailer=worker_pb2.SessionStateTrailer(sha256=digest.digest()))


def state_of_header(h: worker_pb2.SessionStateHeader) -> SessionState:
    """A `SessionState` with the header's fields and every cache's layout (empty buffers).

    Raises:
        InvalidRequest: a layout with a shape that is not 4-D or a dtype MLX does not know.
    """
    import mlx.core as mx

    caches = []
    for c in h.caches:
        if len(c.key_shape) != 4 or len(c.value_shape) != 4 or not isinstance(getattr(mx, c.dtype, None), mx.Dtype):
            raise InvalidRequest(f"cache {c.part} {c.layer}: shapes {list(c.key_shape)} / {list(c.value_shape)}, "
                                 f"dtype {c.dtype!r}")
        lay = Layout(c.part, c.layer, c.dtype, tuple(c.key_shape), tuple(c.value_shape))
        caches.append(CacheBytes(lay, np.empty(0, np.uint8), np.empty(0, np.uint8)))
    return SessionState(h.request_id, h.mode, tuple(h.token_ids), h.positions, caches,
                        h.model_fingerprint, h.draft_fingerprint, h.format_version)


class StateReceiver:
    """Assembles one incoming state, checking every chunk.

    Call `header` once, `data` per chunk, `finish` with the trailer; each raises on a bad stream.
    """

    def __init__(self):
        self.state: SessionState | None = None
        self._digest = hashlib.sha256()
        self._next: list[tuple[int, bool]] = []  # (cache, values) buffers in stream order
        self._filled = 0
        self.received = 0

    def header(self, h: worker_pb2.SessionStateHeader) -> SessionState:
        """Reads the header; returns the state's layouts (buffers not allocated yet).

        Raises:
            InvalidRequest: a second header, a bad layout, or a payload size that disagrees with
                the layouts.
        """
        if self.state is not None:
            raise InvalidRequest("a second header in one state stream")
        state = state_of_header(h)
        if state.payload_bytes != h.payload_bytes:
            raise InvalidRequest(f"payload_bytes {h.payload_bytes} but the layouts hold {state.payload_bytes}")
        self.state = state
        self._next = [(i, v) for i in range(len(state.caches)) for v in (False, True)]
        return state

    def allocate(self) -> None:
        """Allocates the buffers (after the header was accepted and its budget reserved)."""
        for c in self.state.caches:
            c.keys = np.empty(c.layout.key_bytes, np.uint8)
            c.values = np.empty(c.layout.value_bytes, np.uint8)
        self._skip_empty()

    def _skip_empty(self) -> None:
        while self._next and self._buffer(*self._next[0]).size == 0:
            self._next.pop(0)

    def _buffer(self, cache: int, values: bool) -> np.ndarray:
        c = self.state.caches[cache]
        return c.values if values else c.keys

    def data(self, d: worker_pb2.SessionStateData) -> None:
        """Checks one chunk (order, bounds, CRC-32) and copies it into place.

        Raises:
            InvalidRequest: data before the header, or a chunk out of stream order.
            CorruptState: its CRC-32 is wrong.
        """
        if self.state is None or not self._next:
            raise InvalidRequest("state data before the header or after the last buffer is full")
        if (d.cache, d.values) != self._next[0] or d.offset != self._filled:
            raise InvalidRequest(f"chunk (cache {d.cache}, values {d.values}, offset {d.offset}) out of order: "
                                 f"expected cache {self._next[0][0]}, values {self._next[0][1]}, offset {self._filled}")
        buf = self._buffer(d.cache, d.values)
        if d.offset + len(d.data) > buf.size or not d.data:
            raise InvalidRequest(f"chunk of {len(d.data)} bytes at {d.offset} outside a buffer of {buf.size}")
        if zlib.crc32(d.data) != d.crc32:
            raise CorruptState(f"CRC-32 mismatch in cache {d.cache} ({'values' if d.values else 'keys'}) "
                               f"at byte {d.offset}")
        buf[d.offset: d.offset + len(d.data)] = np.frombuffer(d.data, np.uint8)
        self._digest.update(d.data)
        self._filled += len(d.data)
        self.received += len(d.data)
        if self._filled == buf.size:
            self._next.pop(0)
            self._filled = 0
            self._skip_empty()

    def finish(self, t: worker_pb2.SessionStateTrailer) -> SessionState:
        """Checks the trailer; returns the complete state.

        Raises:
            CorruptState: data missing, or the SHA-256 differs.
        """
        if self.state is None or self._next:
            raise CorruptState(f"the state ended after {self.received:,} of "
                               f"{self.state.payload_bytes if self.state else 0:,} bytes")
        if self._digest.digest() != t.sha256:
            raise CorruptState("SHA-256 of the state's data does not match its trailer")
        return self.state
