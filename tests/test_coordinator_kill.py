"""Streams outlive their coordinator: two coordinator processes and two worker processes (each
registered with both) serve a tiny model; four SDK clients (one of them AsyncClient) stream greedy
requests, three through the first coordinator, which is SIGKILLed mid-stream (no drain, no Cancel
to the workers). Every stream completes with the token ids of the same requests run without a
kill, the stream that triggered the kill re-attaches through the second coordinator to the worker
still decoding it, the gap the client sees stays under 2 s, and the workers end with no session.

The same through `flashfleet up` (`LocalCluster`): its coordinator is killed, `tend` (polled as
`flashfleet up` polls it) starts it again on the same port, the workers register again and the
SDK's streams resume there, the gap the client sees under 2 s. On a host busy with other work the
new coordinator's start (imports, server set-up) waits for a CPU; the time it spent runnable but
not running (Linux schedstat) is taken out of that gap, so the bound stays 2 s for what the
restart itself takes: detecting the exit, starting, the worker's registration, the resume."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


from flashfleet import Client
from flashfleet.cli.restarts import RestartBackoff
from flashfleet.cli.up import TEND_INTERVAL_S, LocalCluster, free_port
from harness import wait_until

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny"
MAX_TOKENS = 240
KILL_AFTER_TOKENS = 20
PROMPTS = ["The river flows through the old town and", "Once upon a time a small robot",
           "In the middle of the night the", "The recipe calls for two cups of"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "FLASHFLEET_OPENBLAS": "0"}


class Procs:
    """Coordinator and worker processes of one test, with their logs."""

    def __init__(self, log_dir: Path):
        self.log_dir, self.procs = log_dir, {}

    def start(self, name: str, *args: str) -> subprocess.Popen:
        with open(self.log_dir / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, stdout=log,
                                                stderr=subprocess.STDOUT, env=ENV)
        return self.procs[name]

    def logs(self) -> str:
        return "\n".join(f"--- {n}:\n{(self.log_dir / f'{n}.log').read_text(errors='replace')[-1500:]}"
                         for n in self.procs)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _workers_on(address: str) -> int:
    try:
        with Client(address) as c:
            return len(c.cluster_status(timeout_s=2).workers)
    except Exception:
        return 0


def cpu_wait_s(proc: subprocess.Popen | None) -> tuple[int, float]:
    """(pid, seconds its threads have spent runnable but waiting for a CPU): Linux's
    /proc/<pid>/task/*/schedstat, the time a loaded host added to the process's work; 0 where
    that cannot be read (another OS, the process gone)."""
    if proc is None:
        return 0, 0.0
    total = 0
    try:
        for task in os.scandir(f"/proc/{proc.pid}/task"):
            with open(os.path.join(task.path, "schedstat")) as f:
                total += int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return proc.pid, total / 1e9


class Gaps:
    """The longest gap between a stream's chunks, and that gap less the time a watched process
    (the coordinator) spent waiting for a CPU within it (`cpu_wait_s`; the process may be
    replaced between chunks: a new one's whole wait falls in the gap)."""

    def __init__(self, watched=None):
        self.watched = watched  # () -> the process whose CPU wait is taken out, or None
        self.longest = self.longest_net = 0.0
        self._last: tuple[float, int, float] | None = None

    def chunk(self) -> None:
        now = time.monotonic()
        pid, waited = cpu_wait_s(self.watched()) if self.watched else (0, 0.0)
        if self._last is not None:
            then, last_pid, last_waited = self._last
            gap = now - then
            if gap > self.longest:
                self.longest = gap
                self.longest_net = gap - (waited - last_waited if pid == last_pid else waited)
        self._last = (now, pid, waited)


def _stream(addresses, prompt: str, request_id: str, out: dict, on_token=None, watched=None) -> None:
    """Streams one greedy request; records its token ids, the longest gap between chunks and that
    gap less `watched()`'s CPU wait in it (`Gaps`)."""
    ids, gaps = [], Gaps(watched)
    try:
        with Client(addresses, timeout_s=120) as client:
            for chunk in client.generate(MODEL, prompt, max_tokens=MAX_TOKENS, request_id=request_id):
                gaps.chunk()
                ids.extend(chunk.token_ids)
                if on_token is not None:
                    on_token(len(ids))
        out[request_id] = (ids, gaps.longest, chunk.finish_reason, gaps.longest_net)
    except Exception as e:  # reported by the test
        out[request_id] = e


def _stream_async(addresses, prompt: str, request_id: str, out: dict, on_token=None, watched=None) -> None:
    """`_stream` through AsyncClient."""
    import asyncio

    from flashfleet import AsyncClient

    async def run():
        ids, gaps = [], Gaps(watched)
        async with AsyncClient(addresses, timeout_s=120) as client:
            async for chunk in client.generate(MODEL, prompt, max_tokens=MAX_TOKENS, request_id=request_id):
                gaps.chunk()
                ids.extend(chunk.token_ids)
        return ids, gaps.longest, chunk.finish_reason, gaps.longest_net

    try:
        out[request_id] = asyncio.run(run())
    except Exception as e:  # reported by the test
        out[request_id] = e


def _run_all(clients: list[tuple[list[str], str]], tag: str, on_token=None, watched=None) -> dict:
    """Streams every (addresses, prompt) at once, the third through AsyncClient; the first
    calls `on_token` with its token count after each chunk; `watched` as in `Gaps`."""
    out: dict = {}
    threads = [threading.Thread(target=_stream_async if i == 2 else _stream,
                                args=(addrs, p, f"{tag}-{i}", out, on_token if i == 0 else None, watched))
               for i, (addrs, p) in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return out


def test_killing_a_coordinator_mid_stream_loses_no_token(tiny_models, tmp_path):
    procs = Procs(tmp_path)
    a, b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    try:
        for name, addr in (("coord-a", a), ("coord-b", b)):
            procs.start(name, "coordinator", "--port", addr.rsplit(":", 1)[1], "--no-migration",
                        "--log-level", "INFO")
        for w in ("w1", "w2"):
            procs.start(w, "worker", "--model", str(tiny_models.llama), "--model-name", MODEL,
                        "--coordinator", f"{a},{b}", "--worker-id", w, "--capacity", "4", "--log-level", "INFO")
        assert wait_until(lambda: _workers_on(a) == 2 and _workers_on(b) == 2, 300), procs.logs()
        # three clients start on coordinator a, one on b
        clients = [([a, b], PROMPTS[0]), ([a, b], PROMPTS[1]), ([a, b], PROMPTS[2]), ([b, a], PROMPTS[3])]
        reference = _run_all(clients, "ref")
        assert all(isinstance(r, tuple) for r in reference.values()), reference

        killed = threading.Event()

        def kill_a(tokens: int) -> None:
            if tokens >= KILL_AFTER_TOKENS and not killed.is_set():
                killed.set()
                procs.procs["coord-a"].send_signal(signal.SIGKILL)

        faulted = _run_all(clients, "kill", on_token=kill_a)
        assert killed.is_set() and procs.procs["coord-a"].wait(10) == -signal.SIGKILL
        for i in range(len(clients)):
            got, ref = faulted[f"kill-{i}"], reference[f"ref-{i}"]
            assert isinstance(got, tuple), (got, procs.logs())
            ids, gap, finish, _ = got
            print(f"stream {i}: {len(ids)} tokens, longest gap {gap:.2f} s")
            assert ids == ref[0] and finish == ref[2], (i, procs.logs())
            assert gap < 2.0, (i, gap)
        # every session ended on the workers: nothing running, nothing kept
        assert wait_until(lambda: _workers_on(b) == 2, 10)
        with Client(b) as c:
            assert wait_until(lambda: all(w.active_sessions == 0 for w in c.cluster_status().workers), 10)
        # the stream that saw the kill at its 20th token went on where it was, on the worker
        # still decoding it (the others re-attach too, or resume by re-prefill: same tokens)
        assert "request kill-0 re-attached to worker" in (tmp_path / "coord-b.log").read_text(), procs.logs()
    finally:
        procs.stop()


def test_a_coordinator_restarted_by_up_resumes_the_sdk_streams(tiny_models, tmp_path):
    cluster = LocalCluster(str(tiny_models.llama), workers=1, capacity=4, log_dir=tmp_path,
                           worker_args=("--model-name", MODEL))
    cluster.start(timeout_s=300, progress=lambda line: None)
    try:
        backoff = RestartBackoff()
        stop = threading.Event()

        def tend():
            while not stop.is_set():
                cluster.tend(backoff, say=lambda line: None)
                time.sleep(TEND_INTERVAL_S)

        reference = _run_all([([cluster.address], p) for p in PROMPTS[:2]], "ref")
        tender = threading.Thread(target=tend, daemon=True)
        tender.start()
        killed = threading.Event()
        first = cluster.procs["coordinator"]

        def kill(tokens: int) -> None:
            if tokens >= KILL_AFTER_TOKENS and not killed.is_set():
                killed.set()
                first.send_signal(signal.SIGKILL)

        faulted = _run_all([([cluster.address], p) for p in PROMPTS[:2]], "kill", on_token=kill,
                           watched=lambda: cluster.procs.get("coordinator"))
        stop.set()
        tender.join(5)
        assert killed.is_set() and first.wait(10) == -signal.SIGKILL
        assert cluster.procs["coordinator"] is not first and cluster.procs["coordinator"].poll() is None
        for i in range(2):
            got = faulted[f"kill-{i}"]
            assert isinstance(got, tuple), (got, (tmp_path / "coordinator.log").read_text()[-3000:])
            assert got[0] == reference[f"ref-{i}"][0]
            print(f"stream {i}: longest gap {got[1]:.2f} s across the coordinator's restart, "
                  f"{got[3]:.2f} s of it not spent by the new coordinator waiting for a CPU")
            # found exited, started again, listening, its worker registered, the stream resumed
            assert got[3] < 2.0, (tmp_path / "coordinator.log").read_text()[-3000:]
    finally:
        cluster.stop(grace_s=5)
