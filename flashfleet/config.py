"""The cluster config file (TOML) that `flashfleet up`, `python -m coordinator` and
`python -m worker` read with `--config FILE`; command-line flags override its values.

One file describes the whole fleet (an example with every key: deploy/cluster.toml):

    [coordinator]                 # where it listens and what workers dial
    host = "0.0.0.0"
    port = 50051
    address = "coordinator.local:50051"
    metrics_port = 9400
    http_port = 8000              # OpenAI-compatible HTTP API (omit: none)

    [[models]]                    # what can be served
    name = "Qwen2.5-Coder-1.5B-Instruct"
    draft = "Qwen2.5-Coder-0.5B-Instruct"

    [worker]                      # defaults for every worker entry
    model = "Qwen2.5-Coder-1.5B-Instruct"
    port = 50052
    metrics_port = 9401

    [[workers]]                   # one per host; a worker finds its entry by id or hostname
    id = "mini-1"
    advertise_host = "mini-1.local"
    chip = "M4 Pro"

    [tls]                         # optional: PEM files on every host
    ca_file = "/opt/flashfleet/tls/ca.pem"
    cert_file = "/opt/flashfleet/tls/server.pem"
    key_file = "/opt/flashfleet/tls/server.key"

Everything is parsed into frozen dataclasses; an unknown key, a wrong type or a missing value is a
`ConfigError` that names the file, the table and the key. TLS: the paths are validated and turned
into gRPC credentials by `TLSConfig` (`server_credentials`, `channel_credentials`), which every
server port and channel uses (flashfleet/transport.py): mutual TLS on every hop.
"""
from __future__ import annotations

import dataclasses
import math
import socket
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    """The cluster config file is missing, malformed, or names something that does not exist."""


@dataclass(frozen=True)
class CoordinatorSection:
    """`[coordinator]`.

    Attributes:
        host: address the coordinator binds ("0.0.0.0" for a LAN).
        port: its gRPC port.
        address: "host:port" that workers and clients dial ("" = host:port, or 127.0.0.1:port
            when host is a wildcard); several comma-separated for several coordinators (clients
            and workers use each; worker/server.py `_keep_registered`).
        metrics_port: its Prometheus /metrics port (None = no endpoint).
        http_port: its OpenAI-compatible HTTP API port (None or 0 = no HTTP API;
            coordinator/openai_api.py).
        lease_ttl_s, heartbeat_interval_s, route_attempts: as in CoordinatorConfig.
        max_queued, queue_timeout_s: requests that may wait for a free worker slot when the
            fleet is full, and for how long (coordinator/admission.py).
        migrate, migrate_min_remaining_tokens: session migration on or off, and the budget a
            session must have left to be moved (coordinator/migration.py, MigrationPolicy).
        migrate_cooldown_s, migrate_link_bandwidth_gbps, migrate_hysteresis, migrate_min_speedup,
        migrate_min_saving_s: MigrationPolicy's cooldown_s, link bandwidth (Gb/s), hysteresis,
            min_speedup and min_saving_s.
        migrate_method: how a session moves: "kv" (copy its KV cache, falling back to
            re-prefill) or "reprefill" (coordinator/kv_transfer.py).
        shutdown_grace_s: how long in-flight streams may finish on SIGTERM (as in
            CoordinatorConfig).
        api_keys_file: file of the API keys clients must send, one a line, "<key>" or
            "<key> admin" ("" = none required; flashfleet/auth.py).
        join_token_file: file holding the token workers must send to register, which the
            coordinator sends on every worker call; workers read the same path ("" = none).
        state: where the fleet's state lives: "memory" (this coordinator alone) or "etcd"
            (shared by several coordinators; coordinator/state/etcd.py).
        etcd_endpoints: the etcd members ("host:port" or "http://host:port") for state "etcd".
    """

    host: str = "127.0.0.1"
    port: int = 50051
    address: str = ""
    metrics_port: int | None = None
    http_port: int | None = None
    lease_ttl_s: float = 10.0
    heartbeat_interval_s: float = 2.0
    route_attempts: int = 3
    max_queued: int = 64
    queue_timeout_s: float = 30.0
    migrate: bool = True
    migrate_min_remaining_tokens: int = 64
    migrate_cooldown_s: float = 5.0
    migrate_link_bandwidth_gbps: float = 1.0
    migrate_hysteresis: float = 1.5
    migrate_min_speedup: float = 1.1
    migrate_min_saving_s: float = 1.0
    migrate_method: str = "kv"
    shutdown_grace_s: float = 25.0
    api_keys_file: str = ""
    join_token_file: str = ""
    state: str = "memory"
    etcd_endpoints: tuple[str, ...] = ()

    @property
    def dial_address(self) -> str:
        """The "host:port" workers and clients dial: `address`, else host:port (127.0.0.1 for a
        wildcard host)."""
        if self.address:
            return self.address
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"{host}:{self.port}"


@dataclass(frozen=True)
class ModelEntry:
    """One `[[models]]` entry.

    Attributes:
        name: the name clients request.
        path: catalog name or local model directory to load ("" = name).
        draft: draft model (catalog name or directory; "" = none), or "dflash": the DFlash
            draft shipped for this model (flashfleet/models/drafts.py).
        num_draft_tokens: draft tokens per speculative cycle.
        max_context_tokens: context limit override (None = the model's own).
    """

    name: str
    path: str = ""
    draft: str = ""
    num_draft_tokens: int = 3
    max_context_tokens: int | None = None

    @property
    def source(self) -> str:
        """What the worker loads: `path`, or the name (a catalog model)."""
        return self.path or self.name


@dataclass(frozen=True)
class WorkerEntry:
    """One `[[workers]]` entry, with `[worker]` defaults applied.

    Attributes:
        id: worker id in the fleet (unique).
        model: name of a `[[models]]` entry.
        host: address the worker binds.
        advertise_host: host the coordinator dials ("" = the id).
        port: gRPC port (0 = any free port).
        metrics_port: Prometheus /metrics port (None = no endpoint).
        capacity: sessions admitted at once.
        chip: Apple chip, e.g. "M4 Pro" ("" = detect).
        peak_memory_bandwidth_gbs: overrides the chip table (GB/s).
        prompt_cache_entries: finished turns kept for follow-ups that extend them (0 = none).
        kv_cache_limit_bytes: the engine's KV budget, running sessions and the prompt cache
            (None = the device's usable memory less a margin and the weights).
        drain_timeout_s: on SIGTERM, how long in-flight requests may finish (seconds).
    """

    id: str
    model: str
    host: str = "0.0.0.0"
    advertise_host: str = ""
    port: int = 50052
    metrics_port: int | None = None
    capacity: int = 8
    chip: str = ""
    peak_memory_bandwidth_gbs: float | None = None
    kv_cache_limit_bytes: int | None = None
    prompt_cache_entries: int = 8
    drain_timeout_s: float = 25.0


@dataclass(frozen=True)
class TLSConfig:
    """`[tls]`: PEM files of the cluster's CA and of this host's certificate and key.

    Attributes:
        ca_file: CA certificate that signs every host's certificate.
        cert_file, key_file: this host's certificate chain and private key.
    """

    ca_file: str
    cert_file: str
    key_file: str

    def read(self) -> tuple[bytes, bytes, bytes]:
        """Returns (ca, cert, key) PEM bytes.

        Raises:
            ConfigError: a file is missing, unreadable or not PEM.
        """
        out = []
        for key in ("ca_file", "cert_file", "key_file"):
            path = Path(getattr(self, key)).expanduser()
            try:
                data = path.read_bytes()
            except OSError as e:
                raise ConfigError(f"[tls] {key} = {str(path)!r}: cannot read it ({e.strerror})") from e
            if b"-----BEGIN " not in data:
                raise ConfigError(f"[tls] {key} = {str(path)!r} is not a PEM file")
            out.append(data)
        return out[0], out[1], out[2]

    def server_credentials(self, require_client_auth: bool = True):
        """gRPC server credentials: this host's certificate; clients must present one signed by
        the CA (mutual TLS) unless require_client_auth is False.

        Raises:
            ConfigError: as for `read`.
        """
        import grpc

        ca, cert, key = self.read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=require_client_auth)

    def server_ssl_context(self):
        """An `ssl.SSLContext` for an HTTPS server (the coordinator's HTTP API): this host's
        certificate; clients must present one signed by the CA (mutual TLS, as on gRPC).

        Raises:
            ConfigError: a file is missing, unreadable, not PEM, or the key does not match.
        """
        import ssl

        self.read()  # the same messages as gRPC's credentials for a missing or non-PEM file
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(Path(self.ca_file).expanduser()))
        try:
            ctx.load_cert_chain(str(Path(self.cert_file).expanduser()), str(Path(self.key_file).expanduser()))
        except ssl.SSLError as e:
            raise ConfigError(f"[tls] cert_file / key_file: {e.reason or e}") from e
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def channel_credentials(self):
        """gRPC channel credentials: trust the cluster CA, present this host's certificate.

        Raises:
            ConfigError: as for `read`.
        """
        import grpc

        ca, cert, key = self.read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                            certificate_chain=cert)


@dataclass(frozen=True)
class ClusterConfig:
    """A parsed cluster config file.

    Attributes:
        path: the file it was read from.
        coordinator: `[coordinator]`.
        models: `[[models]]`, names unique.
        workers: `[[workers]]` with `[worker]` defaults applied, ids unique.
        tls: `[tls]`, or None.
    """

    path: Path
    coordinator: CoordinatorSection = field(default_factory=CoordinatorSection)
    models: tuple[ModelEntry, ...] = ()
    workers: tuple[WorkerEntry, ...] = ()
    tls: TLSConfig | None = None

    def model(self, name: str) -> ModelEntry:
        """The `[[models]]` entry called name.

        Raises:
            ConfigError: there is none.
        """
        for m in self.models:
            if m.name == name:
                return m
        raise ConfigError(f"{self.path}: no [[models]] entry named {name!r} "
                          f"(have: {', '.join(m.name for m in self.models) or 'none'})")

    def worker(self, worker_id: str | None = None) -> WorkerEntry:
        """This worker's entry: the one whose id is worker_id or, without one, whose id or
        advertise_host is this machine's hostname (with or without its domain, any case).

        Raises:
            ConfigError: no entry matches.
        """
        if worker_id:
            for w in self.workers:
                if w.id == worker_id:
                    return w
            wanted = f"id {worker_id!r}"
        else:
            host = socket.gethostname().lower()
            names = {host, host.split(".")[0]}
            for w in self.workers:
                if {w.id.lower(), w.advertise_host.lower(), w.advertise_host.lower().split(".")[0]} & names:
                    return w
            wanted = f"this host ({socket.gethostname()!r}); pass --worker-id"
        raise ConfigError(f"{self.path}: no [[workers]] entry for {wanted} "
                          f"(ids: {', '.join(w.id for w in self.workers) or 'none'})")

    def worker_settings(self, entry: WorkerEntry) -> dict[str, object]:
        """`python -m worker` settings of one entry, keyed like its command-line options
        (argparse dest names); None values are left to the command's own defaults.

        Raises:
            ConfigError: the entry's model has no `[[models]]` entry.
        """
        m = self.model(entry.model)
        return {
            "model": m.source, "model_name": m.name, "draft": m.draft or None,
            "num_draft_tokens": m.num_draft_tokens, "max_context_tokens": m.max_context_tokens,
            "capacity": entry.capacity, "coordinator": self.coordinator.dial_address,
            "host": entry.host, "port": entry.port, "advertise_host": entry.advertise_host or entry.id,
            "worker_id": entry.id, "metrics_port": entry.metrics_port, "chip": entry.chip or None,
            "peak_memory_bandwidth_gbs": entry.peak_memory_bandwidth_gbs,
            "kv_cache_limit_bytes": entry.kv_cache_limit_bytes,
            "prompt_cache_entries": entry.prompt_cache_entries,
            "drain_timeout_s": entry.drain_timeout_s,
            "join_token_file": self.coordinator.join_token_file or None,
        }

    def coordinator_settings(self) -> dict[str, object]:
        """`python -m coordinator` settings, keyed like its argparse dest names."""
        c = self.coordinator
        return {"host": c.host, "port": c.port, "metrics_port": c.metrics_port, "http_port": c.http_port,
                "lease_ttl_s": c.lease_ttl_s, "heartbeat_interval_s": c.heartbeat_interval_s,
                "route_attempts": c.route_attempts, "max_queued": c.max_queued,
                "queue_timeout_s": c.queue_timeout_s, "migrate": c.migrate,
                "migrate_min_remaining_tokens": c.migrate_min_remaining_tokens,
                "migrate_cooldown_s": c.migrate_cooldown_s,
                "migrate_link_bandwidth_gbps": c.migrate_link_bandwidth_gbps,
                "migrate_hysteresis": c.migrate_hysteresis, "migrate_min_speedup": c.migrate_min_speedup,
                "migrate_min_saving_s": c.migrate_min_saving_s,
                "migrate_method": c.migrate_method,
                "shutdown_grace_s": c.shutdown_grace_s, "api_keys_file": c.api_keys_file or None,
                "join_token_file": c.join_token_file or None, "state": c.state,
                "etcd_endpoints": ",".join(c.etcd_endpoints) or None}


TOP_LEVEL = ("coordinator", "models", "worker", "workers", "tls")


def load_cluster_config(path: str | Path) -> ClusterConfig:
    """Reads and validates a cluster config file.

    Raises:
        ConfigError: the file is missing or not TOML; an unknown table or key; a value of the
            wrong type or out of range; duplicate model names or worker ids; a worker naming a
            model that has no `[[models]]` entry.
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"cannot read cluster config {path}: {e.strerror}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from e
    for key in data:
        if key not in TOP_LEVEL:
            raise ConfigError(f"{path}: unknown top-level key {key!r}; expected one of "
                              f"{', '.join(TOP_LEVEL)}")
    coordinator = _build(CoordinatorSection, data.get("coordinator", {}), path, "[coordinator]")
    models = tuple(_build(ModelEntry, m, path, f"[[models]] #{i + 1}")
                   for i, m in enumerate(_array(data, "models", path)))
    defaults = data.get("worker", {})
    if not isinstance(defaults, dict):
        raise ConfigError(f"{path}: [worker] must be a table")
    if "id" in defaults:
        raise ConfigError(f"{path}: [worker] holds defaults for every worker; 'id' belongs in "
                          "each [[workers]] entry")
    workers = tuple(_build(WorkerEntry, {**defaults, **w} if isinstance(w, dict) else w, path,
                           f"[[workers]] #{i + 1}")
                    for i, w in enumerate(_array(data, "workers", path)))
    tls = _build(TLSConfig, data["tls"], path, "[tls]") if "tls" in data else None
    cfg = ClusterConfig(path=path, coordinator=coordinator, models=models, workers=workers, tls=tls)
    _check(cfg)
    return cfg


STATES = ("memory", "etcd")


def state_problem(state: str, etcd_endpoints) -> str | None:
    """What is wrong with the fleet-state settings (named as in the cluster config), or None."""
    from coordinator.state.etcd_client import endpoint_target

    if state not in STATES:
        return f"state must be one of {', '.join(repr(s) for s in STATES)}, got {state!r}"
    if state == "etcd" and not etcd_endpoints:
        return 'state = "etcd" needs etcd_endpoints (e.g. ["http://10.0.0.11:2379", "http://10.0.0.12:2379"])'
    if state == "memory" and etcd_endpoints:
        return 'etcd_endpoints is set but state is "memory": set state = "etcd" to use them'
    for e in etcd_endpoints:
        try:
            endpoint_target(e)
        except ValueError as err:
            return f"etcd_endpoints: {err}"
    return None


def _array(data: dict, key: str, path: Path) -> list:
    value = data.get(key, [])
    if not isinstance(value, list):
        raise ConfigError(f"{path}: {key} must be an array of tables ([[{key}]])")
    return value


def _check(cfg: ClusterConfig) -> None:
    """Cross-entry checks: unique names, known models, sane numbers."""
    p, c = cfg.path, cfg.coordinator
    for label, names in (("model name", [m.name for m in cfg.models]),
                         ("worker id", [w.id for w in cfg.workers])):
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"{p}: duplicate {label} {dup[0]!r}")
    for w in cfg.workers:
        cfg.model(w.model)
        if w.capacity < 1:
            raise ConfigError(f"{p}: worker {w.id!r}: capacity must be >= 1, got {w.capacity}")
        if w.prompt_cache_entries < 0:
            raise ConfigError(f"{p}: worker {w.id!r}: prompt_cache_entries must be >= 0, "
                              f"got {w.prompt_cache_entries}")
        for key in ("peak_memory_bandwidth_gbs", "kv_cache_limit_bytes"):
            value = getattr(w, key)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{p}: worker {w.id!r}: {key} must be > 0, got {value}")
        if not (math.isfinite(w.drain_timeout_s) and w.drain_timeout_s >= 0):
            raise ConfigError(f"{p}: worker {w.id!r}: drain_timeout_s must be a finite number of "
                              f"seconds >= 0, got {w.drain_timeout_s}")
    for m in cfg.models:
        if m.num_draft_tokens < 1:
            raise ConfigError(f"{p}: model {m.name!r}: num_draft_tokens must be >= 1")
        if m.max_context_tokens is not None and m.max_context_tokens < 1:
            raise ConfigError(f"{p}: model {m.name!r}: max_context_tokens must be >= 1, got "
                              f"{m.max_context_tokens}")
    from coordinator.config import migration_problems, settings_problems

    bad = settings_problems(c.lease_ttl_s, c.heartbeat_interval_s, c.route_attempts, c.max_queued,
                            c.queue_timeout_s, c.migrate_min_remaining_tokens, c.shutdown_grace_s)
    bad += migration_problems(c.migrate_cooldown_s, c.migrate_link_bandwidth_gbps, c.migrate_hysteresis,
                              c.migrate_min_speedup, c.migrate_min_saving_s)
    if bad:
        raise ConfigError(f"{p}: [coordinator] {bad[0]}")
    problem = state_problem(c.state, c.etcd_endpoints)
    if problem:
        raise ConfigError(f"{p}: [coordinator] {problem}")
    if c.migrate_method not in ("kv", "reprefill"):
        raise ConfigError(f"{p}: [coordinator] migrate_method must be \"kv\" or \"reprefill\", "
                          f"got {c.migrate_method!r}")
    ports = [("[coordinator] port", c.port), ("[coordinator] metrics_port", c.metrics_port),
             ("[coordinator] http_port", c.http_port)]
    ports += [(f"worker {w.id!r} {k}", getattr(w, k)) for w in cfg.workers
              for k in ("port", "metrics_port")]
    for label, port in ports:
        if port is not None and not is_tcp_port(port):
            raise ConfigError(f"{p}: {label} = {port} is not a TCP port")


def is_tcp_port(port: int) -> bool:
    """Whether `port` is 0..65535 (0: any free port; for a metrics port, off)."""
    return 0 <= port <= 65535


def tcp_port(text: str) -> int:
    """argparse `type=` for port flags: the same range a config file's ports must keep.

    Returns:
        The port, 0..65535 (0: any free port; for a metrics port, off).

    Raises:
        argparse.ArgumentTypeError: not an integer, or outside 0..65535 (gRPC and the metrics
            server would otherwise wrap it around or fail with a traceback).
    """
    import argparse

    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not is_tcp_port(port):
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (0..65535)")
    return port


def _build(cls, table, path: Path, where: str):
    """Builds dataclass `cls` from a TOML table, checking keys and value types."""
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: {where} must be a table")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in table.items():
        if key not in names:
            raise ConfigError(f"{path}: {where}: unknown key {key!r}; expected one of "
                              f"{', '.join(names)}")
        kwargs[key] = _typed(value, hints[key], path, f"{where} {key}")
    missing = [f.name for f in dataclasses.fields(cls)
               if f.name not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{path}: {where}: missing {', '.join(repr(m) for m in missing)}")
    return cls(**kwargs)


def _typed(value, hint, path: Path, where: str):
    """Checks a TOML value against a field's type (str, int, float, bool, tuple[str, ...], or
    X | None)."""
    if typing.get_origin(hint) is tuple:
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise ConfigError(f"{path}: {where} must be an array of strings, got {value!r}")
    allowed = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    for t in allowed:
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t in (str, bool) and isinstance(value, t):
            return value
    names = " or ".join(t.__name__ for t in allowed)
    raise ConfigError(f"{path}: {where} must be {names}, got {value!r}")
