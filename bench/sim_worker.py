"""Simulated workers: the Worker gRPC service with no model, for measuring a coordinator.

Each simulated worker is its own gRPC server on its own port (so the coordinator holds one
channel per worker, as with real ones), registers with the coordinator's Registry and heartbeats
a realistic load report (one SessionLoad per running stream, a decode profile), and answers
Generate with `tokens_per_chunk` token ids a chunk until `max_tokens` (a resumed request counts
its `resume_token_ids`), then a Complete. Its chunks come from one clock, as a real engine's come
from its iterations: every `tokens_per_chunk / tokens_per_s` seconds the worker ticks and makes
one chunk for every stream it runs (all of them at the same moment, as one batched decode step
yields them), so a stream admitted between two ticks gets its first chunk at the next one; a
clock that runs late ticks again at once until it is back on schedule, so each stream keeps the
set rate. A tick only queues the chunks: a call writes them as it can. Without a subscription a
Generate call sends them itself: with `coalesce`, every chunk queued while it was writing the
previous message goes as one message, as the real worker sends what queued while it wrote
(worker/servicer.py); without it, one message per chunk. With metadata SUBSCRIPTION_HEADER
naming a Subscribe stream of this worker, the call's chunks and Complete go out on that stream
instead (the call carries no message and ends OK once its Complete is queued there; UNAVAILABLE
when the subscription is not open or closes first), and the subscription sends everything queued
while it wrote its previous batch as one ResponseBatch: one message a tick for all of the
worker's streams (with `coalesce`, a request's chunks in one batch are merged into one).
A worker at `capacity` refuses with RESOURCE_EXHAUSTED, as a full engine does; Cancel ends a
stream with FINISH_REASON_CANCELLED at the next tick. ExportSession and PullSession answer
UNIMPLEMENTED (no state to move). The decode profile reports the same seconds per iteration at
every batch size, which is what a simulated worker does, so the migration policy runs its full
check and finds no worker faster.

The workers of one process share one channel to the coordinator's Registry (each still sends its
own Register and Heartbeat calls); real workers each have their own.

    python bench/sim_worker.py --coordinator 127.0.0.1:50051 --workers 200 --capacity 16 \\
        --tokens-per-s 25 [--tokens-per-chunk 1] [--coalesce] [--model sim]

prints "ready N" once its N workers are registered and runs until SIGINT/SIGTERM (then
deregisters them and prints one JSON line, "heartbeats {...}": each heartbeat's wall-clock send
time, round trip and how much later than due this process sent it, in seconds, and the times a
heartbeat found its lease expired).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashfleet.requests import SUBSCRIPTION_HEADER  # noqa: E402
from flashfleet.transport import CHANNEL_OPTIONS, SERVER_OPTIONS  # noqa: E402
from flashfleet.v1 import common_pb2, worker_pb2, worker_pb2_grpc  # noqa: E402

DEFAULT_MAX_TOKENS = 16  # an unset max_tokens (the real worker's default is larger; the bench sets it)
CONTEXT_TOKENS = 4096
PROMPT_TOKENS = 32  # the prompt every simulated request is said to have (stats, context in heartbeats)
KV_BYTES_PER_TOKEN = 4096


class _Outbox:
    """Responses queued for one writer (a Generate call, or a Subscribe stream), and the event
    that wakes it when more come or its end does."""

    def __init__(self):
        self.pending: list[common_pb2.GenerateResponse] = []
        self.wake = asyncio.Event()
        self.closed = False  # a subscription that ended: its calls end UNAVAILABLE

    def put(self, response: common_pb2.GenerateResponse) -> None:
        self.pending.append(response)
        self.wake.set()

    def take(self) -> list[common_pb2.GenerateResponse]:
        """Everything queued, oldest first; empties the queue."""
        taken, self.pending = self.pending, []
        self.wake.clear()
        return taken


@dataclass
class _Stream:
    """One running simulated request."""

    request_id: str
    total: int  # tokens to emit, resumed ones included
    done: int  # tokens emitted (resumed ones included)
    resumed: int  # tokens it was resumed with (its resume_token_ids)
    outbox: _Outbox  # its call's own, or the subscription's it named
    subscribed: bool = False  # its responses go out on a subscription
    started: float = field(default_factory=time.monotonic)
    first_chunk_s: float | None = None  # seconds from admission to its first chunk
    finished: bool = False  # its Complete is queued
    cancelled: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # a subscribed call's: its end came


def _merge_chunks(responses: list[common_pb2.GenerateResponse]) -> list[common_pb2.GenerateResponse]:
    """`responses` with each request's chunks merged into its first one (in order), every Complete
    kept after its request's chunks: one chunk a request for what queued together. The merged
    messages are changed in place (they are this worker's own)."""
    out: list[common_pb2.GenerateResponse] = []
    open_chunk: dict[str, common_pb2.GenerateResponse] = {}
    for r in responses:
        if r.WhichOneof("kind") != "chunk":
            open_chunk.pop(r.request_id, None)
            out.append(r)
        elif (first := open_chunk.get(r.request_id)) is None:
            open_chunk[r.request_id] = r
            out.append(r)
        else:
            first.chunk.text += r.chunk.text
            first.chunk.token_ids.extend(r.chunk.token_ids)
    return out


class SimWorker(worker_pb2_grpc.WorkerServicer):
    """A Worker that emits tokens at a set rate with no model (module docstring).

    Args:
        worker_id: its id (reported in every Complete and to the Registry).
        model: the model name it serves.
        capacity: streams it runs at once; one more is RESOURCE_EXHAUSTED.
        tokens_per_s: tokens per second each stream emits (> 0).
        tokens_per_chunk: token ids per Chunk, one Chunk a stream per tick (>= 1).
        coalesce: send the chunks queued together as one message (module docstring).

    Raises:
        ValueError: tokens_per_s <= 0, or tokens_per_chunk or capacity < 1.
    """

    def __init__(self, worker_id: str, model: str, capacity: int, tokens_per_s: float, tokens_per_chunk: int = 1,
                 coalesce: bool = False):
        if tokens_per_s <= 0 or tokens_per_chunk < 1 or capacity < 1:
            raise ValueError("tokens_per_s must be > 0, tokens_per_chunk and capacity >= 1")
        self.worker_id, self.model, self.capacity = worker_id, model, capacity
        self.tokens_per_s, self.tokens_per_chunk, self.coalesce = tokens_per_s, tokens_per_chunk, coalesce
        self.period = tokens_per_chunk / tokens_per_s  # seconds between ticks
        self.streams: dict[str, _Stream] = {}  # admitted and not yet ended (their calls hold capacity)
        self.subscriptions: dict[str, _Outbox] = {}
        self.served = 0
        # Ticks fall on origin + k * period; the clock runs only while a stream is unfinished.
        self._origin = time.monotonic()
        self._clock: asyncio.Task | None = None

    def model_info(self) -> common_pb2.ModelInfo:
        """The ModelInfo it registers."""
        return common_pb2.ModelInfo(name=self.model, max_context_tokens=CONTEXT_TOKENS,
                                    kv_bytes_per_token=KV_BYTES_PER_TOKEN)

    def load(self) -> worker_pb2.WorkerLoad:
        """Its WorkerLoad: running streams, KV as if each held its context, a flat decode profile."""
        sessions = [worker_pb2.SessionLoad(
            request_id=s.request_id, context_tokens=PROMPT_TOKENS + s.done,
            kv_bytes=(PROMPT_TOKENS + s.done) * KV_BYTES_PER_TOKEN, tokens_per_s=self.tokens_per_s,
            speculative_speedup=1.0, remaining_tokens=s.total - s.done, kv_bytes_per_position=KV_BYTES_PER_TOKEN)
            for s in self.streams.values()]
        budget = self.capacity * CONTEXT_TOKENS * KV_BYTES_PER_TOKEN
        used = sum(s.kv_bytes for s in sessions)
        step_s = 1.0 / self.tokens_per_s
        profile = [worker_pb2.DecodeCost(batch_size=b, context_tokens=c, seconds=step_s, samples=100)
                   for b in (1, 2, 4, 8, 16, 32, 64) for c in (256, 1024, 4096)]
        return worker_pb2.WorkerLoad(
            active_sessions=len(sessions), capacity=self.capacity, free_capacity=max(0, self.capacity - len(sessions)),
            kv_cache_bytes=used, kv_budget_bytes=budget, kv_free_bytes=max(0, budget - used), sessions=sessions,
            decode_profile=profile, prefill_seconds_per_token=1e-4, kv_layers=24)

    def _tick(self) -> int:
        """One engine iteration: a chunk for every unfinished stream (or its Complete, once it has
        all its tokens or was cancelled), queued for its writer. Returns the streams still unfinished."""
        now = time.monotonic()
        running = 0
        for s in list(self.streams.values()):
            if s.finished:
                continue
            if s.subscribed and s.outbox.closed:  # its call is ending UNAVAILABLE
                continue
            if not s.cancelled and s.done < s.total:
                n = min(self.tokens_per_chunk, s.total - s.done)
                ids = [(s.done + i) % 30000 for i in range(n)]
                s.done += n
                if s.first_chunk_s is None:
                    s.first_chunk_s = now - s.started
                s.outbox.put(common_pb2.GenerateResponse(request_id=s.request_id, chunk=common_pb2.Chunk(
                    text=" tok" * n, token_ids=ids)))
            if s.cancelled or s.done >= s.total:
                s.outbox.put(self._complete(s, now))
                s.finished = True
                s.wake.set()
            else:
                running += 1
        return running

    def _complete(self, s: _Stream, now: float) -> common_pb2.GenerateResponse:
        """The Complete of `s` at `now` (monotonic seconds), with its measured stats."""
        elapsed = now - s.started
        generated = s.done - s.resumed
        stats = common_pb2.GenerationStats(
            prompt_tokens=PROMPT_TOKENS + s.resumed, generated_tokens=generated,
            ttft_s=s.first_chunk_s if s.first_chunk_s is not None else elapsed,
            tokens_per_s=generated / elapsed if elapsed > 0 else 0.0, total_s=elapsed, mode="plain")
        self.served += 1
        reason = common_pb2.FINISH_REASON_CANCELLED if s.cancelled else common_pb2.FINISH_REASON_LENGTH
        return common_pb2.GenerateResponse(request_id=s.request_id, complete=common_pb2.Complete(
            finish_reason=reason, stats=stats, worker_id=self.worker_id))

    async def _run_clock(self) -> None:
        """Ticks on schedule while a stream is unfinished (late ticks run at once, back to back,
        yielding to the loop in between), then stops; `_start_clock` starts it again."""
        k = math.floor((time.monotonic() - self._origin) / self.period) + 1  # the next tick on the grid
        while True:
            delay = self._origin + k * self.period - time.monotonic()
            await asyncio.sleep(max(0.0, delay))
            k += 1
            if self._tick() == 0:
                self._clock = None
                return

    def _start_clock(self) -> None:
        if self._clock is None:
            self._clock = asyncio.get_running_loop().create_task(self._run_clock())

    async def close(self) -> None:
        """Stops its clock (its server is stopped apart)."""
        if self._clock is not None:
            self._clock.cancel()
            await asyncio.gather(self._clock, return_exceptions=True)
            self._clock = None

    async def Generate(self, request: common_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        """Streams chunks at the set rate, then a Complete (or CANCELLED after a Cancel); with
        SUBSCRIPTION_HEADER, sends them on that subscription and carries no message itself."""
        if request.model != self.model:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"this worker serves {self.model!r}")
        subscription_id = next((v for k, v in context.invocation_metadata() or () if k == SUBSCRIPTION_HEADER), None)
        sub = None
        if subscription_id is not None:
            sub = self.subscriptions.get(subscription_id)
            if sub is None:
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    f"subscription {subscription_id!r} is not open on this worker")
        if len(self.streams) >= self.capacity:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{len(self.streams)} of {self.capacity} sessions running")
        if request.request_id in self.streams:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request {request.request_id!r} is running")
        total = request.max_tokens if request.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        resumed = len(request.resume_token_ids)
        stream = _Stream(request.request_id, total, resumed, resumed, sub if sub is not None else _Outbox(),
                         subscribed=sub is not None)
        self.streams[request.request_id] = stream
        self._start_clock()
        try:
            if sub is not None:
                while not stream.finished:
                    if sub.closed:
                        await context.abort(grpc.StatusCode.UNAVAILABLE,
                                            f"subscription {subscription_id!r} closed while the request ran")
                    stream.wake.clear()
                    await stream.wake.wait()
                return
            outbox = stream.outbox
            while True:
                if not outbox.pending:
                    await outbox.wake.wait()
                responses = outbox.take()
                for r in _merge_chunks(responses) if self.coalesce else responses:
                    yield r
                if stream.finished and not outbox.pending:
                    return
        finally:
            self.streams.pop(request.request_id, None)

    async def Subscribe(self, request: worker_pb2.SubscribeRequest, context: grpc.aio.ServicerContext):
        """An empty batch (the subscription is open), then every response of the Generate calls
        naming it, each batch what queued while the previous one was written (module docstring).
        Replaces a subscription of the same id, whose stream and calls end UNAVAILABLE."""
        if not request.subscription_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "subscription_id is required")
        old = self.subscriptions.get(request.subscription_id)
        if old is not None:
            self._close(old)
        sub = self.subscriptions[request.subscription_id] = _Outbox()
        try:
            yield worker_pb2.ResponseBatch()
            while True:
                if not sub.pending:
                    await sub.wake.wait()
                if sub.closed:
                    await context.abort(grpc.StatusCode.UNAVAILABLE,
                                        f"another Subscribe took subscription {request.subscription_id!r}")
                responses = sub.take()
                yield worker_pb2.ResponseBatch(responses=_merge_chunks(responses) if self.coalesce else responses)
        finally:
            if self.subscriptions.get(request.subscription_id) is sub:
                del self.subscriptions[request.subscription_id]
            self._close(sub)

    def _close(self, sub: _Outbox) -> None:
        """Marks `sub` closed and wakes it and the calls that named it (they end UNAVAILABLE)."""
        if sub.closed:
            return
        sub.closed = True
        sub.wake.set()
        for s in self.streams.values():
            if s.outbox is sub:
                s.wake.set()

    async def Cancel(self, request: worker_pb2.CancelRequest, context) -> worker_pb2.CancelResponse:
        """Ends a running stream with FINISH_REASON_CANCELLED at the next tick."""
        stream = self.streams.get(request.request_id)
        if stream is not None:
            stream.cancelled = True
        return worker_pb2.CancelResponse(cancelled=stream is not None)

    async def GetLoad(self, request, context) -> worker_pb2.WorkerLoad:
        """`load()`."""
        return self.load()

    async def ExportSession(self, request, context):
        """UNIMPLEMENTED: a simulated worker has no state to export."""
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "a simulated worker has no session state")

    async def PullSession(self, request, context):
        """UNIMPLEMENTED: a simulated worker takes no session state."""
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "a simulated worker takes no session state")


@dataclass
class SimFleet:
    """Simulated workers started in this process (`start_fleet`)."""

    workers: list[SimWorker]
    servers: list[grpc.aio.Server]
    addresses: list[str]
    channel: grpc.aio.Channel
    tasks: list[asyncio.Task]
    leases: dict[str, str] = field(default_factory=dict)  # worker id -> lease id
    heartbeats: int = 0
    # (wall-clock send time, seconds until the coordinator answered, seconds this process sent it
    # later than due) of every heartbeat, and the wall-clock times a heartbeat was refused because
    # the lease had run out (then it registers again)
    heartbeat_rtts: list[tuple[float, float, float]] = field(default_factory=list)
    lease_losses: list[float] = field(default_factory=list)

    async def stop(self) -> None:
        """Stops heartbeats, deregisters every worker (best effort) and stops the servers and the workers' clocks."""
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        stub = worker_pb2_grpc.RegistryStub(self.channel)
        await asyncio.gather(*(stub.Deregister(worker_pb2.DeregisterRequest(worker_id=w, lease_id=lease), timeout=5)
                               for w, lease in self.leases.items()), return_exceptions=True)
        await asyncio.gather(*(s.stop(0) for s in self.servers))
        await asyncio.gather(*(w.close() for w in self.workers))
        await self.channel.close()


async def _keep_registered(fleet: SimFleet, stub, worker: SimWorker, address: str, registered: asyncio.Event) -> None:
    """Registers `worker`, then heartbeats at the interval the coordinator asks for; registers
    again when a heartbeat is refused."""
    while True:
        try:
            resp = await stub.Register(worker_pb2.RegisterRequest(
                worker_id=worker.worker_id, address=address, models=[worker.model_info()], load=worker.load()),
                timeout=30)
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.5)
            continue
        fleet.leases[worker.worker_id] = resp.lease_id
        registered.set()
        # Heartbeats of many workers spread over the interval, as independent workers' are.
        await asyncio.sleep(resp.heartbeat_interval_s * (hash(worker.worker_id) % 1000) / 1000)
        try:
            late = 0.0
            while True:
                sent, t0 = time.time(), time.monotonic()
                await stub.Heartbeat(worker_pb2.HeartbeatRequest(
                    worker_id=worker.worker_id, lease_id=resp.lease_id, load=worker.load()), timeout=30)
                fleet.heartbeat_rtts.append((sent, time.monotonic() - t0, late))
                fleet.heartbeats += 1
                due = time.monotonic() + resp.heartbeat_interval_s
                await asyncio.sleep(resp.heartbeat_interval_s)
                late = time.monotonic() - due
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                fleet.lease_losses.append(time.time())
            continue


async def start_fleet(coordinator: str, n: int, capacity: int, tokens_per_s: float, tokens_per_chunk: int = 1,
                      model: str = "sim", prefix: str = "sim", coalesce: bool = False) -> SimFleet:
    """Starts `n` simulated workers on 127.0.0.1 (free ports) and registers each with the
    coordinator's Registry at `coordinator` ("host:port"); returns once all are registered.

    Raises:
        RuntimeError: a port could not be bound.
    """
    workers, servers, addresses = [], [], []
    for i in range(n):
        w = SimWorker(f"{prefix}-{i}", model, capacity, tokens_per_s, tokens_per_chunk, coalesce)
        server = grpc.aio.server(options=SERVER_OPTIONS)
        worker_pb2_grpc.add_WorkerServicer_to_server(w, server)
        port = server.add_insecure_port("127.0.0.1:0")
        if port == 0:
            raise RuntimeError("could not bind a port for a simulated worker")
        await server.start()
        workers.append(w)
        servers.append(server)
        addresses.append(f"127.0.0.1:{port}")
    channel = grpc.aio.insecure_channel(coordinator, options=CHANNEL_OPTIONS)
    fleet = SimFleet(workers, servers, addresses, channel, [])
    stub = worker_pb2_grpc.RegistryStub(channel)
    events = [asyncio.Event() for _ in workers]
    fleet.tasks = [asyncio.ensure_future(_keep_registered(fleet, stub, w, a, e))
                   for w, a, e in zip(workers, addresses, events)]
    await asyncio.gather(*(e.wait() for e in events))
    return fleet


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--coordinator", required=True, help="host:port of the coordinator's Registry")
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--capacity", type=int, default=16, help="streams per worker")
    p.add_argument("--tokens-per-s", type=float, default=25.0, help="tokens per second of each stream")
    p.add_argument("--tokens-per-chunk", type=int, default=1)
    p.add_argument("--coalesce", action="store_true",
                   help="a stream behind its schedule sends every chunk already due as one message")
    p.add_argument("--model", default="sim")
    p.add_argument("--prefix", default="sim", help="worker ids are PREFIX-0, PREFIX-1, ...")
    args = p.parse_args(argv)
    if args.workers < 1 or args.capacity < 1 or args.tokens_per_s <= 0 or args.tokens_per_chunk < 1:
        p.error("--workers, --capacity and --tokens-per-chunk must be >= 1, --tokens-per-s > 0")

    async def run() -> None:
        fleet = await start_fleet(args.coordinator, args.workers, args.capacity, args.tokens_per_s,
                                  args.tokens_per_chunk, args.model, args.prefix, args.coalesce)
        print(f"ready {len(fleet.workers)}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await fleet.stop()
        print("heartbeats " + json.dumps({"rtts": [[round(t, 3), round(r, 4), round(late, 4)]
                                                   for t, r, late in fleet.heartbeat_rtts],
                                          "lease_losses": [round(t, 3) for t in fleet.lease_losses]}), flush=True)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
