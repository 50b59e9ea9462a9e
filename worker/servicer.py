"""The worker's gRPC servicer: thin. Validates, converts, submits to the engine, streams events.

Concurrency: handlers run on the asyncio loop; the engine runs MLX on its own thread and calls
the per-request `emit` callback there, which only hands each event to the loop through `_Handoff`:
events wait in a list, and the loop is woken once per burst (one `call_soon_threadsafe` for every
session's events of an engine iteration, not one per session). Everything a request's end
depends on (was it aborted, moved, who reads it) lives in its `_Session` and is read and written
on the loop alone. A call writes what queued while its previous message was being sent as one
message (`flashfleet.coalesce`): fewer messages per token for the coordinator to relay, none held back.
A coordinator opens one Subscribe stream per worker (`_Subscription`) and names it on its Generate
calls: their responses then cross on it, an engine iteration's chunks for all of that
coordinator's sessions as one message, and each call carries only its status.

A request is a `_Session` from submit to its end: the responses the engine's events became, and
the Generate call reading them (at most one). A call that ends before the session does:
    - after a Cancel RPC, or past its deadline, or with the worker leaving: the request is
      aborted in the engine (its slot and KV cache are freed at the engine's next turn);
    - otherwise its upstream vanished without a word (the coordinator died): the session goes
      on, ORPHANED, for `orphan_grace_s` seconds; a Generate with the same request and
      `resume_token_ids` equal to a prefix of its output that ends at a chunk (the client
      resuming through another coordinator) re-attaches and gets every response after that
      prefix, including the ones produced meanwhile. Unclaimed, it is aborted.

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
from contextlib import suppress
from dataclasses import dataclass, field

import grpc

from flashfleet.coalesce import coalesce
from flashfleet.errors import FlashfleetError, short_details
from flashfleet.requests import (RESUME_ONLY_HEADER, SUBSCRIPTION_HEADER, WORKER_DEFAULT_MAX_TOKENS,
                                 validate_request)
from flashfleet.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from worker import convert, kv_pull, kv_wire
from worker.engine.types import (CorruptState, DoneEvent, Draining, EngineProtocol, ErrorEvent, InvalidRequest,
                                 NotExportable, Overloaded, StateMismatch, TokenEvent, UnknownSession)

log = logging.getLogger("flashfleet.worker")
MIGRATED = "migrated"  # CancelRequest.reason of a stream the coordinator moved to another worker
MOVED_WAIT_S = 10.0  # how long a moved stream's handler waits for the coordinator's cancel
# How long a request waits for the engine to end an aborted request with the same id (a client
# retrying right after its deadline or cancel); the engine does so at its next turn.
ABORTED_WAIT_S = 10.0
# How long a session whose upstream vanished without a Cancel keeps decoding for a client to
# resume it (through another coordinator), seconds.
ORPHAN_GRACE_S = 30.0
# What one ResponseBatch carries at most (serialized bytes; a response larger than this goes
# alone): under gRPC's 4 MiB message limit however many sessions' chunks queued.
MAX_BATCH_BYTES = 1 << 20

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
_MOVED = "moved"  # a session's end: the coordinator cancelled it to move it (its reader writes nothing more)
_COMPLETE = "complete"  # a session's end: its last response is the Complete


class _Handoff:
    """Events from the engine thread to the event loop, the loop woken once per burst.

    `put` (any thread) appends (session, event) and schedules one drain on the loop unless one is
    already scheduled; the drain (on the loop) hands every waiting event to `deliver` in order.
    An engine iteration emits one event per session, so the loop wakes about once per iteration
    instead of once per session (each wake-up is a write to the loop's self-pipe). The lock is
    held for a list append or swap only.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, deliver):
        self._loop, self._deliver = loop, deliver
        self._lock = threading.Lock()
        self._items: list[tuple[object, object]] = []
        self._scheduled = False

    def put(self, session, event) -> None:
        """Hands `event` of `session` to the loop (dropped when the loop is closed: nobody listens)."""
        with self._lock:
            self._items.append((session, event))
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
        for session, event in items:
            self._deliver(session, event)


class _Subscription:
    """A Subscribe stream (worker.proto): the responses of the Generate calls that name it, sent
    in batches. `send` queues a response (on the loop, never waiting); `batches` yields an empty
    batch first (the subscription is open), then everything queued while the previous batch was
    being written, as one ResponseBatch of at most MAX_BATCH_BYTES.

    Attributes:
        closed: the stream ended (or another took its id): calls naming it end UNAVAILABLE.
        readers: the sessions whose responses go here (woken when it closes).
    """

    def __init__(self, subscription_id: str):
        self.subscription_id = subscription_id
        self.closed = False
        self.readers: set[_Session] = set()
        self._queued: list[common_pb2.GenerateResponse] = []
        self._ready = asyncio.Event()

    def send(self, response: common_pb2.GenerateResponse) -> None:
        """Queues `response` (its request_id set) for the next batch."""
        self._queued.append(response)
        self._ready.set()

    def close(self) -> None:
        """Marks it closed and wakes the sessions that send to it."""
        self.closed = True
        for session in list(self.readers):
            session.changed.set()

    async def batches(self):
        """The stream's messages: an empty ResponseBatch, then the queued responses in order."""
        yield worker_pb2.ResponseBatch()
        while True:
            if not self._queued:
                self._ready.clear()
                await self._ready.wait()
            n, size = 0, 0
            while n < len(self._queued):
                size += self._queued[n].ByteSize()
                if n and size > MAX_BATCH_BYTES:
                    break
                n += 1
            batch = worker_pb2.ResponseBatch(responses=self._queued[:n])
            del self._queued[:n]
            yield batch


@dataclass(eq=False)
class _Session:
    """One Generate request on this worker, from submit to its end (module docstring). Loop only.

    Attributes:
        request: the request as it was submitted.
        responses: the chunk responses its events became, then its Complete (if it completed).
        token_ids: its resume tokens, then every token in `responses`.
        end: None while it runs; `_COMPLETE`, `_MOVED`, or (status code, details) to end with.
        reader: how many calls have attached (the attached one holds the latest number).
        attached: a Generate call reads it now.
        aborting: this servicer asked the engine to end it (Cancel, a call's deadline).
        migrated: the Cancel said "migrated".
        orphan_timer: while orphaned, the timer that aborts it.
    """

    request: common_pb2.GenerateRequest
    responses: list = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    end: object = None
    reader: int = 0
    attached: bool = False
    aborting: bool = False
    migrated: bool = False
    orphan_timer: asyncio.TimerHandle | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.token_ids = list(self.request.resume_token_ids)

    def resume_index(self, request: common_pb2.GenerateRequest) -> int | None:
        """Where a call resuming this session with `request` starts reading `responses`: the
        index after the chunk whose end is the last of `request.resume_token_ids`; None when the
        request is another one, its tokens or text are not a prefix of this session's output
        at a chunk's end, or the session was aborted, moved or failed."""
        if self.aborting or self.migrated or self.end not in (None, _COMPLETE) or not _same_request(
                self.request, request):
            return None
        n = len(request.resume_token_ids)
        if list(request.resume_token_ids) != self.token_ids[:n]:
            return None
        count, text = len(self.request.resume_token_ids), [self.request.resume_text]
        for i, resp in enumerate([None, *self.responses]):
            if resp is not None:
                if resp.WhichOneof("kind") != "chunk":
                    return None
                count += len(resp.chunk.token_ids)
                text.append(resp.chunk.text)
            if count == n:
                return i if "".join(text) == request.resume_text else None
            if count > n:
                return None
        return None


def _same_request(a: common_pb2.GenerateRequest, b: common_pb2.GenerateRequest) -> bool:
    """Whether two requests ask for the same generation (resume fields and import_id aside)."""
    x, y = common_pb2.GenerateRequest(), common_pb2.GenerateRequest()
    x.CopyFrom(a)
    y.CopyFrom(b)
    for r in (x, y):
        r.ClearField("resume_token_ids")
        r.ClearField("resume_text")
        r.ClearField("import_id")
    return x == y


def _shift_stats(resp: common_pb2.GenerateResponse, tokens: int) -> common_pb2.GenerateResponse:
    """A Complete's copy whose stats read as if the session had been resumed `tokens` later
    (those tokens counted in the prompt, not the generated ones): what a reader that re-attached
    after them gets, so that its coordinator counts them once (`StreamProgress.finish_stats`)."""
    if not tokens or resp.WhichOneof("kind") != "complete":
        return resp
    out = common_pb2.GenerateResponse()
    out.CopyFrom(resp)
    out.complete.stats.prompt_tokens += tokens
    out.complete.stats.generated_tokens = max(0, out.complete.stats.generated_tokens - tokens)
    return out


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Serves Generate / Cancel / GetLoad, and ExportSession / PullSession (KV transfer), on top
    of one engine.

    Args:
        engine: anything implementing EngineProtocol (the MLX Engine, or a fake in tests).
        worker_id: reported in every Complete message.
        metrics: optional WorkerMetrics (request outcomes, latency histograms).
        peers: how PullSession dials the source worker (TLS, join token; worker/kv_pull.py);
            default plaintext without a join token.
        orphan_grace_s: how long a session whose upstream vanished without a Cancel is kept for
            its client to resume (module docstring), seconds (0: not kept).
    """

    def __init__(self, engine: EngineProtocol, worker_id: str, metrics=None, peers: kv_pull.Peers | None = None,
                 orphan_grace_s: float = ORPHAN_GRACE_S):
        self.engine = engine
        self.worker_id = worker_id
        self.metrics = metrics
        self._peers = peers or kv_pull.Peers()
        self.orphan_grace_s = orphan_grace_s
        self._sessions: dict[str, _Session] = {}  # request id -> its session, until it ended and nobody reads it
        self._gone: str | None = None  # set by fail_streams: why no request can be served
        self._handoff: _Handoff | None = None  # made on the loop by the first Generate
        self._subscriptions: dict[str, _Subscription] = {}  # id -> open Subscribe stream

    def stop_keeping(self) -> None:
        """From now on a call that ends early aborts its session (the worker is stopping: no
        session outlives it); sessions kept until now are aborted."""
        self.orphan_grace_s = 0.0
        for session in list(self._sessions.values()):
            if session.orphan_timer is not None:
                self._drop_orphan(session)
                self._expire(session)

    def fail_streams(self, reason: str) -> int:
        """Ends every running session's stream with UNAVAILABLE(`reason`), and every later call
        at its start: for a worker whose engine can serve nothing more. Call on the event loop.

        Returns:
            How many open streams were told to end.
        """
        self._gone = reason
        told = 0
        for session in list(self._sessions.values()):
            if session.end is None:
                told += session.attached
                self._finish(session, (grpc.StatusCode.UNAVAILABLE, reason))
        return told

    @property
    def orphans(self) -> list[str]:
        """Request ids of the sessions kept for their clients to resume (no call reads them)."""
        return [rid for rid, s in self._sessions.items() if s.orphan_timer is not None]

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        """Tokenizes the request, submits it to the engine and streams its TokenEvents as Chunks
        (those queued while the call was writing go out as one, `coalesce`), then one Complete (finish reason, stats, this worker's id); or re-attaches to the session
        of the same request kept after its upstream vanished (module docstring), streaming what
        follows `resume_token_ids`.

        With metadata `SUBSCRIPTION_HEADER` naming an open Subscribe stream, the responses go
        there (`_Subscription`) and the call carries none: it ends OK once its Complete is queued
        there, or with the request's error.

        Unset max_tokens becomes `WORKER_DEFAULT_MAX_TOKENS` capped by the context the prompt
        leaves (at least 1). A request reusing the id of a running session it cannot resume (one
        being aborted: a client retrying after its deadline) waits until the engine has ended
        that one (`ABORTED_WAIT_S` at most).

        Aborts the call with:
            INVALID_ARGUMENT: `validate_request` fails, more chat turns than the model's context
                has tokens, or the engine's `InvalidRequest`
                (tokenization, context length, sampling parameters, mode, resume tokens).
            NOT_FOUND: the request names a model this worker does not serve.
            RESOURCE_EXHAUSTED: the engine is at capacity (`Overloaded`).
            UNAVAILABLE: the engine is starting or shutting down (`Draining`), it ended the
                request without being asked (it stopped), the worker is leaving the fleet
                because its engine thread died (`fail_streams`), another call resumed the
                session this one read, or the subscription the call names is not open or closed
                while it ran (the session is then kept for a resume).
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
        if self._gone is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self._gone)
        metadata = dict(context.invocation_metadata() or ())
        sub = None
        if SUBSCRIPTION_HEADER in metadata:
            sub = self._subscriptions.get(metadata[SUBSCRIPTION_HEADER])
            if sub is None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.worker_id} has no open subscription "
                                    f"{metadata[SUBSCRIPTION_HEADER]!r}: subscribe again")
        session = self._sessions.get(request.request_id)
        start = session.resume_index(request) if session is not None else None
        shift = 0
        if start is not None:
            shift = len(request.resume_token_ids) - len(session.request.resume_token_ids)
            log.info("request %s resumed after %d tokens (its upstream had gone)", request.request_id,
                     len(request.resume_token_ids))
        elif RESUME_ONLY_HEADER in metadata:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"worker {self.worker_id} keeps no session of "
                                f"request {request.request_id!r} to resume")
        else:
            session = await self._submit(request, context, model)
            start = 0
        async for response in self._read(session, start, shift, context, sub):
            yield response

    async def Subscribe(self, request, context):
        """Sends the responses of every Generate call naming `request.subscription_id` in
        batches (worker.proto); runs until the subscriber leaves. A call whose subscription
        closes ends UNAVAILABLE and its session is kept for a resume, as after a lost upstream.

        Aborts the call with INVALID_ARGUMENT when the id is empty."""
        sid = request.subscription_id
        if not sid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Subscribe needs a subscription_id (any string "
                                "unique to the subscriber)")
        old = self._subscriptions.get(sid)
        if old is not None:
            old.close()
        sub = self._subscriptions[sid] = _Subscription(sid)
        try:
            async for batch in sub.batches():
                yield batch
        finally:
            sub.close()
            if self._subscriptions.get(sid) is sub:
                del self._subscriptions[sid]

    async def _submit(self, request, context, model) -> _Session:
        """Submits a new request (after any running session with its id has ended) and returns
        its session; aborts the call with the engine's refusal."""
        old = self._sessions.get(request.request_id)
        if old is not None and (old.aborting or old.orphan_timer is not None or old.end is not None):
            # Another incarnation of the id that is ending (or kept, but not this request's
            # prefix): it ends first. One that runs and is read goes on, and the engine refuses
            # the duplicate id.
            if old.end is None and not old.aborting:
                self._abort(old)
            self._drop_orphan(old)
            with suppress(TimeoutError):
                await asyncio.wait_for(old.ended.wait(), ABORTED_WAIT_S)
            self._forget(old)
        if self._handoff is None:
            self._handoff = _Handoff(asyncio.get_running_loop(), lambda s, e: self._on_event(s, e))
        handoff = self._handoff
        session = _Session(request)

        def emit(event) -> None:  # engine thread: hand over, nothing else
            handoff.put(session, event)

        try:
            prompt_tokens = await asyncio.to_thread(
                self.engine.encode_prompt,
                request.prompt if request.WhichOneof("input") == "prompt" else None,
                convert.messages_of(request), convert.tools_of(request))
            max_tokens = request.max_tokens if request.HasField("max_tokens") else max(
                1, min(WORKER_DEFAULT_MAX_TOKENS, model.max_context_tokens - len(prompt_tokens)))
            generation = convert.generation_request(request, prompt_tokens, max_tokens)
            # Validation decodes resume tokens: off the loop, which relays every other stream.
            submitted = asyncio.ensure_future(asyncio.to_thread(self.engine.submit, generation, emit))
            self._sessions.setdefault(request.request_id, session)
            try:
                await asyncio.shield(submitted)
            except asyncio.CancelledError:  # the caller left: once admitted, the request is aborted
                submitted.add_done_callback(lambda f: f.cancelled() or f.exception() or self._abort(session))
                raise
        except tuple(ENGINE_ERROR_CODES) as e:
            self._forget(session)
            transfer = getattr(self.engine, "transfer", None)
            if request.import_id and transfer is not None:
                transfer.drop_import(request.import_id)  # refused: its staged state goes too
            self._outcome(type(e).__name__.lower())
            await context.abort(ENGINE_ERROR_CODES[type(e)], short_details(str(e)))
        except BaseException:
            if not session.aborting:  # not admitted (an aborted one stays until its engine end)
                self._forget(session)
            raise
        return session

    def _on_event(self, session: _Session, event) -> None:
        """On the loop: one engine event of `session` becomes a response or its end."""
        if isinstance(event, TokenEvent):
            session.responses.append(convert.chunk_response(event))
            session.token_ids.extend(event.token_ids)
            session.changed.set()
        elif isinstance(event, DoneEvent):
            moved, asked = session.migrated, session.aborting
            if self.metrics is not None:
                # Recorded here, not by a reader: a request whose client left still ends with
                # DoneEvent("cancelled") and its tokens count.
                self.metrics.observe_request(self.engine.model.name, dataclasses.replace(event, finish_reason="migrated")
                                             if moved and event.finish_reason == "cancelled" else event)
            if moved:  # the coordinator drops this stream now: write nothing more on it
                self._finish(session, _MOVED)
            elif event.finish_reason == "cancelled" and not asked:
                reason = f"the engine of worker {self.worker_id} stopped and cancelled the request"
                log.warning("request %s ends UNAVAILABLE: %s", event.request_id, reason)
                self._finish(session, (grpc.StatusCode.UNAVAILABLE, reason))
            else:
                session.responses.append(convert.complete_response(event, self.worker_id))
                self._finish(session, _COMPLETE)
        elif isinstance(event, ErrorEvent):
            log.error("request %s failed", event.request_id, exc_info=event.error)
            self._outcome("error")
            self._finish(session, (grpc.StatusCode.INTERNAL, f"generation failed on worker {self.worker_id} "
                                   f"({type(event.error).__name__}); see the worker log"))

    def _finish(self, session: _Session, end) -> None:
        """Records a session's end (once); a session nobody reads or keeps is forgotten."""
        if session.end is not None:
            return
        session.end = end
        session.ended.set()
        session.changed.set()
        if not session.attached and session.orphan_timer is None:
            self._forget(session)

    def _forget(self, session: _Session) -> None:
        if self._sessions.get(session.request.request_id) is session:
            del self._sessions[session.request.request_id]

    async def _read(self, session: _Session, start: int, shift: int, context, sub: _Subscription | None = None):
        """Streams `session.responses[start:]` as they come, then its end (on `sub` when given:
        the call then yields nothing); when the call ends first, or `sub` closes, aborts the
        session or keeps it for a resume (module docstring)."""
        if session.attached:  # another call still reads it (its upstream's loss not yet seen here)
            log.info("request %s: a resuming call takes the session over", session.request.request_id)
        self._drop_orphan(session)
        session.reader += 1
        me = session.reader
        session.attached = True
        session.changed.set()  # wakes the reader it replaces
        if sub is not None:
            sub.readers.add(session)
        i, finished = start, False
        try:
            while True:
                if session.reader != me:
                    finished = True
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "another call resumed this request")
                if sub is not None and sub.closed:  # its upstream is gone: kept for a resume below
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"subscription {sub.subscription_id!r} closed")
                while i < len(session.responses):
                    response = session.responses[i]
                    if response.WhichOneof("kind") == "complete":
                        finished = True
                        if sub is None:
                            yield _shift_stats(response, shift)
                        else:
                            sub.send(_shift_stats(response, shift))
                        return
                    response, i = coalesce(session.responses, i)
                    if sub is None:
                        yield response
                    else:
                        sub.send(response)
                if session.end == _MOVED:
                    # A final message or status raced with the coordinator's cancel of the call
                    # (grpc logs an ExecuteBatchError then); wait for that cancel instead.
                    finished = True
                    await asyncio.sleep(MOVED_WAIT_S)
                    return
                if isinstance(session.end, tuple):
                    finished = True
                    await context.abort(*session.end)
                session.changed.clear()
                await session.changed.wait()
        finally:
            if sub is not None:
                sub.readers.discard(session)
            if session.reader == me:
                session.attached = False
                if finished:
                    self._forget(session)
                elif (session.aborting or self._gone is not None or self.orphan_grace_s <= 0
                      or _past_deadline(context)):
                    self._abort(session)
                    if session.end is not None:
                        self._forget(session)
                else:  # kept, also when it ended meanwhile: its client has not got the end
                    self._orphan(session)

    def _orphan(self, session: _Session) -> None:
        """Keeps a session whose call ended without a Cancel for `orphan_grace_s` seconds."""
        log.info("request %s lost its upstream without a cancel: kept %.0f s for its client to resume",
                 session.request.request_id, self.orphan_grace_s)
        session.orphan_timer = asyncio.get_running_loop().call_later(self.orphan_grace_s, self._expire, session)

    def _drop_orphan(self, session: _Session) -> None:
        if session.orphan_timer is not None:
            session.orphan_timer.cancel()
            session.orphan_timer = None

    def _expire(self, session: _Session) -> None:
        """An orphan nobody resumed: aborted in the engine, forgotten once it ended."""
        session.orphan_timer = None
        if session.attached:
            return
        log.info("request %s was not resumed within %.0f s: aborted", session.request.request_id, self.orphan_grace_s)
        if session.end is None:
            self._abort(session)
        else:
            self._forget(session)

    def _abort(self, session: _Session) -> bool:
        """engine.abort of a session (once), remembering that its DoneEvent("cancelled") was
        asked for; False when the engine no longer runs it."""
        if session.aborting:
            return session.end is None
        session.aborting = True
        return self.engine.abort(session.request.request_id)

    async def Cancel(self, request, context):
        """Aborts a running request by id (or drops a state staged for it); `cancelled` is False
        when the id is unknown here. reason "migrated" (the coordinator, before it drops a moved
        stream) counts the request's end as outcome "migrated" rather than "cancelled"."""
        session = self._sessions.get(request.request_id)
        if session is None:
            return worker_pb2.CancelResponse(cancelled=self.engine.abort(request.request_id))
        if request.reason == MIGRATED:
            session.migrated = True
        self._drop_orphan(session)
        cancelled = self._abort(session)
        if session.end is not None and not session.attached:
            self._forget(session)
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


def _past_deadline(context) -> bool:
    """Whether a call's deadline has passed (its end then was no vanished upstream)."""
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0
