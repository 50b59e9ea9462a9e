"""The worker's gRPC servicer: thin. Validates, converts, submits to the engine, streams events.

Concurrency: handlers run on the asyncio loop; the engine runs MLX on its own thread and calls
the per-request `emit` callback there, which hands each event to the loop through `_Handoff`:
events wait in a list, and the loop is woken once per burst (one `call_soon_threadsafe` for every
session's events of an engine iteration, not one per session) to put each into its request's own
asyncio.Queue. The handoff's lock is held for a list append or swap only.
A handler that ends for any reason other than the engine's final event (client gone, deadline,
error) aborts its request in `finally`, which frees the engine's slot and KV cache.

A request the engine ends as "cancelled" although nobody asked (no Cancel RPC, no handler abort:
the engine stopped or its thread crashed) and every stream still open when `fail_streams` is
called (the worker's engine watchdog, `worker.watchdog`) end with UNAVAILABLE, not with a
Complete that reads like a finished answer and not with a stream that waits forever.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import uuid
from contextlib import aclosing, suppress
from dataclasses import dataclass

import grpc

from flashfleet.errors import FlashfleetError, short_details
from flashfleet.requests import WORKER_DEFAULT_MAX_TOKENS, validate_request
from flashfleet.v1 import worker_pb2, worker_pb2_grpc
from worker import convert, kv_pull, kv_wire
from worker.engine.types import (CorruptState, DoneEvent, Draining, EngineProtocol, ErrorEvent, InvalidRequest,
                                 NotExportable, Overloaded, StateMismatch, TokenEvent, UnknownSession)

log = logging.getLogger("flashfleet.worker")
MIGRATED = "migrated"  # CancelRequest.reason of a stream the coordinator moved to another worker
MOVED_WAIT_S = 10.0  # how long a moved stream's handler waits for the coordinator's cancel
# How long a request waits for the engine to end an aborted request with the same id (a client
# retrying right after its deadline or cancel); the engine does so at its next turn.
ABORTED_WAIT_S = 10.0
_MOVED = object()  # queued instead of the DoneEvent of a request cancelled for a migration
_UNASKED = object()  # queued instead of a DoneEvent("cancelled") no one asked for: the engine stopped

ENGINE_ERROR_CODES = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Draining: grpc.StatusCode.UNAVAILABLE,
}
STATE_ERROR_CODES = {  # ExportSession / PullSession
    **ENGINE_ERROR_CODES,
    UnknownSession: grpc.StatusCode.NOT_FOUND,
    NotExportable: grpc.StatusCode.FAILED_PRECONDITION,
    StateMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    CorruptState: grpc.StatusCode.DATA_LOSS,
}


@dataclass(frozen=True)
class _EngineGone:
    """Queued into every open stream by `WorkerServicer.fail_streams`."""

    reason: str


class _Handoff:
    """Events from the engine thread to the event loop, the loop woken once per burst.

    `put` (any thread) appends (queue, event) and schedules one drain on the loop unless one is
    already scheduled; the drain (on the loop) puts every waiting event into its queue in order.
    An engine iteration emits one event per session, so the loop wakes about once per iteration
    instead of once per session (each wake-up is a write to the loop's self-pipe).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, object]] = []
        self._scheduled = False

    def put(self, events: asyncio.Queue, event: object) -> None:
        """Hands `event` to `events` on the loop (dropped when the loop is closed: nobody listens)."""
        with self._lock:
            self._items.append((events, event))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # loop closed during shutdown
            with self._lock:
                self._items.clear()
                self._scheduled = False

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False
        for events, event in items:
            events.put_nowait(event)


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Serves Generate / Cancel / GetLoad, and ExportSession / PullSession (KV transfer), on top
    of one engine.

    Args:
        engine: anything implementing EngineProtocol (the MLX Engine, or a fake in tests).
        worker_id: reported in every Complete message.
        metrics: optional WorkerMetrics (request outcomes, latency histograms).
        peers: how PullSession dials the source worker (TLS, join token; worker/kv_pull.py);
            default plaintext without a join token.
    """

    def __init__(self, engine: EngineProtocol, worker_id: str, metrics=None, peers: kv_pull.Peers | None = None):
        self.engine = engine
        self.worker_id = worker_id
        self.metrics = metrics
        self._peers = peers or kv_pull.Peers()
        # Request ids the coordinator cancelled to move them elsewhere (Cancel reason "migrated").
        self._migrated: set[str] = set()
        # Request ids this servicer aborted (Cancel RPC, a handler that ended early): their
        # DoneEvent("cancelled") was asked for; any other one means the engine stopped.
        self._aborting: set[str] = set()
        # Aborted requests still admitted in the engine, set when their DoneEvent comes: a new
        # request with the same id waits for it instead of being refused as a duplicate.
        self._ending: dict[str, asyncio.Event] = {}
        self._streams: set[asyncio.Queue] = set()  # event queues of the open Generate handlers
        self._gone: str | None = None  # set by fail_streams: why no request can be served
        self._handoff: _Handoff | None = None  # made on the loop by the first Generate

    def fail_streams(self, reason: str) -> int:
        """Ends every open Generate stream with UNAVAILABLE(`reason`), and every later call at its
        start: for a worker whose engine can serve nothing more. Call on the event loop.

        Returns:
            How many open streams were told to end.
        """
        self._gone = reason
        for events in self._streams:
            events.put_nowait(_EngineGone(reason))
        return len(self._streams)

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        """Tokenizes the request, submits it to the engine and streams a Chunk per TokenEvent,
        then one Complete (finish reason, stats, this worker's id).

        Unset max_tokens becomes `WORKER_DEFAULT_MAX_TOKENS` capped by the context the prompt
        leaves (at least 1). The request is aborted in the engine if the stream ends early. A
        request reusing the id of one aborted that way (a client retrying after its deadline)
        waits until the engine has ended that one (`ABORTED_WAIT_S` at most).

        Aborts the call with:
            INVALID_ARGUMENT: `validate_request` fails, more chat turns than the model's context
                has tokens, or the engine's `InvalidRequest`
                (tokenization, context length, sampling parameters, mode, resume tokens).
            NOT_FOUND: the request names a model this worker does not serve.
            RESOURCE_EXHAUSTED: the engine is at capacity (`Overloaded`).
            UNAVAILABLE: the engine is starting or shutting down (`Draining`), it ended the
                request without being asked (it stopped), or the worker is leaving the fleet
                because its engine thread died (`fail_streams`).
            INTERNAL: the request failed on the engine thread after admission (`ErrorEvent`).
        """
        model = self.engine.model
        try:
            validate_request(request)
        except FlashfleetError as e:
            await context.abort(e.code, short_details(e.details))
        if request.model != model.name:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                short_details(f"this worker serves {model.name!r}, not {request.model!r}"))
        turns = len(request.messages.messages) if request.WhichOneof("input") == "messages" else 0
        if model.max_context_tokens and turns > model.max_context_tokens:  # each turn renders to a token or more
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{turns:,} chat turns cannot fit the model's context of "
                                f"{model.max_context_tokens:,} tokens")
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        if self._handoff is None:
            self._handoff = _Handoff(loop)
        handoff = self._handoff

        metrics = self.metrics

        def emit(event) -> None:  # engine thread
            if isinstance(event, DoneEvent):
                moved = event.request_id in self._migrated
                self._migrated.discard(event.request_id)  # with or without metrics: no id is kept
                asked = event.request_id in self._aborting
                self._aborting.discard(event.request_id)
                if asked:
                    try:
                        loop.call_soon_threadsafe(self._ended, event.request_id)
                    except RuntimeError:  # loop closed during shutdown
                        pass
                if metrics is not None:
                    # Recorded here, not in the handler: a request whose client left still ends
                    # with DoneEvent("cancelled") and its tokens count.
                    metrics.observe_request(model.name, dataclasses.replace(event, finish_reason="migrated")
                                            if moved and event.finish_reason == "cancelled" else event)
                if moved:  # the coordinator drops this stream now: write nothing more on it
                    event = _MOVED
                elif event.finish_reason == "cancelled" and not asked:
                    event = _UNASKED
            handoff.put(events, event)

        if self._gone is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self._gone)
        self._streams.add(events)
        try:
            async with aclosing(self._serve(request, context, model, events, emit)) as responses:
                async for response in responses:  # aclosing: its finally runs as this one's does
                    yield response
        finally:
            self._streams.discard(events)

    async def _serve(self, request, context, model, events: asyncio.Queue, emit):
        """Generate's body once its event queue is open: submit, then stream the events."""
        try:
            await self._wait_aborted(request.request_id)
            prompt_tokens = await asyncio.to_thread(
                self.engine.encode_prompt,
                request.prompt if request.WhichOneof("input") == "prompt" else None,
                convert.messages_of(request))
            max_tokens = request.max_tokens if request.HasField("max_tokens") else max(
                1, min(WORKER_DEFAULT_MAX_TOKENS, model.max_context_tokens - len(prompt_tokens)))
            self.engine.submit(convert.generation_request(request, prompt_tokens, max_tokens), emit)
        except tuple(ENGINE_ERROR_CODES) as e:
            transfer = getattr(self.engine, "transfer", None)
            if request.import_id and transfer is not None:
                transfer.drop_import(request.import_id)  # refused: its staged state goes too
            self._outcome(type(e).__name__.lower())
            await context.abort(ENGINE_ERROR_CODES[type(e)], short_details(str(e)))
        finished = False
        try:
            while True:
                event = await events.get()
                if event is _MOVED:
                    # A final message or status raced with the coordinator's cancel of the call
                    # (grpc logs an ExecuteBatchError then); wait for that cancel instead.
                    finished = True
                    await asyncio.sleep(MOVED_WAIT_S)
                    return
                if isinstance(event, TokenEvent):
                    yield convert.chunk_response(event)
                elif isinstance(event, DoneEvent):
                    finished = True
                    yield convert.complete_response(event, self.worker_id)
                    return
                elif isinstance(event, ErrorEvent):
                    finished = True
                    log.error("request %s failed", request.request_id, exc_info=event.error)
                    self._outcome("error")
                    await context.abort(grpc.StatusCode.INTERNAL,
                                        f"generation failed on worker {self.worker_id} "
                                        f"({type(event.error).__name__}); see the worker log")
                elif event is _UNASKED or isinstance(event, _EngineGone):
                    finished = True  # the engine has ended it, or can no longer
                    reason = (event.reason if isinstance(event, _EngineGone) else
                              f"the engine of worker {self.worker_id} stopped and cancelled the request")
                    log.warning("request %s ends UNAVAILABLE: %s", request.request_id, reason)
                    await context.abort(grpc.StatusCode.UNAVAILABLE, reason)
        finally:
            if not finished:  # its DoneEvent("cancelled") is counted by emit
                self._abort(request.request_id)

    def _abort(self, request_id: str) -> bool:
        """engine.abort, remembering that this request's DoneEvent("cancelled") was asked for."""
        self._aborting.add(request_id)
        known = self.engine.abort(request_id)
        if not known:
            self._aborting.discard(request_id)
        else:  # its DoneEvent follows (the engine releases a request before emitting it)
            self._ending.setdefault(request_id, asyncio.Event())
        return known

    def _ended(self, request_id: str) -> None:
        """On the loop: an aborted request's DoneEvent came; a request waiting to reuse its id may go."""
        ending = self._ending.pop(request_id, None)
        if ending is not None:
            ending.set()

    async def _wait_aborted(self, request_id: str) -> None:
        """Waits (at most ABORTED_WAIT_S) until the engine has ended an aborted request with
        this id, if there is one: the client of that request left (its deadline, a cancel), so
        the id is free to reuse, but the engine holds it until its next turn."""
        ending = self._ending.get(request_id)
        if ending is not None:
            with suppress(TimeoutError):
                await asyncio.wait_for(ending.wait(), ABORTED_WAIT_S)

    async def Cancel(self, request, context):
        """Aborts a running request by id; `cancelled` is False when the id is unknown here.
        reason "migrated" (the coordinator, before it drops a moved stream) counts the request's
        end as outcome "migrated" rather than "cancelled"."""
        if request.reason == MIGRATED:
            self._migrated.add(request.request_id)
        cancelled = self._abort(request.request_id)
        if not cancelled:
            self._migrated.discard(request.request_id)
        return worker_pb2.CancelResponse(cancelled=cancelled)

    async def ExportSession(self, request, context):
        """Streams a snapshot of a running session's KV state (`kv_wire`: header, data chunks
        with CRC-32s, trailer with the SHA-256); the session keeps decoding.

        Aborts the call with:
            NOT_FOUND: no such session decoding here (`UnknownSession`).
            FAILED_PRECONDITION: its mode keeps no exportable state (`NotExportable`).
            UNIMPLEMENTED: this worker's engine cannot export.
            UNAVAILABLE: the engine is starting or shutting down.
        """
        transfer = getattr(self.engine, "transfer", None)
        if transfer is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this worker's engine cannot export sessions")
        try:
            state = await asyncio.wrap_future(transfer.export_session(request.request_id))
        except tuple(STATE_ERROR_CODES) as e:
            await context.abort(STATE_ERROR_CODES[type(e)], short_details(str(e)))
        chunks = kv_wire.state_chunks(state)
        while True:  # checksums and copies off the event loop: other streams go on meanwhile
            chunk = await asyncio.to_thread(next, chunks, None)
            if chunk is None:
                return
            yield chunk

    async def PullSession(self, request, context):
        """Pulls a running session's state from the worker at `request.source_address` (its
        ExportSession, worker to worker; worker/kv_pull.py), checks it and stages it in the
        engine for one Generate naming the returned import_id. The header is checked and KV
        budget reserved before any data is taken; nothing stays staged when the call fails (or
        is cancelled: the export is cancelled with it).

        Aborts the call with:
            INVALID_ARGUMENT: no request_id or source_address, messages out of order or a
                malformed header.
            FAILED_PRECONDITION: format version, model, dtype or shapes differ (`StateMismatch`).
            RESOURCE_EXHAUSTED: the state does not fit the KV budget now.
            DATA_LOSS: a CRC-32 or the SHA-256 is wrong, or the stream ended early (`CorruptState`).
            UNIMPLEMENTED: this worker's engine cannot import.
            UNAVAILABLE: the engine is starting or shutting down.
            the export's own code (message "export from ADDRESS failed: ..."): the source
                refused it (NOT_FOUND: no such session decoding there, FAILED_PRECONDITION: a mode
                without exportable state) or failed during it (UNAVAILABLE: it is gone).
        """
        transfer = getattr(self.engine, "transfer", None)
        if transfer is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this worker's engine cannot import sessions")
        if not request.request_id or not request.source_address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "PullSession needs request_id and source_address")
        relayed = kv_pull.Relayed()
        channel = self._peers.channel(request.source_address)
        export = self._peers.stub(channel).ExportSession(
            worker_pb2.ExportSessionRequest(request_id=request.request_id), timeout=context.time_remaining())
        try:
            return await self._stage(transfer, kv_pull.relay_chunks(export, relayed))
        except tuple(STATE_ERROR_CODES) as e:
            failed = relayed.export_error  # the export's failure caused the import's
            if failed is not None:
                log.info("pull of %s from %s: the export failed (%s %s)", request.request_id,
                         request.source_address, failed.code().name, failed.details())
                await context.abort(failed.code(), short_details(
                    f"export from {request.source_address} failed: {failed.details()}"))
            log.info("pull of %s refused: %s", request.request_id, e)
            await context.abort(STATE_ERROR_CODES[type(e)], short_details(str(e)))
        finally:
            export.cancel()
            await channel.close()

    @staticmethod
    async def _stage(transfer, messages) -> worker_pb2.PullSessionResponse:
        """Receives a state's messages (`kv_wire`), checks them and stages the state.

        Raises:
            the STATE_ERROR_CODES exceptions (nothing stays staged or reserved then).
        """
        receiver = kv_wire.StateReceiver()
        import_id = ""
        staged = False
        try:
            async for msg in messages:
                kind = msg.WhichOneof("kind")
                if kind == "header":
                    header = receiver.header(msg.header)
                    import_id = await asyncio.wrap_future(transfer.reserve_import(header))
                    await asyncio.to_thread(receiver.allocate)
                elif kind == "data":
                    if not import_id:
                        raise InvalidRequest("state data before the header")
                    await asyncio.to_thread(receiver.data, msg.data)
                elif kind == "trailer":
                    state = receiver.finish(msg.trailer)
                    await asyncio.wrap_future(transfer.stage_import(import_id, state.tokens, state.caches))
                    staged = True
                    return worker_pb2.PullSessionResponse(import_id=import_id, positions=state.positions,
                                                          bytes=receiver.received)
            raise CorruptState(f"the stream ended after {receiver.received:,} bytes, without its trailer")
        finally:
            if import_id and not staged:
                transfer.drop_import(import_id)

    async def GetLoad(self, request, context):
        """The engine's current load (`load`)."""
        return self.load()

    def load(self):
        """The WorkerLoad proto of heartbeats and GetLoad: the engine's load and measurements
        (`worker.convert.load_proto`) with the host's chip and peak memory bandwidth from the
        metrics' `MachineInfo` (unknown without metrics)."""
        machine = getattr(self.metrics, "machine", None)
        if machine is None:
            return convert.load_proto(self.engine.load())
        return convert.load_proto(self.engine.load(), machine.chip, machine.peak_memory_bandwidth_bytes_per_s)

    def _outcome(self, outcome: str) -> None:
        if self.metrics:
            self.metrics.requests.labels(model=self.engine.model.name, outcome=outcome).inc()
