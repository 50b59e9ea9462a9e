"""What a draft vocabulary (EAGLE-3's reduced draft vocabulary) buys and costs, side by side.

For one target and one DFlash draft, and for each vocabulary size K (0: the whole head), in one
run on one machine:

- coverage: the share of the data's answer tokens inside the K most frequent ones;
- draft ms: one draft forward of a full block (16 tokens, one context position injected, argmax,
  one sync) alone, the median over rounds that visit the sizes in turn;
- train ms: one compiled training step (the draft's shape, taps cached, so the draft alone) and
  the supervised block positions per second it gives;
- tau: held-out acceptance length (greedy DFlash decoding, the same prompts for every size).

    python bench/bench_draft_vocab.py --target MODEL_DIR --draft DRAFT_DIR --data TRAIN_JSONL[.xz] \
        --heldout HELDOUT_JSONL [--sizes 0 32768 65536 --per-corpus 8 --max-new-tokens 128]

The draft's weights are the same for every size: a vocabulary only selects rows of the target's
head (`Model.set_vocab`), so tau differences come from the tokens it leaves out alone.
"""
from __future__ import annotations

import argparse
import json
import lzma
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rows(path: Path) -> list[dict]:
    opener = lzma.open if path.suffix == ".xz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv=None) -> int:
    import mlx.core as mx

    from worker.models.dflash_checkpoint import load_dflash_draft
    from worker.training.sequences import TokenDataset
    from worker.training.defaults import DraftSpec, choose_draft_vocab, label_token_counts, make_draft
    from worker.training.evaluate import evaluate_tau
    from worker.training.config import TrainConfig, resolve_dtype
    from worker.training.target import load_target
    from worker.training.trainer import Trainer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--data", required=True, type=Path, help="a data cache's train.jsonl (or .xz)")
    ap.add_argument("--heldout", type=Path, default=None, help="held-out prompts (heldout.jsonl); none: no tau")
    ap.add_argument("--sizes", type=int, nargs="+", default=[0, 32768, 65536])
    ap.add_argument("--per-corpus", type=int, default=8, help="held-out prompts decoded per corpus and size")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=30, help="timed draft forwards per size")
    ap.add_argument("--train-steps", type=int, default=10, help="timed training steps per size (0: none)")
    ap.add_argument("--train-sequences", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--json-out", type=Path, default=None)
    a = ap.parse_args(argv)

    dtype = resolve_dtype("auto")
    target, tokenizer = load_target(Path(a.target), dtype)
    draft = load_dflash_draft(a.draft, target, dtype=None if "quantization" in json.loads(
        (Path(a.draft) / "config.json").read_text()) else dtype)
    rows = _rows(a.data)
    V = int(draft.args.vocab_size or target.args.vocab_size)
    counts = label_token_counts([r["response_ids"] for r in rows], V)
    vocabs = {}
    for k in a.sizes:
        vocabs[k] = (None, 1.0) if k == 0 else choose_draft_vocab(counts, k, always=tokenizer.eos_token_ids)
    print(f"{len(rows)} answers, {int(counts.sum())} tokens, {int((counts > 0).sum())} distinct of {V}; "
          f"device {mx.default_device()}; draft {a.draft}", flush=True)

    # Draft forward alone: the sizes in turn each round, so drift hits them alike.
    B = draft.block_size
    block = mx.array([[rows[0]["response_ids"][0]] + [draft.mask_token_id] * (B - 1)], dtype=mx.uint32)
    ctx = mx.random.normal((1, 256, len(draft.target_layer_ids) * target.args.hidden_size)).astype(dtype)
    one = ctx[:, -1:]
    caches = {}
    for k in a.sizes:
        draft.set_vocab(vocabs[k][0])
        caches[k] = draft.make_cache()
        draft.extend_context(ctx[:, :-1], caches[k])
        for _ in range(3):  # warm-up: kernels, the padded cache's bucket
            mx.eval(draft.draft_tokens(draft(block, one, caches[k])[0]))
            for c in caches[k]:
                c.trim(1)
    draft_ms = {k: [] for k in a.sizes}
    for _ in range(a.rounds):
        for k in a.sizes:
            draft.set_vocab(vocabs[k][0])
            t0 = time.perf_counter()
            mx.eval(draft.draft_tokens(draft(block, one, caches[k])[0]))
            draft_ms[k].append(1e3 * (time.perf_counter() - t0))
            for c in caches[k]:
                c.trim(1)
    del caches

    # One training step of the draft's shape, taps cached.
    train = {}
    if a.train_steps:
        ds = TokenDataset()
        for r in rows[: a.train_sequences]:
            ds.corpus.append(r.get("corpus", ""))
            ds.ids.append(r.get("id", ""))
            ds.prompt_ids.append(r["prompt_ids"])
            ds.response_ids.append(r["response_ids"])
        args = draft.args
        spec = DraftSpec(args.num_hidden_layers, B, args.target_layer_ids, args.mask_token_id, args.intermediate_size)
        for k in a.sizes:
            cfg = TrainConfig(target="", prompts=[], out="", batch_size=a.batch_size, anchors=a.anchors,
                              steps=a.train_steps + 4, length_buckets=1, progress=False)
            tr = Trainer(target, make_draft(target, spec, 0).set_vocab(vocabs[k][0]), ds, cfg)
            tr.precompute_taps(progress=False)
            step_fn = tr._build_step()
            clock = mx.zeros(2)
            for step in range(2):  # compiles
                mx.eval(step_fn(*tr.batch(step)[0], clock), tr.draft.parameters(), tr.opt.state)
            labels, secs = 0, 0.0
            for step in range(2, 2 + a.train_steps):
                inputs, n_labels, _, _ = tr.batch(step)
                t0 = time.perf_counter()
                mx.eval(step_fn(*inputs, clock), tr.draft.parameters(), tr.opt.state)
                secs += time.perf_counter() - t0
                labels += n_labels
            train[k] = {"step_ms": 1e3 * secs / a.train_steps, "labels_per_s": labels / secs}
            del tr, step_fn
            mx.clear_cache()

    taus = {}
    if a.heldout:
        held, seen = [], {}
        for r in _rows(a.heldout):  # the first --per-corpus of each corpus
            if seen.setdefault(r["corpus"], 0) < a.per_corpus:
                seen[r["corpus"]] += 1
                held.append(r)
        for k in a.sizes:
            draft.set_vocab(vocabs[k][0])
            taus[k] = evaluate_tau(target, draft, held, a.max_new_tokens, tokenizer.eos_token_ids,
                                   progress=False)

    base = a.sizes[0]
    print("| draft vocabulary | coverage of answer tokens | draft ms (median) | vs first | train step ms | "
          "label positions/s | vs first | held-out tau | code tau |")
    print("|---|---|---|---|---|---|---|---|---|")
    out = []
    for k in a.sizes:
        med = statistics.median(draft_ms[k])
        t = train.get(k, {})
        ev = taus.get(k)
        code = None
        if ev:
            rows_c = [r for r in ev["per_prompt"] if r["corpus"] in ("code_requests", "code_tasks", "humaneval")]
            cyc = sum(r["cycles"] for r in rows_c)
            code = (sum(r["accepted"] for r in rows_c) + cyc) / cyc if cyc else None
        row = {"size": k or V, "coverage": vocabs[k][1], "draft_ms": med, "draft_ms_all": draft_ms[k],
               **t, "tau": ev["all"]["tau"] if ev else None, "code_tau": code,
               "per_corpus": ev["per_corpus"] if ev else None}
        out.append(row)
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        print(f"| {k or f'{V} (all)'} | {100 * vocabs[k][1]:.2f}% | {med:.3f} | "
              f"{statistics.median(draft_ms[base]) / med:.2f}x | {fmt(t.get('step_ms'), '.1f')} | "
              f"{fmt(t.get('labels_per_s'), '.0f')} | "
              f"{fmt(t['labels_per_s'] / train[base]['labels_per_s'] if t else None, '.2f')}"
              f"{'x' if t else ''} | {fmt(row['tau'], '.3f')} | {fmt(code, '.3f')} |", flush=True)
    if a.json_out:
        a.json_out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
