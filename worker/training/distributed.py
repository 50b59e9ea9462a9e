"""Data-parallel draft training over `mx.distributed` (one process per GPU or per Mac).

Started by `mlx.launch` (e.g. `mlx.launch -n 2 --backend nccl -- python -m flashfleet.cli.draft_cmd
train ...` on a host with two CUDA GPUs, or `--backend ring --hostfile hosts.json` over a Mac
mini fleet), every process runs the same `train_draft`: each answers its own share of the
prompts (`answers.build_dataset(shard=...)`), trains on it, and the gradients are averaged every step
(`mlx.nn.average_gradients`, as mlx-lm's LoRA trainer does), so all ranks hold the same weights.
Decisions that end or shape the run (stop on the time budget, the learning rate) come from
values all ranks agree on (averaged in the step's own all-reduce), so no rank waits forever in a
collective the others never issue.

Run as a single process (no launcher), `world()` is None and nothing here is used.
"""
from __future__ import annotations

import codecs
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence, TextIO

import mlx.core as mx
from mlx.utils import tree_map

def _launched() -> Optional[tuple[str, int]]:
    """(backend, expected process count) from the variables an MLX launcher sets in each process
    it starts, or None when none is set (a plain single process). Count 0: not known here.

    Raises:
        RuntimeError: a ring hostfile that cannot be read.
    """
    env = os.environ
    forced = env.get("FLASHFLEET_DIST_BACKEND")
    if env.get("NCCL_HOST_IP") and env.get("MLX_WORLD_SIZE"):  # mlx.launch --backend nccl
        return forced or "nccl", int(env["MLX_WORLD_SIZE"])
    if env.get("MLX_JACCL_COORDINATOR"):  # mlx.launch --backend jaccl / jaccl-ring
        return forced or "jaccl", 0
    if env.get("MLX_HOSTFILE"):  # mlx.launch --backend ring
        text = Path(env["MLX_HOSTFILE"]).read_text().strip() if Path(env["MLX_HOSTFILE"]).is_file() else ""
        try:
            hosts = json.loads(text) if text else []
        except ValueError as e:
            raise RuntimeError(f"MLX_HOSTFILE={env['MLX_HOSTFILE']}: not a JSON host list ({e})") from e
        return (forced or "ring", len(hosts)) if len(hosts) > 1 else None  # `-n 1`: no ring at all
    if env.get("OMPI_COMM_WORLD_SIZE"):  # mpirun
        return forced or "mpi", int(env["OMPI_COMM_WORLD_SIZE"])
    return None


def world() -> Optional[mx.distributed.Group]:
    """The group of training processes when started by a launcher with more than one process,
    else None (single process: no collective is ever called).

    The backend is the one the launcher set up (its variables say which; FLASHFLEET_DIST_BACKEND
    overrides): MLX's "any" could settle on another that comes up alone, e.g. an MPI library on
    the host, and every rank would then train by itself.

    Raises:
        RuntimeError: the backend did not come up, or gave another process count than launched.
    """
    launched = _launched()
    if launched is None:
        return None
    backend, expected = launched
    try:
        group = mx.distributed.init(strict=True, backend=backend)
    except Exception as e:  # noqa: BLE001 - MLX raises RuntimeError/ValueError by backend
        raise RuntimeError(f"distributed training: the {backend} backend did not start ({e}); "
                           "nccl needs MLX's CUDA build, ring a reachable host list") from e
    if expected and group.size() != expected:
        raise RuntimeError(f"distributed training: launched {expected} processes but the {backend} group has "
                           f"{group.size()}")
    return group if group.size() > 1 else None


def leave_gpu_headroom(group: Optional[mx.distributed.Group], headroom_gib: float = 12.0) -> Optional[int]:
    """Caps MLX's memory limit at the GPU's memory minus `headroom_gib` when several processes
    train on GPUs, and returns the new limit in bytes (None: nothing changed).

    Why: NCCL allocates its buffers outside MLX's allocator, so MLX's default limit can lie above
    what is really free; then a large step fails in cudaMalloc instead of MLX first releasing its
    buffer cache (seen once: out of memory at step 1,916 of a two-GPU run on H200s whose single
    GPU runs of the same settings never ran out). FLASHFLEET_GPU_HEADROOM_GIB overrides the amount.
    The device's memory is `device_info()`'s "memory_size" on Metal, "total_memory" on CUDA (reading
    only the Metal key left the cap unapplied on CUDA).
    """
    if group is None or mx.default_device() != mx.gpu:
        return None
    info = mx.device_info()
    size = info.get("memory_size") or info.get("total_memory")  # Metal's key, CUDA's key
    if not size:
        return None
    headroom = float(os.environ.get("FLASHFLEET_GPU_HEADROOM_GIB", headroom_gib))
    limit = int(min(mx.get_memory_limit(), size - headroom * 2**30))
    mx.set_memory_limit(limit)
    return limit


def rank_of(group: Optional[mx.distributed.Group]) -> int:
    return group.rank() if group is not None else 0


def size_of(group: Optional[mx.distributed.Group]) -> int:
    return group.size() if group is not None else 1


def agree_sum(values: Sequence[float], group: Optional[mx.distributed.Group],
              dtype: mx.Dtype = mx.float32) -> list:
    """Elementwise sum over ranks (a host sync), e.g. the sequence counts of each rank's data
    shard (`dtype=mx.int32`: exact up to 2**31). Only `all_sum` is used here and in the step:
    every backend (ring, nccl, mpi, jaccl) has it. Call it at the same point on every rank."""
    if group is None:
        return [float(v) if dtype == mx.float32 else int(v) for v in values]
    return mx.distributed.all_sum(mx.array(list(values), dtype=dtype), group=group).tolist()


def broadcast_tree(tree, group: Optional[mx.distributed.Group]):
    """Rank 0's arrays of `tree` on every rank (an all_sum of rank 0's values and zeros), so the
    run starts from one set of weights even if ranks initialised differently."""
    if group is None:
        return tree
    first = group.rank() == 0
    out = tree_map(lambda x: mx.distributed.all_sum(x if first else mx.zeros_like(x), group=group), tree)
    mx.eval(out)
    return out


_LAUNCH = "import sys; from mlx._distributed_utils.launch import main; sys.argv[0] = 'mlx.launch'; main()"
# What mlx.launch prints when a rank ends badly; its own exit status is 0 either way.
FAILED_RANK = re.compile(rb"Node with rank \d+ (exited with code|was killed)")


def default_backend() -> str:
    """nccl where MLX has CUDA, else ring (one host's CPU, or Macs)."""
    return "nccl" if mx.cuda.is_available() else "ring"


def _free_ports(n: int) -> int:
    """A port p with p .. p + n - 1 free on 127.0.0.1 (ring listens on one port per rank)."""
    for _ in range(100):
        socks = [socket.socket()]
        try:
            socks[0].bind(("127.0.0.1", 0))
            port = socks[0].getsockname()[1]
            for k in range(1, n):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", port + k))
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports on 127.0.0.1")


def launched() -> bool:
    """Whether this process was started by an MLX launcher (a rank of a distributed run)."""
    return _launched() is not None


def run_local_ranks(n: int, backend: str, command: Sequence[str], out: Optional[TextIO] = None) -> int:
    """Runs `command` as `n` ranks on this host through `mlx.launch` and returns 0 only if every
    rank exited 0 (mlx.launch itself exits 0 even when a rank failed; its output says so).

    The ranks' output (stdout and stderr, progress bars included) is copied to `out` (default
    stdout) as it comes. ring: ranks on 127.0.0.1 over free ports; nccl: rank i on GPU i.

    Args:
        n: number of ranks (>= 2).
        backend: an mlx.launch backend for one host ("ring" or "nccl").
        command: the program each rank runs, e.g. [sys.executable, "-m", "flashfleet.cli.draft_cmd", ...].

    Returns:
        0, or 1 when a rank failed or the launcher did.

    Raises:
        ValueError: nccl with CUDA_VISIBLE_DEVICES set to other GPUs than 0 .. n-1 (mlx.launch
            places rank i on GPU i and would silently ignore it).
    """
    out = out or sys.stdout
    argv = [sys.executable, "-c", _LAUNCH, "-n", str(n), "--backend", backend]
    if backend == "ring":
        argv += ["--starting-port", str(_free_ports(n))]
    elif backend == "nccl":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        if visible and visible.replace(" ", "").split(",")[:n] != [str(i) for i in range(n)]:
            raise ValueError(f"CUDA_VISIBLE_DEVICES={visible}: --processes puts rank i on GPU i; unset it, or run "
                             "mlx.launch yourself to choose GPUs")
        argv += ["--nccl-port", str(_free_ports(1))]
    env = {**os.environ, "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0")}
    proc = subprocess.Popen([*argv, "--", *command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    failed = copy_and_scan(proc.stdout, out)
    return 1 if proc.wait() != 0 or failed else 0


def copy_and_scan(stream, out: TextIO) -> bool:
    """Copies a byte stream (anything with `read1`) to the text stream `out` as it arrives and
    returns whether it reported a failed rank (`FAILED_RANK`). A UTF-8 character or the marker may
    be split across reads."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    tail, failed = b"", False
    while chunk := stream.read1(65536):
        out.write(decoder.decode(chunk))
        out.flush()
        buf = tail + chunk
        failed = failed or FAILED_RANK.search(buf) is not None
        tail = buf[-128:]
    out.write(decoder.decode(b"", final=True))
    return failed
