"""How long the coordinator takes to answer an RPC, measured on itself, and what it does when late.

Everything a coordinator does runs on one asyncio event loop: relaying every stream's messages,
admitting requests and answering the workers' heartbeats. gRPC's asyncio server takes new calls
one at a time, each taking a few turns of the loop, so a loop made slow by more streams than one
core relays answers every new call, heartbeats included, late: seconds late, and leases run out
while healthy workers' heartbeats wait in line. The coordinator therefore calls itself: a health
check through its own server every `PROBE_INTERVAL_S`, on a unix socket in a private directory
(the same server and the same queue of new calls as every worker's and client's, with no TLS or
network in the way). While the answer takes longer than `MAX_RPC_LAG_S`:

- new requests wait in the admission queue (coordinator/admission.py) instead of adding streams
  the loop cannot serve, as they wait for a free worker slot; resumed ones go on;
- a worker's lease runs out only after its TTL plus the current lateness
  (`coordinator.registry.Registry`'s `grace`): a heartbeat still waiting in the queue is no
  sign of a dead worker.

This is load shedding on the server's own measured pressure, as Envoy's overload manager does.
"""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
import time
from collections import deque
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger("flashfleet.coordinator")

MAX_RPC_LAG_S = 0.5  # an RPC answered later than this (sustained) means the coordinator is overloaded
PROBE_INTERVAL_S = 0.1  # how often the coordinator calls itself
PROBE_WINDOW = 3  # completed probes `lag_s` looks at (one slow answer, a garbage collection, is not an overload)
PROBE_TIMEOUT_S = 30.0
# Probe failures that mean "not answered in time"; others (UNAVAILABLE: its socket removed, say)
# measure nothing and must not read as an overload.
LATE_CODES = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED)
PROBE_DIR_PREFIX = "flashfleet-coordinator-"  # + "<pid>-<random>": the probe socket's directory
# In the probe directory: a file its coordinator holds an exclusive lock on while it lives. The
# lock, not the pid, says whether the directory is in use: a coordinator in another pid namespace
# (a container sharing the temporary directory) has a pid this one cannot see.
PROBE_LOCK_FILE = "alive.lock"


class RpcLag:
    """Measures how long this process's gRPC server takes to answer a unary call.

    Call `attach(server)` before the server starts (it adds the probe's port), then run `run()`
    as a task; `close()` removes the socket's directory.

    Args:
        interval_s: seconds between probes (> 0).
        window: completed probes `lag_s` weighs (>= 1).
        on_recover: called (on the loop) when the coordinator stops being late (`overloaded`
            turns False): requests held in the admission queue may go.

    Raises:
        ValueError: interval_s <= 0 or window < 1.
    """

    def __init__(self, interval_s: float = PROBE_INTERVAL_S, window: int = PROBE_WINDOW,
                 on_recover: Callable[[], None] | None = None):
        if not interval_s > 0 or window < 1:
            raise ValueError(f"interval_s must be > 0 and window >= 1, got {interval_s}, {window}")
        self.interval_s = interval_s
        self.on_recover = on_recover
        self._rtts: deque[float] = deque(maxlen=window)
        self._pending_since: float | None = None
        self._dir: str | None = None
        self._lock: int | None = None  # the fd holding PROBE_LOCK_FILE's lock while the directory is in use

    @property
    def lag_s(self) -> float:
        """Seconds an RPC waits now: the least of the last `window` probes' round trips (0.0
        before there are `window`), or, when longer, how long ago the first probe still without an
        answer was sent (a refused or timed-out probe is sent again; the wait counts on)."""
        done = min(self._rtts) if len(self._rtts) == self._rtts.maxlen else 0.0
        pending = 0.0 if self._pending_since is None else time.monotonic() - self._pending_since
        return max(done, pending)

    def overloaded(self, limit_s: float = MAX_RPC_LAG_S) -> bool:
        """Whether an RPC waits longer than `limit_s` seconds now."""
        return self.lag_s > limit_s

    def attach(self, server: grpc.aio.Server) -> None:
        """Adds the probe's port to `server` (before it starts): a unix socket in a directory
        only this user can open (and removes those that killed coordinators of this user left).

        Raises:
            RuntimeError: the socket could not be bound.
        """
        remove_stale_probe_dirs()
        self._dir = tempfile.mkdtemp(prefix=f"{PROBE_DIR_PREFIX}{os.getpid()}-")  # mode 0700
        # Locked before it takes its name, so no cleaner finds it there unlocked.
        unnamed = os.path.join(self._dir, PROBE_LOCK_FILE + ".new")
        self._lock = os.open(unnamed, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(unnamed, os.path.join(self._dir, PROBE_LOCK_FILE))
        if server.add_insecure_port(f"unix:{self._socket()}") == 0:
            raise RuntimeError(f"could not bind the coordinator's probe socket in {self._dir}")

    def _socket(self) -> str:
        return os.path.join(self._dir, "probe.sock")

    def record(self, rtt_s: float) -> None:
        """Records one probe's round trip, seconds; tells `on_recover` when that ends an overload."""
        was = self.overloaded()
        self._rtts.append(rtt_s)
        if was and not self.overloaded() and self.on_recover is not None:
            self.on_recover()

    async def run(self) -> None:
        """Probes the server every `interval_s` until cancelled (needs `attach` first)."""
        async with grpc.aio.insecure_channel(f"unix:{self._socket()}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if self._pending_since is None:
                    self._pending_since = time.monotonic()
                try:
                    await stub.Check(health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S)
                except grpc.aio.AioRpcError as e:
                    if e.code() not in LATE_CODES:  # no measurement (its socket gone, the server stopping)
                        self._pending_since = None
                        log.debug("the coordinator's probe failed: %s", e.code().name)
                    # Shed (gRPC refuses calls when too many wait to be taken) or timed out: no
                    # answer yet, so the wait goes on counting from the first unanswered probe.
                    await asyncio.sleep(self.interval_s)
                    continue
                rtt = time.monotonic() - self._pending_since
                self._pending_since = None
                self.record(rtt)
                await asyncio.sleep(self.interval_s)

    def close(self) -> None:
        """Removes the probe socket's directory (and lets go of its lock)."""
        if self._dir is not None:
            with contextlib.suppress(OSError):
                shutil.rmtree(self._dir)
            self._dir = None
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def remove_stale_probe_dirs(root: str | None = None) -> list[str]:
    """Removes the probe directories in `root` (the temporary directory by default) that this
    user's coordinators left when they were killed (SIGKILL: no `close`): those whose lock file
    nobody holds, or, holding no lock file, whose process no longer runs (a coordinator between
    creating its directory and locking). Returns the paths removed."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        pid = name[len(PROBE_DIR_PREFIX):].split("-", 1)[0]
        if not name.startswith(PROBE_DIR_PREFIX) or not pid.isdigit():
            continue
        path = os.path.join(root, name)
        try:
            if os.stat(path).st_uid != os.getuid() or _in_use(path, int(pid)):
                continue
        except OSError:  # the directory went meanwhile
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _in_use(path: str, pid: int) -> bool:
    """Whether a live coordinator holds the probe directory `path` (named for `pid`)."""
    try:
        fd = os.open(os.path.join(path, PROBE_LOCK_FILE), os.O_RDWR)
    except FileNotFoundError:
        try:
            os.kill(pid, 0)  # raises when no such process runs
        except ProcessLookupError:
            return False
        except OSError:  # another user's process: it runs
            pass
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
