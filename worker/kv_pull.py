"""The destination's side of a KV transfer: pulling a running session's state straight from the
worker that runs it (PullSession, docs/migration.md).

The destination opens the source's ExportSession and feeds its messages, as they arrive, to its
own import (`WorkerServicer._stage`: header check and budget reservation, CRC-32 per chunk,
SHA-256 trailer). The state goes worker to worker: the coordinator only asks for the pull and
gets the import id back, so a long context's KV bytes never cross the coordinator's link.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator

import grpc

from flashfleet.auth import join_token_metadata, with_metadata
from flashfleet.transport import WORKER_CHANNEL_OPTIONS, aio_channel
from flashfleet.v1 import worker_pb2, worker_pb2_grpc


@dataclass
class Relayed:
    """What a pull has received so far: the export's error if it failed."""

    export_error: grpc.aio.AioRpcError | None = None


async def relay_chunks(export_call: Any, relayed: Relayed) -> AsyncIterator[worker_pb2.SessionStateChunk]:
    """The export's messages, as the import's input. An export that fails ends the stream early
    (the import then refuses the incomplete state with DATA_LOSS); its error is kept in
    `relayed`."""
    try:
        async for chunk in export_call:
            yield chunk
    except grpc.aio.AioRpcError as e:
        relayed.export_error = e


class Peers:
    """Opens the calls a worker makes to other workers (the same TLS and join token as the
    coordinator's calls to workers).

    Args:
        tls: flashfleet.config.TLSConfig for mutual TLS, or None for plaintext.
        join_token: sent as metadata on every call (workers with a join token serve only callers
            that present it), or None.
    """

    def __init__(self, tls=None, join_token: str | None = None):
        self._tls = tls
        self._metadata = join_token_metadata(join_token)

    def channel(self, address: str) -> grpc.aio.Channel:
        """A new channel to the worker at `address` ("host:port"); close it after use."""
        return aio_channel(address, self._tls, WORKER_CHANNEL_OPTIONS)

    def stub(self, channel: grpc.aio.Channel) -> worker_pb2_grpc.WorkerStub:
        """A Worker stub on `channel` whose calls carry the join token."""
        return with_metadata(worker_pb2_grpc.WorkerStub(channel), self._metadata)
