"""One rank of the data-parallel trainer test (`test_training_distributed.py`), started by
`mlx.launch`: trains a tiny draft on this rank's own synthetic data and writes its weights, step
count and learning rates to OUT/rank{r}.*, so the test can compare the ranks.

    python tests/dp_rank.py OUT STEPS MAX_MINUTES STALL_S
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from test_training import _synthetic_dataset, tiny_llama  # noqa: E402
from worker.models.dflash_checkpoint import init_dflash_draft  # noqa: E402
from worker.training.distributed import broadcast_tree, world  # noqa: E402
from worker.training.config import TrainConfig  # noqa: E402
from worker.training.trainer import Trainer  # noqa: E402


def main() -> None:
    out, steps, minutes, stall = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
    group = world()
    rank = group.rank()
    target = tiny_llama()
    # Each rank its own data (and its own draft seed: the run must start from rank 0's weights).
    ds = _synthetic_dataset(n=12 + 4 * rank, seed=100 + rank)
    draft = init_dflash_draft(target, num_layers=1, block_size=8, seed=5 + rank, dtype=mx.float32)
    draft.update(broadcast_tree(draft.parameters(), group))
    cfg = TrainConfig(target="", prompts=[], out="", batch_size=4, anchors=6, steps=steps, compile=False,
                      progress=False, lr=3e-3, warmup=0.0, max_minutes=minutes or None)
    tr = Trainer(target, draft, ds, cfg, group)
    lrs = []
    step_fn = tr._build_step()

    def recorded(*inputs):
        lrs.append(tr.opt.learning_rate.item())
        if rank == 1 and stall:  # rank 1's clock runs ahead: the ranks must still agree
            time.sleep(stall)
        return step_fn(*inputs)

    tr._step_fn = recorded
    tr.run(log=lambda _: None)
    mx.save_safetensors(str(out / f"rank{rank}.safetensors"), dict(tree_flatten(tr.draft.parameters())))
    (out / f"rank{rank}.json").write_text(json.dumps({"step": tr.step, "lrs": lrs, "elapsed_s": tr.elapsed_s,
                                                      "history": tr.history}))


if __name__ == "__main__":
    main()
