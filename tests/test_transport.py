"""gRPC keepalive between flashfleet's channels and servers (flashfleet/transport.py): a stream
that sends nothing for longer than several ping intervals (a prompt that takes minutes to
prefill) must survive; with grpc's default server ping policy it is killed with GOAWAY
"too_many_pings", which this test shows first (so it can fail). Intervals are scaled down from
30 s to 1 s; the production defaults keep the same order."""
import asyncio

import grpc
import pytest

from flashfleet.transport import KEEPALIVE_TIME_MS, SERVER_OPTIONS, channel_options, server_options

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
    assert opts["grpc.http2.min_recv_ping_interval_without_data_ms"] < KEEPALIVE_TIME_MS
    assert opts["grpc.http2.min_ping_interval_without_data_ms"] < KEEPALIVE_TIME_MS
    assert opts["grpc.so_reuseport"] == 0
