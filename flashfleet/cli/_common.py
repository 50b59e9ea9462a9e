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


def config_api_key(config_path: str | None, api_keys_file: str | None = None) -> str | None:
    """The key a client on the coordinator's own host sends: env FLASHFLEET_API_KEY, else the
    first key of `api_keys_file`, else of the config's [coordinator] api_keys_file, or of env
    FLASHFLEET_COORDINATOR_API_KEYS (None: none configured, or the file is unreadable here).

    Raises:
        flashfleet.config.ConfigError: a bad config.
    """
    from flashfleet.auth import client_api_key, load_api_keys

    if client_api_key():
        return client_api_key()
    keys_file = api_keys_file
    if config_path and not keys_file:
        from flashfleet.config import load_cluster_config

        keys_file = load_cluster_config(config_path).coordinator.api_keys_file or None
    try:
        keys = load_api_keys(keys_file)
    except (OSError, ValueError):
        return None
    return next(iter(keys), None)


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
