"""The Prometheus /metrics endpoint of a coordinator or worker (prometheus-client's own server).

One place for both processes, so a port that cannot be bound is the same one-line error naming
the flag to change, not an OSError traceback.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server


def serve_metrics(port: int, host: str, registry: CollectorRegistry) -> None:
    """Serves `registry` at http://host:port/metrics from a daemon thread.

    Args:
        port: TCP port (1-65535).
        host: address to bind, as the gRPC server's --host.
        registry: what the endpoint exposes.

    Raises:
        RuntimeError: the port is in use or may not be bound here (the message names
            --metrics-port / metrics_port and the OS's reason).
    """
    try:
        start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise RuntimeError(f"cannot serve metrics on {host}:{port} ({e.strerror or e}): stop what "
                           "holds that port or pick another --metrics-port (config key "
                           "metrics_port)") from None
