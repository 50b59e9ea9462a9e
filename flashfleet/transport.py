"""Plaintext or mutual-TLS gRPC ports and channels, chosen in one place.

Every server port and channel in flashfleet is made here, so a cluster with a `[tls]` section
(flashfleet/config.py TLSConfig) uses TLS on every hop: client -> coordinator, coordinator ->
worker, worker -> coordinator registry. Without it, everything is plaintext (a trusted LAN).
"""
from __future__ import annotations

from typing import Sequence

import grpc

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


# grpc sets SO_REUSEPORT by default, which lets a second coordinator or worker bind a port in use
# and silently split the traffic; turn it off so binding a busy port fails.
SERVER_OPTIONS: list[tuple[str, int]] = [("grpc.so_reuseport", 0)]


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
