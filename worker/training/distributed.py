"""Data-parallel draft training over `mx.distributed` (one process per GPU or per Mac).

Started by `mlx.launch` (e.g. `mlx.launch -n 2 --backend nccl -- python -m flashfleet.cli.draft_cmd
train ...` on a host with two CUDA GPUs, or `--backend ring --hostfile hosts.json` over a Mac
mini fleet), every process runs the same `train_draft`: each answers its own share of the
prompts (`data.build_dataset(shard=...)`), trains on it, and the gradients are averaged every step
(`mlx.nn.average_gradients`, as mlx-lm's LoRA trainer does), so all ranks hold the same weights.
Decisions that end or shape the run (stop on the time budget, the learning rate) come from
values all ranks agree on (averaged in the step's own all-reduce), so no rank waits forever in a
collective the others never issue.

Run as a single process (no launcher), `world()` is None and nothing here is used.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import mlx.core as mx
from mlx.utils import tree_map

# Variables the MLX launchers set in each process they start (ring/jaccl: MLX_RANK + hostfile;
# nccl: MLX_WORLD_SIZE; mpirun: OMPI_*).
_LAUNCH_VARS = ("MLX_WORLD_SIZE", "MLX_HOSTFILE", "MLX_JACCL_COORDINATOR", "OMPI_COMM_WORLD_SIZE")


def world() -> Optional[mx.distributed.Group]:
    """The group of training processes when started by a launcher with more than one process,
    else None (single process: no collective is ever called).

    Raises:
        RuntimeError: a launcher's variables are set but no distributed backend came up.
    """
    if not any(os.environ.get(v) for v in _LAUNCH_VARS):
        return None
    # Name the backend mlx.launch set up: "any" may settle on another one that comes up alone
    # (an MPI library on the host, say) and give a group of one.
    backend = os.environ.get("FLASHFLEET_DIST_BACKEND") or ("nccl" if os.environ.get("NCCL_HOST_IP") else "any")
    group = mx.distributed.init(backend=backend)
    if group.size() == 1 and int(os.environ.get("MLX_WORLD_SIZE", "1")) > 1:
        raise RuntimeError("distributed training was launched with MLX_WORLD_SIZE="
                           f"{os.environ['MLX_WORLD_SIZE']} but mx.distributed.init() gave one process; "
                           "check the backend (nccl needs MLX's CUDA build)")
    return group if group.size() > 1 else None


def rank_of(group: Optional[mx.distributed.Group]) -> int:
    return group.rank() if group is not None else 0


def size_of(group: Optional[mx.distributed.Group]) -> int:
    return group.size() if group is not None else 1


def agree_sum(values: Sequence[float], group: Optional[mx.distributed.Group]) -> list[float]:
    """Elementwise sum over ranks (a host sync), e.g. the sequence counts of each rank's data
    shard. Only `all_sum` is used here and in the step: every backend (ring, nccl, mpi, jaccl)
    has it. Call it at the same point of the run on every rank."""
    if group is None:
        return [float(v) for v in values]
    out = mx.distributed.all_sum(mx.array(list(values), dtype=mx.float32), group=group)
    return out.tolist()


def broadcast_tree(tree, group: Optional[mx.distributed.Group]):
    """Rank 0's arrays of `tree` on every rank (an all_sum of rank 0's values and zeros), so the
    run starts from one set of weights even if ranks initialised differently."""
    if group is None:
        return tree
    first = group.rank() == 0
    out = tree_map(lambda x: mx.distributed.all_sum(x if first else mx.zeros_like(x), group=group), tree)
    mx.eval(out)
    return out
