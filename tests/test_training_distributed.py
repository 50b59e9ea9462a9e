"""Data-parallel draft training (`worker/training/distributed.py`): two processes started by
`mlx.launch` (ring backend over localhost, on the CPU) must average their gradients, stay on the
same weights, learning rates and stopping step, and split the data generation between them.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten, tree_map

from test_training import _synthetic_dataset, _write_prompts, tiny_llama
from worker.models.dflash_checkpoint import init_dflash_draft, load_dflash_draft
from worker.training.data import read_prompt_files, split_heldout
from worker.training.distributed import _LAUNCH, _free_ports
from worker.training.config import TrainConfig
from worker.training.trainer import Trainer

HERE = Path(__file__).resolve().parent


def _launch(*command: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """Runs `command` as 2 ranks on this host (ring backend) and checks that both exited 0:
    mlx.launch itself exits 0 either way, and reports a failed rank only in its output."""
    argv = [sys.executable, "-c", _LAUNCH, "-n", "2", "--backend", "ring", "--starting-port", str(_free_ports(2)),
            "--", sys.executable, *command]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=HERE.parent)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "exited with code" not in out and "Traceback" not in out, out[-3000:]
    return r


def _params(path: Path) -> dict:
    return mx.load(str(path))


def test_ranks_average_gradients_and_stay_in_step(tmp_path):
    # One step, no warmup: the result must be exactly one AdamW step on the mean of the two
    # ranks' gradients (each rank's own data), from rank 0's initial weights.
    _launch(str(HERE / "dp_rank.py"), str(tmp_path), "1", "0", "0")
    a, b = _params(tmp_path / "rank0.safetensors"), _params(tmp_path / "rank1.safetensors")
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)

    target = tiny_llama()
    trainers = []
    for rank in (0, 1):
        cfg = TrainConfig(target="", prompts=[], out="", batch_size=4, anchors=6, steps=1, compile=False,
                          progress=False, lr=3e-3, warmup=0.0)
        draft = init_dflash_draft(target, num_layers=1, block_size=8, seed=5, dtype=mx.float32)  # rank 0's init
        trainers.append(Trainer(target, draft, _synthetic_dataset(n=12 + 4 * rank, seed=100 + rank), cfg))
    grads = [nn.value_and_grad(t.draft, t._loss)(*t.batch(0)[0])[1] for t in trainers]
    mean = tree_map(lambda x, y: (x + y) / 2, *grads)
    mean, _ = optim.clip_grad_norm(mean, trainers[0].cfg.grad_clip)
    ref = trainers[0]
    ref.opt.learning_rate = ref.cfg.lr
    ref.opt.update(ref.draft, mean)
    want = dict(tree_flatten(ref.draft.parameters()))
    moved = 0
    for k, v in want.items():
        assert mx.allclose(a[k], v, atol=1e-5).item(), k
        moved += int(not mx.allclose(a[k], dict(tree_flatten(trainers[1].draft.parameters()))[k]).item())
    assert moved > 0  # the step changed the weights


def test_ranks_stop_together_with_one_learning_rate_under_a_time_budget(tmp_path):
    # Rank 1 stalls every step, so the two wall clocks differ; the decisions must not.
    _launch(str(HERE / "dp_rank.py"), str(tmp_path), "100000", "0.03", "0.05")
    runs = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1)]
    assert runs[0]["step"] == runs[1]["step"] > 3
    assert runs[0]["lrs"] == runs[1]["lrs"]
    assert runs[0]["elapsed_s"] == runs[1]["elapsed_s"] >= 0.03 * 60 * 0.9
    a, b = _params(tmp_path / "rank0.safetensors"), _params(tmp_path / "rank1.safetensors")
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)
    hist = runs[0]["history"]
    assert hist[-1]["loss"] < hist[0]["loss"]


def test_cli_train_under_mlx_launch_splits_the_data_and_writes_one_draft(tmp_path, tiny_models, capsys):
    from mlx_lm import load

    from flashfleet.cli.draft_cmd import main

    files = _write_prompts(tmp_path)
    out, work = tmp_path / "draft", tmp_path / "work"
    argv = ["-m", "flashfleet.cli.draft_cmd", "train", "--target", str(tiny_models.llama),
            "--prompts", *map(str, files), "--out", str(out), "--work-dir", str(work),
            "--max-new-tokens", "12", "--steps", "4", "--batch-size", "2", "--anchors", "4", "--block-size", "4",
            "--heldout-per-corpus", "2", "--heldout-fraction", "0.2", "--eval-max-new-tokens", "8",
            "--gen-samples", "2", "--synthetic-prompts", "6", "--no-compile", "--quiet"]
    r = _launch(*argv)
    assert "data parallel over 2 processes" in r.stdout

    shards = []
    for rank in (0, 1):
        meta = json.loads((work / f"data-rank{rank}of2" / "meta.json").read_text())
        assert meta["shard"] == [rank, 2]
        rows = (work / f"data-rank{rank}of2" / "train.jsonl").read_text().splitlines()
        ids = {json.loads(line)["id"] for line in rows}
        assert len(ids) == meta["train_sequences"] > 0
        # Each rank writes and answers its own share (3 of 6) of the synthetic prompts.
        mine = {i for i in ids if i.startswith("synthetic/")}
        assert 0 < len(mine) <= meta["synthetic_prompts_written"] <= 3
        assert all(i.startswith(f"synthetic/{rank}/") for i in mine)
        shards.append(ids - mine)
    train, _ = split_heldout(read_prompt_files(files), 2, 0.2)
    # Greedy pass and sampled pass alike: the two ranks split every prompt between them.
    every = {p.id for p in train} | {f"{p.id}#sample1" for p in train}
    assert shards[0].isdisjoint(shards[1])
    assert shards[0] | shards[1] <= every
    assert len(shards[0]) + len(shards[1]) >= len(every) - 4  # only answers under 2 tokens dropped
    assert any(i.endswith("#sample1") for i in shards[0]) and any(i.endswith("#sample1") for i in shards[1])

    card = json.loads((out / "training_card.json").read_text())
    assert card["training"]["processes"] == 2 and card["training"]["steps"] == 4
    curve_steps = [c["step"] for c in card["training"]["curve"]]
    assert curve_steps == sorted(set(curve_steps)) and curve_steps[-1] == 4  # the last point once
    synthetic = card["data"]["corpora"]["synthetic"]
    assert card["data"]["train_sequences"] == len(shards[0]) + len(shards[1]) + synthetic
    assert sum(card["data"]["corpora"].values()) == card["data"]["train_sequences"]
    assert synthetic <= card["data"]["synthetic_prompts_written"] <= 6  # summed over the ranks
    state = json.loads((work / "resume" / "state.json").read_text())
    assert state["world_size"] == 2
    target, _ = load(str(tiny_models.llama))
    assert load_dflash_draft(out, target).block_size == 4

    # Starting over (--no-resume) clears the old checkpoint once, not once per rank; this time
    # the command starts its own ranks (--processes).
    fresh = [*argv[2:argv.index("--steps") + 1], "2", *argv[argv.index("--steps") + 2:], "--no-resume"]
    assert main([*fresh, "--proc=2", "--back", "ring"]) == 0  # abbreviations argparse accepts work too
    assert json.loads((work / "resume" / "state.json").read_text())["step"] == 2
    assert json.loads((out / "training_card.json").read_text())["training"]["processes"] == 2
    # Inputs the launcher can check are checked once, before any rank starts: one message, exit 2.
    t = fresh.index("--target") + 1

    def with_target(path):
        return [*fresh[:t], str(path), *fresh[t + 1:], "--processes", "2", "--backend", "ring"]

    capsys.readouterr()
    assert main(with_target(tmp_path / "no-model")) == 2
    err = capsys.readouterr().err
    assert err.count("no-model") == 1 and "processes over" not in err, err  # no rank was started
    p = fresh.index("--prompts") + 1
    bad_prompts = tmp_path / "bad.jsonl"
    bad_prompts.write_text("{not json\n")
    assert main([*fresh[:p], str(bad_prompts), *fresh[p + 1:], "--processes", "2"]) == 2
    assert capsys.readouterr().err.count("invalid JSON") == 1
    # A failing rank fails the command (mlx.launch alone would exit 0): a model directory whose
    # config passes the launcher's check but whose weights are missing.
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    for f in Path(tiny_models.llama).iterdir():
        if not f.name.endswith(".safetensors"):
            (no_weights / f.name).write_bytes(f.read_bytes())
    assert main(with_target(no_weights)) == 1
    # One process cannot resume a checkpoint of two: each rank's data shard would change.
    single = [a for a in argv[2:]]
    single[single.index("--steps") + 1] = "6"
    assert main(single) == 2


# --------------------------------------------------------------------------- launcher detection, GPU memory

_LAUNCH_ENV = ("MLX_WORLD_SIZE", "NCCL_HOST_IP", "MLX_HOSTFILE", "MLX_JACCL_COORDINATOR", "OMPI_COMM_WORLD_SIZE",
               "FLASHFLEET_DIST_BACKEND")


def test_launcher_variables_name_the_backend_and_the_process_count(tmp_path, monkeypatch):
    from worker.training import distributed as dist

    for v in _LAUNCH_ENV:
        monkeypatch.delenv(v, raising=False)
    assert dist._launched() is None and dist.world() is None  # a plain process: no collectives

    monkeypatch.setenv("NCCL_HOST_IP", "127.0.0.1")
    monkeypatch.setenv("MLX_WORLD_SIZE", "2")
    assert dist._launched() == ("nccl", 2)
    monkeypatch.setenv("FLASHFLEET_DIST_BACKEND", "mpi")
    assert dist._launched() == ("mpi", 2)
    from flashfleet.cli.draft_cmd import main  # a rank must not start ranks of its own

    assert main(["train", "--target", "t", "--prompts", "p", "--out", str(tmp_path / "o"), "--processes", "2"]) == 2
    for v in _LAUNCH_ENV:
        monkeypatch.delenv(v, raising=False)

    hosts = tmp_path / "hosts.json"
    monkeypatch.setenv("MLX_HOSTFILE", str(hosts))
    hosts.write_text(json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"]]))
    assert dist._launched() == ("ring", 2)
    hosts.write_text("")  # mlx.launch -n 1 writes no host list: one process, no ring
    assert dist._launched() is None
    hosts.write_text("{not json")
    with pytest.raises(RuntimeError, match="MLX_HOSTFILE"):
        dist._launched()


class _Group:
    def size(self):
        return 2


def test_gpu_headroom_caps_the_memory_limit_below_the_device_memory(monkeypatch):
    from worker.training import distributed as dist

    limits = []
    monkeypatch.setattr(dist.mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr(dist.mx, "device_info", lambda: {"memory_size": 100 * 2**30})
    monkeypatch.setattr(dist.mx, "get_memory_limit", lambda: 95 * 2**30)
    monkeypatch.setattr(dist.mx, "set_memory_limit", limits.append)
    monkeypatch.delenv("FLASHFLEET_GPU_HEADROOM_GIB", raising=False)
    assert dist.leave_gpu_headroom(_Group()) == 88 * 2**30 and limits == [88 * 2**30]
    monkeypatch.setenv("FLASHFLEET_GPU_HEADROOM_GIB", "2")
    assert dist.leave_gpu_headroom(_Group()) == 95 * 2**30  # never above MLX's own limit
    assert dist.leave_gpu_headroom(None) is None  # one process: MLX's default stands
    monkeypatch.setattr(dist.mx, "device_info", lambda: {"total_memory": 100 * 2**30, "free_memory": 1})  # CUDA's key
    monkeypatch.delenv("FLASHFLEET_GPU_HEADROOM_GIB")
    assert dist.leave_gpu_headroom(_Group()) == 88 * 2**30 and limits[-1] == 88 * 2**30
    monkeypatch.setattr(dist.mx, "default_device", lambda: mx.Device(mx.cpu))
    assert dist.leave_gpu_headroom(_Group()) is None and len(limits) == 3


class _Chunks:
    """A byte stream whose reads return the given chunks one by one."""

    def __init__(self, *chunks: bytes):
        self.chunks = list(chunks)

    def read1(self, _n: int) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""


def test_rank_output_is_copied_whole_and_failures_are_seen_across_reads():
    import io

    from worker.training.distributed import copy_and_scan

    bar = "train: 50%|█████|".encode()
    cut = bar.index("█".encode()) + 1  # inside the 3-byte character
    out = io.StringIO()
    assert not copy_and_scan(_Chunks(bar[:cut], bar[cut:], b" rank 0 says: exited with code 0 is text\n"), out)
    assert out.getvalue().startswith("train: 50%|█████|")
    marker = b"[WARN] Node with rank 1 exited with code 2\n"
    assert copy_and_scan(_Chunks(b"log\n" + marker[:20], marker[20:] + b"x" * 5000), io.StringIO())
    assert copy_and_scan(_Chunks(marker + b"x" * 70000), io.StringIO())


def test_processes_on_gpus_refuse_a_gpu_selection_they_would_ignore(monkeypatch):
    from worker.training.distributed import run_local_ranks

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    with pytest.raises(ValueError, match="rank i on GPU i"):
        run_local_ranks(2, "nccl", [sys.executable, "-c", "pass"])
