"""Failover under `kill -9`: a coordinator (in this process) and two real worker processes serve a
tiny model with a DFlash draft; the worker serving a greedy stream is SIGKILLed mid-stream (no
drain, no deregistration). The client's stream ends normally, its token ids equal the greedy
output of the same request run without a kill, and the coordinator counts one failover."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.migration import MigrationPolicy
from flashfleet import Client
from harness import start_cluster, wait_until

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny"
PROMPT = "The river flows through the old town and"
MAX_TOKENS = 320
KILL_AFTER_TOKENS = 12  # tokens the client has seen when the serving worker is killed


class Fleet:
    """The coordinator and its worker processes (worker id -> Popen, log path)."""

    def __init__(self, cluster, model_dir: Path, draft_dir: Path, log_dir: Path):
        self.cluster, self.model_dir, self.draft_dir, self.log_dir = cluster, model_dir, draft_dir, log_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.started = 0

    def spawn(self) -> str:
        """Starts one more worker process; returns its id."""
        self.started += 1
        worker_id = f"w{self.started}"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "FLASHFLEET_OPENBLAS": "0"}
        with open(self.log_dir / f"{worker_id}.log", "wb") as log:
            self.procs[worker_id] = subprocess.Popen(
                [sys.executable, "-m", "worker", "--model", str(self.model_dir), "--model-name", MODEL,
                 "--draft", str(self.draft_dir), "--coordinator", self.cluster.address, "--worker-id", worker_id,
                 "--capacity", "2", "--drain-timeout", "1", "--log-level", "WARNING"],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        return worker_id

    def logs(self) -> str:
        return "\n".join(f"--- {w}:\n{(self.log_dir / f'{w}.log').read_text(errors='replace')[-1500:]}"
                         for w in self.procs)

    def live_ids(self) -> set[str]:
        """Ids of running processes whose registration the coordinator holds and can reach."""
        out = set()
        for worker_id, proc in self.procs.items():
            rec = self.cluster.coordinator.registry.get(worker_id)
            if proc.poll() is None and rec is not None and not rec.unreachable:
                out.add(worker_id)
        return out

    def ensure_two(self, timeout_s: float = 300.0) -> None:
        """Starts processes until two live workers are registered."""
        for _ in range(2 - len([p for p in self.procs.values() if p.poll() is None])):
            self.spawn()
        assert wait_until(lambda: len(self.live_ids()) == 2, timeout_s), self.logs()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.cluster.close()


@pytest.fixture(scope="module")
def fleet(tiny_models, dflash_dir, tmp_path_factory):
    # The lease outlasts the test: only the failed stream tells the coordinator a worker is gone.
    cluster = start_cluster({}, lease_ttl_s=120.0, migration=MigrationPolicy(enabled=False))
    f = Fleet(cluster, tiny_models.llama, dflash_dir, tmp_path_factory.mktemp("failover-logs"))
    try:
        yield f
    finally:
        f.stop()


def _failovers(fleet: Fleet) -> float:
    """Failovers counted so far, by either method (a KV state staged before the kill, or re-prefill)."""
    return sum(fleet.cluster.coordinator_registry.get_sample_value(
        "flashfleet_coordinator_migrations_total",
        {"model": MODEL, "reason": "failure", "outcome": "failover", "method": method}) or 0.0
        for method in ("kv", "reprefill"))


@pytest.mark.parametrize("mode", ["dflash", "plain"])
def test_greedy_stream_survives_kill_9_of_its_worker(fleet, mode):
    fleet.ensure_two()
    with Client(fleet.cluster.address) as client:
        ref = client.complete(MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, mode=mode, timeout_s=120)
        assert ref.finish_reason == "length" and len(ref.token_ids) == MAX_TOKENS, ref.finish_reason
        assert ref.stats.mode == mode and ref.stats.migrations == 0
        before = _failovers(fleet)

        stream = client.generate(MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, mode=mode,
                                 timeout_s=120)
        got = []
        while sum(len(c.token_ids) for c in got) < KILL_AFTER_TOKENS:
            got.append(next(stream))
        serving = [w for w in fleet.live_ids() if fleet.cluster.coordinator.registry.get(w).in_flight == 1]
        assert len(serving) == 1, serving
        victim = fleet.procs[serving[0]]
        victim.send_signal(signal.SIGKILL)
        got += list(stream)  # raises if the stream fails
        assert victim.wait(10) == -signal.SIGKILL

    tokens = [t for c in got for t in c.token_ids]
    last = got[-1]
    assert tokens == list(ref.token_ids), (len(tokens), fleet.logs())
    assert last.finish_reason == "length" and last.worker_id not in ("", serving[0])
    assert last.stats.migrations == 1 and last.stats.mode == mode
    assert last.served_by == (serving[0], last.worker_id)
    assert _failovers(fleet) == before + 1
