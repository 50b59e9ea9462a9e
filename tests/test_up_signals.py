"""`flashfleet up` and `LocalCluster` leave no process behind however they end: SIGHUP (the
terminal closed), a second Ctrl-C while the cluster stops (at once, not after the drain), Ctrl-C
while the workers load. The children run in sessions of their own, so nothing else stops them.
Here they are stand-ins (Python processes that sleep) started where LocalCluster starts its
coordinator and workers: only the supervision is under test."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Runs `flashfleet up` with stand-in children; prints "child PID" for each one it starts, which
# creates the file ready-PID once its signal handling is set.
UP_WITH_STAND_INS = r"""
import subprocess, sys
from flashfleet.cli import up

child = ("import os, pathlib, signal, time\n"
         + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if sys.argv[1] == "ignore-term" else "")
         + f"pathlib.Path({sys.argv[2]!r}, f'ready-{{os.getpid()}}').touch()\n"
         + "time.sleep(300)")
real_popen = subprocess.Popen

def popen(argv, **kw):
    proc = real_popen([sys.executable, "-c", child], start_new_session=True, stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL)  # not up's pipe: the test reads it to its end
    print("child", proc.pid, flush=True)
    return proc

up.subprocess.Popen = popen
up.LocalCluster._wait_ready = lambda self, timeout_s, progress, should_stop: None
sys.exit(up.main(["--workers", "1", "--port", "0", "--log-dir", sys.argv[2]]))
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def start_up(tmp_path: Path, children: str) -> tuple[subprocess.Popen, list[int]]:
    """`flashfleet up` with stand-in children ("ignore-term": they ignore SIGTERM, as a worker
    still draining its streams does), once it says the cluster is ready; and the children's pids."""
    # SIGHUP at its default, as in a terminal: a test run under nohup would pass its SIG_IGN on,
    # which `up` keeps (docs: a cluster started under nohup outlives its terminal).
    proc = subprocess.Popen([sys.executable, "-c", UP_WITH_STAND_INS, children, str(tmp_path)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    pids, lines = [], []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("child "):
            pids.append(int(line.split()[1]))
        if "Ctrl-C stops everything" in line:
            deadline = time.monotonic() + 30
            while not all((tmp_path / f"ready-{pid}").exists() for pid in pids):
                assert time.monotonic() < deadline, "the stand-in children did not start"
                time.sleep(0.05)
            return proc, pids
    raise AssertionError("".join(lines))


def finish(proc: subprocess.Popen, pids: list[int], within_s: float) -> tuple[int, str]:
    """(exit status, the rest of its output) of `up` once it exits within `within_s`; kills
    whatever is left either way."""
    try:
        out, _ = proc.communicate(timeout=within_s)
        return proc.returncode, out
    finally:
        proc.kill()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_up_stops_its_cluster_when_its_terminal_hangs_up(tmp_path):
    proc, pids = start_up(tmp_path, "exit-on-term")
    assert len(pids) == 2 and all(alive(p) for p in pids)  # the coordinator and one worker
    proc.send_signal(signal.SIGHUP)
    alive_after = []
    try:
        code, out = proc.wait(20), proc.stdout.read()
    finally:
        alive_after = [p for p in pids if alive(p)]
        finish(proc, pids, 1)
    assert code == 0 and "cluster stopped" in out, out
    assert alive_after == []


def test_a_second_ctrl_c_stops_up_at_once(tmp_path):
    """The first Ctrl-C lets streams finish (up to the workers' drain, 30 s); the second kills
    what is left at once, as `up` says."""
    proc, pids = start_up(tmp_path, "ignore-term")
    proc.send_signal(signal.SIGINT)
    assert "stopping cluster" in proc.stdout.readline()
    time.sleep(0.5)
    assert all(alive(p) for p in pids)  # draining: they ignore SIGTERM
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    alive_after = []
    try:
        code = proc.wait(10)
    finally:
        alive_after = [p for p in pids if alive(p)]
        finish(proc, pids, 1)
    assert code == 0 and time.monotonic() - started < 10
    assert alive_after == []


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt(), RuntimeError("startup failed")])
def test_local_cluster_stops_its_children_when_start_is_interrupted(tmp_path, monkeypatch, interrupt):
    """Ctrl-C while the workers load (KeyboardInterrupt in the wait; `flashfleet demo` has no
    handler of its own there), or any other error, stops every child started so far, also
    through `with LocalCluster(...)`, whose __exit__ never runs when __enter__ raises."""
    from flashfleet.cli import up

    children = []
    real_popen = subprocess.Popen

    def popen(argv, **kw):
        children.append(real_popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True))
        return children[-1]

    def wait_ready(self, timeout_s, progress, should_stop):
        raise interrupt

    monkeypatch.setattr(up.subprocess, "Popen", popen)
    monkeypatch.setattr(up.LocalCluster, "_wait_ready", wait_ready)
    try:
        with pytest.raises(type(interrupt)):
            with up.LocalCluster(workers=2, port=up.free_port(), log_dir=tmp_path):
                pytest.fail("the cluster started")
        assert len(children) == 3 and all(c.poll() is not None for c in children)
    finally:
        for c in children:
            c.kill()
            c.wait()
