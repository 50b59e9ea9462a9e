"""How well a DFlash draft predicts answers it trained on vs answers it never saw (teacher-forced).

Reads data caches (`WORK/data` of a training run, or what `bench/h200/collect.sh` brings back),
groups their sequences by corpus and by origin (rows an earlier run added through --extra-data
carry `extraK:` id prefixes, one per run that carried them), takes the same number from each group and prints the draft's
loss and teacher-forced tau per group (`worker.training.validation.Validator`, the numbers a
training run logs as `val:`). A draft whose tau is much higher on the groups it trained on than
on new ones is bound by its data, not its steps:

    python bench/validation_gap.py --target MODEL_DIR --draft DRAFT_DIR... --data DATA_DIR... \
        [--groups synthetic extra0:synthetic code_tasks] [--per-group 16] [--anchors 32] \
        [--val-fraction 0.005]

Several drafts are measured on the same sequences and anchors (one table row per group and
draft; the last column numbers the draft), which compares a new draft with the one it started
from. `--val-fraction F` keeps only the rows a training run with the same `--val-fraction` held
out of its training (by prompt hash, `worker.training.validation`): no draft trained on them in
that run, but an older draft may have in earlier runs (before validation existed, every row was
trained on), so only the groups new to every draft compared are a fair comparison.

A quantized draft is dequantized to float32 first. Memory: the draft's logits of one batch are
batch x anchors x (B-1) x vocab floats (4 x 32 x 15 x 152K x 4 bytes = 1.2 GB on a Qwen2.5
target), so keep --batch-size small on a CPU.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def group_of(row: dict) -> str:
    """A row's group: its corpus, prefixed by the `extraK:` markers of the runs that carried it
    over (`extra0:extra0:synthetic`: added two runs ago, carried on by the last one)."""
    head = row["id"].split("/", 1)[0]
    return (head.rsplit(":", 1)[0] + ":" if ":" in head else "") + row["corpus"]


def main(argv=None) -> int:
    import mlx.core as mx
    import numpy as np

    from bench.bench_dflash import load_model
    from worker.models.dflash_checkpoint import DraftCheckpointError, dequantized_weights, load_dflash_draft
    from worker.training.data import TokenDataset
    from worker.training.defaults import DraftSpec, make_draft
    from worker.training.extra_data import cache_rows
    from worker.training.train import Trainer, TrainConfig
    from worker.training.validation import Validator, prompt_hash

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", nargs="+", required=True, help="draft directories, measured on the same rows")
    ap.add_argument("--data", nargs="+", required=True, help="data cache directories (train.jsonl[.xz|.gz])")
    ap.add_argument("--groups", nargs="+", default=None, help="groups to measure (default: all)")
    ap.add_argument("--per-group", type=int, default=16, help="sequences per group (random, --seed)")
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--val-fraction", type=float, default=None,
                    help="only the rows a training run with this --val-fraction held out of training")
    a = ap.parse_args(argv)
    if a.per_group < 1 or a.anchors < 1 or a.batch_size < 1:
        ap.error("--per-group, --anchors and --batch-size: at least 1")
    if a.val_fraction is not None and not 0 < a.val_fraction < 1:
        ap.error("--val-fraction: between 0 and 1 (exclusive)")

    from worker.training.data import DataError

    groups: dict[str, list[dict]] = {}
    try:
        for d in a.data:
            for row in cache_rows(d):
                if a.val_fraction is None or prompt_hash(row["prompt_ids"]) < a.val_fraction:
                    groups.setdefault(group_of(row), []).append(row)
    except DataError as e:
        ap.error(str(e).replace("--extra-data ", "--data ", 1))
    names = a.groups if a.groups is not None else sorted(groups)
    missing = [g for g in names if g not in groups]
    held = "" if a.val_fraction is None else f" held out at --val-fraction {a.val_fraction}"
    if not groups:
        ap.error(f"no rows{held} in --data")
    if missing:
        ap.error(f"no rows{held} in group(s) {missing}; the data has {sorted(groups)}")
    for d in a.draft:
        if not Path(d, "config.json").is_file():
            ap.error(f"--draft {d}: no config.json there (a DFlash draft directory)")

    target, _ = load_model(a.target, False, None, tokenizer=False)
    loaded = []
    for d in a.draft:  # every draft checked before minutes are spent measuring the first
        try:
            loaded.append(load_dflash_draft(d, target))
        except DraftCheckpointError as e:
            ap.error(f"--draft {d}: {e}")

    def float_draft(init):
        """The draft dequantized into a float32 model built like a training run's."""
        args = init.args
        spec = DraftSpec(args.num_hidden_layers, args.block_size, list(args.dflash_config["target_layer_ids"]),
                         int(args.dflash_config["mask_token_id"]), args.intermediate_size)
        draft = make_draft(target, spec, 0, from_target=False)
        draft.load_weights(list(dequantized_weights(init).items()), strict=True)
        mx.eval(draft.parameters())
        return draft

    rng = np.random.default_rng(a.seed)
    picked = {}
    for g in names:
        rows = groups[g]
        take = rng.choice(len(rows), size=min(a.per_group, len(rows)), replace=False)
        ds = TokenDataset()
        for i in sorted(take.tolist()):
            r = rows[i]
            ds.prompt_ids.append(r["prompt_ids"]), ds.response_ids.append(r["response_ids"])
            ds.corpus.append(g), ds.ids.append(r["id"])
        picked[g] = ds
    cfg = TrainConfig(target=a.target, prompts=[], out="", batch_size=a.batch_size, anchors=a.anchors, steps=1,
                      seed=a.seed, compile=False, progress=False, compute_dtype="float32", cache_taps_gib=0)
    drafts = ", ".join(f"[{k}] {d}" for k, d in enumerate(a.draft, 1))
    print(f"target {a.target}; drafts {drafts} (dequantized, float32); {a.anchors} anchors per sequence, "
          f"block {'/'.join(str(d.args.block_size) for d in loaded)}; device {mx.default_device()}")
    print(f"{'group':<30} {'rows':>6} {'seqs':>5} {'blocks':>7} {'loss':>7} {'tau':>6} {'s':>6} {'draft':>5}")
    for k, init in enumerate(loaded, 1):
        draft = float_draft(init)
        trainer = Trainer(target, draft, picked[names[0]], cfg)  # same seed: the same anchors per draft
        for g in names:
            t0 = time.perf_counter()
            res = Validator(trainer, picked[g]).run()
            if res is None:  # no block with a label: answers of fewer than 2 tokens
                print(f"{g:<30} {len(groups[g]):>6} {len(picked[g]):>5} {0:>7}  (no answer long enough to measure) "
                      f"{k:>5}")
                continue
            print(f"{g:<30} {len(groups[g]):>6} {res.sequences:>5} {res.blocks:>7} {res.loss:>7.3f} {res.tau:>6.2f} "
                  f"{time.perf_counter() - t0:>6.0f} {k:>5}", flush=True)
        del trainer, draft
    return 0


if __name__ == "__main__":
    sys.exit(main())
