"""Session migration by KV transfer: the coordinator has the destination pull a running session's
KV state straight from its worker while the stream goes on.

`start` calls the destination's PullSession(request id, the source's address) as an asyncio
task; the destination opens the source's ExportSession (a snapshot of the session's caches at its
committed length, docs/migration.md) and stages what arrives (worker/kv_pull.py), so the state's
bytes go worker to worker and never through the coordinator. The client keeps receiving the
source's tokens meanwhile. When the task has the destination's `PullSessionResponse`, the
coordinator cuts the stream at the next chunk boundary and opens Generate on the destination with
the usual resume fields plus `import_id` (coordinator/servicer.py `_migrate`): the destination
prefills only the tokens generated during the transfer. Any failure of the pull (the export
refused or cut, the state refused, a checksum wrong, the deadline) ends the task with
`TransferFailed`; the destination keeps nothing of a failed pull, and the coordinator falls back
to re-prefill or stays on the source.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import grpc

from flashfleet.v1 import worker_pb2

METHODS = ("kv", "reprefill")  # how sessions move: KV transfer (falling back), or re-prefill only
TRANSFER_TIMEOUT_S = 120.0  # longest transfer of one state, seconds (a request's deadline may cut it sooner)


class TransferFailed(Exception):
    """The destination did not stage the state.

    Attributes:
        code: the grpc.StatusCode of its PullSession (the export's own code when the source
            refused or failed; the message then starts "export from").
    """

    def __init__(self, error: grpc.aio.AioRpcError):
        super().__init__(f"pull failed: {error.code().name} {error.details()}")
        self.code = error.code()


async def pull(dest_stub: Any, request_id: str, source_address: str,
               timeout_s: float) -> worker_pb2.PullSessionResponse:
    """Has the destination (an aio Worker stub) pull request `request_id`'s state from the worker
    at `source_address`.

    Returns:
        The destination's PullSessionResponse (its import_id, positions, bytes).

    Raises:
        TransferFailed: the pull failed.
    """
    try:
        return await dest_stub.PullSession(
            worker_pb2.PullSessionRequest(request_id=request_id, source_address=source_address), timeout=timeout_s)
    except grpc.aio.AioRpcError as e:
        raise TransferFailed(e) from None


@dataclass
class Transfer:
    """One stream's transfer in flight or done.

    Attributes:
        dest: the destination's WorkerRecord (its `in_flight` counts this transfer).
        task: the pull; its result is the PullSessionResponse.
        started_s: monotonic time it started.
        reason: why the session moves (coordinator.migration.REASONS).
    """

    dest: Any
    task: asyncio.Task
    started_s: float
    reason: str = "load"

    def staged(self) -> worker_pb2.PullSessionResponse | None:
        """The destination's response when the pull is done and succeeded, else None."""
        if not self.task.done() or self.task.cancelled() or self.task.exception() is not None:
            return None
        return self.task.result()

    @property
    def bytes(self) -> int:
        """KV bytes the destination received (0 until the pull succeeded)."""
        staged = self.staged()
        return staged.bytes if staged is not None else 0

    def error(self) -> str:
        """Why a finished pull failed ("" when it did not)."""
        if not self.task.done():
            return ""
        if self.task.cancelled():
            return "cancelled"
        e = self.task.exception()
        return "" if e is None else str(e)


def start(dest_stub: Any, source_address: str, request_id: str, dest: Any, timeout_s: float | None,
          reason: str = "load") -> Transfer:
    """Starts the destination's pull of request `request_id`'s state from the worker at
    `source_address` (an asyncio task on the running loop) for `reason`; `timeout_s` None means
    `TRANSFER_TIMEOUT_S`."""
    timeout = TRANSFER_TIMEOUT_S if timeout_s is None else min(timeout_s, TRANSFER_TIMEOUT_S)
    task = asyncio.ensure_future(pull(dest_stub, request_id, source_address, timeout))
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: never "never retrieved"
    return Transfer(dest, task, time.monotonic(), reason)
