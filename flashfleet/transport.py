"""Plaintext or mutual-TLS gRPC ports and channels, chosen in one place.

Every server port and channel in flashfleet is made here, so a cluster with a `[tls]` section
(flashfleet/config.py TLSConfig) uses TLS on every hop: client -> coordinator, coordinator ->
worker, worker -> coordinator registry. Without it, everything is plaintext (a trusted LAN).
"""
from __future__ import annotations

import asyncio
from typing import Sequence

import grpc

KEEPALIVE_TIME_MS = 30_000  # every channel pings an idle or silent connection this often
# The coordinator's channels to workers ping faster: a worker that hangs or loses power (no TCP
# reset) is then found within about 10 s, as its lease expires, not after 40-60 s; its streams
# end with UNAVAILABLE and requests not yet answered go to another worker.
WORKER_KEEPALIVE_TIME_MS = 5_000
WORKER_KEEPALIVE_TIMEOUT_MS = 5_000
RECONNECT_BACKOFF_MS = (100, 250)  # a channel dials a lost peer again after this long, first and at most


def channel_options(keepalive_time_ms: int = KEEPALIVE_TIME_MS,
                    keepalive_timeout_ms: int = 10_000) -> list[tuple[str, int]]:
    """Options of every flashfleet channel: keepalive pings every `keepalive_time_ms` (a peer that
    does not answer one within `keepalive_timeout_ms` is dead), also on a stream that sends
    nothing for a while (a long prefill), so a dead peer is found in seconds; a lost peer is
    dialled again after `RECONNECT_BACKOFF_MS`."""
    return [("grpc.keepalive_time_ms", keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", keepalive_timeout_ms),
            # grpc 1.85 times a keepalive ping out by this one (default 60 s), not the option
            # above: a hung peer was found 65 s after it stopped with 5 s pings (measured,
            # tests/test_transport.py), 10 s with both set.
            ("grpc.http2.ping_timeout_ms", keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            # A peer that went away is dialled again within a quarter of a second (grpc's default
            # backoff grows to two minutes; a 1 s cap cost up to a second of a restarted
            # coordinator's pause): a restarted coordinator gets its workers' registrations and its
            # SDK clients' resumed streams as soon as it listens. A dial of a closed port costs a
            # reset, and one to a silent host waits out its connect timeout before the next.
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
            ("grpc.min_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1])]


# Calls a server may hold that its event loop has not taken yet. grpc's default starts refusing at
# 1,000 (and refuses all at 3,000), and a refused call ends CANCELLED before the application sees
# it, so a coordinator whose loop falls behind under a burst of streams would lose some of them
# without a word. The coordinator's own admission queue decides who waits and who is refused,
# with a status that says why; calls in grpc's queue wait for the loop, at most until their
# deadline or 30 s (grpc.server_max_unrequested_time_in_server), when grpc ends them.
MAX_PENDING_CALLS = 20_000


def server_options(min_ping_interval_ms: int = WORKER_KEEPALIVE_TIME_MS // 2) -> list[tuple[str, int]]:
    """Options of every flashfleet server.

    grpc sets SO_REUSEPORT by default, which lets a second coordinator or worker bind a port in
    use and silently split the traffic: off, so binding a busy port fails. grpc servers also
    accept a ping without data only every 5 minutes by default and answer a third early one
    with GOAWAY "too_many_pings", which killed a stream whose prompt took minutes to prefill
    (the channels ping every 30 s, the coordinator's to workers every 5 s): the server here
    accepts pings `min_ping_interval_ms` apart, below the channels' intervals, with or without
    calls (gRPC keepalive guide, doc/keepalive.md). Calls arriving faster than the event loop
    takes them wait for it (`MAX_PENDING_CALLS`) instead of ending CANCELLED.
    """
    return [("grpc.so_reuseport", 0),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", min_ping_interval_ms),
            # grpc 1.85's server checks incoming pings against this one too (measured:
            # tests/test_transport.py fails with the option above alone)
            ("grpc.http2.min_ping_interval_without_data_ms", min_ping_interval_ms),
            ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
            ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS)]


CHANNEL_OPTIONS: list[tuple[str, int]] = channel_options()
WORKER_CHANNEL_OPTIONS: list[tuple[str, int]] = channel_options(WORKER_KEEPALIVE_TIME_MS,
                                                                WORKER_KEEPALIVE_TIMEOUT_MS)
SERVER_OPTIONS: list[tuple[str, int]] = server_options()


def add_port(server: grpc.aio.Server, address: str, tls=None) -> int:
    """Binds `address` ("host:port", port 0 = any free one) on `server`.

    Args:
        tls: a flashfleet.config.TLSConfig for mutual TLS, or None for plaintext.

    Returns:
        The bound port (0 when binding failed, as some grpc versions report it).

    Raises:
        RuntimeError: the address could not be bound (port in use).
        flashfleet.config.ConfigError: unreadable or non-PEM TLS files.
    """
    try:
        if tls is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, tls.server_credentials())
    except RuntimeError:  # grpc's own message points at GRPC_VERBOSITY, not at the cause
        raise RuntimeError(f"could not bind {address}: is another process using the port?") from None


def aio_channel(address: str, tls=None,
                options: Sequence[tuple[str, int]] = CHANNEL_OPTIONS) -> grpc.aio.Channel:
    """An asyncio channel to `address`, over mutual TLS when `tls` is given."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=list(options))


async def refuses_connections(address: str, timeout_s: float = 0.5) -> bool:
    """Whether nothing listens at `address` ("host:port", "[v6]:port"): True only when a TCP
    connect is refused (the host is up, no process has the port: a worker killed and started
    again elsewhere); False when it connects, or when the host does not answer within
    `timeout_s` seconds or cannot be resolved (it may be alive behind a partition)."""
    host, _, port = address.rpartition(":")
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), timeout_s)
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError, asyncio.TimeoutError):
        return False
    writer.close()
    return False
