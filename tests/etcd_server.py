"""Starts a real etcd (the `etcd` binary that .ci/run installs) on free loopback ports in a
temporary directory, for the tests of the fleet state in etcd."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

ETCD = shutil.which("etcd")
SKIP_REASON = "the etcd binary is not installed (apt-get install etcd-server; .ci/run installs it)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdServer:
    """One etcd member listening on 127.0.0.1 (`endpoint`); `stop()` kills it."""

    def __init__(self, data_dir: Path, name: str = "test"):
        self.client_port, self.peer_port = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{self.client_port}"
        self.log = open(data_dir / "etcd.log", "wb")
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.proc = subprocess.Popen(
            [ETCD, "--name", name, "--data-dir", str(data_dir / "data"),
             "--listen-client-urls", f"http://{self.endpoint}", "--advertise-client-urls", f"http://{self.endpoint}",
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"{name}={peer}", "--logger", "zap", "--log-level", "warn"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready()

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

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        self.log.close()
