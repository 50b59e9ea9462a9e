"""gRPC keepalive between flashfleet's channels and servers (flashfleet/transport.py): a stream
that sends nothing for longer than several ping intervals (a prompt that takes minutes to
prefill) must survive; with grpc's default server ping policy it is killed with GOAWAY
"too_many_pings", which this test shows first (so it can fail). Intervals are scaled down from
30 s to 1 s; the production defaults keep the same order."""
import asyncio

import grpc
import pytest

import os
import signal
import subprocess
import sys
import time

from flashfleet.transport import (KEEPALIVE_TIME_MS, SERVER_OPTIONS, WORKER_CHANNEL_OPTIONS,
                                  WORKER_KEEPALIVE_TIME_MS, channel_options, server_options)

SILENT_S = 9.0  # the handler says nothing this long: nine client pings at 1 s (GOAWAY came at 4-5 s)


async def _silent_stream(server_opts, channel_opts) -> bytes:
    async def wait(request, context):
        await asyncio.sleep(SILENT_S)
        yield b"done"

    server = grpc.aio.server(options=server_opts)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "test.Slow", {"Wait": grpc.unary_stream_rpc_method_handler(wait)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_opts) as channel:
            call = channel.unary_stream("/test.Slow/Wait")(b"", timeout=30)
            return b"".join([chunk async for chunk in call])
    finally:
        await server.stop(None)


def test_a_silent_stream_outlives_many_keepalive_pings():
    fast_pings = channel_options(keepalive_time_ms=1000)
    with pytest.raises(grpc.aio.AioRpcError) as e:  # grpc's default server policy: GOAWAY
        asyncio.run(_silent_stream([("grpc.so_reuseport", 0)], fast_pings))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "ping" in e.value.details().lower()
    assert asyncio.run(_silent_stream(server_options(min_ping_interval_ms=200), fast_pings)) == b"done"


def test_production_servers_accept_the_channels_ping_rate():
    opts = dict(SERVER_OPTIONS)
    assert opts["grpc.keepalive_permit_without_calls"] == 1
    for key in ("grpc.http2.min_recv_ping_interval_without_data_ms", "grpc.http2.min_ping_interval_without_data_ms"):
        assert opts[key] < WORKER_KEEPALIVE_TIME_MS < KEEPALIVE_TIME_MS
    assert opts["grpc.so_reuseport"] == 0


HUNG_SERVER = """
import asyncio, sys
import grpc
from flashfleet.transport import SERVER_OPTIONS

async def main():
    async def wait(request, context):
        yield b"first"
        await asyncio.sleep(3600)

    server = grpc.aio.server(options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "test.Slow", {"Wait": grpc.unary_stream_rpc_method_handler(wait)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


def test_a_hung_worker_ends_the_coordinators_stream_within_seconds():
    # A worker that stops answering without closing its socket (hung, power loss, a pulled
    # cable: no TCP reset) is found by the coordinator's keepalive pings: its stream ends with
    # UNAVAILABLE within about 10 s, about when its lease expires (it took 40-60 s at the
    # 30 s / 10 s pings of the other channels).
    proc = subprocess.Popen([sys.executable, "-c", HUNG_SERVER], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        port = int(proc.stdout.readline())

        async def run() -> tuple[grpc.StatusCode, float]:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=WORKER_CHANNEL_OPTIONS) as ch:
                call = ch.unary_stream("/test.Slow/Wait")(b"", timeout=120)
                assert await call.read() == b"first"
                proc.send_signal(signal.SIGSTOP)
                t0 = time.monotonic()
                try:
                    await call.read()
                except grpc.aio.AioRpcError as e:
                    return e.code(), time.monotonic() - t0
                return grpc.StatusCode.OK, time.monotonic() - t0

        code, waited = asyncio.run(run())
        assert code == grpc.StatusCode.UNAVAILABLE and waited < 16.0, (code, waited)
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()
