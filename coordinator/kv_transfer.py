"""Session migration by KV transfer: the coordinator relays a running session's KV state from its
worker to the destination while the stream goes on.

`start` opens source.ExportSession (a snapshot of the session's caches at its committed length,
docs/migration.md) and pipes its messages into dest.ImportSession as they arrive, as an asyncio
task; the client keeps receiving the source's tokens meanwhile. When the task has the
destination's `ImportSessionResponse`, the coordinator cuts the stream at the next chunk
boundary and opens Generate on the destination with the usual resume fields plus `import_id`
(coordinator/servicer.py `_migrate`): the destination prefills only the tokens generated during
the transfer. Any failure of the relay (the export refused or cut, the import refused, a
checksum wrong, the deadline) ends the task with `TransferFailed`; the destination keeps nothing
of a failed import (its ImportSession drops it), and the coordinator falls back to re-prefill
or stays on the source.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import grpc

from flashfleet.v1 import worker_pb2

METHODS = ("kv", "reprefill")  # how sessions move: KV transfer (falling back), or re-prefill only
TRANSFER_TIMEOUT_S = 120.0  # longest relay of one state, seconds (a request's deadline may cut it sooner)


class TransferFailed(Exception):
    """The relay did not stage the state on the destination.

    Attributes:
        code: the grpc.StatusCode of the call that failed (the export's when it failed first).
        stage: "export" or "import".
    """

    def __init__(self, stage: str, error: grpc.aio.AioRpcError):
        super().__init__(f"{stage} failed: {error.code().name} {error.details()}")
        self.stage, self.code = stage, error.code()


@dataclass
class Relayed:
    """What the relay has moved so far: payload bytes, and the export's error if it failed."""

    bytes: int = 0
    export_error: grpc.aio.AioRpcError | None = None


async def relay_chunks(export_call: Any, relayed: Relayed) -> AsyncIterator[worker_pb2.SessionStateChunk]:
    """The export's messages, as the import's request stream. An export that fails ends the
    stream early (the destination then refuses the incomplete state with DATA_LOSS); its error is
    kept in `relayed`."""
    try:
        async for chunk in export_call:
            if chunk.WhichOneof("kind") == "data":
                relayed.bytes += len(chunk.data.data)
            yield chunk
    except grpc.aio.AioRpcError as e:
        relayed.export_error = e


async def relay(source_stub: Any, dest_stub: Any, request_id: str, timeout_s: float,
                relayed: Relayed) -> worker_pb2.ImportSessionResponse:
    """Exports request `request_id`'s state from the source worker and imports it on the
    destination (aio Worker stubs).

    Returns:
        The destination's ImportSessionResponse (its import_id, positions, bytes).

    Raises:
        TransferFailed: either call failed (the export's error wins: it caused the import's).
    """
    export = source_stub.ExportSession(worker_pb2.ExportSessionRequest(request_id=request_id), timeout=timeout_s)
    try:
        return await dest_stub.ImportSession(relay_chunks(export, relayed), timeout=timeout_s)
    except grpc.aio.AioRpcError as e:
        if relayed.export_error is not None:
            raise TransferFailed("export", relayed.export_error) from None
        raise TransferFailed("import", e) from None
    finally:
        export.cancel()


@dataclass
class Transfer:
    """One stream's relay in flight or done.

    Attributes:
        dest: the destination's WorkerRecord (its `in_flight` counts this transfer).
        task: the relay; its result is the ImportSessionResponse.
        started_s: monotonic time it started.
        relayed: bytes moved so far.
        reason: why the session moves (coordinator.migration.REASONS).
    """

    dest: Any
    task: asyncio.Task
    started_s: float
    relayed: Relayed = field(default_factory=Relayed)
    reason: str = "load"

    def staged(self) -> worker_pb2.ImportSessionResponse | None:
        """The destination's response when the relay is done and succeeded, else None."""
        if not self.task.done() or self.task.cancelled() or self.task.exception() is not None:
            return None
        return self.task.result()

    def error(self) -> str:
        """Why a finished relay failed ("" when it did not)."""
        if not self.task.done():
            return ""
        if self.task.cancelled():
            return "cancelled"
        e = self.task.exception()
        return "" if e is None else str(e)


def start(source_stub: Any, dest_stub: Any, request_id: str, dest: Any, timeout_s: float | None,
          reason: str = "load") -> Transfer:
    """Starts relaying request `request_id`'s state from the source to `dest` (an asyncio task on
    the running loop) for `reason`; `timeout_s` None means `TRANSFER_TIMEOUT_S`."""
    relayed = Relayed()
    timeout = TRANSFER_TIMEOUT_S if timeout_s is None else min(timeout_s, TRANSFER_TIMEOUT_S)
    task = asyncio.ensure_future(relay(source_stub, dest_stub, request_id, timeout, relayed))
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: never "never retrieved"
    return Transfer(dest, task, time.monotonic(), relayed, reason)
