"""bench/h200's shell helpers that run on the GPU machine, tried here with stand-in files:
progress.sh splits a log's progress bars and keeps its milestones; wait.sh ends as soon as its
pattern shows up (exit 0), or after its limit (exit 1), and says which."""
import subprocess
import threading
import time
from pathlib import Path

H200 = Path(__file__).resolve().parents[1] / "bench" / "h200"


def _run(*args, timeout=60):
    return subprocess.run(["bash", *map(str, args)], capture_output=True, text=True, timeout=timeout)


def test_progress_keeps_milestones_printed_inside_a_bar(tmp_path):
    log = tmp_path / "job.log"
    log.write_text("job start\rtrain:  10%|#  | 1/10\rdata: 40117 sequences\rtrain:  20%|## | 2/10\r"
                   "val: step 500, tau 2.39\nnoise line\ncard: /root/res/x/training_card.json\n")
    r = _run(H200 / "progress.sh", log)
    assert r.stdout.splitlines() == ["data: 40117 sequences", "val: step 500, tau 2.39",
                                     "card: /root/res/x/training_card.json"], r.stdout


def test_wait_ends_when_the_pattern_appears_or_at_its_limit(tmp_path):
    f = tmp_path / "bench.txt"
    f.write_text("bench start\n")
    log = tmp_path / "job.log"
    log.write_text("card: done\n")
    threading.Timer(1.0, lambda: f.write_text("bench start\nbench end\n")).start()
    t0 = time.monotonic()
    r = _run(H200 / "wait.sh", 30, "bench end", f, log)
    assert r.returncode == 0 and time.monotonic() - t0 < 15, r.stdout
    assert "wait: 'bench end' in" in r.stdout and "card: done" in r.stdout
    t0 = time.monotonic()
    r = _run(H200 / "wait.sh", 1, "never", f, log)
    assert r.returncode == 1 and "wait: no 'never' in" in r.stdout and time.monotonic() - t0 < 15
    r = _run(H200 / "wait.sh", 1, "x", tmp_path / "missing.txt", tmp_path / "missing.log")
    assert r.returncode == 1 and "wait: no 'x' in" in r.stdout
    for bad in (["2m", "x", f], ["5", "x"]):
        r = _run(H200 / "wait.sh", *bad)
        assert r.returncode == 2 and "usage: wait.sh" in r.stderr