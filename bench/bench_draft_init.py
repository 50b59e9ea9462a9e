"""How a DFlash draft's starting weights change what a short training reaches, side by side.

Trains the same draft shape on the same data for the same steps from three starts, then measures
the teacher-forced loss/tau curve and tau on the held-out prompts:

  random         the draft's random initialisation (`--init-layers random`)
  target         decoder layers copied from the target's last layers (`--init-layers target`,
                 `worker.training.defaults.copy_target_layers`)
  target-attn    the same, but the MLP left random (what a draft narrower than the target gets)

    python bench/bench_draft_init.py --target MODEL_DIR --prompts FILE... [--steps 150 --work /tmp/x]

Data: the target's greedy answers, cached in WORK/data like `flashfleet draft train` does. Prints
a table of the loss curves and the held-out tau per corpus, and writes WORK/results.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    from mlx.utils import tree_flatten

    from worker.training.data import build_dataset
    from worker.training.defaults import choose_draft_spec, copy_target_layers, make_draft
    from worker.training.evaluate import evaluate_tau
    from worker.training.train import TrainConfig, Trainer, load_target, resolve_dtype

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--prompts", nargs="+", required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench_draft_init"))
    ap.add_argument("--max-prompts-per-file", type=int, default=30)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--anchors", type=int, default=8)
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--eval-tokens", type=int, default=32)
    ap.add_argument("--starts", nargs="+", default=["random", "target", "target-attn"])
    a = ap.parse_args(argv)

    target, tok = load_target(Path(a.target), resolve_dtype("auto"))
    split = build_dataset(target, tok, a.prompts, a.work / "data", max_per_file=a.max_prompts_per_file,
                          max_new_tokens=a.max_new_tokens, max_prompt_tokens=96, heldout_per_corpus=3,
                          heldout_fraction=0.1, gen_batch_size=32)
    used = {t for r in split.train.prompt_ids + split.train.response_ids for t in r}
    spec = choose_draft_spec(target, tok, used, draft_layers=a.draft_layers, num_taps=4, block_size=16)
    print(f"{len(split.train)} training sequences, {len(split.heldout)} held-out prompts; draft {spec}", flush=True)
    results = {}
    for start in a.starts:
        draft = make_draft(target, spec, 0)
        if start != "random":
            random_mlp = {k: v for k, v in tree_flatten(draft.parameters()) if ".mlp." in k}
            copied = copy_target_layers(draft, target)
            if start == "target-attn":
                draft.load_weights(list(random_mlp.items()), strict=False)
                copied = [k for k in copied if ".mlp." not in k]
            print(f"{start}: {len(copied)} tensors from the target", flush=True)
        cfg = TrainConfig(target="", prompts=[], out="", batch_size=a.batch_size, anchors=a.anchors,
                          steps=a.steps, log_every=10, progress=False)
        tr = Trainer(target, draft, split.train, cfg)
        tr.precompute_taps(False)
        t0 = time.perf_counter()
        tr.run(log=lambda _: None)
        ev = evaluate_tau(target, draft, split.heldout, a.eval_tokens, tok.eos_token_ids)
        results[start] = dict(curve=[(h["step"], h["loss"], h["train_tau"]) for h in tr.history],
                              heldout_tau=ev["all"]["tau"], per_corpus={c: v["tau"] for c, v in ev["per_corpus"].items()},
                              train_s=round(time.perf_counter() - t0, 1))
        print(f"{start}: loss {tr.history[-1]['loss']:.3f}, held-out tau {ev['all']['tau']:.3f}", flush=True)
    a.work.mkdir(parents=True, exist_ok=True)
    (a.work / "results.json").write_text(json.dumps(results, indent=1))
    names = list(results)
    print("\n| step | " + " | ".join(f"{n}: loss / train tau" for n in names) + " |")
    print("|---|" + "---|" * len(names))
    curves = {n: {s: (l, t) for s, l, t in results[n]["curve"]} for n in names}
    for s in sorted(curves[names[0]]):
        if s % 30 == 0 or s == max(curves[names[0]]):
            print(f"| {s} | " + " | ".join(f"{curves[n][s][0]:.2f} / {curves[n][s][1]:.3f}" for n in names) + " |")
    print("| held-out tau | " + " | ".join(f"{results[n]['heldout_tau']:.3f}" for n in names) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
