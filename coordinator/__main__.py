"""`python -m coordinator --port 50051`: runs a coordinator (flashfleet up starts one for you)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from coordinator.config import CoordinatorConfig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m coordinator", description=__doc__)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for a LAN)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0 = any free port)")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port")
    p.add_argument("--lease-ttl-s", type=float, default=10.0)
    p.add_argument("--heartbeat-interval-s", type=float, default=2.0)
    p.add_argument("--route-attempts", type=int, default=3)
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if a.route_attempts < 1 or a.lease_ttl_s <= a.heartbeat_interval_s:
        p.error("need --route-attempts >= 1 and --lease-ttl-s > --heartbeat-interval-s")
    from coordinator.server import serve
    config = CoordinatorConfig(host=a.host, port=a.port, lease_ttl_s=a.lease_ttl_s,
                               heartbeat_interval_s=a.heartbeat_interval_s,
                               route_attempts=a.route_attempts)
    try:
        asyncio.run(serve(config, a.metrics_port))
    except RuntimeError as e:
        print(f"coordinator: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
