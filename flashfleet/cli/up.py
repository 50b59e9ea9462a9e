"""`flashfleet up`: start a coordinator and N workers on this machine as processes, print their
addresses, start again a worker or the coordinator when it fails (`flashfleet.cli.restarts`), and
shut them all down cleanly on Ctrl-C, SIGTERM or SIGHUP (a closed terminal)."""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flashfleet.blas import openblas_env
from flashfleet.cli.restarts import RestartBackoff, should_restart
from flashfleet.config import tcp_port

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# How often `flashfleet up` looks for exited children (seconds): a killed coordinator is started
# again within this (its SDK streams pause until it is back), and a poll of a few processes is free.
TEND_INTERVAL_S = 0.1


STILL_LOADING_EVERY_S = 15.0  # how often startup says it is still waiting for workers


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def fixed_port(port: int, host: str) -> int:
    """The coordinator's port for the cluster's whole life: `port`, or for 0 a free one chosen now,
    since a coordinator that restarts must come back where the workers and clients know it."""
    return port or free_port(host)


def port_is_free(host: str, port: int) -> bool:
    """Whether a listener could bind host:port now (False while another process listens there;
    a closed listener's TIME_WAIT connections do not count)."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
    except OSError:
        return True  # an unresolvable host: the coordinator's own bind reports it
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError:
            return False
        return True


def worker_env() -> dict[str, str]:
    """Environment for worker processes (and for anything that must compute as they do): this
    one's, with OpenBLAS preloaded where it applies (`flashfleet.blas.openblas_env`)."""
    return openblas_env() or dict(os.environ)


class LocalCluster:
    """A coordinator and workers as child processes of this one.

    Args:
        model: model name (fetched with `flashfleet models fetch`) or a local model directory.
        workers: number of worker processes (>= 1).
        port: coordinator port (0 = a free one).
        host: address every process binds and advertises (default 127.0.0.1).
        draft: optional draft model (name or directory) loaded beside the target on each worker;
            "dflash": the DFlash draft shipped for the model (each worker resolves it).
        capacity: sessions each worker admits at once.
        log_dir: where each process logs (default: a new temporary directory).
        metrics_port: coordinator /metrics port; workers get the following ports (None = off).
        http_port: the coordinator's OpenAI-compatible HTTP API port (None = off, or the config
            file's `http_port`).
        worker_args: extra flags for every worker (they override the config file's values).
        api_keys_file: file of the API keys the coordinator accepts, one a line (None: the config
            file's `api_keys_file`, or env FLASHFLEET_COORDINATOR_API_KEYS, or no key required).
        join_token_file: file holding the join token the coordinator requires of workers and
            every worker sends (None: the config file's `join_token_file`, or env
            FLASHFLEET_JOIN_TOKEN, or none).
        coordinator_args: extra flags for the coordinator (e.g. `--state etcd --etcd-endpoints
            ...`; they override the config file's values).
        config: a cluster config file (flashfleet/config.py). Each of its [[workers]] entries
            becomes a local worker process reading its model, draft and capacity from the file
            (the first `workers` entries when `workers` is given); addresses stay local.

    Use as a context manager; stop() terminates every child: SIGTERM, then SIGKILL once a group
    has had its drain time (`drain_s`: the workers' drain timeout, the coordinator's shutdown
    grace, each plus 5 s), so answers still streaming finish as a worker stopped by hand would.

    Raises:
        ValueError: workers < 1.
        flashfleet.config.ConfigError: an invalid config file, one with no [[workers]]
            entries, or fewer entries than `workers`.
    """

    def __init__(self, model: str = DEFAULT_MODEL, workers: int = 2, port: int = 0,
                 host: str = "127.0.0.1", draft: str | None = None, capacity: int = 8,
                 log_dir: str | Path | None = None, metrics_port: int | None = None,
                 worker_args: tuple[str, ...] = (), config: str | Path | None = None,
                 http_port: int | None = None, api_keys_file: str | Path | None = None,
                 join_token_file: str | Path | None = None, coordinator_args: tuple[str, ...] = ()):
        self.config = self.worker_ids = None
        self.api_keys_file = str(Path(api_keys_file).resolve()) if api_keys_file else None
        self.join_token_file = str(Path(join_token_file).resolve()) if join_token_file else None
        self.coordinator_args = coordinator_args
        self.http_port = http_port
        if config is not None:
            from flashfleet.config import ConfigError, load_cluster_config

            cfg = load_cluster_config(config)
            if not cfg.workers:  # a coordinator host's file: nothing for `up` to start
                raise ConfigError(f"{config} has no [[workers]] entries: `flashfleet up --config` "
                                  "starts one local worker per entry")
            if workers > len(cfg.workers):
                raise ConfigError(f"{config} has {len(cfg.workers)} [[workers]] entries, "
                                  f"{workers} requested")
            self.config, model = Path(config).resolve(), cfg.workers[0].model
            self.worker_ids = [w.id for w in cfg.workers[:workers]]
            worker_drain = max(w.drain_timeout_s for w in cfg.workers[:workers])
            coordinator_grace = cfg.coordinator.shutdown_grace_s
            self.models = [w.model for w in cfg.workers[:workers]]
        else:
            worker_drain = coordinator_grace = 25.0  # the processes' defaults
        if "--drain-timeout" in worker_args[:-1]:  # a flag overrides the file
            worker_drain = float(worker_args[list(worker_args).index("--drain-timeout") + 1])
        # seconds each group may take to stop before SIGKILL: (workers, coordinator)
        self.drain_s = (worker_drain + 5.0, coordinator_grace + 5.0)
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self.model, self.n_workers, self.host = model, workers, host
        if self.config is None:
            self.models = [model] * workers
        self.port = port or free_port(host)
        self.draft, self.capacity, self.metrics_port = draft, capacity, metrics_port
        self.worker_args = worker_args
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="flashfleet-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.own_ids: list[str] = []  # the ids of the workers this cluster starts
        self.commands: dict[str, tuple[list[str], dict | None]] = {}  # name -> (args, env) it ran with
        self.started: dict[str, float] = {}  # name -> time.monotonic() of its last start
        self.restarts_due: dict[str, float] = {}  # exited child -> time.monotonic() it starts again
        # The coordinator comes back at once (SDK streams wait to resume), then after doubling waits.
        self.coordinator_backoff = RestartBackoff(first_s=0.5, max_s=10.0)

    @property
    def address(self) -> str:
        """The coordinator's "host:port"."""
        return f"{self.host}:{self.port}"

    @property
    def http_url(self) -> str | None:
        """The HTTP API's base URL, "http://host:port" (None: not served)."""
        return f"http://{self.host}:{self.http_port}" if self.http_port else None

    def __enter__(self) -> "LocalCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _spawn(self, name: str, args: list[str], env=None, append: bool = False) -> None:
        self.commands[name] = (args, env)
        self.started[name] = time.monotonic()
        log = open(self.log_dir / f"{name}.log", "ab" if append else "wb")
        # -P: the caller's working directory is not put first on the import path, so a folder
        # named `worker` or `coordinator` where `flashfleet up` runs cannot shadow the package.
        self.procs[name] = subprocess.Popen([sys.executable, "-P", "-m", *args], stdout=log,
                                            stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)

    def start(self, timeout_s: float = 600.0, progress=print, should_stop=lambda: False) -> None:
        """Starts every process and waits until all workers have registered.

        Args:
            timeout_s: how long the workers have to load their models and register (seconds).
            progress: called with each progress line (str).
            should_stop: polled while waiting (every 0.3 s or so): True stops every child and
                raises `StartupCancelled` (how `flashfleet up` honours Ctrl-C during start-up).

        Whatever ends the wait early (these errors, KeyboardInterrupt) stops every child first:
        the processes run in sessions of their own, so nothing else would stop them.

        Raises:
            StartupCancelled: should_stop() became True before the cluster was ready.
            RuntimeError: the coordinator's address is in use (nothing is started then), a
                process exited during start-up (its log's tail is in the message), or the workers
                were not all registered within timeout_s.
        """
        if not port_is_free(self.host, self.port):
            # Checked before anything starts: the workers would otherwise register with the
            # process already there, and this cluster would look ready before its coordinator
            # failed to bind.
            raise RuntimeError(f"{self.address} is in use (another coordinator?): stop it or pick "
                               "another --port")
        conf = ["--config", str(self.config)] if self.config else []
        coord = ["coordinator", *conf, "--host", self.host, "--port", str(self.port),
                 "--metrics-port", str(self.metrics_port or 0)]
        if self.http_port:
            coord += ["--http-port", str(self.http_port)]
        if self.api_keys_file:
            coord += ["--api-keys-file", self.api_keys_file]
        coord += list(self.coordinator_args)
        token = ["--join-token-file", self.join_token_file] if self.join_token_file else []
        self._spawn("coordinator", coord + token)
        # The workers share this machine's memory: each one's default KV budget is its share.
        env = {**worker_env(), "FLASHFLEET_DEVICE_SHARE": str(self.n_workers)}
        self.own_ids = []
        for i in range(self.n_workers):
            args = ["worker", *conf, "--coordinator", self.address, "--host", self.host,
                    "--port", "0", "--advertise-host", self.host,
                    "--metrics-port", str(self.metrics_port + 1 + i if self.metrics_port else 0), *token]
            worker_id = self.worker_ids[i] if self.config else f"worker-{i + 1}"
            self.own_ids.append(worker_id)
            if self.config:  # model, draft and capacity come from the entry
                args += ["--worker-id", worker_id, *self.worker_args]
            else:
                args += ["--model", self.model, "--worker-id", worker_id,
                         "--capacity", str(self.capacity), *self.worker_args]
                if self.draft:
                    args += ["--draft", self.draft]
            # Named (and logged, LOG_DIR/ID.log) by worker id, as status and the metrics name it.
            self._spawn(worker_id if worker_id != "coordinator" else "worker-coordinator", args, env)
        models = ", ".join(dict.fromkeys(self.models))
        progress(f"coordinator {self.address}; {self.n_workers} worker(s) loading {models} "
                 f"(logs in {self.log_dir})")
        try:
            self._wait_ready(timeout_s, progress, should_stop)
        except BaseException:  # Ctrl-C (KeyboardInterrupt) included: no child outlives a failed start
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float, progress, should_stop) -> None:
        from flashfleet.client import Client
        from flashfleet.errors import FlashfleetError

        t0 = time.monotonic()
        deadline, seen, told = t0 + timeout_s, -1, t0
        from flashfleet.cli._common import credentials

        with Client(self.address, credentials=credentials(self.config), api_key=self.readiness_key()) as client:
            while time.monotonic() < deadline:
                if should_stop():
                    self.stop()
                    raise StartupCancelled("stopped before the cluster was ready")
                self.check_alive()
                try:
                    status = client.cluster_status(timeout_s=2)
                except FlashfleetError:
                    time.sleep(0.3)
                    continue
                # only this cluster's workers count: another process may register with the same
                # coordinator (a worker started by hand) before ours have loaded their models
                ours = [w for w in status.workers if w.worker_id in self.own_ids]
                if len(ours) != seen:
                    seen = len(ours)
                    if seen:  # the coordinator answers before any worker has registered
                        progress(f"  {seen}/{self.n_workers} workers ready: " +
                                 ", ".join(f"{w.worker_id} at {w.address}" for w in ours))
                if seen >= self.n_workers:
                    return
                if time.monotonic() - told >= STILL_LOADING_EVERY_S:  # a worker's load is silent here
                    told = time.monotonic()
                    progress(f"  still loading after {told - t0:.0f} s: the weights, then the shapes "
                             f"it will decode, warmed for up to 60 s (worker --warmup-shapes-s)")
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"workers not ready after {timeout_s:.0f} s; see logs in {self.log_dir}")

    def _access(self):
        """`read_access()`, or None where the secrets cannot be read (the coordinator itself
        reports that, and `flashfleet up` checks them before it starts anything)."""
        try:
            return self.read_access()
        except (OSError, ValueError):
            return None

    def read_access(self):
        """(API keys file or None, API keys, join token, TLS on) as the coordinator reads them
        from its flags, config and environment.

        Raises:
            OSError: a secrets file cannot be read.
            ValueError: a keys file with no key or a bad entry, a token file with no token
                (`flashfleet.auth.load_api_keys`, `load_join_token`).
        """
        from flashfleet.auth import load_api_keys, load_join_token

        keys_file, token_file, tls = self.api_keys_file, self.join_token_file, False
        if self.config is not None:
            from flashfleet.config import load_cluster_config

            cfg = load_cluster_config(self.config)
            keys_file = keys_file or cfg.coordinator.api_keys_file or None
            token_file = token_file or cfg.coordinator.join_token_file or None
            tls = cfg.tls is not None
        return keys_file, load_api_keys(keys_file), load_join_token(token_file), tls

    def access_lines(self) -> list[str]:
        """What the coordinator's access control is (`flashfleet.auth.access_summary`, from the
        same files, config and environment it read), then a warning for each protection missing
        on a non-loopback host; the secrets themselves never appear."""
        from flashfleet.auth import access_summary, access_warnings, is_loopback

        if (access := self._access()) is None:
            return []
        _, keys, token, tls = access
        return [access_summary(keys, token, tls)] + [
            f"warning: {w}" for w in access_warnings(is_loopback(self.host), keys, token, tls)]

    def readiness_key(self) -> str | None:
        """The API key `start` asks the coordinator for its workers with: the first key it
        accepts (its keys file's, then env FLASHFLEET_COORDINATOR_API_KEYS'), whatever this
        shell's FLASHFLEET_API_KEY holds (it may be another cluster's key). None where it
        requires none."""
        access = self._access()
        return next(iter(access[1]), None) if access else None

    def api_key_hint(self) -> str | None:
        """Where the coordinator requires an API key and this shell's env FLASHFLEET_API_KEY holds
        none of its keys: how a client here sends one (it names the keys file, never a key).
        None otherwise."""
        from flashfleet.auth import API_KEY_ENV, API_KEYS_ENV, client_api_key

        access = self._access()
        if access is None or not access[1] or client_api_key() in access[1]:
            return None
        source = f"a key in {access[0]}" if access[0] else f"one of {API_KEYS_ENV}"
        return f"clients need an API key: export {API_KEY_ENV}=<{source}> (or Client(api_key=...))"

    def check_alive(self) -> None:
        """Raises RuntimeError (with the exit code and the last 2000 characters of its log) if a
        child process has exited, after stopping every other child."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                code = proc.returncode
                self.stop()
                raise ChildExited(f"{name} exited with code {code}:\n{tail}", code)

    def reap(self) -> list[tuple[str, int, str]]:
        """Forgets children that have exited; returns (name, exit code, log tail) of each."""
        gone = [(n, p.returncode) for n, p in self.procs.items() if p.poll() is not None]
        for name, _ in gone:
            del self.procs[name]
        return [(n, code, (self.log_dir / f"{n}.log").read_text(errors="replace")[-2000:])
                for n, code in gone]

    def tend(self, backoff: RestartBackoff, say=print) -> None:
        """One round of supervision once the cluster is up (call it every `TEND_INTERVAL_S`):
        reaps exited children; a worker that exited with a failure (`should_restart`) is started
        again, with its command and its log (appended to), after `backoff`'s delay; another
        exit is reported and the other workers keep serving. The coordinator that exited with a
        failure (killed, crashed) is started again on the same port after
        `coordinator_backoff`'s delay (the first at once, then 0.5 s doubling): the workers keep serving and register
        with it again, and SDK clients resume their streams through it.

        Args:
            backoff: the delays before worker restarts (it keeps each worker's run of failures).
            say: called with one line (str) for each exit and each restart.

        Raises:
            RuntimeError: the coordinator exited cleanly or for a bad config (its log's tail in
                the message), or every worker has exited and none is due to start again.
        """
        now = time.monotonic()
        for name, code, tail in self.reap():
            log = self.log_dir / f"{name}.log"
            if name == "coordinator":
                if not should_restart(code):
                    raise RuntimeError(f"the coordinator exited with code {code}:\n{tail}")
                delay = self.coordinator_backoff.delay(name, now - self.started.get(name, now), first_at_once=True)
                self.restarts_due[name] = now + delay
                say(f"the coordinator exited with code {code}; starting it again on port {self.port} "
                    f"in {delay:.1f} s (its log: {log})")
                continue
            if should_restart(code):
                delay = backoff.delay(name, now - self.started.get(name, now))
                self.restarts_due[name] = now + delay
                say(f"{name} exited with code {code}; starting it again in {delay:.0f} s "
                    f"(its log: {log})")
            else:
                say(f"{name} exited with code {code}; the other workers keep serving (its log: {log})")
        for name, due in list(self.restarts_due.items()):
            if due <= now:
                del self.restarts_due[name]
                self._spawn(name, *self.commands[name], append=True)
                say("the coordinator started again" if name == "coordinator" else f"{name} started again")
        if not self.restarts_due and not any(n != "coordinator" for n in self.procs):
            raise RuntimeError("every worker has exited")

    def stop(self, grace_s: float | None = None) -> None:
        """Stops the workers first (SIGTERM: they deregister and finish in-flight streams),
        then the coordinator; SIGKILL whatever is left of a group after grace_s (default
        `drain_s`, per group), or at once on a second Ctrl-C. Restarts not yet due are dropped."""
        self.restarts_due.clear()
        workers = [p for n, p in self.procs.items() if n != "coordinator"]
        coordinator = [p for n, p in self.procs.items() if n == "coordinator"]
        graces = (grace_s, grace_s) if grace_s is not None else self.drain_s
        try:
            for group, grace in zip((workers, coordinator), graces):
                for proc in group:
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + grace
                for proc in group:
                    try:
                        proc.wait(max(deadline - time.monotonic(), 0.1))
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
        except KeyboardInterrupt:  # asked twice: no more waiting
            for proc in workers + coordinator:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        self.procs.clear()


@contextlib.contextmanager
def stopping_on_signals(handler):
    """Calls `handler(signum, frame)` on SIGINT, SIGTERM and SIGHUP (the terminal closed, the SSH
    session dropped) while in the block, then restores the earlier handlers. SIGHUP is left
    alone where it is ignored (`nohup`: the caller asked to outlive the terminal). The children
    of a LocalCluster run in sessions of their own and get none of these signals, so without
    this a `flashfleet up` or `demo` ended by one would leave its coordinator and workers running."""
    signums = [signal.SIGINT, signal.SIGTERM]
    if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signums.append(signal.SIGHUP)
    previous = {signum: signal.getsignal(signum) for signum in signums}
    for signum in signums:
        signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, earlier in previous.items():
            signal.signal(signum, earlier)


class ChildExited(RuntimeError):
    """A child process exited (`LocalCluster.check_alive`); `code` is its exit status (2: it was
    given a bad config or model, which `flashfleet up` passes on as its own status)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class StartupCancelled(RuntimeError):
    """`LocalCluster.start` was asked to stop (Ctrl-C) before every worker had registered; every
    child process has been stopped."""


def check_shipped_drafts(cfg, workers: int, model: str | None, draft: str | None) -> None:
    """Fails early, before any process starts, when a worker would get the draft keyword
    `dflash` for a model without a shipped DFlash draft (each worker resolves it itself).

    Args:
        cfg: the parsed cluster config, or None (every worker runs `model` with `draft`).
        workers: how many of the config's [[workers]] entries run.
        model, draft: the --model and --draft overrides (None: the config's).

    Raises:
        flashfleet.models.NoShippedDraftError: names the model and the models with a shipped draft.
    """
    from flashfleet.models.drafts import resolve_draft_arg

    if cfg is None:
        resolve_draft_arg(draft, model)
        return
    for entry in cfg.workers[:workers]:
        settings = cfg.worker_settings(entry)
        if model:  # as in the worker: another model drops the entry's model settings
            resolve_draft_arg(draft, model)
        else:
            resolve_draft_arg(draft or settings["draft"], settings["model"], settings["model_name"])


def served_name(model: str) -> str:
    """The name a worker serves `model` under (`flashfleet.models.served_model_name`)."""
    from flashfleet.models import served_model_name

    return served_model_name(model)


def check_model_ref(flag: str, value: str | None) -> None:
    """Fails early, before any process starts, when --model or --draft names neither a local
    directory nor a catalog model (the draft keyword `dflash` is checked by
    `check_shipped_drafts`).

    Raises:
        ValueError: one line naming the flag, the value and the catalog models.
    """
    from flashfleet.models import CATALOG
    from flashfleet.models.catalog import close_match_hint, is_catalog_name
    from flashfleet.models.drafts import is_dflash_keyword

    if value is None or is_dflash_keyword(value) or Path(value).expanduser().is_dir():
        return
    if is_catalog_name(value):  # a catalog model or its quantized copy (NAME-4bit)
        return
    raise ValueError(f"{flag} {value!r} is neither a local model directory nor a catalog model"
                     f"{close_match_hint(value)}; catalog: {', '.join(CATALOG)}")


def main(argv: list[str]) -> int:
    """Starts the cluster and keeps it up until SIGINT, SIGTERM or SIGHUP (`stopping_on_signals`;
    a second one stops it at once), the coordinator exits, or every worker has exited for good.
    A worker that exits with a failure (its engine thread died: 70; killed) is started again
    after a capped, doubling delay (1 s up to 30 s, `LocalCluster.tend`); one that exits cleanly
    or for a bad config or model (2) is reported and the others keep serving.

    Returns:
        The exit status: 0 after a signal, 1 when start-up failed or the cluster died, 2 for a
        bad config, model or draft argument, or an unreadable or empty API keys or join token file.
    """
    p = argparse.ArgumentParser(prog="flashfleet up", description=__doc__)
    p.add_argument("--config", default=None, help="cluster config file (deploy/cluster.toml): "
                   "one local worker per [[workers]] entry, with its model, draft and capacity; "
                   "the flags below override it")
    p.add_argument("--model", default=None, help=f"model name or local model directory "
                   f"(default {DEFAULT_MODEL})")
    p.add_argument("--draft", default=None, help="draft model (name or directory) for speculative "
                   "decoding; 'dflash': the DFlash draft shipped for the model (flashfleet models list)")
    p.add_argument("--workers", type=int, default=None, help="default 2, or every config entry")
    p.add_argument("--port", type=tcp_port, default=None, help="coordinator port (default 50051; 0: "
                   "a free port, chosen once at start and kept when the coordinator restarts)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--capacity", type=int, default=None, help="sessions per worker (default 8)")
    p.add_argument("--metrics-port", type=tcp_port, default=None,
                   help="coordinator /metrics port; worker i gets this + i")
    p.add_argument("--http-port", type=tcp_port, default=None,
                   help="serve the OpenAI-compatible HTTP API (/v1/chat/completions...) on this port")
    p.add_argument("--api-keys-file", default=None,
                   help="require an API key of clients: this file's keys, one a line, # comments "
                   "(clients send one: Client(api_key=...) or env FLASHFLEET_API_KEY; default: the "
                   "config's api_keys_file, or env FLASHFLEET_COORDINATOR_API_KEYS, else none)")
    p.add_argument("--join-token-file", default=None,
                   help="require this file's token of every worker that registers (the local "
                   "workers send it; default: the config's join_token_file, or env "
                   "FLASHFLEET_JOIN_TOKEN, else none)")
    p.add_argument("--etcd-endpoints", default=None,
                   help="comma-separated etcd members: the coordinator keeps the fleet's state in etcd "
                   "(shared with other coordinators) instead of in memory (docs/operations.md)")
    p.add_argument("--log-dir", default=None)
    a = p.parse_args(argv)
    coordinator_args = ("--state", "etcd", "--etcd-endpoints", a.etcd_endpoints) if a.etcd_endpoints else ()
    for flag in ("workers", "capacity"):  # 0 would otherwise mean "the default"
        if getattr(a, flag) is not None and getattr(a, flag) < 1:
            p.error(f"--{flag} must be >= 1, got {getattr(a, flag)}")
    from flashfleet.models.drafts import NoShippedDraftError

    if a.config:
        from flashfleet.config import ConfigError, load_cluster_config

        try:
            cfg = load_cluster_config(a.config)
            check_shipped_drafts(cfg, a.workers or len(cfg.workers), a.model, a.draft)
            overrides = [*(["--model", a.model] if a.model else []),
                         *(["--draft", a.draft] if a.draft else []),
                         *(["--capacity", str(a.capacity)] if a.capacity else [])]
            cluster = LocalCluster(
                workers=a.workers or len(cfg.workers),
                port=fixed_port(cfg.coordinator.port if a.port is None else a.port, a.host),
                host=a.host, log_dir=a.log_dir,
                metrics_port=a.metrics_port or cfg.coordinator.metrics_port,
                worker_args=tuple(overrides), config=a.config,
                http_port=a.http_port or cfg.coordinator.http_port,
                api_keys_file=a.api_keys_file, join_token_file=a.join_token_file,
                coordinator_args=coordinator_args)
        except (ConfigError, ValueError, NoShippedDraftError) as e:
            print(f"flashfleet up: {e}", file=sys.stderr)
            return 2
    else:
        try:
            check_model_ref("--model", a.model)
            check_model_ref("--draft", a.draft)
            check_shipped_drafts(None, a.workers or 2, a.model or DEFAULT_MODEL, a.draft)
        except (ValueError, NoShippedDraftError) as e:
            print(f"flashfleet up: {e}", file=sys.stderr)
            return 2
        port = fixed_port(50051 if a.port is None else a.port, a.host)
        cluster = LocalCluster(a.model or DEFAULT_MODEL, a.workers or 2, port, a.host,
                               a.draft, a.capacity or 8, a.log_dir, a.metrics_port, http_port=a.http_port,
                               api_keys_file=a.api_keys_file, join_token_file=a.join_token_file,
                               coordinator_args=coordinator_args)
    try:  # what the coordinator and workers would exit on, before any of them starts
        cluster.read_access()
    except (OSError, ValueError) as e:
        print(f"flashfleet up: cannot read a secrets file: {e}", file=sys.stderr)
        return 2
    stop = {"now": False}

    def on_signal(signum, frame):
        if stop["now"]:  # asked twice: LocalCluster.stop kills what is left at once
            raise KeyboardInterrupt
        stop["now"] = True

    with stopping_on_signals(on_signal):
        return serve(cluster, lambda: stop["now"])


def serve(cluster: LocalCluster, should_stop) -> int:
    """Starts `cluster`, prints its addresses, and tends it (`LocalCluster.tend`) until
    should_stop() is True, then stops it (`up`'s main documents the exit status)."""
    try:
        cluster.start(progress=lambda m: print(m, flush=True), should_stop=should_stop)
    except StartupCancelled as e:
        print(f"flashfleet up: {e}", file=sys.stderr)
        return 0
    except RuntimeError as e:
        print(f"flashfleet up: {e}", file=sys.stderr)
        return 2 if isinstance(e, ChildExited) and e.code == 2 else 1  # a bad model or config: as the worker says
    try:
        print(f"cluster ready: coordinator at {cluster.address}\n  try: flashfleet generate --address "
              f"{cluster.address} --model {served_name(cluster.model)} \"What is a GPU?\"", flush=True)
        if (hint := cluster.api_key_hint()) is not None:
            print(f"  {hint}", flush=True)
        if cluster.http_port:
            print(f"  OpenAI-compatible API: {cluster.http_url}/v1", flush=True)
        for line in cluster.access_lines():
            print(f"  {line}", flush=True)
        print("Ctrl-C stops everything.", flush=True)
        backoff = RestartBackoff()
        while not should_stop():
            cluster.tend(backoff, say=lambda line: print(f"flashfleet up: {line}", file=sys.stderr,
                                                         flush=True))
            time.sleep(TEND_INTERVAL_S)
    except RuntimeError as e:
        print(f"flashfleet up: {e}", file=sys.stderr)
        return 1
    finally:
        try:
            print(f"stopping cluster (answers still streaming get up to {cluster.drain_s[0]:.0f} s; "
                  "Ctrl-C again stops at once)...", flush=True)
            cluster.stop()  # a second Ctrl-C inside it kills what is left
        except KeyboardInterrupt:  # ... or one just before it
            cluster.stop(grace_s=0)
        print(f"cluster stopped (logs: {cluster.log_dir})", flush=True)
    return 0
