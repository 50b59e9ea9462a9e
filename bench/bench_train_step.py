"""Training throughput of `flashfleet draft train` with and without length classes, side by side.

Runs the same trainer on the same cached data (a `WORK/data` directory written by `flashfleet
draft train`) for a few steps per setting and prints supervised block positions per second:

    python bench/bench_train_step.py --target MODEL_DIR --data WORK/data [--steps 20 --batch-size 8
        --anchors 8 --buckets 1 4 --cache-taps]

Each setting gets a fresh draft (same seed) and one untimed warm-up step per batch width (each
new width compiles); the timed steps are the second epoch's first ones. With
--cache-taps the taps of every sequence are computed first (not timed), so the step time is the
draft alone; without, every step runs the target over its batch (online).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    import mlx.core as mx

    from worker.training.sequences import TokenDataset
    from worker.training.defaults import choose_draft_spec, make_draft
    from worker.training.config import TrainConfig, resolve_dtype
    from worker.training.target import load_target
    from worker.training.trainer import Trainer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", required=True, type=Path, help="a WORK/data directory (train.jsonl)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--anchors", type=int, default=8)
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--buckets", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--cache-taps", action="store_true")
    ap.add_argument("--cut-responses", action="store_true",
                    help="cut each response at a random length (seed 0) for a wider length spread, as in "
                         "data where many answers end early with EOS")
    a = ap.parse_args(argv)

    target, tokenizer = load_target(Path(a.target), resolve_dtype("auto"))
    ds = TokenDataset.load(a.data / "train.jsonl")
    if a.cut_responses:
        import numpy as np

        rng = np.random.default_rng(0)
        ds.response_ids = [r[: int(rng.integers(2, len(r) + 1))] for r in ds.response_ids]
    used = {t for r in ds.prompt_ids + ds.response_ids for t in r}
    spec = choose_draft_spec(target, tokenizer, used, draft_layers=a.draft_layers, num_taps=4)
    lengths = [len(p) + len(r) for p, r in zip(ds.prompt_ids, ds.response_ids)]
    print(f"{len(ds)} sequences, lengths {min(lengths)}-{max(lengths)} (mean {sum(lengths) / len(lengths):.0f}); "
          f"batch {a.batch_size} x {a.anchors} anchors; taps {'cached' if a.cache_taps else 'online'}; "
          f"device {mx.default_device()}", flush=True)
    rows = []
    for k in a.buckets:
        cfg = TrainConfig(target="", prompts=[], out="", batch_size=a.batch_size, anchors=a.anchors,
                          steps=a.steps + 1, length_buckets=k, progress=False)
        tr = Trainer(target, make_draft(target, spec, 0), ds, cfg)
        if a.cache_taps:
            tr.precompute_taps(progress=False)
        step_fn = tr._build_step()
        clock = mx.zeros(2)  # the step's run-clock input (used by data-parallel runs only)
        warm = {}  # one untimed step per batch width: each new width compiles
        for step in range(tr.per_epoch):
            warm.setdefault(tr.batch(step)[0][0].shape[1], step)
        for step in warm.values():
            mx.eval(step_fn(*tr.batch(step)[0], clock), tr.draft.parameters(), tr.opt.state)
        labels_total, secs = 0, 0.0
        for step in range(tr.per_epoch, tr.per_epoch + a.steps):  # the next epoch's batches
            inputs, labels, _, _ = tr.batch(step)
            t0 = time.perf_counter()
            mx.eval(step_fn(*inputs, clock), tr.draft.parameters(), tr.opt.state)
            secs += time.perf_counter() - t0
            labels_total += labels
        rows.append(dict(buckets=k, widths=tr.widths, label_positions_per_s=labels_total / secs,
                         step_ms=1e3 * secs / a.steps))
    base = rows[0]["label_positions_per_s"]
    print("| length classes | batch widths | ms per step | label positions/s | vs first |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['buckets']} | {r['widths']} | {r['step_ms']:.0f} | {r['label_positions_per_s']:.0f} | "
              f"{r['label_positions_per_s'] / base:.2f}x |")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
