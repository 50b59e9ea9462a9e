"""Starts a real etcd (the `etcd` binary that .ci/run installs) on free loopback ports in a
temporary directory, for the tests of the fleet state in etcd."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

ETCD = shutil.which("etcd")
SKIP_REASON = "the etcd binary is not installed (apt-get install etcd-server; .ci/run installs it)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdServer:
    """One etcd member listening on 127.0.0.1 (`endpoint`); `stop()` kills it."""

    def __init__(self, data_dir: Path, name: str = "test", peers: dict[str, int] | None = None,
                 client_port: int | None = None, wait: bool = True):
        """One member; `peers` (name -> peer port, this one's included) makes it one of a cluster."""
        self.client_port = client_port or free_port()
        self.peer_port = (peers or {}).get(name) or free_port()
        self.endpoint = f"127.0.0.1:{self.client_port}"
        data_dir.mkdir(parents=True, exist_ok=True)
        self.log = open(data_dir / "etcd.log", "ab")
        peer = f"http://127.0.0.1:{self.peer_port}"
        cluster = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in (peers or {name: self.peer_port}).items())
        self.argv = [ETCD, "--name", name, "--data-dir", str(data_dir / "data"),
                     "--listen-client-urls", f"http://{self.endpoint}",
                     "--advertise-client-urls", f"http://{self.endpoint}",
                     "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                     "--initial-cluster", cluster, "--initial-cluster-token", "test",
                     "--logger", "zap", "--log-level", "warn"]
        self.start(wait)

    def start(self, wait: bool = True) -> None:
        """Starts (or restarts, on the same ports and data) the member; with `wait`, until it listens."""
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT)
        if wait:
            self._wait_ready()

    def kill(self) -> None:
        """SIGKILL, keeping the data directory (`start` brings the same member back)."""
        self.proc.kill()
        self.proc.wait(10)

    def _wait_ready(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with socket.create_connection(("127.0.0.1", self.client_port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"etcd did not listen on {self.endpoint} within {timeout_s} s")

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        """Waits until the member's /health says true: it has a leader and answers a quorum
        read, so a member started again has rejoined its cluster (listening comes first).

        Raises:
            RuntimeError: not healthy within `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=2) as resp:
                    if b'"true"' in resp.read():
                        return
            except (urllib.error.URLError, OSError):  # 503 while it has no leader; refused while starting
                pass
            time.sleep(0.1)
        raise RuntimeError(f"etcd member {self.endpoint} not healthy within {timeout_s} s; see {self.log.name}")

    def stop(self) -> None:
        self.kill()
        self.log.close()


def start_cluster_of_three(root: Path) -> list[EtcdServer]:
    """Three members on loopback forming one etcd cluster (started together: each waits for a quorum)."""
    peers = {f"m{i}": free_port() for i in range(3)}
    members = [EtcdServer(root / name, name, peers, wait=False) for name in peers]
    for m in members:
        m._wait_ready()
    return members
