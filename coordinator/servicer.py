"""The coordinator's gRPC servicers: the public Coordinator API and the internal Registry.

They only adapt: each Generate becomes one `coordinator.stream.ProxiedStream` (placement, proxying,
moves, failover, resumption, as a state machine), whose responses the handler writes and whose
`GenerateFailed` becomes the call's status. Operators drain a worker (`DrainWorker`: its sessions
move, then it is told to leave) or move one request (`MoveSession`); both are Coordinator RPCs, so
API keys guard them.

Concurrency: everything runs on one asyncio event loop; the registry and the streams are plain
objects touched only from that loop, so no locks. The client going away cancels the handler task,
whose stream then ends its worker session (coordinator/stream.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import AsyncIterator

import grpc

from coordinator.admission import AdmissionQueue
from coordinator.config import CoordinatorConfig
from coordinator.migration import session_load
from coordinator.registry import UnknownLease, WorkerIdInUse
from coordinator.routing import PowerOfTwoRouter
from coordinator.state import FleetState, NotLive
from coordinator.stream import Fleet, GenerateFailed, MoveRequest, ProxiedStream, TimeRemaining
from coordinator.subscription import WorkerSubscription
from flashfleet.auth import join_token_metadata, with_metadata
from flashfleet.errors import FlashfleetError, short_details
from flashfleet.requests import COORDINATOR_VERDICT_HEADER, validate_request
from flashfleet.transport import WORKER_CHANNEL_OPTIONS, aio_channel, refuses_connections
from flashfleet.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, worker_pb2, worker_pb2_grpc

__all__ = ["CoordinatorServicer", "GenerateFailed", "RegistryServicer", "WorkerPool"]

log = logging.getLogger("flashfleet.coordinator")
DRAIN_POLL_S = 0.1  # how often DrainWorker looks at the drained worker's streams
RESUME_WAIT_S = 2.0  # a resumed request waits this long for the same request id's old stream to end


class WorkerPool:
    """One gRPC channel per worker address, opened lazily and closed when the worker leaves, and
    on it one Subscribe stream (coordinator/subscription.py) that carries the responses of the
    Generate calls opened with `generate`.

    Args:
        tls: flashfleet.config.TLSConfig for mutual TLS to workers, or None for plaintext.
        join_token: sent as metadata on every worker call (workers with a join token serve only
            callers that present it; flashfleet/auth.py), or None.
    """

    def __init__(self, tls=None, join_token: str | None = None):
        self._tls = tls
        self._metadata = join_token_metadata(join_token)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._subscriptions: dict[str, WorkerSubscription] = {}

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        """A Worker stub on the channel to `address` ("host:port"), opening the channel on first use."""
        if address not in self._channels:
            self._channels[address] = aio_channel(address, self._tls, WORKER_CHANNEL_OPTIONS)
        return with_metadata(worker_pb2_grpc.WorkerStub(self._channels[address]), self._metadata)

    def subscribe(self, address: str) -> WorkerSubscription:
        """The subscription to the worker at `address`, opened (with its channel) on first use."""
        sub = self._subscriptions.get(address)
        if sub is None:
            sub = self._subscriptions[address] = WorkerSubscription(self.stub(address), address)
        return sub

    def live_subscriptions(self) -> int:
        """How many workers' subscriptions are open now."""
        return sum(sub.live for sub in self._subscriptions.values())

    def generate(self, address: str, request: common_pb2.GenerateRequest, *, timeout: float | None, metadata=()):
        """Opens Generate on the worker at `address`: on its subscription while that is open
        (a `SubscribedCall`), else a plain call (the subscription opens meanwhile; a worker
        without Subscribe always gets these). Either reads and cancels as a grpc.aio call."""
        sub = self.subscribe(address)
        if sub.live:
            return sub.generate(request, timeout=timeout, metadata=metadata)
        return self.stub(address).Generate(request, timeout=timeout, metadata=metadata)

    def unsubscribe(self, address: str) -> None:
        """Retires the subscription to `address` (its worker left the registry): the stream open
        now goes on serving its calls, none is opened after it (`WorkerSubscription.retire`)."""
        sub = self._subscriptions.pop(address, None)
        if sub is not None:
            sub.retire()

    async def drop(self, address: str) -> None:
        """Closes the subscription and the channel to `address` (cancelling its open calls); a
        no-op when none is open."""
        sub = self._subscriptions.pop(address, None)
        if sub is not None:
            await sub.close()
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        """Closes every channel (coordinator shutdown)."""
        for address in list(self._channels):
            await self.drop(address)


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    """Public API: routes Generate to a worker and proxies its stream; lists models and status;
    drains workers and moves sessions on an operator's command."""

    def __init__(self, config: CoordinatorConfig, state: FleetState, pool: WorkerPool,
                 router: PowerOfTwoRouter | None = None, metrics=None):
        self.state = state  # the fleet's state (coordinator/state/): workers, drains, placements
        self.registry = state.registry
        self.pool = pool
        self.router = router or PowerOfTwoRouter()
        self.affinity = state.affinity
        self.metrics = metrics
        self.fleet = Fleet(config, state, pool, self.router, metrics)
        self.admission: AdmissionQueue = self.fleet.admission
        self._in_flight: set[str] = set()  # request ids of streams running now (duplicates refused)
        self._streams = self.fleet.streams  # request id -> its ProxiedStream, once placed
        self.moves = self.fleet.moves  # recent moves, newest last
        if metrics:
            metrics.queued.set_function(lambda: self.admission.waiting)
            metrics.rpc_lag.set_function(lambda: self.fleet.rpc_lag.lag_s)
            metrics.subscriptions.set_function(lambda: pool.live_subscriptions())

    @property
    def config(self) -> CoordinatorConfig:
        """The coordinator's settings (every stream's; setting them applies to the next decisions)."""
        return self.fleet.config

    @config.setter
    def config(self, config: CoordinatorConfig) -> None:
        self.fleet.config = config

    async def Generate(self, request: common_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        """gRPC Generate: writes what `generate` yields to the call and aborts the call with the
        status of its `GenerateFailed` (marked `COORDINATOR_VERDICT_HEADER`: the SDK does not
        resume a stream this coordinator ended). The client going away cancels this handler, whose
        generator then closes: the worker call is cancelled and the slot given back."""
        async with contextlib.aclosing(self.generate(request, context.time_remaining)) as responses:
            try:
                async for resp in responses:
                    await context.write(resp)
            except GenerateFailed as e:
                await context.abort(e.code, e.details, trailing_metadata=((COORDINATOR_VERDICT_HEADER, "1"),))

    async def generate(self, request: common_pb2.GenerateRequest,
                       time_remaining: TimeRemaining) -> AsyncIterator[common_pb2.GenerateResponse]:
        """Routes a request to a worker and yields its responses (chunks, then one complete): the
        one path of every public API (gRPC `Generate`, the OpenAI-compatible HTTP API).

        Waits in the admission queue while every worker serving the model is full, retries other
        workers on UNAVAILABLE / RESOURCE_EXHAUSTED before the first message, and may migrate the
        stream between chunks (`coordinator.migration`: the policy's speed, load, memory and drain
        moves, and an operator's `MoveSession`). The final stats get `queue_s` (seconds
        from arrival until the serving worker's call was issued) and, after a migration or a
        resumption, counts as if one worker had served it (`StreamProgress.finish_stats`). Sets
        `request.request_id` when it is empty. Close the generator (`contextlib.aclosing`) when
        leaving it early: that ends the worker's session, gives back its slot and counts the
        request as cancelled (or as past its deadline when `time_remaining` says so).

        A request with `resume_token_ids` (and `resume_text`) is a client resuming a stream whose
        coordinator died (the SDK does it): every token id and the text it received, under the
        request's own request_id. It goes back to the worker still decoding that session (its
        heartbeat lists it; the worker kept it for its grace period) or, where none does, to any
        worker, which prefills prompt + those tokens; either way the stream goes on after them.

        Args:
            request: the client's request (`import_id` must be empty).
            time_remaining: seconds left before the request's deadline, or None without one; the
                worker calls get it as their timeout.

        Raises:
            GenerateFailed: with
                INVALID_ARGUMENT: the request fails `validate_request`, sets `import_id` (a
                    coordinator-only field) or `resume_text` without `resume_token_ids`, or reuses
                    the request_id of a request still in flight.
                NOT_FOUND: no live worker serves the model (or none has a draft for the requested mode).
                RESOURCE_EXHAUSTED: every eligible worker is full and the admission queue is full or
                    its `queue_timeout_s` ran out (a new request also waits there while this
                    coordinator answers RPCs later than `overload.MAX_RPC_LAG_S`).
                the worker's own status code: the last worker tried refused the request before its
                    first message, or a worker failed mid-stream (never retried once tokens were sent).
        """
        t0 = time.monotonic()
        try:
            validate_request(request)
        except FlashfleetError as e:
            known = any(w.serves(request.model) for w in self.registry.live())
            self.fleet.count(request.model if known else "(unknown)", "", "invalid")
            raise GenerateFailed(e.code, e.details) from None
        if request.import_id or (request.resume_text and not request.resume_token_ids):
            self.fleet.count("(unknown)", "", "invalid")
            raise GenerateFailed(grpc.StatusCode.INVALID_ARGUMENT, "import_id is set by the coordinator when it "
                                 "migrates a session, and resume_text only comes with resume_token_ids; leave "
                                 "them empty")
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        elif request.request_id in self._in_flight and request.resume_token_ids:
            # The client reconnected before this coordinator saw its old call end: that call's
            # end comes within moments (its connection is gone).
            deadline = time.monotonic() + RESUME_WAIT_S
            while request.request_id in self._in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        if request.request_id in self._in_flight:
            self.fleet.count(request.model, "", "invalid")
            raise GenerateFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"request_id {request.request_id!r} is already in flight: give each request "
                                 "its own id (or none: the coordinator makes one)")

        self._in_flight.add(request.request_id)
        try:
            stream = ProxiedStream(self.fleet, request, time_remaining, t0)
            async with contextlib.aclosing(stream.run()) as responses:
                async for resp in responses:
                    yield resp
        finally:
            self._in_flight.discard(request.request_id)

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
        if stream.move_request is not None:
            raise GenerateFailed(grpc.StatusCode.FAILED_PRECONDITION, f"{request_id!r} is already being moved")
        pending = stream.move_request = MoveRequest(dest)
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
            self.fleet.drain_moved[worker_id] = 0
            if self.metrics:
                self.metrics.draining.labels(worker=worker_id).set(1)
            log.info("draining worker %s (%d session(s) running)", worker_id, rec.in_flight)
        last = None
        while True:
            now = self.registry.get(worker_id)
            gone = now is None or not now.draining  # deregistered (or expired), or back as a new worker
            state = "left" if gone else "leaving" if now.in_flight == 0 else "draining"
            msg = coordinator_pb2.DrainProgress(worker_id=worker_id, sessions_left=0 if gone else now.in_flight,
                                                moved=self.fleet.drain_moved.get(worker_id, 0), state=state)
            if msg != last:
                yield msg
                last = msg
            if gone:
                self.fleet.drain_moved.pop(worker_id, None)
                if self.metrics:
                    self.metrics.draining.labels(worker=worker_id).set(0)
                log.info("worker %s drained and left", worker_id)
                return
            await asyncio.sleep(DRAIN_POLL_S)

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

    async def PutApiKey(self, request: coordinator_pb2.PutApiKeyRequest, context):
        """Has every coordinator sharing the fleet's state accept the key whose SHA-256 is
        `request.sha256`, in `request.role` (the admin role is checked before: server.py).
        Aborts INVALID_ARGUMENT for a malformed digest or role, UNAVAILABLE when etcd does not
        answer."""
        try:
            await self.state.put_api_key(request.sha256, request.role)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ConnectionError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the fleet's state did not answer: {e}")
        log.info("API key %s... (%s) added", request.sha256[:8], request.role)
        return coordinator_pb2.PutApiKeyResponse()

    async def DeleteApiKey(self, request: coordinator_pb2.DeleteApiKeyRequest, context):
        """Stops every coordinator accepting the key whose SHA-256 is `request.sha256`. Aborts
        NOT_FOUND when no key has it, UNAVAILABLE when etcd does not answer."""
        try:
            deleted = await self.state.delete_api_key(request.sha256)
        except ConnectionError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the fleet's state did not answer: {e}")
        if not deleted:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no API key has the digest {request.sha256[:64]!r}")
        log.info("API key %s... removed", request.sha256[:8])
        return coordinator_pb2.DeleteApiKeyResponse()

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
        with ALREADY_EXISTS when another live worker at another address holds the id and still
        accepts connections there (the worker retries, so it joins once that one's lease ends; a
        holder whose port refuses connections died, and the id is taken over at once), and with
        UNAVAILABLE when the shared fleet state (etcd) does not answer (the worker retries).
        """
        try:
            try:
                rec = await self.state.register(request)
            except WorkerIdInUse:
                if not await self._holder_gone(request.worker_id):
                    raise
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
        self.pool.subscribe(rec.address)  # open before its first request
        if self.admission:
            self.admission.notify()
        return worker_pb2.RegisterResponse(lease_id=rec.lease_id,
                                           lease_ttl_s=self.config.lease_ttl_s,
                                           heartbeat_interval_s=self.config.heartbeat_interval_s,
                                           shared_state=self.state.shared)

    async def _holder_gone(self, worker_id: str) -> bool:
        """True when nothing listens any more where the live record of `worker_id` says its
        worker is (that worker died and one started again on another port, under a supervisor
        that gives it a free one); the record is then marked unreachable, so the new worker takes
        it over now instead of after the old lease runs out."""
        rec = self.state.registry.get(worker_id)
        if rec is None or not await refuses_connections(rec.address):
            return False
        rec.unreachable = True
        return True

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
