"""Pieces shared by the client-side subcommands."""
from __future__ import annotations

import argparse


def add_connection_args(p: argparse.ArgumentParser) -> None:
    """Adds --address (coordinator "host:port") and --config (cluster file whose [tls] section,
    if any, turns on mutual TLS; see `credentials`) to `p`."""
    p.add_argument("--address", default="127.0.0.1:50051", help="coordinator host:port")
    p.add_argument("--config", default=None, help="cluster config file: its [tls] section makes "
                   "the client use mutual TLS")


def credentials(config_path: str | None):
    """gRPC channel credentials from a cluster config's [tls] section, or None (plaintext).

    Raises:
        flashfleet.config.ConfigError: a bad config or unreadable TLS files.
    """
    if not config_path:
        return None
    from flashfleet.config import load_cluster_config

    tls = load_cluster_config(config_path).tls
    return tls.channel_credentials() if tls else None


def explain(e: Exception, address: str) -> str:
    """`e` (an SDK or config error) as a client command prints it, with what to do where the
    message alone leaves a new user guessing: no coordinator listening at `address`, or an API
    key missing or wrong."""
    from flashfleet.auth import API_KEY_ENV
    from flashfleet.errors import Unauthenticated, Unavailable

    if isinstance(e, Unauthenticated):
        return f"{e} (send one of the coordinator's API keys: export {API_KEY_ENV}=KEY)"
    if isinstance(e, Unavailable) and "failed to connect" in str(e):  # gRPC's own, not a server's
        return f"{e} (is a coordinator running at {address}? `flashfleet up` starts one)"
    return str(e)
