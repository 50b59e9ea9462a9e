"""bench/h200's shell helpers that run on the GPU machine, tried here with stand-in files:
progress.sh splits a log's progress bars and keeps its milestones; wait.sh ends as soon as its
pattern shows up (exit 0), or after its limit (exit 1), and says which; collect.sh splits what
is too big to come back in one file."""
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


def test_wait_on_the_job_log_stops_when_the_job_ended_without_the_pattern(tmp_path):
    """Session 15: the training died (CUDA OOM) and a 560 s wait for `saved: ` slept to its limit.
    A wait on the job's own log ends once `JOB DONE` is there (or no job runs), status 1, with the
    log's error lines; a pattern written before the end still counts (status 0)."""
    log = tmp_path / "job.log"
    log.write_text("taps: caching\nRuntimeError: cudaMallocAsync out of memory\nJOB DONE Q rc=1 10:28:32\n")
    t0 = time.monotonic()
    r = _run(H200 / "wait.sh", 300, "saved: ", log, log)
    assert r.returncode == 1 and time.monotonic() - t0 < 15, r.stdout
    assert "the job ended" in r.stdout and "JOB DONE Q rc=1" in r.stdout and "out of memory" in r.stdout
    log.write_text("saved: /root/res/Q\nJOB DONE Q rc=0\n")
    r = _run(H200 / "wait.sh", 300, "saved: ", log, log)
    assert r.returncode == 0 and "wait: 'saved: ' in" in r.stdout
    other = tmp_path / "bench.txt"  # not the job log: the benchmark runs after the job's end
    other.write_text("bench start\n")
    threading.Timer(2.5, lambda: other.write_text("bench start\nbench end\n")).start()
    r = _run(H200 / "wait.sh", 30, "bench end", other, log)
    assert r.returncode == 0, r.stdout

def test_collect_splits_a_draft_too_big_to_come_back_in_one_file(tmp_path):
    """Files come back from the GPU machine at most 16 MiB each: a draft packed over 15 MiB (a
    grown one is about 20) is split into .partaa, .partab, ... that join to the whole draft."""
    import os

    res, out = tmp_path / "res", tmp_path / "out"
    (res / "Big").mkdir(parents=True)
    (res / "Big" / "config.json").write_text("{}")
    (res / "Big" / "model.safetensors").write_bytes(os.urandom(17 * 2**20))  # incompressible
    r = subprocess.run(["bash", str(H200 / "collect.sh")], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OUT": str(out), "RES": str(res), "WORK_ROOT": str(tmp_path / "none"),
                            "KERNELS": "0", "DATA": "0"})
    assert r.returncode == 0, r.stderr
    parts = sorted(out.glob("draft-Big.tgz.part*"))
    assert len(parts) == 2 and not (out / "draft-Big.tgz").exists()
    assert all(p.stat().st_size <= 15 * 2**20 for p in parts)
    joined = subprocess.run(f"cat {' '.join(map(str, parts))} | tar tzf -", shell=True, capture_output=True,
                            text=True, timeout=60)
    assert joined.returncode == 0 and "Big/model.safetensors" in joined.stdout
