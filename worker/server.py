"""Builds, starts and stops a worker's gRPC server (Worker API, health, reflection) and keeps its
registration with the coordinator alive (register, heartbeats with load, re-register when the
lease was lost, deregister on shutdown). A watchdog (`worker.watchdog`) takes the worker out of
the fleet when its engine thread dies: NOT_SERVING, open streams end UNAVAILABLE, deregister,
server stopped; `RunningWorker.left` is then set and the process exits (`worker.__main__`)."""
from __future__ import annotations

import asyncio
import logging
from contextlib import AsyncExitStack, suppress
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential_jitter

from flashfleet.auth import BAD_JOIN_TOKEN, JOIN_TOKEN_HEADER, RequireSecret, join_token_metadata, with_metadata
from flashfleet.bad_messages import RejectUndecodable
from flashfleet.transport import SERVER_OPTIONS, add_port, aio_channel
from flashfleet.v1 import worker_pb2, worker_pb2_grpc
from worker import convert, kv_pull
from worker.engine.types import EngineProtocol
from worker.servicer import ORPHAN_GRACE_S, WorkerServicer
from worker.watchdog import ENGINE_DIED_EXIT, POLL_S, watch_engine

log = logging.getLogger("flashfleet.worker")
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
REGISTER_TIMEOUT_S = 5.0
UNREACHABLE_WARN_EVERY_S = 60.0  # while registration fails, the log says so this often
# Registration retries wait at most this long (seconds): a restarted coordinator gets the worker
# within this of listening (its SDK streams wait for a worker to resume on), and a refused dial
# costs next to nothing.
REGISTER_RETRY_MAX_S = 0.1
FAILED_STREAMS_GRACE_S = 1.0  # after the engine died: time for the streams' UNAVAILABLE to go out


@dataclass
class RunningWorker:
    """A started worker: server, bound port, and its registration task.

    Attributes:
        advertise_address: "host:port" it registers under (the address the coordinator dials).
        coordinator: "host:port" of the coordinator's Registry, several comma-separated
            (`_keep_registered`), or None when standalone.
        registered: set while the worker holds a lease with at least one coordinator (cleared
            when its last one's heartbeat fails).
        engine_died: True once the watchdog found the engine thread dead.
        left: set when the worker, its engine dead, has left the fleet and stopped its server.
        leave_requested: set when the coordinator drained this worker and told it to leave (a
            heartbeat response with `leave`): it has deregistered and stopped heartbeating; the
            process stops its server and exits 0 (`worker.__main__.serve`).
    """

    server: grpc.aio.Server
    port: int
    worker_id: str
    engine: EngineProtocol
    health: health.aio.HealthServicer
    advertise_address: str
    coordinator: str | None = None
    tls: object = None
    join_token: str | None = field(default=None, repr=False)
    servicer: WorkerServicer | None = None
    _heartbeat_tasks: list[asyncio.Task] = field(default_factory=list)
    _watchdog_task: asyncio.Task | None = None
    _leases: dict[str, str] = field(default_factory=dict)  # coordinator address -> lease id
    registered: asyncio.Event = field(default_factory=asyncio.Event)
    shared_state: bool = False  # its coordinators share the fleet's state: one registration serves all
    engine_died: bool = False
    left: asyncio.Event = field(default_factory=asyncio.Event)
    leave_requested: asyncio.Event = field(default_factory=asyncio.Event)

    async def stop(self, grace_s: float = 5.0, close_engine: bool = True) -> None:
        """NOT_SERVING -> deregister -> let in-flight RPCs finish for `grace_s` seconds (then
        cancel them) -> stop the engine thread (unless `close_engine` is False). A failed
        deregistration is logged, not raised."""
        if self._watchdog_task:  # closing the engine ends its thread: that is no death
            self._watchdog_task.cancel()
        await self.health.enter_graceful_shutdown()
        self.stop_heartbeats()
        if self.servicer is not None:
            self.servicer.stop_keeping()
        await self._deregister()
        await self.server.stop(grace_s)
        if close_engine:
            await asyncio.to_thread(self.engine.close)

    async def leave_after_engine_death(self) -> None:
        """What the watchdog does once the engine thread is dead: health NOT_SERVING, heartbeats
        stopped, every open stream (and any later call) ended with UNAVAILABLE, deregistration,
        then the server stopped (`FAILED_STREAMS_GRACE_S` for those statuses to go out); sets
        `engine_died` first and `left` last, also when a step fails or the task is cancelled.
        A failed deregistration is logged, not raised (the lease then expires)."""
        self.engine_died = True
        log.error("the engine thread of worker %s died: it can serve nothing more; leaving the "
                  "fleet (NOT_SERVING, open streams end UNAVAILABLE, deregistering), then exiting "
                  "with status %d so its supervisor restarts it", self.worker_id, ENGINE_DIED_EXIT)
        try:
            await self.health.enter_graceful_shutdown()
            self.stop_heartbeats()
            if self.servicer is not None:
                self.servicer.fail_streams(f"the engine of worker {self.worker_id} stopped; the "
                                           "worker is restarting")
            await self._deregister()
            await self.server.stop(FAILED_STREAMS_GRACE_S)
        finally:
            self.left.set()

    def stop_heartbeats(self) -> None:
        """Stops heartbeats without deregistering (tests simulate a hung or partitioned worker;
        stop() and leaving the fleet call it first)."""
        try:
            current = asyncio.current_task()
        except RuntimeError:  # called from outside the loop (tests)
            current = None
        for task in self._heartbeat_tasks:
            if task is not current:
                task.cancel()

    @property
    def coordinators(self) -> list[str]:
        """The coordinators' addresses it registers with (none when standalone)."""
        return coordinator_addresses(self.coordinator)

    async def _deregister(self) -> None:
        leases, self._leases = self._leases, {}  # once: a later stop() does not deregister again
        for address, lease_id in leases.items():
            try:
                async with aio_channel(address, self.tls) as ch:
                    await _registry_stub(ch, self.join_token).Deregister(
                        worker_pb2.DeregisterRequest(worker_id=self.worker_id, lease_id=lease_id),
                        timeout=REGISTER_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                log.warning("deregistration from %s failed: %s", address, e.details())


def coordinator_addresses(coordinator: str | None) -> list[str]:
    """The addresses in a --coordinator value: "host:port", or several separated by commas."""
    return [a.strip() for a in (coordinator or "").split(",") if a.strip()]


async def start_worker(engine: EngineProtocol, worker_id: str, host: str = "127.0.0.1",
                       port: int = 0, coordinator: str | None = None,
                       advertise_host: str | None = None, metrics=None,
                       tls=None, engine_poll_s: float = POLL_S,
                       join_token: str | None = None, orphan_grace_s: float = ORPHAN_GRACE_S) -> RunningWorker:
    """Serves `engine` on host:port and, when `coordinator` is given, registers with it.

    Args:
        engine: a started engine (weights loaded).
        worker_id: unique name in the fleet.
        host, port: where to listen (port 0 = a free port).
        coordinator: "host:port" of the coordinator's Registry, or several, comma-separated
            (`_keep_registered`: it registers with each, or, when they share the fleet's state in
            etcd, with one and moves its heartbeats on when that one stops answering); None for
            a standalone worker.
        advertise_host: host the coordinator and other workers should dial (default: host).
        metrics: optional WorkerMetrics for the servicer.
        tls: flashfleet.config.TLSConfig: serve, and dial the coordinator, over mutual TLS.
        engine_poll_s: seconds between the watchdog's looks at `engine.alive`; once it is False
            the worker leaves the fleet (`RunningWorker.leave_after_engine_death`).
        join_token: sent to the coordinator's Registry and to the workers it pulls session
            states from, and required (metadata `x-flashfleet-join-token`) of every caller of
            the Worker service, else UNAUTHENTICATED (flashfleet/auth.py); None: neither.
        orphan_grace_s: how long a session whose coordinator vanished is kept for its client to
            resume (worker/servicer.py), seconds.

    Raises:
        RuntimeError: the port could not be bound.
        flashfleet.config.ConfigError: unreadable or non-PEM TLS files.
    """
    guards = [RequireSecret((SERVICE_NAME,), JOIN_TOKEN_HEADER, (join_token,), BAD_JOIN_TOKEN)] if join_token else []
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[*guards, RejectUndecodable()])
    servicer = WorkerServicer(engine, worker_id, metrics, kv_pull.Peers(tls, join_token), orphan_grace_s)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME),
                                        server)
    bound = add_port(server, f"{host}:{port}", tls)
    if bound == 0:
        raise RuntimeError(f"could not bind {host}:{port} (in use?)")
    await server.start()
    for name in (SERVICE_NAME, ""):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    address = f"{advertise_host or host}:{bound}"
    running = RunningWorker(server, bound, worker_id, engine, health_servicer, address, coordinator,
                            tls=tls, join_token=join_token, servicer=servicer)
    running._watchdog_task = asyncio.get_running_loop().create_task(
        watch_engine(engine, running.leave_after_engine_death, engine_poll_s))
    running._watchdog_task.add_done_callback(_log_if_watchdog_failed)
    if coordinator:
        task = asyncio.get_running_loop().create_task(_keep_registered(running))
        task.add_done_callback(_log_if_failed)
        running._heartbeat_tasks.append(task)
    return running


def _registry_stub(channel, join_token: str | None):
    """A Registry stub whose calls carry the join token (when there is one)."""
    return with_metadata(worker_pb2_grpc.RegistryStub(channel), join_token_metadata(join_token))


def _log_if_failed(task: asyncio.Task) -> None:
    """A registration task that dies leaves the worker serving no one: say so loudly."""
    if not task.cancelled() and task.exception() is not None:
        log.error("registration with the coordinator stopped; this worker gets no requests "
                  "until it restarts", exc_info=task.exception())


def _log_if_watchdog_failed(task: asyncio.Task) -> None:
    """A watchdog that fails while taking the worker out of the fleet: say so loudly."""
    if not task.cancelled() and task.exception() is not None:
        log.error("leaving the fleet after the engine died failed; stop this worker",
                  exc_info=task.exception())


# What to fix when the coordinator refuses a registration (a retry alone will not help).
REGISTER_HINTS = {
    grpc.StatusCode.ALREADY_EXISTS: "another worker holds this --worker-id",
    grpc.StatusCode.UNAUTHENTICATED: "the coordinator requires its join token: give this worker the same "
                                     "--join-token-file (or env FLASHFLEET_JOIN_TOKEN)",
}


def _warn_while_unreachable(coordinator: str):
    """tenacity before_sleep callback: warns at the first failed registration, then every
    UNREACHABLE_WARN_EVERY_S seconds, with the gRPC status of the last attempt."""
    last = [float("-inf")]

    def before_sleep(state: RetryCallState) -> None:
        if state.seconds_since_start - last[0] < UNREACHABLE_WARN_EVERY_S:
            return
        last[0] = state.seconds_since_start
        e = state.outcome.exception()
        hint = REGISTER_HINTS.get(e.code(), "check --coordinator and that it is running")
        log.warning("cannot register with the coordinator at %s (%s: %s) for %.0f s; retrying (%s)",
                    coordinator, e.code().name, e.details(), state.seconds_since_start, hint)

    return before_sleep


async def _register(w: RunningWorker, addresses: list[str], at: int, channels: "_Channels",
                    rotate: bool) -> tuple[int, worker_pb2.RegisterResponse]:
    """Registers with the coordinator at `addresses[at]`, retrying for as long as it takes with a
    capped backoff (a warning a minute while none answers); with `rotate`, each retry tries the
    next address.

    Returns:
        (index of the address that answered, its RegisterResponse).
    """
    warn = _warn_while_unreachable(",".join(addresses) if rotate else addresses[at])
    spot = [at]

    def before_sleep(state: RetryCallState) -> None:
        warn(state)
        if rotate:
            spot[0] = (spot[0] + 1) % len(addresses)

    async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(grpc.aio.AioRpcError),
            wait=wait_exponential_jitter(multiplier=0.02, max=REGISTER_RETRY_MAX_S, jitter=0.02), before_sleep=before_sleep):
        with attempt:
            resp = await channels.stub(addresses[spot[0]]).Register(worker_pb2.RegisterRequest(
                worker_id=w.worker_id, address=w.advertise_address, models=[convert.model_info(w.engine.model)],
                load=w.servicer.load()), timeout=REGISTER_TIMEOUT_S)
    return spot[0], resp


class _Channels:
    """One Registry channel per coordinator address, opened on first use, closed together."""

    def __init__(self, w: RunningWorker, stack: AsyncExitStack):
        self._w, self._stack, self.channels = w, stack, {}

    def channel(self, address: str) -> grpc.aio.Channel:
        if address not in self.channels:
            self.channels[address] = aio_channel(address, self._w.tls)
            self._stack.push_async_callback(self.channels[address].close)
        return self.channels[address]

    def stub(self, address: str):
        return _registry_stub(self.channel(address), self._w.join_token)


async def _leave(w: RunningWorker, address: str) -> None:
    """A heartbeat's response asked the worker to leave (it was drained): deregisters everywhere."""
    log.info("the coordinator at %s drained this worker: deregistering and leaving", address)
    w.stop_heartbeats()
    await w._deregister()
    w.registered.clear()
    w.leave_requested.set()


async def _next_beat(channel: grpc.aio.Channel, interval_s: float) -> None:
    """Waits `interval_s` seconds, or less when the connection to the coordinator is lost (its
    process died: the heartbeat then fails at once and the worker registers again as soon as a
    coordinator answers, not a heartbeat interval later)."""
    async def lost() -> None:
        state = channel.get_state()
        if state != grpc.ChannelConnectivity.READY:  # not connected now: the usual interval
            await asyncio.sleep(interval_s)
        while state == grpc.ChannelConnectivity.READY:
            await channel.wait_for_state_change(state)
            state = channel.get_state()

    with suppress(TimeoutError):
        await asyncio.wait_for(lost(), interval_s)


async def _keep_registered(w: RunningWorker) -> None:
    """Keeps the worker registered with its coordinators, then heartbeating; re-registers when a
    heartbeat fails (lease expired, coordinator restarted or unreachable). Ends after
    deregistering when a heartbeat's response asks the worker to leave
    (`RunningWorker.leave_requested`).

    The first registration goes to the first address that answers (each retry tries the next).
    Its response says whether the coordinators share the fleet's state (etcd, `shared_state`):
      - shared: that one registration serves every coordinator; a heartbeat that finds its
        coordinator gone (UNAVAILABLE, or no answer in time) goes to the next address under the
        same lease, so the worker stays in the fleet while any coordinator lives;
      - not shared: each coordinator knows only the workers registered with it, so the worker
        registers and heartbeats with every address, each retried on its own."""
    addresses = w.coordinators
    async with AsyncExitStack() as stack:
        channels = _Channels(w, stack)
        at, resp = await _register(w, addresses, 0, channels, rotate=True)
        if resp.shared_state:
            w.shared_state = True
            await _heartbeat_shared(w, addresses, at, resp, channels)
            return
        for address in addresses:
            if address != addresses[at]:
                task = asyncio.get_running_loop().create_task(_keep_registered_with(w, address))
                task.add_done_callback(_log_if_failed)
                w._heartbeat_tasks.append(task)
        await _keep_registered_with(w, addresses[at], resp, channels)


async def _keep_registered_with(w: RunningWorker, address: str, resp: worker_pb2.RegisterResponse | None = None,
                                channels: _Channels | None = None) -> None:
    """One coordinator's registration (coordinators that share nothing): registers (unless
    `resp` is its registration), heartbeats, registers again when a heartbeat fails."""
    async with AsyncExitStack() as stack:
        channels = channels or _Channels(w, stack)
        while True:
            if resp is None:
                _, resp = await _register(w, [address], 0, channels, rotate=False)
            w._leases[address] = resp.lease_id
            w.registered.set()
            log.info("registered with %s (lease %s)", address, resp.lease_id)
            try:
                while True:
                    await _next_beat(channels.channel(address), resp.heartbeat_interval_s)
                    beat = await channels.stub(address).Heartbeat(worker_pb2.HeartbeatRequest(
                        worker_id=w.worker_id, lease_id=resp.lease_id, load=w.servicer.load()),
                        timeout=REGISTER_TIMEOUT_S)
                    if beat.leave:  # drained (Coordinator.DrainWorker): no session left here
                        await _leave(w, address)
                        return
            except grpc.aio.AioRpcError as e:
                log.warning("heartbeat to %s failed (%s: %s); registering again", address, e.code().name,
                            e.details())
                w._leases.pop(address, None)
                if not w._leases:
                    w.registered.clear()
                resp = None


async def _heartbeat_shared(w: RunningWorker, addresses: list[str], at: int, resp: worker_pb2.RegisterResponse,
                            channels: _Channels) -> None:
    """Heartbeats of a worker whose coordinators share the fleet's state (`_keep_registered`)."""
    while True:
        w._leases = {addresses[at]: resp.lease_id}
        w.registered.set()
        log.info("registered with %s (lease %s)", addresses[at], resp.lease_id)
        try:
            while True:
                await _next_beat(channels.channel(addresses[at]), resp.heartbeat_interval_s)
                request = worker_pb2.HeartbeatRequest(worker_id=w.worker_id, lease_id=resp.lease_id,
                                                      load=w.servicer.load())
                for tried in range(len(addresses)):
                    try:
                        beat = await channels.stub(addresses[at]).Heartbeat(request, timeout=REGISTER_TIMEOUT_S)
                        break
                    except grpc.aio.AioRpcError as e:
                        if (tried == len(addresses) - 1 or e.code() not in
                                (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)):
                            raise
                        log.warning("heartbeat to %s failed (%s); trying %s", addresses[at], e.code().name,
                                    addresses[(at + 1) % len(addresses)])
                        at = (at + 1) % len(addresses)
                        w._leases = {addresses[at]: resp.lease_id}
                if beat.leave:  # drained (Coordinator.DrainWorker): no session left here
                    await _leave(w, addresses[at])
                    return
        except grpc.aio.AioRpcError as e:
            log.warning("heartbeat to %s failed (%s: %s); registering again", addresses[at], e.code().name,
                        e.details())
            w._leases = {}
            w.registered.clear()
            at, resp = await _register(w, addresses, at, channels, rotate=True)
