"""Streams outlive their coordinator: two coordinator processes and two worker processes (each
registered with both) serve a tiny model; four SDK clients (one of them AsyncClient) stream greedy
requests, three through the first coordinator, which is SIGKILLed mid-stream (no drain, no Cancel
to the workers). Every stream completes with the token ids of the same requests run without a
kill, the stream that triggered the kill re-attaches through the second coordinator to the worker
still decoding it, the gap the client sees stays under 2 s, and the workers end with no session.

The same through `flashfleet up` (`LocalCluster`): its coordinator is killed, `tend` (polled as
`flashfleet up` polls it) starts it again on the same port, the workers register again and the
SDK's streams resume there, the gap the client sees under 2 s."""
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


def _stream(addresses, prompt: str, request_id: str, out: dict, on_token=None) -> None:
    """Streams one greedy request; records its token ids and the longest gap between chunks."""
    ids, gaps, last = [], [], None
    try:
        with Client(addresses, timeout_s=120) as client:
            for chunk in client.generate(MODEL, prompt, max_tokens=MAX_TOKENS, request_id=request_id):
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now
                ids.extend(chunk.token_ids)
                if on_token is not None:
                    on_token(len(ids))
        out[request_id] = (ids, max(gaps, default=0.0), chunk.finish_reason)
    except Exception as e:  # reported by the test
        out[request_id] = e


def _stream_async(addresses, prompt: str, request_id: str, out: dict, on_token=None) -> None:
    """`_stream` through AsyncClient."""
    import asyncio

    from flashfleet import AsyncClient

    async def run():
        ids, gaps, last = [], [], None
        async with AsyncClient(addresses, timeout_s=120) as client:
            async for chunk in client.generate(MODEL, prompt, max_tokens=MAX_TOKENS, request_id=request_id):
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now
                ids.extend(chunk.token_ids)
        return ids, max(gaps, default=0.0), chunk.finish_reason

    try:
        out[request_id] = asyncio.run(run())
    except Exception as e:  # reported by the test
        out[request_id] = e


def _run_all(clients: list[tuple[list[str], str]], tag: str, on_token=None) -> dict:
    """Streams every (addresses, prompt) at once, the third through AsyncClient; the first
    calls `on_token` with its token count after each chunk."""
    out: dict = {}
    threads = [threading.Thread(target=_stream_async if i == 2 else _stream,
                                args=(addrs, p, f"{tag}-{i}", out, on_token if i == 0 else None))
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
            ids, gap, finish = got
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

        faulted = _run_all([([cluster.address], p) for p in PROMPTS[:2]], "kill", on_token=kill)
        stop.set()
        tender.join(5)
        assert killed.is_set() and first.wait(10) == -signal.SIGKILL
        assert cluster.procs["coordinator"] is not first and cluster.procs["coordinator"].poll() is None
        for i in range(2):
            got = faulted[f"kill-{i}"]
            assert isinstance(got, tuple), (got, (tmp_path / "coordinator.log").read_text()[-3000:])
            assert got[0] == reference[f"ref-{i}"][0]
            print(f"stream {i}: longest gap {got[1]:.2f} s across the coordinator's restart")
            # found exited, started again, listening, its worker registered, the stream resumed
            assert got[1] < 2.0, (tmp_path / "coordinator.log").read_text()[-3000:]
    finally:
        cluster.stop(grace_s=5)
