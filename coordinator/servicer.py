"""The coordinator's gRPC servicers: the public Coordinator API and the internal Registry.

Concurrency: everything runs on one asyncio event loop; the registry and session map are plain
objects touched only from that loop, so no locks. A client's Generate is proxied to one worker
stream; the client going away cancels the handler task, whose `finally` cancels the worker call,
which in turn aborts the request in the worker's engine. Between two chunks the stream may move
to another worker (session migration, coordinator/migration.py): the destination pulls the
session's KV state straight from the source while the stream goes on (coordinator/kv_transfer.py),
then the same request, resumed after the tokens already sent and naming the imported state, opens on the
destination (or, without a state, prefills everything there), and the source call is cancelled
once the destination answers. Operators drain a worker (`DrainWorker`: its sessions move, then it
is told to leave) or move one request (`MoveSession`); both are Coordinator RPCs, so API keys
guard them.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import grpc
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from coordinator import kv_transfer
from coordinator.admission import AdmissionQueue
from coordinator.config import CoordinatorConfig
from coordinator.migration import Decision, StreamProgress, session_load
from coordinator.registry import UnknownLease, WorkerIdInUse, WorkerRecord
from coordinator.routing import AllBusy, NoWorker, PowerOfTwoRouter, request_tokens_bound, route
from coordinator.state import FleetState, NotLive
from flashfleet.errors import FlashfleetError, short_details
from flashfleet.requests import validate_request
from flashfleet.auth import join_token_metadata, with_metadata
from flashfleet.transport import WORKER_CHANNEL_OPTIONS, aio_channel
from flashfleet.v1 import (common_pb2, coordinator_pb2, coordinator_pb2_grpc, worker_pb2,
                           worker_pb2_grpc)

log = logging.getLogger("flashfleet.coordinator")

# Seconds left before the request's deadline, or None when it has none (a gRPC call's
# `context.time_remaining`).
TimeRemaining = Callable[[], "float | None"]

# Failures that mean "this worker cannot take it now": try another one (before the first token).
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
OUTCOME_BY_CODE = {grpc.StatusCode.INVALID_ARGUMENT: "invalid",
                   grpc.StatusCode.RESOURCE_EXHAUSTED: "overloaded",
                   grpc.StatusCode.DEADLINE_EXCEEDED: "deadline",
                   grpc.StatusCode.CANCELLED: "cancelled"}


# The server's copy of a deadline runs out later than the client's by the request's one-way
# latency, so the cancel a client sends at its deadline can arrive while the server still sees a
# few milliseconds left. A cancel this close to the deadline is counted as the deadline.
DEADLINE_SLACK_S = 0.05
FAILOVER_TRANSFER_WAIT_S = 2.0  # a failover waits this long for a KV transfer that is finishing


def _deadline_passed(time_remaining: TimeRemaining) -> bool:
    """Whether the call's deadline (if it has one) is over, within DEADLINE_SLACK_S seconds: a
    call that ends unfinished then ended by DEADLINE_EXCEEDED, not by the client's cancel."""
    remaining = time_remaining()
    return remaining is not None and remaining <= DEADLINE_SLACK_S


class GenerateFailed(Exception):
    """A request `CoordinatorServicer.generate` ends with an error status.

    Attributes:
        code: the grpc.StatusCode the gRPC API aborts the call with (the HTTP API maps it onto an
            HTTP status, coordinator/openai_api.py).
        details: what went wrong, for the client.
    """

    def __init__(self, code: grpc.StatusCode, details: str):
        details = short_details(details)
        super().__init__(details)
        self.code, self.details = code, details


class WorkerPool:
    """One gRPC channel per worker address, opened lazily and closed when the worker leaves.

    Args:
        tls: flashfleet.config.TLSConfig for mutual TLS to workers, or None for plaintext.
        join_token: sent as metadata on every worker call (workers with a join token serve only
            callers that present it; flashfleet/auth.py), or None.
    """

    def __init__(self, tls=None, join_token: str | None = None):
        self._tls = tls
        self._metadata = join_token_metadata(join_token)
        self._channels: dict[str, grpc.aio.Channel] = {}

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        """A Worker stub on the channel to `address` ("host:port"), opening the channel on first use."""
        if address not in self._channels:
            self._channels[address] = aio_channel(address, self._tls, WORKER_CHANNEL_OPTIONS)
        return with_metadata(worker_pb2_grpc.WorkerStub(self._channels[address]), self._metadata)

    async def drop(self, address: str) -> None:
        """Closes the channel to `address` (cancelling its open calls); a no-op when none is open."""
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        """Closes every channel (coordinator shutdown)."""
        for address in list(self._channels):
            await self.drop(address)


class _WorkerFailed(Exception):
    def __init__(self, worker: WorkerRecord, error: grpc.aio.AioRpcError):
        super().__init__(error.details())
        self.worker, self.error = worker, error


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, _WorkerFailed) and exc.error.code() in RETRYABLE


@dataclass(frozen=True)
class Move:
    """One session move (or attempt), as `CoordinatorServicer.moves` records it.

    Attributes:
        model: the request's model.
        outcome: "ok", "aborted", "failover" or "failover_failed" (as the migrations metric).
        reason: why it moved (coordinator.migration.REASONS).
        method: "kv" (the state was copied) or "reprefill" (the destination prefilled it all).
        bytes_moved: KV bytes the destination received from the source (0 for re-prefill).
        pause_s: the gap the client saw: last source token forwarded to the destination's first
            message (0 when the session did not move).
        total_s: from the start of the move (the transfer's start, for "kv") to the destination's
            first message, seconds.
    """

    model: str
    outcome: str
    reason: str
    method: str
    bytes_moved: int
    pause_s: float
    total_s: float


MOVES_KEPT = 256  # recent moves kept in `CoordinatorServicer.moves`


def _full(exc: BaseException | None) -> bool:
    """A worker refused for capacity: its sessions outnumber this coordinator's streams to it
    (a cancelled stream's session ends at the worker's next engine turn, not when the coordinator
    drops the call), so it is full for now, not failed."""
    return isinstance(exc, _WorkerFailed) and exc.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


@dataclass
class _MoveRequest:
    """An operator's MoveSession waiting for the stream's next chunk boundary."""

    dest: WorkerRecord
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass
class _Stream:
    """A Generate stream in flight: what MoveSession and DrainWorker look up."""

    request: common_pb2.GenerateRequest
    progress: StreamProgress
    worker: WorkerRecord | None = None


DRAIN_POLL_S = 0.1  # how often DrainWorker looks at the drained worker's streams


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    """Public API: routes Generate to a worker and proxies its stream; lists models and status;
    drains workers and moves sessions on an operator's command."""

    def __init__(self, config: CoordinatorConfig, state: FleetState, pool: WorkerPool,
                 router: PowerOfTwoRouter | None = None, metrics=None):
        self.config = config
        self.state = state  # the fleet's state (coordinator/state/): workers, drains, placements
        self.registry = state.registry
        self.pool = pool
        self.router = router or PowerOfTwoRouter()
        self.affinity = state.affinity
        self.metrics = metrics
        self.admission = AdmissionQueue(config.max_queued, config.queue_timeout_s)
        self._in_flight: set[str] = set()  # request ids of streams running now (duplicates refused)
        self._streams: dict[str, _Stream] = {}  # request id -> its stream, once routed
        self._drain_moved: dict[str, int] = {}  # worker id -> sessions moved off it while it drains
        self._transfers: dict[str, kv_transfer.Transfer] = {}  # request id -> its KV transfer in flight
        self._background: set[asyncio.Task] = set()  # best-effort calls nobody waits for
        self.moves: deque[Move] = deque(maxlen=MOVES_KEPT)  # recent moves, newest last
        if metrics:
            metrics.queued.set_function(lambda: self.admission.waiting)

    def _has_room(self, request: common_pb2.GenerateRequest) -> bool:
        """True when a reachable worker serving the request's model and mode has a free slot
        (or none serves it, or all that do are unreachable: routing then says so or tries them)."""
        serving = [w for w in self.registry.live() if w.serves(request.model, request.mode) and not w.draining]
        reachable = [w for w in serving if not w.unreachable]
        return not reachable or any(w.busy < w.capacity for w in reachable)

    def _release(self, worker: WorkerRecord) -> None:
        """Gives back the slot a stream held on `worker` and wakes requests waiting for one."""
        worker.in_flight -= 1
        self.admission.notify()

    async def Generate(self, request: common_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        """gRPC Generate: writes what `generate` yields to the call and aborts the call with the
        status of its `GenerateFailed`. The client going away cancels this handler, whose
        generator then closes: the worker call is cancelled and the slot given back."""
        async with contextlib.aclosing(self.generate(request, context.time_remaining)) as responses:
            try:
                async for resp in responses:
                    await context.write(resp)
            except GenerateFailed as e:
                await context.abort(e.code, e.details)

    async def generate(self, request: common_pb2.GenerateRequest,
                       time_remaining: TimeRemaining) -> AsyncIterator[common_pb2.GenerateResponse]:
        """Routes a request to a worker and yields its responses (chunks, then one complete): the
        one path of every public API (gRPC `Generate`, the OpenAI-compatible HTTP API).

        Waits in the admission queue while every worker serving the model is full, retries other
        workers on UNAVAILABLE / RESOURCE_EXHAUSTED before the first message, and may migrate the
        stream between chunks (`coordinator.migration`: the policy's speed, load, memory and drain moves, and
        an operator's `MoveSession`). The final stats get `queue_s` (seconds
        from arrival until the serving worker's call was issued) and, after a migration, counts
        as if one worker had served it (`StreamProgress.finish_stats`). Sets `request.request_id`
        when it is empty. Close the generator (`contextlib.aclosing`) when leaving it early: that
        cancels the worker call, gives back its slot and counts the request as cancelled (or as
        past its deadline when `time_remaining` says so).

        Args:
            request: the client's request (`resume_*` fields and `import_id` must be empty).
            time_remaining: seconds left before the request's deadline, or None without one; the
                worker calls get it as their timeout.

        Raises:
            GenerateFailed: with
                INVALID_ARGUMENT: the request fails `validate_request`, sets `resume_token_ids` /
                    `resume_text` / `import_id` (coordinator-only fields), or reuses the request_id of a request
                    still in flight.
                NOT_FOUND: no live worker serves the model (or none has a draft for the requested mode).
                RESOURCE_EXHAUSTED: every eligible worker is full and the admission queue is full or
                    its `queue_timeout_s` ran out.
                the worker's own status code: the last worker tried refused the request before its
                    first message, or a worker failed mid-stream (never retried once tokens were sent).
        """
        t0 = time.monotonic()
        try:
            validate_request(request)
        except FlashfleetError as e:
            known = any(w.serves(request.model) for w in self.registry.live())
            self._count(request.model if known else "(unknown)", "", "invalid")
            raise GenerateFailed(e.code, e.details) from None
        if request.resume_token_ids or request.resume_text or request.import_id:
            self._count("(unknown)", "", "invalid")
            raise GenerateFailed(grpc.StatusCode.INVALID_ARGUMENT, "resume_token_ids, resume_text and import_id "
                                 "are set by the coordinator when it migrates a session; leave them empty")
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        elif request.request_id in self._in_flight:
            self._count(request.model, "", "invalid")
            raise GenerateFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"request_id {request.request_id!r} is already in flight: give each request "
                                 "its own id (or none: the coordinator makes one)")
        self._in_flight.add(request.request_id)
        try:
            async with contextlib.aclosing(self._routed(request, time_remaining, t0)) as responses:
                async for resp in responses:
                    yield resp
        finally:
            self._in_flight.discard(request.request_id)

    async def _routed(self, request: common_pb2.GenerateRequest, time_remaining: TimeRemaining,
                      t0: float) -> AsyncIterator[common_pb2.GenerateResponse]:
        """`generate` after validation: routing, the stream, migration (see `generate`)."""
        tried: set[str] = set()
        try:
            worker, call, first, queue_s = await self._open_stream(request, time_remaining, tried, t0)
        except asyncio.CancelledError:  # the client left, or its deadline ran out, before a first token
            self._count(request.model, "", "deadline" if _deadline_passed(time_remaining) else "cancelled")
            raise
        except NoWorker as e:
            # Unknown names share one label value: clients must not create unbounded series.
            known = any(w.serves(request.model) for w in self.registry.live())
            self._count(request.model if known else "(unknown)", "", "no_worker")
            served = sorted({m for w in self.registry.live() for m in w.model_names})
            raise GenerateFailed(grpc.StatusCode.NOT_FOUND,
                                 str(e) if known else f"{e}; models served: {served}") from None
        except AllBusy as e:
            self._count(request.model, "", "overloaded")
            raise GenerateFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        except _WorkerFailed as e:
            self._count(request.model, e.worker.worker_id, OUTCOME_BY_CODE.get(e.error.code(), "error"))
            raise GenerateFailed(e.error.code(), e.error.details() or "worker failed") from None
        if self.metrics:
            self.metrics.observe_queue(request.model, queue_s)
        self.affinity.bind(request.session_id, worker.worker_id)
        self.state.place(request.request_id, worker.worker_id, 0)
        progress = StreamProgress()
        stream = self._streams[request.request_id] = _Stream(request, progress, worker)
        outcome = "cancelled"
        try:
            resp = first
            while resp is not grpc.aio.EOF:
                stream.worker = worker
                if resp.WhichOneof("kind") == "complete":
                    resp.complete.stats.queue_s = queue_s
                    progress.finish_stats(resp.complete.stats)
                    outcome = "ok"
                    yield resp
                else:
                    progress.add(resp.chunk)
                    yield resp
                    moved = await self._transfer_due(request, time_remaining, progress, worker, call)
                    if not moved and request.request_id not in self._transfers:
                        decision = self._move_decision(request, worker, progress)
                        if decision is not None:
                            moved = await self._migrate(request, time_remaining, progress, worker, call,
                                                        decision.dest, decision.reason)
                    if request.request_id not in self._transfers:  # a move ended (or none was asked)
                        self._settle_move_request(progress, worker, moved)
                        if moved:
                            progress.left(worker.worker_id)
                            if worker.draining:
                                self._drain_moved[worker.worker_id] = self._drain_moved.get(worker.worker_id, 0) + 1
                            worker, call, resp = moved
                            continue
                try:
                    resp = await call.read()
                except grpc.aio.AioRpcError as e:
                    if e.code() != grpc.StatusCode.UNAVAILABLE:
                        raise
                    worker.unreachable = True  # died mid-stream: new requests go elsewhere first
                    moved = await self._failover(request, time_remaining, progress, worker, e)
                    if moved is None:
                        raise
                    call.cancel()
                    self._release(worker)
                    worker, call, resp = moved
        except grpc.aio.AioRpcError as e:
            outcome = OUTCOME_BY_CODE.get(e.code(), "error")
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                worker.unreachable = True  # died mid-stream: new requests go elsewhere first
            # Tokens are with the client: a replay elsewhere would repeat them (failover resumes
            # instead, after UNAVAILABLE; it found no worker that took the session).
            raise GenerateFailed(e.code(), f"worker {worker.worker_id} failed after {len(progress.token_ids)} "
                                 f"tokens and no other worker could resume the session: {e.details()}") from None
        finally:
            self._abandon_transfer(request.request_id)
            self._streams.pop(request.request_id, None)
            self.state.unplace(request.request_id)
            self._settle_move_request(progress, worker, None, ended=True)
            call.cancel()
            self._release(worker)
            worker.served_requests += 1
            if outcome == "cancelled" and _deadline_passed(time_remaining):
                outcome = "deadline"  # the client's deadline ended the call, not the client
            self._count(request.model, worker.worker_id, outcome)
            if worker.in_flight == 0 and not any(w.address == worker.address
                                                 for w in self.registry.live()):
                await self.pool.drop(worker.address)  # the worker left while this stream ran

    async def _migrate(self, request, time_remaining: TimeRemaining, progress: StreamProgress, source: WorkerRecord,
                       source_call, dest: WorkerRecord, reason: str = "load"):
        """Starts moving a stream from `source` to `dest` for `reason` (coordinator.migration.REASONS,
        which labels its metrics).

        With `migration_method` "kv" (the default) this has `dest` start pulling the session's KV
        state from `source` (coordinator/kv_transfer.py) and returns None: the stream goes on from the
        source, and `_transfer_due` completes the move at a chunk boundary once the state is
        staged. With "reprefill" the move happens now (`_move`). One move at a time per stream.

        Returns:
            (dest, its call, its first response) when the stream moved now, else None.
        """
        if request.request_id in self._transfers:
            return None
        if self.config.migration_method == "kv":
            dest.in_flight += 1  # reserved now, so no other stream takes the idle worker meanwhile
            self._transfers[request.request_id] = kv_transfer.start(
                self.pool.stub(dest.address), source.address, request.request_id, dest, time_remaining(), reason)
            log.info("moving %s from %s to %s (%s): KV transfer started", request.request_id, source.worker_id,
                     dest.worker_id, reason)
            return None
        return await self._move(request, time_remaining, progress, source, source_call, dest, reason=reason,
                                method="reprefill")

    async def _transfer_due(self, request, time_remaining: TimeRemaining, progress: StreamProgress,
                            source: WorkerRecord, source_call):
        """At a chunk boundary: completes a finished KV transfer of this stream. Staged: the
        stream moves to its destination, claiming the state (`_move`). Failed: the stream moves by
        re-prefill when it must move (an operator's move, a drain, memory) or the policy still picks
        that destination, else it stays.

        Returns:
            (dest, its call, its first response) when the stream moved, else None.
        """
        t = self._transfers.get(request.request_id)
        if t is None or not t.task.done():
            return None
        del self._transfers[request.request_id]
        self._release(t.dest)  # `_move` reserves it again
        staged = t.staged()
        if staged is not None:
            return await self._move(request, time_remaining, progress, source, source_call, t.dest, reason=t.reason,
                                    method="kv", import_id=staged.import_id, bytes_moved=t.bytes,
                                    started_s=t.started_s)
        log.info("KV transfer of %s to %s failed (%s)", request.request_id, t.dest.worker_id, t.error())
        self._migrated(request.model, "aborted", reason=t.reason, method="kv", bytes_moved=t.bytes,
                       total_s=time.monotonic() - t.started_s)
        if t.reason in ("load", "speed"):  # the re-prefill's cost may not pay where the copy's did
            again = self.config.migration.decide(request, source, len(progress.token_ids), [source, t.dest], None,
                                                 time.monotonic())
            if again is None or again.dest is not t.dest:
                progress.attempted()
                return None
        return await self._move(request, time_remaining, progress, source, source_call, t.dest, reason=t.reason,
                                method="reprefill")

    def _abandon_transfer(self, request_id: str) -> None:
        """Stops a stream's KV transfer, gives back its destination's slot and asks the
        destination to drop a state it may have staged (a Cancel of the request id)."""
        t = self._transfers.pop(request_id, None)
        if t is None:
            return
        t.task.cancel()
        self._release(t.dest)
        self._spawn(self._cancel_quietly(t.dest, request_id))

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _cancel_quietly(self, worker: WorkerRecord, request_id: str) -> None:
        """Cancel(request_id) on a worker, best effort: drops a state staged there for it."""
        try:
            await self.pool.stub(worker.address).Cancel(worker_pb2.CancelRequest(request_id=request_id), timeout=1.0)
        except grpc.aio.AioRpcError as e:
            log.debug("cancel of %s on %s: %s", request_id, worker.worker_id, e.code().name)

    async def _move(self, request, time_remaining: TimeRemaining, progress: StreamProgress, source: WorkerRecord,
                    source_call, dest: WorkerRecord, *, reason: str, method: str, import_id: str = "",
                    bytes_moved: int = 0, started_s: float | None = None):
        """Moves a stream from `source` to `dest` now: the resumed request (naming `import_id`,
        a state staged there, if any) goes to `dest` while the source call stays open and unread;
        only when `dest` sends its first message is the source cancelled (its unread messages,
        past the resume point, are dropped). If `dest` refuses (at capacity, draining, or the
        request ended meanwhile: its tokens already reach a stop string or the budget), the
        stream simply stays on the source, nothing lost.

        Returns:
            (dest, its call, its first response), or None when the stream stays on the source.
        """
        cut_s = time.monotonic()
        started_s = cut_s if started_s is None else started_s
        resumed = progress.resume_request(request)
        resumed.import_id = import_id
        dest.in_flight += 1  # reserved now, so no other stream takes the idle worker meanwhile
        call = None
        try:
            call = self.pool.stub(dest.address).Generate(resumed, timeout=time_remaining())
            first = await call.read()
            if first is grpc.aio.EOF:
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           "the worker ended the stream without a message")
        except BaseException as e:
            self._release(dest)
            if call is not None:
                call.cancel()
            if import_id:  # the destination drops it when it refuses; said again for a call that never reached it
                self._spawn(self._cancel_quietly(dest, request.request_id))
            if not isinstance(e, grpc.aio.AioRpcError):  # the client left, or the server stops
                raise
            log.info("migration of %s to %s refused (%s %s); it stays on %s", request.request_id, dest.worker_id,
                     e.code().name, e.details(), source.worker_id)
            if call is not None and await call.code() == grpc.StatusCode.UNAVAILABLE:
                dest.unreachable = True  # its own call failed, as in routing: passed over until it heartbeats
            self._migrated(request.model, "aborted", reason=reason, method=method, bytes_moved=bytes_moved,
                           total_s=time.monotonic() - started_s)
            progress.attempted()
            return None
        first_s = time.monotonic()
        try:  # said first, so the source counts the request as migrated, not cancelled by its client
            await self.pool.stub(source.address).Cancel(
                worker_pb2.CancelRequest(request_id=request.request_id, reason="migrated"), timeout=1.0)
        except grpc.aio.AioRpcError as e:
            log.info("cancel of %s on %s before its move: %s (the stream is dropped anyway)",
                     request.request_id, source.worker_id, e.code().name)
        except BaseException:  # the client left meanwhile: the destination's call goes too
            self._release(dest)
            call.cancel()
            raise
        source_call.cancel()  # the client has exactly progress.token_ids: nothing lost, nothing repeated
        self._release(source)  # served_requests counts the request once, on the worker that ends it
        if source.in_flight == 0 and not any(w.address == source.address for w in self.registry.live()):
            await self.pool.drop(source.address)  # the source left while this stream ran
        self._migrated(request.model, "ok", reason=reason, method=method, bytes_moved=bytes_moved,
                       pause_s=first_s - cut_s, total_s=first_s - started_s)
        progress.moved()
        self.affinity.bind(request.session_id, dest.worker_id)
        self.state.place(request.request_id, dest.worker_id, len(progress.token_ids))
        log.info("session %s (request %s) moved from %s to %s after %d tokens (%s, %d bytes, pause %.3f s)",
                 request.session_id or "-", request.request_id, source.worker_id, dest.worker_id,
                 len(progress.token_ids), method, bytes_moved, first_s - cut_s)
        return dest, call, first

    async def _staged_transfer(self, request_id: str) -> kv_transfer.Transfer | None:
        """A stream's KV transfer when its source failed: the transfer if its state is staged on
        the destination (waiting up to `FAILOVER_TRANSFER_WAIT_S` for one still finishing), else
        None; either way it no longer counts against its destination."""
        t = self._transfers.pop(request_id, None)
        if t is None:
            return None
        self._release(t.dest)
        if not t.task.done():
            with contextlib.suppress(asyncio.TimeoutError, kv_transfer.TransferFailed):
                await asyncio.wait_for(asyncio.shield(t.task), FAILOVER_TRANSFER_WAIT_S)
        if t.staged() is None:
            t.task.cancel()
            return None
        return t

    async def _failover(self, request, time_remaining: TimeRemaining, progress: StreamProgress,
                        dead: WorkerRecord, error: grpc.aio.AioRpcError):
        """Resumes a stream whose worker failed UNAVAILABLE mid-stream on another worker serving
        the model, from the tokens the client already has (the destination prefills prompt +
        output, as a migration by recomputation does; greedy and seeded output continue exactly).
        A KV transfer of the stream whose state is staged on a live destination is claimed there
        first. Tries the live, reachable workers with a free slot, least busy first.

        Returns:
            (worker, its call, its first response), or None when none took it.
        """
        started_s = time.monotonic()
        transfer = await self._staged_transfer(request.request_id)
        candidates = sorted((w for w in self.registry.live()
                             if w is not dead and not w.unreachable and not w.draining and w.busy < w.capacity
                             and w.serves(request.model, request.mode)), key=lambda w: w.busy)
        if transfer is not None and transfer.dest in candidates:
            candidates.remove(transfer.dest)
            candidates.insert(0, transfer.dest)
        elif transfer is not None:
            self._spawn(self._cancel_quietly(transfer.dest, request.request_id))
            transfer = None
        resumed = progress.resume_request(request)
        for dest in candidates:
            claim = transfer is not None and dest is transfer.dest
            req = resumed
            if claim:
                req = common_pb2.GenerateRequest()
                req.CopyFrom(resumed)
                req.import_id = transfer.staged().import_id
            dest.in_flight += 1
            call = None
            try:
                call = self.pool.stub(dest.address).Generate(req, timeout=time_remaining())
                first = await call.read()
                if first is grpc.aio.EOF:
                    raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                               grpc.aio.Metadata(), "the worker ended the stream without a message")
            except grpc.aio.AioRpcError as e:
                self._release(dest)
                if call is not None:
                    call.cancel()
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    dest.unreachable = True
                log.info("failover of %s to %s refused: %s %s", request.request_id, dest.worker_id,
                         e.code().name, e.details())
                continue
            except BaseException:
                self._release(dest)
                if call is not None:
                    call.cancel()
                raise
            now = time.monotonic()
            self._migrated(request.model, "failover", method="kv" if claim else "reprefill",
                           bytes_moved=transfer.bytes if claim else 0, pause_s=now - started_s,
                           total_s=now - (transfer.started_s if claim else started_s))
            progress.moved()
            self.affinity.bind(request.session_id, dest.worker_id)
            self.state.place(request.request_id, dest.worker_id, len(progress.token_ids))
            log.warning("worker %s failed mid-stream (%s); request %s resumed on %s after %d tokens%s",
                        dead.worker_id, error.details(), request.request_id, dest.worker_id, len(progress.token_ids),
                        " from its transferred KV state" if claim else "")
            return dest, call, first
        self._migrated(request.model, "failover_failed")
        return None

    def _migrated(self, model: str, outcome: str, *, reason: str = "load", method: str = "reprefill",
                  bytes_moved: int = 0, pause_s: float | None = None, total_s: float | None = None) -> None:
        """Counts a migration attempt in the metrics (`CoordinatorMetrics.observe_migration`).

        Args:
            model: the request's model.
            outcome: "ok", "aborted" (the destination refused), "failover" or "failover_failed"
                (after the worker failed: counted with reason "failure" whatever `reason` says).
            reason: why it moved (coordinator.migration.REASONS).
            method: how the destination got the session's state ("reprefill": recomputation).
            bytes_moved: bytes of session state sent between workers.
            pause_s: seconds the client got nothing because of the move (None: not measured).
            total_s: seconds from the decision until the destination streamed (None: not measured).
        """
        if outcome in ("failover", "failover_failed"):
            reason = "failure"
        self.moves.append(Move(model, outcome, reason, method, bytes_moved, pause_s or 0.0, total_s or 0.0))
        if self.metrics:
            self.metrics.observe_migration(model, outcome, reason, method, bytes_moved, pause_s, total_s)

    def _move_decision(self, request: common_pb2.GenerateRequest, worker: WorkerRecord,
                       progress: StreamProgress) -> Decision | None:
        """An operator's pending move of this stream, else the policy's decision when a check is
        due (coordinator/migration.py), else None. Of the policy's moves, a coordinator that does
        not own the stream's worker (coordinator/state/: with several coordinators, each worker
        has one owner) makes only drain moves, which every stream off a draining worker needs:
        speed, load and memory moves off a worker are decided by its owner alone, so two
        coordinators never both act on one worker's load."""
        pending = progress.move_request
        if pending is not None:
            return Decision(pending.dest, "manual")
        if not worker.draining and not self.state.owns(worker.worker_id):
            return None
        policy = self.config.migration
        if not progress.due(policy.check_interval_s):
            return None
        return policy.decide(request, worker, len(progress.token_ids), self.registry.live(), progress.moved_s,
                             time.monotonic(), progress.left_worker, progress.left_s)

    @staticmethod
    def _settle_move_request(progress: StreamProgress, source: WorkerRecord, moved, ended: bool = False) -> None:
        """Answers an operator's pending MoveSession: the destination, or why it did not move."""
        pending, progress.move_request = progress.move_request, None
        if pending is None or pending.done.done():
            return
        if moved:
            pending.done.set_result(moved[0].worker_id)
        elif ended:
            pending.done.set_exception(GenerateFailed(grpc.StatusCode.NOT_FOUND, "the request ended before it moved"))
        else:
            pending.done.set_exception(GenerateFailed(
                grpc.StatusCode.ABORTED, f"worker {pending.dest.worker_id} refused the request; it stays on "
                f"{source.worker_id}"))

    async def MoveSession(self, request: coordinator_pb2.MoveSessionRequest, context):
        """Moves a running request to `to_worker_id`, or to the worker the migration policy
        predicts fastest for it, at its next chunk; returns once it streams there.

        Aborts the call with NOT_FOUND (no such request streaming, no such live worker, or the
        request ended first), FAILED_PRECONDITION (the worker is its own, draining, full,
        unreachable, serves another model or mode, or would not continue a seeded sample exactly;
        or no worker can take it) or ABORTED (the destination refused; it stays where it was).
        """
        try:
            return await self.move_session(request.request_id, request.to_worker_id)
        except GenerateFailed as e:
            await context.abort(e.code, e.details)

    async def move_session(self, request_id: str, to_worker_id: str = "") -> coordinator_pb2.MoveSessionResponse:
        """`MoveSession` as a coroutine (see there). `request_id` may also be the `id` of an HTTP
        API response (`chatcmpl-<request id>`, `cmpl-<request id>`).

        Raises:
            GenerateFailed: with the status codes `MoveSession` aborts with.
        """
        stream = self._streams.get(request_id)
        for prefix in ("chatcmpl-", "cmpl-"):
            if stream is None and request_id.startswith(prefix):
                stream = self._streams.get(request_id[len(prefix):])
        if stream is None or stream.worker is None:
            raise GenerateFailed(grpc.StatusCode.NOT_FOUND, f"no request {request_id!r} is streaming")
        req, source = stream.request, stream.worker
        request_id = req.request_id
        policy = self.config.migration
        live = self.registry.live()
        candidates = policy.candidates(req, source, live)
        if to_worker_id:
            dest = self.registry.get(to_worker_id)
            if dest is None:
                raise GenerateFailed(grpc.StatusCode.NOT_FOUND, f"no live worker {to_worker_id!r}")
            if not any(w is dest for w in candidates):
                why = ("it already serves the request" if dest is source else "it is being drained" if dest.draining
                       else "it is full" if dest.busy >= dest.capacity else "it is unreachable" if dest.unreachable
                       else f"it does not serve {req.model!r} in the request's mode, or would not continue its "
                       "seeded sample exactly")
                raise GenerateFailed(grpc.StatusCode.FAILED_PRECONDITION,
                                     f"cannot move {request_id!r} to {to_worker_id!r}: {why}")
        else:
            dest = policy.fastest(req, source, session_load(source, request_id), candidates,
                                  [w for w in live if w.serves(req.model)])
            if dest is None:
                raise GenerateFailed(grpc.StatusCode.FAILED_PRECONDITION,
                                     f"no other worker can take {request_id!r} (none serves {req.model!r} in its "
                                     "mode with a free slot and KV room)")
        if stream.progress.move_request is not None:
            raise GenerateFailed(grpc.StatusCode.FAILED_PRECONDITION, f"{request_id!r} is already being moved")
        pending = stream.progress.move_request = _MoveRequest(dest)
        moved_to = await pending.done
        return coordinator_pb2.MoveSessionResponse(request_id=request_id, from_worker_id=source.worker_id,
                                                   to_worker_id=moved_to)

    async def DrainWorker(self, request: coordinator_pb2.DrainWorkerRequest, context):
        """Drains a worker (`drain_worker`), writing its progress whenever it changes.

        Aborts the call with NOT_FOUND (no live worker with that id) or FAILED_PRECONDITION (no
        other live, undrained worker serves its models: its sessions could not move, and the
        models would go unserved), or UNAVAILABLE (the shared fleet state, etcd, does not answer).
        """
        try:
            async for progress in self.drain_worker(request.worker_id):
                await context.write(progress)
        except GenerateFailed as e:
            await context.abort(e.code, e.details)

    async def drain_worker(self, worker_id: str) -> AsyncIterator[coordinator_pb2.DrainProgress]:
        """Marks a worker draining (routing sends it nothing new; the migration policy moves its
        sessions, coordinator/migration.py) and yields its progress whenever it changes: state
        "draining" while streams to it are open, "leaving" once none are (its next heartbeat's
        response tells it to deregister and exit), "left" once it is gone from the registry (then
        the generator ends). Leaving the generator early does not stop the drain.

        Raises:
            GenerateFailed: NOT_FOUND or FAILED_PRECONDITION, as `DrainWorker` says.
        """
        rec = self.registry.get(worker_id)
        if rec is None:
            raise GenerateFailed(grpc.StatusCode.NOT_FOUND, f"no live worker {worker_id!r}")
        others = [w for w in self.registry.live() if w is not rec and not w.draining
                  and any(w.serves(m) for m in rec.model_names)]
        if not others:  # its sessions could not move, and its models would go unserved
            raise GenerateFailed(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"worker {worker_id!r} is the last live worker serving "
                                 f"{', '.join(sorted(rec.model_names))}: start another first, or stop this one")
        if not rec.draining:
            try:
                rec = await self.state.set_draining(worker_id)
            except NotLive:
                raise GenerateFailed(grpc.StatusCode.NOT_FOUND, f"no live worker {worker_id!r}") from None
            except ConnectionError as e:  # the shared state's store (etcd) does not answer
                raise GenerateFailed(grpc.StatusCode.UNAVAILABLE, f"cannot mark {worker_id!r} draining: {e}") from None
            self._drain_moved[worker_id] = 0
            if self.metrics:
                self.metrics.draining.labels(worker=worker_id).set(1)
            log.info("draining worker %s (%d session(s) running)", worker_id, rec.in_flight)
        last = None
        while True:
            now = self.registry.get(worker_id)
            gone = now is None or not now.draining  # deregistered (or expired), or back as a new worker
            state = "left" if gone else "leaving" if now.in_flight == 0 else "draining"
            msg = coordinator_pb2.DrainProgress(worker_id=worker_id, sessions_left=0 if gone else now.in_flight,
                                                moved=self._drain_moved.get(worker_id, 0), state=state)
            if msg != last:
                yield msg
                last = msg
            if gone:
                self._drain_moved.pop(worker_id, None)
                if self.metrics:
                    self.metrics.draining.labels(worker=worker_id).set(0)
                log.info("worker %s drained and left", worker_id)
                return
            await asyncio.sleep(DRAIN_POLL_S)

    async def _open_stream(self, request, time_remaining: TimeRemaining, tried: set[str], t0: float):
        """Opens a worker stream and reads its first message, retrying other workers on
        UNAVAILABLE / RESOURCE_EXHAUSTED (bounded attempts, exponential backoff with jitter).

        A worker that answers RESOURCE_EXHAUSTED is full for now, not failed: the next attempt
        prefers other workers, then tries it again, and such refusals are retried (with the same
        backoff) until `queue_timeout_s` from the request's arrival, as a request waiting in the
        admission queue would (with `max_queued` 0, no request waits: `route_attempts` bounds them).

        Returns:
            (worker, call, first response, queue_s); the worker's in_flight count includes this
            request; queue_s is the time from t0 until the call to the serving worker was issued
            (routing and earlier failed attempts; the worker's prefill is not included).
        """
        cfg = self.config
        full_wait_s = cfg.queue_timeout_s if cfg.max_queued > 0 else 0.0
        bounded = stop_after_attempt(cfg.route_attempts)

        def stop(state) -> bool:
            if _full(state.outcome.exception()) and time.monotonic() - t0 < full_wait_s:
                return False
            return bounded(state)

        tokens = request_tokens_bound(request)  # KV the request may need: routing prefers room for it
        refused: set[str] = set()  # workers that said "full": tried again once the others are
        retrying = AsyncRetrying(
            stop=stop,
            wait=wait_exponential_jitter(multiplier=cfg.retry_initial_wait_s, max=cfg.retry_max_wait_s),
            retry=retry_if_exception(_retryable), reraise=True)
        last_failure: _WorkerFailed | None = None
        async for attempt in retrying:
            with attempt:
                if attempt.retry_state.attempt_number > 1 and self.metrics:
                    self.metrics.retries.labels(model=request.model).inc()
                if attempt.retry_state.attempt_number == 1:  # a full fleet: wait for a slot
                    await self.admission.wait_for_room(lambda: self._has_room(request), request.model)
                try:  # from here to the reservation below nothing awaits: the slot stays ours
                    try:
                        worker = route(request.model, request.session_id, self.registry.live(), tried | refused,
                                       self.router, self.affinity, request.mode, tokens)
                    except AllBusy:
                        if not refused:
                            raise
                        worker = route(request.model, request.session_id, self.registry.live(), tried,
                                       self.router, self.affinity, request.mode, tokens)
                except AllBusy:
                    if last_failure is not None:  # report why the tried workers failed
                        raise last_failure from None
                    raise
                tried.add(worker.worker_id)
                # Reserve the slot now, so concurrent requests routed before this one's first
                # token see the worker as busy (heartbeat loads lag by seconds).
                worker.in_flight += 1
                call = self.pool.stub(worker.address).Generate(request, timeout=time_remaining())
                queue_s = time.monotonic() - t0
                try:
                    first = await call.read()
                except BaseException as e:
                    self._release(worker)
                    if not isinstance(e, grpc.aio.AioRpcError):
                        call.cancel()
                        raise
                    log.info("worker %s refused %s: %s %s", worker.worker_id, request.request_id,
                             e.code().name, e.details())
                    if e.code() == grpc.StatusCode.UNAVAILABLE:
                        worker.unreachable = True  # until its next heartbeat (coordinator/registry.py)
                    last_failure = _WorkerFailed(worker, e)
                    if _full(last_failure):
                        tried.discard(worker.worker_id)
                        refused.add(worker.worker_id)
                    raise last_failure from None
                return worker, call, first, queue_s

    async def ListModels(self, request, context):
        """Models served by live workers (`served_models`)."""
        return coordinator_pb2.ListModelsResponse(models=self.served_models())

    def served_models(self) -> list[coordinator_pb2.ServedModel]:
        """Models served by live workers, sorted by name, each with its worker ids and decode modes
        (PLAIN always, plus each worker's draft mode; AUTO never listed)."""
        by_name: dict[str, coordinator_pb2.ServedModel] = {}
        modes: dict[str, set[int]] = {}
        for w in self.registry.live():
            for m in w.models:
                served = by_name.setdefault(m.name, coordinator_pb2.ServedModel(info=m))
                served.worker_ids.append(w.worker_id)
                modes.setdefault(m.name, {common_pb2.DECODE_MODE_PLAIN}).add(m.draft_mode)
        for name, served in by_name.items():
            served.modes.extend(sorted(modes[name] - {common_pb2.DECODE_MODE_AUTO}))
        return [by_name[k] for k in sorted(by_name)]

    async def GetClusterStatus(self, request, context):
        """One `WorkerStatus` per live worker (sorted by id; `heartbeat_age_s` in seconds,
        `active_sessions` the coordinator's open streams to it, KV bytes from its latest heartbeat)
        and the number of sessions with a
        live affinity entry."""
        workers = [
            coordinator_pb2.WorkerStatus(
                worker_id=w.worker_id, address=w.address, models=w.models,
                active_sessions=w.busy, capacity=w.load.capacity,
                kv_cache_bytes=w.load.kv_cache_bytes, kv_budget_bytes=w.load.kv_budget_bytes,
                kv_free_bytes=w.load.kv_free_bytes, prompt_cache_bytes=w.load.prompt_cache_bytes,
                heartbeat_age_s=self.registry.heartbeat_age_s(w), served_requests=w.served_requests,
                unreachable=w.unreachable, draining=w.draining, chip=w.load.chip,
                peak_memory_bandwidth_bytes_per_s=w.load.peak_memory_bandwidth_bytes_per_s)
            for w in sorted(self.registry.live(), key=lambda w: w.worker_id)]
        return coordinator_pb2.ClusterStatus(workers=workers, sessions=len(self.affinity))

    def _count(self, model: str, worker_id: str, outcome: str) -> None:
        if self.metrics:
            self.metrics.routed.labels(model=model, worker=worker_id, outcome=outcome).inc()


class RegistryServicer(worker_pb2_grpc.RegistryServicer):
    """Internal API: workers register, heartbeat and deregister."""

    def __init__(self, config: CoordinatorConfig, state: FleetState, pool: WorkerPool,
                 admission: AdmissionQueue | None = None):
        self.config = config
        self.state = state
        self.pool = pool
        self.admission = admission  # woken on every registration and heartbeat: capacity may have grown

    async def Register(self, request, context):
        """Registers (or re-registers) a worker and returns its new lease, the lease TTL and the
        heartbeat interval (seconds).

        Aborts the call with INVALID_ARGUMENT when worker_id, address or the model list is empty,
        with ALREADY_EXISTS when another live worker at another address holds the id (the
        worker retries, so it joins once that one's lease ends), and with UNAVAILABLE when the
        shared fleet state (etcd) does not answer (the worker retries).
        """
        try:
            rec = await self.state.register(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, short_details(str(e)))
        except WorkerIdInUse as e:
            log.warning("refused a registration from %s: %s", request.address, e)
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, short_details(str(e)))
        except ConnectionError as e:  # the shared state's store (etcd) does not answer: the worker retries
            await context.abort(grpc.StatusCode.UNAVAILABLE, short_details(f"fleet state unavailable: {e}"))
        log.info("worker %s registered at %s serving %s", rec.worker_id, rec.address,
                 sorted(rec.model_names))
        if self.admission:
            self.admission.notify()
        return worker_pb2.RegisterResponse(lease_id=rec.lease_id,
                                           lease_ttl_s=self.config.lease_ttl_s,
                                           heartbeat_interval_s=self.config.heartbeat_interval_s)

    async def Heartbeat(self, request, context):
        """Renews a worker's lease, records its load and clears its `unreachable` mark; tells a
        drained worker that runs no session any more (no stream from this coordinator, none in
        its own load report) to leave (`leave`).

        Aborts the call with NOT_FOUND when the lease is unknown or expired (the worker must
        register again), UNAVAILABLE when the shared fleet state (etcd) does not answer.
        """
        try:
            rec = await self.state.heartbeat(request.worker_id, request.lease_id, request.load)
        except UnknownLease as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, short_details(str(e)))
        except ConnectionError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, short_details(f"fleet state unavailable: {e}"))
        if self.admission:
            self.admission.notify()
        # Its own count of sessions too: another coordinator sharing the fleet's state may still
        # stream from it, and a session moved off it ends there at the engine's next turn.
        leave = rec.draining and rec.in_flight == 0 and request.load.active_sessions == 0
        if leave:
            log.info("worker %s is drained: telling it to leave", rec.worker_id)
        return worker_pb2.HeartbeatResponse(leave=leave)

    async def Deregister(self, request, context):
        """Removes a worker (clean shutdown); its channel closes now, or when its last open stream ends.

        Aborts the call with NOT_FOUND when the lease is unknown or expired, UNAVAILABLE when the
        shared fleet state (etcd) does not answer.
        """
        try:
            rec = await self.state.deregister(request.worker_id, request.lease_id)
        except UnknownLease as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, short_details(str(e)))
        except ConnectionError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, short_details(f"fleet state unavailable: {e}"))
        if rec.in_flight == 0:  # else the last stream's handler closes it (closing cancels them)
            await self.pool.drop(rec.address)
        log.info("worker %s deregistered", rec.worker_id)
        return worker_pb2.DeregisterResponse()
