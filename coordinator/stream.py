"""One proxied Generate stream as a state machine, and the fleet-wide parts every stream shares.

A `ProxiedStream` carries one client request from placement to its end:

    PLACING ──> STREAMING <──> MOVING            (a migration's destination call opens)
       │            │  ^
       │            v  │
       │        FAILING_OVER                     (its worker failed mid-stream)
       v
    RESUMING ──> STREAMING                       (a client resumed the request after its
                                                  coordinator died: re-attach, or resume elsewhere)
    any state ──> DONE

Each state change is one method; the stream's hold on a worker's capacity is a `Slot` (a context
manager: a slot taken by code that then raises is given back, so no failure path leaves a worker
looking busier than it is). The gRPC and HTTP servicers only adapt (coordinator/servicer.py,
coordinator/openai_api.py).

Moves: between two chunks the stream may move to another worker (session migration,
coordinator/migration.py): the destination pulls the session's KV state straight from the source
while the stream goes on (coordinator/kv_transfer.py), then the same request, resumed after the
tokens already sent and naming the imported state, opens on the destination (or, without a state,
prefills everything there), and the source call is cancelled once the destination answers. Of
the policy's moves, a coordinator that does not own the stream's worker (coordinator/state/:
with several coordinators sharing the fleet's state, each worker has one owner) decides only
drain moves; the owner decides the others for it (`Fleet.decide_for_others`) and the stream
makes them (`ProxiedStream.owner_move`).

Ends: a stream that ends before its worker's Complete (its client left, its deadline, an error)
sends the worker Cancel(request_id) before it closes the call, so the worker frees the session at
once; a call that ends WITHOUT a Cancel means the coordinator itself died, and the worker keeps
the session for its client to resume (worker/servicer.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import grpc
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from coordinator import kv_transfer
from coordinator.admission import AdmissionQueue
from coordinator.config import CoordinatorConfig
from coordinator.migration import Decision, StreamProgress, profile_timings, session_load
from coordinator.overload import RpcLag
from coordinator.registry import WorkerRecord
from coordinator.routing import AllBusy, NoWorker, PowerOfTwoRouter, has_kv_room, request_tokens_bound, route
from coordinator.state import FleetState
from flashfleet.errors import short_details
from flashfleet.requests import RESUME_ONLY_HEADER
from flashfleet.v1 import common_pb2, worker_pb2

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
CANCEL_TIMEOUT_S = 1.0  # a Cancel sent to a worker waits this long for its answer
REJOIN_POLL_S = 0.05  # a young coordinator looks this often for a worker that registered since
MOVES_KEPT = 256  # recent moves kept in `Fleet.moves`
ROUTE_DRAWS = 16  # workers with a free slot an admission looks at (all of them in a smaller fleet)


def deadline_passed(time_remaining: TimeRemaining) -> bool:
    """Whether the call's deadline (if it has one) is over, within DEADLINE_SLACK_S seconds: a
    call that ends unfinished then ended by DEADLINE_EXCEEDED, not by the client's cancel."""
    remaining = time_remaining()
    return remaining is not None and remaining <= DEADLINE_SLACK_S


class GenerateFailed(Exception):
    """A request ends with an error status.

    Attributes:
        code: the grpc.StatusCode the gRPC API aborts the call with (the HTTP API maps it onto an
            HTTP status, coordinator/openai_api.py).
        details: what went wrong, for the client.
    """

    def __init__(self, code: grpc.StatusCode, details: str):
        details = short_details(details)
        super().__init__(details)
        self.code, self.details = code, details


class State(enum.Enum):
    """Where a `ProxiedStream` is (module docstring)."""

    PLACING = "placing"
    STREAMING = "streaming"
    MOVING = "moving"
    FAILING_OVER = "failing_over"
    RESUMING = "resuming"
    DONE = "done"


class Slot:
    """A stream's hold on one of a worker's sessions, counted in `WorkerRecord.in_flight` from
    construction until `release()` (idempotent).

    Used as a context manager around the code that opens the worker's call: leaving the block by
    an exception releases the slot (whatever raised: opening the channel, the call, its first
    read), leaving it normally keeps it for the stream, which releases it when it ends or moves.

    Args:
        worker: the worker whose slot this is.
        on_release: called after the slot is given back (wakes requests waiting for one).
    """

    def __init__(self, worker: WorkerRecord, on_release: Callable[[], None]):
        self.worker = worker
        self._on_release = on_release
        self.held = True
        worker.in_flight += 1
        worker.changed()

    def release(self) -> None:
        """Gives the slot back (once; later calls do nothing)."""
        if self.held:
            self.held = False
            self.worker.in_flight -= 1
            self.worker.changed()
            self._on_release()

    def __enter__(self) -> "Slot":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            self.release()
        return False


@dataclass(frozen=True)
class Move:
    """One session move (or attempt), as `Fleet.moves` records it.

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


@dataclass
class MoveRequest:
    """An operator's MoveSession waiting for the stream's next chunk boundary."""

    dest: WorkerRecord
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class WorkerFailed(Exception):
    """A worker's call failed before its first message (routing tries another one)."""

    def __init__(self, worker: WorkerRecord, error: grpc.aio.AioRpcError):
        super().__init__(error.details())
        self.worker, self.error = worker, error


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, WorkerFailed) and exc.error.code() in RETRYABLE


def _full(exc: BaseException | None) -> bool:
    """A worker refused for capacity: its sessions outnumber this coordinator's streams to it
    (another coordinator's streams, or a cancelled stream's session that ends at the worker's
    next engine turn), so it is full for now, not failed."""
    return isinstance(exc, WorkerFailed) and exc.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def _takes(w: WorkerRecord, model: str, mode: int) -> bool:
    """Whether routing may give `w` a request for `model` in `mode` now: it serves them, has a
    free slot, and is neither draining nor marked unreachable."""
    return w.busy < w.capacity and not w.draining and not w.unreachable and w.serves(model, mode)


def _no_message() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                "the worker ended the stream without a message")


class Fleet:
    """What every stream of one coordinator shares: config, registry, channels, routing,
    admission, metrics, the streams in flight and the record of recent moves.

    Args:
        config: the coordinator's settings.
        state: the fleet's state (coordinator/state/): its registry of live workers, session
            affinity, placements and worker ownership.
        pool: one channel per worker (coordinator/servicer.py WorkerPool).
        router: routing's choice.
        metrics: CoordinatorMetrics, or None.
    """

    def __init__(self, config: CoordinatorConfig, state: FleetState, pool, router: PowerOfTwoRouter, metrics=None):
        self.config, self.state, self.pool = config, state, pool
        self.registry, self.affinity = state.registry, state.affinity
        self.router, self.metrics = router, metrics
        self.admission = AdmissionQueue(config.max_queued, config.queue_timeout_s)
        self.streams: dict[str, ProxiedStream] = {}  # request id -> its stream, once routed
        self.drain_moved: dict[str, int] = {}  # worker id -> sessions moved off it while it drains
        self.moves: deque[Move] = deque(maxlen=MOVES_KEPT)  # recent moves, newest last
        self._background: set[asyncio.Task] = set()  # best-effort calls nobody waits for
        self.started_s = time.monotonic()
        # Moves this coordinator decided, as its workers' owner, for streams other coordinators
        # proxy: request id -> when (not asked again within the policy's cooldown), and a count.
        self._decided_for_others: dict[str, float] = {}
        self.moves_decided_for_others = 0
        # worker id -> (its load report last weighed, {request id: first seen on it}) for those
        self._owner_checked: dict[str, tuple[object, dict[str, float]]] = {}
        state.on_move = self.moved_by_owner
        # How late this coordinator answers RPCs (its probe is started with the server,
        # coordinator/server.py): while it is overloaded new requests wait for room.
        self.rpc_lag = RpcLag(on_recover=self.admission.notify)
        self.admission.held = self.rpc_lag.overloaded

    def decide_for_others(self) -> None:
        """Runs the migration policy, as the owner of its workers, for the streams other
        coordinators proxy from them (coordinator/state/: shared state only), once per load
        report of each worker, and asks their coordinators to make the moves it decides
        (`FleetState.request_move`). The streams this coordinator proxies decide for themselves.

        A stream that arrived on the worker by a move or a resume (its placement counts tokens
        already sent) stays for the policy's cooldown from when this coordinator first saw it
        there, and a stream asked to move is not asked again within the cooldown."""
        policy, state = self.config.migration, self.state
        if not policy.enabled:
            return
        now = time.monotonic()
        self._decided_for_others = {r: t for r, t in self._decided_for_others.items() if now - t < policy.cooldown_s}
        live = self.registry.live()
        for worker_id in [w for w in self._owner_checked if self.registry.get(w) is None]:
            del self._owner_checked[worker_id]
        for source in live:
            if source.draining or not state.owns(source.worker_id):
                continue  # a drain's moves are every proxying coordinator's own
            checked_load, seen_before = self._owner_checked.get(source.worker_id, (None, {}))
            if checked_load is source.load:
                continue
            seen = {}  # request id -> when first seen on this worker
            for placement in state.foreign_placements(source.worker_id):
                first = seen[placement.request_id] = seen_before.get(placement.request_id, now)
                if placement.request_id in self._decided_for_others:
                    continue
                arrived_s = first if placement.tokens > 0 else None
                # The proxying coordinator moves it only once it has forwarded tokens.
                decision = policy.decide(placement.request(), source, max(placement.tokens, 1), live, arrived_s, now)
                if decision is not None:
                    self._decided_for_others[placement.request_id] = now
                    self.moves_decided_for_others += 1
                    state.request_move(placement, decision.dest.worker_id, decision.reason)
            self._owner_checked[source.worker_id] = (source.load, seen)

    async def decide_for_others_loop(self) -> None:
        """`decide_for_others` every `check_interval_s` (at least every 50 ms), until cancelled."""
        while True:
            await asyncio.sleep(max(self.config.migration.check_interval_s, 0.05))
            try:
                self.decide_for_others()
            except Exception:  # a bad load report must not end the loop
                log.exception("deciding moves for other coordinators' streams failed")

    def moved_by_owner(self, request_id: str, to_worker_id: str, reason: str) -> None:
        """The owner of a stream's worker asked this coordinator to move the stream
        (`FleetState.on_move`): the stream weighs it at its next chunk (`ProxiedStream`)."""
        self.state.move_taken(request_id)
        stream = self.streams.get(request_id)
        if stream is not None:
            stream.owner_move = (to_worker_id, reason)

    def slot(self, worker: WorkerRecord) -> Slot:
        """Takes a slot on `worker` (see `Slot`)."""
        return Slot(worker, self.admission.notify)

    def has_room(self, request: common_pb2.GenerateRequest) -> bool:
        """True when a reachable worker serving the request's model and mode has a free slot
        (or none serves it, or all that do are unreachable: routing then says so or tries them).

        Looks at a few workers with a free slot (the registry's per-model index), not the fleet:
        the whole fleet is read only when none of those drawn can take the request. False while
        the coordinator itself is overloaded (coordinator/overload.py): the request waits."""
        if self.rpc_lag.overloaded():
            return False
        model, mode = request.model, request.mode
        free = self.registry.free_sample(model, ROUTE_DRAWS)
        if any(_takes(w, model, mode) for w in free):
            return True
        if not free:  # every worker serving the model is full: room only if none is reachable
            return not any(w.serves(model, mode) and not w.draining and not w.unreachable
                           for w in self.registry.serving(model))
        serving = [w for w in self.registry.serving(model) if w.serves(model, mode) and not w.draining]
        reachable = [w for w in serving if not w.unreachable]
        return not reachable or any(w.busy < w.capacity for w in reachable)

    def pick(self, request: common_pb2.GenerateRequest, exclude: set[str], tokens: int) -> WorkerRecord | None:
        """`routing.route`'s choice in the common case, from a few workers: the session's worker
        when it can take the request and has KV room for `tokens`, else the router's choice among
        up to `ROUTE_DRAWS` workers with a free slot drawn at random (the index's) that can take
        it and have KV room. None when that does not settle it (no such worker drawn, the
        session's worker lacks room): then `route` decides over the whole fleet."""
        model, mode = request.model, request.mode
        sticky = self.affinity.lookup(request.session_id)
        if sticky:
            w = self.registry.get(sticky)
            if w is not None and w.worker_id not in exclude and _takes(w, model, mode):
                return w if has_kv_room(w, model, tokens) else None
        roomy = [w for w in self.registry.free_sample(model, ROUTE_DRAWS)
                 if w.worker_id not in exclude and _takes(w, model, mode) and has_kv_room(w, model, tokens)]
        return self.router.choose_worker(roomy) if roomy else None

    def count(self, model: str, worker_id: str, outcome: str) -> None:
        """Counts a finished request in the metrics."""
        if self.metrics:
            self.metrics.routed.labels(model=model, worker=worker_id, outcome=outcome).inc()

    def record_move(self, model: str, outcome: str, *, reason: str = "load", method: str = "reprefill",
                    bytes_moved: int = 0, pause_s: float | None = None, total_s: float | None = None) -> None:
        """Counts a migration attempt in `moves` and the metrics (`CoordinatorMetrics.observe_migration`).

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

    def spawn(self, coro) -> None:
        """Runs a best-effort coroutine nobody waits for (kept referenced until it ends)."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def cancel_quietly(self, worker: WorkerRecord, request_id: str, reason: str = "") -> None:
        """Cancel(request_id) on a worker, best effort: ends the session there (or drops a state
        staged for it)."""
        try:
            await self.pool.stub(worker.address).Cancel(worker_pb2.CancelRequest(request_id=request_id, reason=reason),
                                                        timeout=CANCEL_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            log.debug("cancel of %s on %s: %s", request_id, worker.worker_id, e.code().name)

    async def end_session(self, worker: WorkerRecord, request_id: str, call) -> None:
        """Ends a session this coordinator gives up on: Cancel(request_id) first, then the call
        closed (a call that closes without a Cancel tells the worker its coordinator died, and the
        worker keeps the session for a resume)."""
        try:
            await self.cancel_quietly(worker, request_id)
        finally:
            call.cancel()

    async def drop_if_left(self, worker: WorkerRecord) -> None:
        """Closes the channel to a worker that left the registry once no stream uses it."""
        if (worker.in_flight == 0 and self.registry.get(worker.worker_id) is not worker
                and not any(w.address == worker.address for w in self.registry.live())):
            await self.pool.drop(worker.address)


class ProxiedStream:
    """One client request, proxied to a worker (module docstring).

    Args:
        fleet: the coordinator's shared parts.
        request: the validated request (its request_id set).
        time_remaining: seconds left before the request's deadline, or None without one.
        t0: monotonic time the request arrived.

    Attributes:
        state: the `State` it is in.
        progress: what the client has received (the resume point of any move).
        worker: the worker serving it now (None while placing).
        move_request: an operator's pending MoveSession.
    """

    def __init__(self, fleet: Fleet, request: common_pb2.GenerateRequest, time_remaining: TimeRemaining, t0: float):
        self.fleet = fleet
        self.request = request
        self.time_remaining = time_remaining
        self.t0 = t0
        self.state = State.PLACING
        self.progress = StreamProgress()
        self.worker: WorkerRecord | None = None
        self.slot: Slot | None = None
        self.call = None
        self.transfer: kv_transfer.Transfer | None = None
        self._move_gain = 0.0  # the Decision.gain of the move under way (`StreamProgress.left`)
        self._transfer_slot: Slot | None = None
        self.move_request: MoveRequest | None = None
        self.queue_s = 0.0
        self._moved_first = None  # the new worker's first response, after a move or failover
        self._checked_load = None  # the worker's load report the policy last weighed for this stream
        self.owner_move: tuple[str, str] | None = None  # (worker id, reason) its worker's owner decided
        if request.resume_token_ids:  # a client resuming after its coordinator died
            self.state = State.RESUMING
            self.progress.resume_from(list(request.resume_token_ids), request.resume_text)

    # ----- the whole stream --------------------------------------------------------------------

    async def run(self) -> AsyncIterator[common_pb2.GenerateResponse]:
        """Places the request and yields its worker's responses (chunks, then one Complete),
        moving and failing over between chunks (`CoordinatorServicer.generate` documents the
        behaviour and errors). Close the generator (`contextlib.aclosing`) when leaving early."""
        fleet, request = self.fleet, self.request
        try:
            first = await self._place()
        except asyncio.CancelledError:  # the client left, or its deadline ran out, before a first token
            fleet.count(request.model, "", "deadline" if deadline_passed(self.time_remaining) else "cancelled")
            self.state = State.DONE
            raise
        except BaseException:
            self.state = State.DONE
            raise
        fleet.streams[request.request_id] = self
        fleet.state.place(request.request_id, self.worker.worker_id, len(self.progress.token_ids), request)
        outcome = "cancelled"
        try:
            resp = first
            served_by: list[str] = []  # the workers that served it, in order (moves, failovers)
            while resp is not grpc.aio.EOF:
                self.state = State.STREAMING
                if not served_by or served_by[-1] != self.worker.worker_id:
                    served_by.append(self.worker.worker_id)
                if resp.WhichOneof("kind") == "complete":
                    resp.complete.stats.queue_s = self.queue_s
                    resp.complete.served_by[:] = served_by
                    self.progress.finish_stats(resp.complete.stats)
                    outcome = "ok"
                    yield resp
                else:
                    self.progress.add(resp.chunk)
                    yield resp
                    if not self._quiet() and await self._between_chunks():
                        resp = self._moved_first
                        continue
                try:
                    resp = await self.call.read()
                except grpc.aio.AioRpcError as e:
                    if e.code() != grpc.StatusCode.UNAVAILABLE:
                        raise
                    self.worker.unreachable = True  # died mid-stream: new requests go elsewhere first
                    if not await self._fail_over(e):
                        raise
                    resp = self._moved_first
        except grpc.aio.AioRpcError as e:
            outcome = OUTCOME_BY_CODE.get(e.code(), "error")
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                self.worker.unreachable = True
            # Tokens are with the client: a replay elsewhere would repeat them (failover resumes
            # instead, after UNAVAILABLE; it found no worker that took the session).
            raise GenerateFailed(e.code(), f"worker {self.worker.worker_id} failed after "
                                 f"{len(self.progress.token_ids)} tokens and no other worker could resume "
                                 f"the session: {e.details()}") from None
        finally:
            await self._finish(outcome)

    async def _finish(self, outcome: str) -> None:
        """DONE: gives back every slot, ends the worker's session unless it completed (Cancel
        before the call is closed, so the worker does not keep it for a client that will not
        resume it), counts the request."""
        fleet, request, worker = self.fleet, self.request, self.worker
        self.state = State.DONE
        self._abandon_transfer()
        fleet.streams.pop(request.request_id, None)
        fleet.state.unplace(request.request_id)
        self._settle_move_request(None, ended=True)
        if outcome == "ok":
            self.call.cancel()
        else:
            fleet.spawn(fleet.end_session(worker, request.request_id, self.call))
        self.slot.release()
        worker.served_requests += 1
        if outcome == "cancelled" and deadline_passed(self.time_remaining):
            outcome = "deadline"  # the client's deadline ended the call, not the client
        fleet.count(request.model, worker.worker_id, outcome)
        await fleet.drop_if_left(worker)  # the worker left while this stream ran

    def _quiet(self) -> bool:
        """True when this chunk boundary has nothing to weigh, so `_between_chunks` would do
        nothing: no KV transfer, operator's or owner's move is pending, the worker is not
        draining, and the policy decides once per load report of the worker and has weighed
        (or, for a worker another coordinator owns, passed over) its latest one. Most boundaries
        are such, and the relay then does no more per message than forward it and count it."""
        return (self.transfer is None and self.move_request is None and self.owner_move is None
                and self.worker.load is self._checked_load and not self.worker.draining
                and getattr(self.fleet.config.migration, "once_per_load_report", False))

    async def _between_chunks(self) -> bool:
        """At a chunk boundary: completes a finished KV transfer, asks the migration policy (or
        an operator's move) where the stream should be, and answers a pending MoveSession.

        Returns:
            True when the stream moved (then `_moved_first` is the new worker's first response).
        """
        source = self.worker
        moved = await self._transfer_due()
        if not moved and self.transfer is None:
            decision = self._move_decision()
            if decision is not None:
                self._move_gain = decision.gain
                moved = await self._migrate(decision.dest, decision.reason)
        if self.transfer is not None:  # a move is under way: MoveSession waits for it
            return False
        self._settle_move_request(moved)
        if not moved:
            return False
        self.progress.left(source.worker_id, self._move_gain)
        if source.draining:
            self.fleet.drain_moved[source.worker_id] = self.fleet.drain_moved.get(source.worker_id, 0) + 1
        return True

    # ----- PLACING / RESUMING -----------------------------------------------------------------

    async def _place(self) -> common_pb2.GenerateResponse:
        """PLACING (or RESUMING): routes the request and opens its worker call; returns the
        worker's first response (`_open_stream`), mapping routing's refusals onto GenerateFailed."""
        fleet, request = self.fleet, self.request
        try:
            first = await self._open_stream()
        except NoWorker as e:
            # Unknown names share one label value: clients must not create unbounded series.
            known = any(w.serves(request.model) for w in fleet.registry.live())
            fleet.count(request.model if known else "(unknown)", "", "no_worker")
            served = sorted({m for w in fleet.registry.live() for m in w.model_names})
            raise GenerateFailed(grpc.StatusCode.NOT_FOUND,
                                 str(e) if known else f"{e}; models served: {served}") from None
        except AllBusy as e:
            fleet.count(request.model, "", "overloaded")
            raise GenerateFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        except WorkerFailed as e:
            fleet.count(request.model, e.worker.worker_id, OUTCOME_BY_CODE.get(e.error.code(), "error"))
            raise GenerateFailed(e.error.code(), e.error.details() or "worker failed") from None
        if fleet.metrics:
            fleet.metrics.observe_queue(request.model, self.queue_s)
        fleet.affinity.bind(request.session_id, self.worker.worker_id)
        return first

    async def _reattach(self, probed: set[str]) -> common_pb2.GenerateResponse | None:
        """RESUMING: asks every live worker serving the model and not in `probed`, at once, to
        re-attach to the session it kept for this request (metadata `RESUME_ONLY_HEADER`: one
        that keeps none answers NOT_FOUND), adding them to `probed`; sets `worker`, `slot` and
        `call` and returns the first response of the one that holds it, else None (nothing is
        left open)."""
        fleet, request = self.fleet, self.request

        async def probe(w: WorkerRecord):
            return (w, *await self._open_on(w, request, metadata=((RESUME_ONLY_HEADER, "1"),)))

        workers = [w for w in fleet.registry.live()
                   if w.serves(request.model) and not w.unreachable and w.worker_id not in probed]
        probed.update(w.worker_id for w in workers)
        probes = [asyncio.ensure_future(probe(w)) for w in workers]
        try:
            results = await asyncio.gather(*probes, return_exceptions=True)
        except asyncio.CancelledError:
            # The client left while probing: gather cancelled the probes still running (each gives
            # its slot back), but one that had already answered holds a slot and a call.
            for task in probes:
                if task.done() and not task.cancelled() and task.exception() is None:
                    w, slot, call, _ = task.result()
                    slot.release()
                    fleet.spawn(fleet.end_session(w, request.request_id, call))
            raise
        found = [r for r in results if not isinstance(r, BaseException)]
        for w, slot, call, _ in found[1:]:  # one session per request id: never more than one, but nothing leaks
            slot.release()
            fleet.spawn(fleet.end_session(w, request.request_id, call))
        if not found:
            return None
        self.worker, self.slot, self.call, first = found[0]
        self.queue_s = time.monotonic() - self.t0
        log.info("request %s re-attached to worker %s after %d tokens", request.request_id, self.worker.worker_id,
                 len(self.progress.token_ids))
        return first

    async def _route(self, tried: set[str], refused: set[str], tokens: int) -> WorkerRecord:
        """One routing decision (the holder of a resumed session first)."""
        fleet, request = self.fleet, self.request
        while True:
            picked = fleet.pick(request, tried | refused, tokens)
            if picked is not None:
                return picked
            try:
                try:
                    return route(request.model, request.session_id, fleet.registry.live(), tried | refused,
                                 fleet.router, fleet.affinity, request.mode, tokens)
                except AllBusy:
                    if not refused:
                        raise
                    return route(request.model, request.session_id, fleet.registry.live(), tried,
                                 fleet.router, fleet.affinity, request.mode, tokens)
            except NoWorker:
                # A coordinator that just (re)started has not heard from every worker yet: they
                # register again within a heartbeat or two. Wait for them rather than refuse.
                young_s = fleet.config.lease_ttl_s - (time.monotonic() - fleet.started_s)
                if young_s <= 0:
                    raise
                await asyncio.sleep(min(REJOIN_POLL_S, young_s))

    async def _open_stream(self) -> common_pb2.GenerateResponse:
        """Opens a worker stream and reads its first message, retrying other workers on
        UNAVAILABLE / RESOURCE_EXHAUSTED (bounded attempts, exponential backoff with jitter).

        A worker that answers RESOURCE_EXHAUSTED is full for now, not failed: the next attempt
        prefers other workers, then tries it again, and such refusals are retried (with the same
        backoff) until `queue_timeout_s` from the request's arrival, as a request waiting in the
        admission queue would (with `max_queued` 0, no request waits: `route_attempts` bounds them).

        Sets `worker`, `slot`, `call` and `queue_s` (the time from arrival until the call to the
        serving worker was issued: routing and earlier failed attempts, not the worker's prefill).
        """
        fleet, request = self.fleet, self.request
        cfg = fleet.config
        full_wait_s = cfg.queue_timeout_s if cfg.max_queued > 0 else 0.0
        bounded = stop_after_attempt(cfg.route_attempts)

        def stop(state) -> bool:
            if _full(state.outcome.exception()) and time.monotonic() - self.t0 < full_wait_s:
                return False
            return bounded(state)

        if self.state is State.RESUMING:
            probed: set[str] = set()
            first = await self._reattach(probed)
            # A coordinator that just (re)started hears from the workers its predecessor served
            # within moments of listening: the one keeping this session may not have registered yet.
            while first is None and time.monotonic() - fleet.started_s < fleet.config.heartbeat_interval_s:
                await asyncio.sleep(REJOIN_POLL_S)
                first = await self._reattach(probed)
            if first is not None:
                return first
        tokens = request_tokens_bound(request)  # KV the request may need: routing prefers room for it
        tried: set[str] = set()
        refused: set[str] = set()  # workers that said "full": tried again once the others are
        retrying = AsyncRetrying(
            stop=stop,
            wait=wait_exponential_jitter(multiplier=cfg.retry_initial_wait_s, max=cfg.retry_max_wait_s),
            retry=retry_if_exception(_retryable), reraise=True)
        last_failure: WorkerFailed | None = None
        async for attempt in retrying:
            with attempt:
                if attempt.retry_state.attempt_number > 1 and fleet.metrics:
                    fleet.metrics.retries.labels(model=request.model).inc()
                if attempt.retry_state.attempt_number == 1 and self.state is not State.RESUMING:
                    await fleet.admission.wait_for_room(lambda: fleet.has_room(request), request.model)
                try:  # from here to the slot below nothing awaits (unless no worker is known yet)
                    worker = await self._route(tried, refused, tokens)
                except AllBusy:
                    if last_failure is not None:  # report why the tried workers failed
                        raise last_failure from None
                    raise
                tried.add(worker.worker_id)
                # The slot is taken now, so concurrent requests routed before this one's first
                # token see the worker as busy (heartbeat loads lag by seconds).
                with fleet.slot(worker) as slot:
                    try:
                        call = fleet.pool.generate(worker.address, request, timeout=self.time_remaining())
                    except Exception as e:  # the channel could not be made (an address or TLS setting grpc refuses)
                        worker.unreachable = True
                        last_failure = WorkerFailed(worker, grpc.aio.AioRpcError(
                            grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                            f"could not open a channel to worker {worker.worker_id} at {worker.address}: {e}"))
                        log.warning("%s", last_failure.error.details())
                        raise last_failure from None
                    self.queue_s = time.monotonic() - self.t0
                    try:
                        first = await call.read()
                    except grpc.aio.AioRpcError as e:
                        log.info("worker %s refused %s: %s %s", worker.worker_id, request.request_id,
                                 e.code().name, e.details())
                        if e.code() == grpc.StatusCode.UNAVAILABLE:
                            worker.unreachable = True  # until its next heartbeat (coordinator/registry.py)
                        last_failure = WorkerFailed(worker, e)
                        if _full(last_failure):
                            tried.discard(worker.worker_id)
                            refused.add(worker.worker_id)
                        raise last_failure from None
                    except BaseException:  # the client left: the worker is told, then the call closed
                        fleet.spawn(fleet.end_session(worker, request.request_id, call))
                        raise
                self.worker, self.slot, self.call = worker, slot, call
                return first

    # ----- MOVING -------------------------------------------------------------------------------

    def _move_decision(self) -> Decision | None:
        """An operator's pending move of this stream, else the policy's decision when a check is
        due (coordinator/migration.py), else None."""
        if self.move_request is not None:
            return Decision(self.move_request.dest, "manual")
        policy = self.fleet.config.migration
        if self.owner_move is not None:
            return self._owner_decision(policy)
        if not self.worker.draining and not self.fleet.state.owns(self.worker.worker_id):
            # Speed, load and memory moves off a worker are its owner's (`_owner_decision`);
            # ownership is looked at again with the worker's next load report.
            self._checked_load = self.worker.load
            return None
        # The policy weighs what heartbeats report: between two load reports of the stream's
        # worker a second check would weigh the same sessions (a drain is checked regardless).
        if (getattr(policy, "once_per_load_report", False) and not self.worker.draining
                and self.worker.load is self._checked_load):
            return None
        if not self.progress.due(policy.check_interval_s):
            return None
        self._checked_load = self.worker.load
        p = self.progress
        if p.left_worker is not None and p.left_timings is None:
            # The baseline of the worker's timings once it no longer runs the stream: the steps it
            # took for the stream before the move are no news of its speed afterwards.
            left = self.fleet.registry.get(p.left_worker)
            if left is not None and session_load(left, self.request.request_id) is None:
                p.left_timings = profile_timings(left)
        return policy.decide(self.request, self.worker, len(p.token_ids), self.fleet.registry.live(), p.moved_s,
                             time.monotonic(), p.left_worker, p.left_s, left_gain=p.left_gain,
                             left_timings=p.left_timings)

    def _owner_decision(self, policy) -> Decision | None:
        """The move the owner of the stream's worker (another coordinator) decided, if its
        destination can still take the stream (a candidate with KV room for it) and the stream
        has tokens to resume from; else None (the owner may decide again after its cooldown)."""
        (to_worker_id, reason), self.owner_move = self.owner_move, None
        dest = self.fleet.registry.get(to_worker_id)
        p = self.progress
        if dest is None or not p.token_ids:
            return None
        cands = policy.candidates(self.request, self.worker, [dest], p.left_worker, p.left_s, time.monotonic())
        if not cands or policy.fastest(self.request, self.worker, session_load(self.worker, self.request.request_id),
                                       cands, ()) is None:
            return None
        return Decision(dest, reason)

    async def _migrate(self, dest: WorkerRecord, reason: str) -> bool:
        """Starts moving the stream to `dest` for `reason` (coordinator.migration.REASONS).

        With `migration_method` "kv" (the default) this starts relaying the session's KV state
        to `dest` (coordinator/kv_transfer.py) and returns False: the stream goes on from the
        source, and `_transfer_due` completes the move at a chunk boundary once the state is
        staged. With "reprefill" the move happens now (`_move`).

        Returns:
            True when the stream moved now.
        """
        fleet = self.fleet
        if fleet.config.migration_method == "kv":
            with fleet.slot(dest) as slot:  # reserved now, so no other stream takes the idle worker meanwhile
                self.transfer = kv_transfer.start(fleet.pool.stub(dest.address), self.worker.address,
                                                  self.request.request_id, dest, self.time_remaining(), reason)
            self._transfer_slot = slot
            log.info("moving %s from %s to %s (%s): KV transfer started", self.request.request_id,
                     self.worker.worker_id, dest.worker_id, reason)
            return False
        return await self._move(dest, reason=reason, method="reprefill")

    def _take_transfer(self) -> kv_transfer.Transfer | None:
        """Ends the stream's hold on its transfer: the transfer (or None); its destination's slot
        is given back."""
        t, self.transfer = self.transfer, None
        if self._transfer_slot is not None:
            self._transfer_slot.release()
            self._transfer_slot = None
        return t

    async def _transfer_due(self) -> bool:
        """At a chunk boundary: completes a finished KV transfer of this stream. Staged: the
        stream moves to its destination, claiming the state (`_move`). Failed: the stream moves by
        re-prefill when it must move (an operator's move, a drain, memory) or the policy still picks
        that destination, else it stays.

        Returns:
            True when the stream moved.
        """
        if self.transfer is None or not self.transfer.task.done():
            return False
        t = self._take_transfer()  # `_move` takes the destination's slot again
        staged = t.staged()
        if staged is not None:
            return await self._move(t.dest, reason=t.reason, method="kv", import_id=staged.import_id,
                                    bytes_moved=t.bytes, started_s=t.started_s)
        log.info("KV transfer of %s to %s failed (%s)", self.request.request_id, t.dest.worker_id, t.error())
        self.fleet.record_move(self.request.model, "aborted", reason=t.reason, method="kv",
                               bytes_moved=t.bytes, total_s=time.monotonic() - t.started_s)
        if t.reason in ("load", "speed"):  # the re-prefill's cost may not pay where the copy's did
            again = self.fleet.config.migration.decide(self.request, self.worker, len(self.progress.token_ids),
                                                       [self.worker, t.dest], None, time.monotonic())
            if again is None or again.dest is not t.dest:
                self.progress.attempted()
                return False
        return await self._move(t.dest, reason=t.reason, method="reprefill")

    def _abandon_transfer(self) -> None:
        """Stops the stream's KV transfer, gives back its destination's slot and asks the
        destination to drop a state it may have staged (a Cancel of the request id)."""
        t = self._take_transfer()
        if t is None:
            return
        t.task.cancel()
        self.fleet.spawn(self.fleet.cancel_quietly(t.dest, self.request.request_id))

    async def _open_on(self, dest: WorkerRecord, request: common_pb2.GenerateRequest, metadata=None):
        """Opens `request` on `dest` (with the call's `metadata`) and reads its first message;
        returns (slot, call, first). Every failure gives the slot back and cancels the call before
        it propagates."""
        with self.fleet.slot(dest) as slot:  # reserved now, so no other stream takes the idle worker meanwhile
            call = self.fleet.pool.generate(dest.address, request, timeout=self.time_remaining(),
                                            metadata=metadata or ())
            try:
                first = await call.read()
                if first is grpc.aio.EOF:
                    raise _no_message()
            except grpc.aio.AioRpcError:
                call.cancel()
                raise
            except BaseException:  # the client left: the destination is told, then the call closed
                self.fleet.spawn(self.fleet.end_session(dest, request.request_id, call))
                raise
        return slot, call, first

    def _switch(self, dest: WorkerRecord, slot: Slot, call, first) -> None:
        """The stream now reads from `dest` (the previous worker's slot is given back)."""
        self.slot.release()  # served_requests counts the request once, on the worker that ends it
        self.worker, self.slot, self.call, self._moved_first = dest, slot, call, first
        self.progress.moved()
        self.fleet.affinity.bind(self.request.session_id, dest.worker_id)
        self.fleet.state.place(self.request.request_id, dest.worker_id, len(self.progress.token_ids), self.request)

    async def _move(self, dest: WorkerRecord, *, reason: str, method: str, import_id: str = "",
                    bytes_moved: int = 0, started_s: float | None = None) -> bool:
        """MOVING: moves the stream to `dest` now. The resumed request (naming `import_id`, a
        state staged there, if any) goes to `dest` while the source call stays open and unread;
        only when `dest` sends its first message is the source cancelled (its unread messages,
        past the resume point, are dropped). If `dest` refuses (at capacity, draining, or the
        request ended meanwhile: its tokens already reach a stop string or the budget), the
        stream simply stays on the source, nothing lost.

        Returns:
            True when the stream moved (then `_moved_first` is `dest`'s first response).
        """
        fleet, request, source = self.fleet, self.request, self.worker
        self.state = State.MOVING
        cut_s = time.monotonic()
        started_s = cut_s if started_s is None else started_s
        resumed = self.progress.resume_request(request)
        resumed.import_id = import_id
        try:
            slot, call, first = await self._open_on(dest, resumed)
        except BaseException as e:
            if import_id:  # the destination drops it when it refuses; said again for a call that never reached it
                fleet.spawn(fleet.cancel_quietly(dest, request.request_id))
            if not isinstance(e, grpc.aio.AioRpcError):  # the client left, or the server stops
                raise
            log.info("migration of %s to %s refused (%s %s); it stays on %s", request.request_id, dest.worker_id,
                     e.code().name, e.details(), source.worker_id)
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                dest.unreachable = True  # its own call failed, as in routing: passed over until it heartbeats
            fleet.record_move(request.model, "aborted", reason=reason, method=method, bytes_moved=bytes_moved,
                              total_s=time.monotonic() - started_s)
            self.progress.attempted()
            self.state = State.STREAMING
            return False
        first_s = time.monotonic()
        try:  # said first, so the source counts the request as migrated, not cancelled by its client
            await fleet.pool.stub(source.address).Cancel(
                worker_pb2.CancelRequest(request_id=request.request_id, reason="migrated"), timeout=CANCEL_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            log.info("cancel of %s on %s before its move: %s (the stream is dropped anyway)",
                     request.request_id, source.worker_id, e.code().name)
        except BaseException:  # the client left meanwhile: the destination's call goes too
            slot.release()
            call.cancel()
            fleet.spawn(fleet.cancel_quietly(dest, request.request_id))
            raise
        self.call.cancel()  # the client has exactly progress.token_ids: nothing lost, nothing repeated
        self._switch(dest, slot, call, first)
        await fleet.drop_if_left(source)  # the source left while this stream ran
        fleet.record_move(request.model, "ok", reason=reason, method=method, bytes_moved=bytes_moved,
                          pause_s=first_s - cut_s, total_s=first_s - started_s)
        log.info("session %s (request %s) moved from %s to %s after %d tokens (%s, %d bytes, pause %.3f s)",
                 request.session_id or "-", request.request_id, source.worker_id, dest.worker_id,
                 len(self.progress.token_ids), method, bytes_moved, first_s - cut_s)
        self.state = State.STREAMING
        return True

    def _settle_move_request(self, moved: bool | None, ended: bool = False) -> None:
        """Answers an operator's pending MoveSession: the destination, or why it did not move."""
        pending, self.move_request = self.move_request, None
        if pending is None or pending.done.done():
            return
        if moved:
            pending.done.set_result(self.worker.worker_id)
        elif ended:
            pending.done.set_exception(GenerateFailed(grpc.StatusCode.NOT_FOUND, "the request ended before it moved"))
        else:
            pending.done.set_exception(GenerateFailed(
                grpc.StatusCode.ABORTED, f"worker {pending.dest.worker_id} refused the request; it stays on "
                f"{self.worker.worker_id}"))

    # ----- FAILING_OVER ---------------------------------------------------------------------------

    async def _staged_transfer(self) -> kv_transfer.Transfer | None:
        """The stream's KV transfer when its source failed: the transfer if its state is staged on
        the destination (waiting up to `FAILOVER_TRANSFER_WAIT_S` for one still finishing), else
        None; either way it no longer counts against its destination."""
        t = self._take_transfer()
        if t is None:
            return None
        if not t.task.done():
            with contextlib.suppress(asyncio.TimeoutError, kv_transfer.TransferFailed):
                await asyncio.wait_for(asyncio.shield(t.task), FAILOVER_TRANSFER_WAIT_S)
        if t.staged() is None:
            t.task.cancel()
            return None
        return t

    async def _fail_over(self, error: grpc.aio.AioRpcError) -> bool:
        """FAILING_OVER: resumes a stream whose worker failed UNAVAILABLE mid-stream on another
        worker serving the model, from the tokens the client already has (the destination
        prefills prompt + output, as a migration by recomputation does; greedy and seeded output
        continue exactly). A KV transfer of the stream whose state is staged on a live
        destination is claimed there first. Tries the live, reachable workers with a free slot,
        least busy first.

        Returns:
            True when a worker took it (then `_moved_first` is its first response).
        """
        fleet, request, dead = self.fleet, self.request, self.worker
        self.state = State.FAILING_OVER
        started_s = time.monotonic()
        transfer = await self._staged_transfer()
        candidates = sorted((w for w in fleet.registry.live()
                             if w is not dead and not w.unreachable and not w.draining and w.busy < w.capacity
                             and w.serves(request.model, request.mode)), key=lambda w: w.busy)
        if transfer is not None and transfer.dest in candidates:
            candidates.remove(transfer.dest)
            candidates.insert(0, transfer.dest)
        elif transfer is not None:
            fleet.spawn(fleet.cancel_quietly(transfer.dest, request.request_id))
            transfer = None
        resumed = self.progress.resume_request(request)
        for dest in candidates:
            claim = transfer is not None and dest is transfer.dest
            req = resumed
            if claim:
                req = common_pb2.GenerateRequest()
                req.CopyFrom(resumed)
                req.import_id = transfer.staged().import_id
            try:
                slot, call, first = await self._open_on(dest, req)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    dest.unreachable = True
                log.info("failover of %s to %s refused: %s %s", request.request_id, dest.worker_id,
                         e.code().name, e.details())
                continue
            now = time.monotonic()
            self.call.cancel()
            self._switch(dest, slot, call, first)
            fleet.record_move(request.model, "failover", method="kv" if claim else "reprefill",
                              bytes_moved=transfer.bytes if claim else 0, pause_s=now - started_s,
                              total_s=now - (transfer.started_s if claim else started_s))
            log.warning("worker %s failed mid-stream (%s); request %s resumed on %s after %d tokens%s",
                        dead.worker_id, error.details(), request.request_id, dest.worker_id,
                        len(self.progress.token_ids), " from its transferred KV state" if claim else "")
            self.state = State.STREAMING
            return True
        if await self._reattach_to(dead, resumed, error, started_s):
            return True
        fleet.record_move(request.model, "failover_failed")
        return False

    async def _reattach_to(self, worker: WorkerRecord, resumed: common_pb2.GenerateRequest,
                           error: grpc.aio.AioRpcError, started_s: float) -> bool:
        """FAILING_OVER, no other worker took the stream: re-attaches to the session on the
        worker whose call failed. The failure may have been the connection's, not the worker's (a
        keepalive ping unanswered on an overloaded host ends the call as UNAVAILABLE), and a
        worker whose call ends without a Cancel keeps the session for a resume. True when it did
        (`_moved_first` is then its first response); a worker that is gone or keeps no session
        refuses, and nothing is left open."""
        fleet, request = self.fleet, self.request
        try:
            slot, call, first = await self._open_on(worker, resumed, metadata=((RESUME_ONLY_HEADER, "1"),))
        except grpc.aio.AioRpcError as e:
            log.info("re-attaching %s to %s refused: %s %s", request.request_id, worker.worker_id, e.code().name,
                     e.details())
            return False
        self.call.cancel()
        self._switch(worker, slot, call, first)
        worker.unreachable = False  # it answered
        fleet.record_move(request.model, "failover", method="reattach", pause_s=time.monotonic() - started_s,
                          total_s=time.monotonic() - started_s)
        log.warning("the call to worker %s failed mid-stream (%s) and no other worker could take request %s: "
                    "re-attached to its session there after %d tokens", worker.worker_id, error.details(),
                    request.request_id, len(self.progress.token_ids))
        self.state = State.STREAMING
        return True
