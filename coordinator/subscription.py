"""The coordinator's end of a worker's Subscribe stream (worker.proto): one per worker channel.

Relaying a token costs the coordinator a gRPC read from the worker and a write to the client,
each a completion handed from grpc's poller thread to the event loop. A worker's engine decodes
all of its sessions in one iteration, so their chunks are ready together: over a subscription
they cross as one ResponseBatch, and the read side costs one gRPC message per iteration of the
worker instead of one per session. Each Generate call still exists, carrying the request's
status (its refusal, deadline, error) and its lifetime (cancel ends the session, a call that
vanishes without a Cancel leaves it kept for a resume), but no message.

`WorkerSubscription` keeps the stream open (subscribing again after it breaks) and hands each
response to the `SubscribedCall` of its request_id; a `SubscribedCall` reads like the grpc.aio
call it wraps (`read`: the next response, `grpc.aio.EOF`, or the call's AioRpcError; `cancel`).
A worker that answers Subscribe with UNIMPLEMENTED, and a subscription not open yet, get plain
calls whose responses come on the call (`WorkerPool.generate`).
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import uuid

import grpc

from flashfleet.coalesce import MAX_COALESCED, coalesce
from flashfleet.requests import SUBSCRIPTION_HEADER
from flashfleet.v1 import common_pb2, worker_pb2

log = logging.getLogger("flashfleet.coordinator")
RESUBSCRIBE_S = 0.5  # how long a broken subscription waits before subscribing again
# A call can end OK before its Complete, sent first on the subscription, has been read from it
# (two HTTP/2 streams): its reader waits this long for the Complete before reading the end.
COMPLETE_WAIT_S = 5.0


def _unavailable(details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class SubscribedCall:
    """A worker's Generate call whose responses arrive on the worker's subscription.

    Args:
        subscription: the subscription it was attached to.
        request_id: the request's id (the responses' `request_id`).
        call: the grpc.aio call (its messages, if any, count as responses too).
    """

    __slots__ = ("_subscription", "request_id", "_call", "_queue", "_waiter", "_end", "_watch", "_give_up")

    def __init__(self, subscription: "WorkerSubscription", request_id: str, call):
        self._subscription, self.request_id, self._call = subscription, request_id, call
        self._queue: collections.deque[common_pb2.GenerateResponse] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._end: object = None  # grpc.aio.EOF, an exception to raise, or None while it runs
        self._give_up: asyncio.TimerHandle | None = None
        self._watch = asyncio.ensure_future(self._watch_call())

    def deliver(self, response: common_pb2.GenerateResponse) -> None:
        """A response of this request (from the subscription or the call), in order."""
        if self._end is not None:
            return
        self._queue.append(response)
        if response.WhichOneof("kind") == "complete":
            self._close(grpc.aio.EOF)
        self._wake()

    def fail(self, error: BaseException) -> None:
        """Ends the call with `error` (raised by `read` after the responses already queued)."""
        if self._end is None:
            self._close(error)
            self._wake()

    async def read(self):
        """The next response, or grpc.aio.EOF after the last; raises the call's AioRpcError (or
        asyncio.CancelledError after `cancel`). Chunks that queued while the reader was busy
        (writing to a slow client) come as one (`flashfleet.coalesce`)."""
        while not self._queue:
            end = self._end
            if end is grpc.aio.EOF:
                return end
            if end is not None:
                raise end
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        queue = self._queue
        resp = queue.popleft()
        if queue and resp.WhichOneof("kind") == "chunk":
            resp, n = coalesce([resp, *itertools.islice(queue, MAX_COALESCED - 1)], 0)
            for _ in range(n - 1):
                queue.popleft()
        return resp

    def cancel(self) -> bool:
        """Cancels the worker call (ending its session there) and drops what was not read."""
        self._queue.clear()
        if self._end is None:
            self._close(asyncio.CancelledError())
            self._wake()
        self._watch.cancel()
        return self._call.cancel()

    def _close(self, end) -> None:
        self._end = end
        self._subscription.detach(self)
        if self._give_up is not None:
            self._give_up.cancel()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _watch_call(self) -> None:
        """Reads the call itself: its end (OK or an error status) and any message it carries."""
        try:
            while (resp := await self._call.read()) is not grpc.aio.EOF:
                self.deliver(resp)
        except grpc.aio.AioRpcError as e:
            self.fail(e)
            return
        except asyncio.CancelledError:
            return
        if self._end is None:  # ended OK: its Complete may still be on its way on the subscription
            self._give_up = asyncio.get_running_loop().call_later(COMPLETE_WAIT_S, self._eof)

    def _eof(self) -> None:
        self._give_up = None
        if self._end is None:
            self._close(grpc.aio.EOF)
            self._wake()


class WorkerSubscription:
    """A Subscribe stream to one worker, kept open while the coordinator has a channel to it.

    Args:
        stub: the worker's stub (sends the join token when the coordinator has one).
        address: the worker's "host:port" (for messages).

    Attributes:
        live: the worker confirmed the current subscription (its first, empty batch arrived).
        unsupported: the worker answered UNIMPLEMENTED (it streams on each call).
    """

    def __init__(self, stub, address: str):
        self._stub, self.address = stub, address
        self.subscription_id = ""
        self.live = False
        self.unsupported = False
        self._retired = False
        self._calls: dict[str, SubscribedCall] = {}
        self._task = asyncio.ensure_future(self._run())

    def generate(self, request: common_pb2.GenerateRequest, *, timeout: float | None, metadata=()) -> SubscribedCall:
        """Opens Generate on the worker naming this subscription (call only while `live`)."""
        call = self._stub.Generate(request, timeout=timeout,
                                   metadata=(*metadata, (SUBSCRIPTION_HEADER, self.subscription_id)))
        sub_call = SubscribedCall(self, request.request_id, call)
        self._calls[request.request_id] = sub_call
        return sub_call

    def detach(self, sub_call: SubscribedCall) -> None:
        """Stops routing responses to `sub_call` (its call ended or was cancelled)."""
        if self._calls.get(sub_call.request_id) is sub_call:
            del self._calls[sub_call.request_id]

    def retire(self) -> None:
        """Subscribes no more: the stream open now serves its calls until it ends (its worker
        left the registry, maybe only for a late heartbeat)."""
        self._retired = True
        if not self.live:
            self._task.cancel()

    async def close(self) -> None:
        """Ends the stream; the calls attached to it end UNAVAILABLE."""
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass

    async def _run(self) -> None:
        while True:
            self.subscription_id = uuid.uuid4().hex
            call = self._stub.Subscribe(worker_pb2.SubscribeRequest(subscription_id=self.subscription_id))
            why = "ended"
            try:
                async for batch in call:
                    self.live = True
                    calls = self._calls
                    for resp in batch.responses:
                        sub_call = calls.get(resp.request_id)
                        if sub_call is not None:
                            sub_call.deliver(resp)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    self.unsupported = True
                    log.info("worker %s has no Subscribe: its responses come on each call", self.address)
                    return
                why = f"{e.code().name}: {e.details()}"
            finally:
                call.cancel()
                self.live = False
                self._fail_all(f"the subscription to worker {self.address} broke ({why})")
            if self._retired:
                return
            await asyncio.sleep(RESUBSCRIBE_S)

    def _fail_all(self, details: str) -> None:
        for sub_call in list(self._calls.values()):
            sub_call.fail(_unavailable(details))
        self._calls.clear()
