"""What prompts the target writes itself, with and without openings (`--synthetic-openings`).

    python bench/synthetic_openings.py TARGET_DIR [--tokenizer DIR] [--count 32] [--words 4]
        [--from code_requests code_tasks humaneval] [--max-tokens 64] [--data DIR [--sample 2000]]

Side by side in one run, from the same target and seed: Magpie from the bare user-turn prefix,
and prompts begun with the first WORDS words of training prompts of the chosen corpora (the
prompt files the H200 job trains on: those of FILES in bench/prompts plus
`bench/make_code_tasks.py`'s two; held-out prompts never among them). Prints per mode how many distinct prompts came back,
the share that mention code (a keyword test: a programming language, `def`, `function`, code
fences and the like; crude, the same for both), for the openings mode also the share of the
openings alone and of the target's continuations alone that do, their mean length, and three
examples. With `--data DIR` (a training data cache, e.g. bench/h200/data/...-data) it first prints
the same test's share over `--sample` of the cache's synthetic prompts.
"""
from __future__ import annotations

import argparse
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from mlx_lm.utils import load_model, load_tokenizer  # noqa: E402

from worker.training.data import read_prompt_files, split_heldout, synthetic_openings_pool  # noqa: E402
from worker.training.extra_data import cache_rows  # noqa: E402
from worker.training.synthetic import write_user_prompts  # noqa: E402

CASES = ROOT / "bench" / "prompts"
FILES = ["code_requests", "code_tasks", "dataset_build_multilingual", "dataset_build_pl", "enwiki_en",
         "fortunes_en", "fortunes_pl", "humaneval", "lee_news_en"]
CODE = re.compile(r"\b(python|java|javascript|typescript|c\+\+|c#|rust|golang|sql|bash|html|css|regex|def|"
                  r"function|class|code|program|script|algorithm|api|compile|array|implement)\b|```|\(\)", re.I)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target", type=Path)
    ap.add_argument("--tokenizer", type=Path, default=None, help="directory with the tokenizer (default: the target's)")
    ap.add_argument("--count", type=int, default=32)
    ap.add_argument("--words", type=int, default=4)
    ap.add_argument("--from", dest="corpora", nargs="+", default=["code_requests", "code_tasks", "humaneval"])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", type=Path, default=None, help="a data cache whose synthetic prompts to test too")
    ap.add_argument("--sample", type=int, default=2000, help="synthetic prompts of --data to test")
    a = ap.parse_args()
    tok = load_tokenizer(a.tokenizer or a.target)
    if a.data:
        rows = list(cache_rows(a.data))
        own = [r for r in rows if r["corpus"] == "synthetic"]
        pick = random.Random(a.seed).sample(own, min(a.sample, len(own)))
        user = [tok.decode(r["prompt_ids"]).split("<|im_start|>user\n", 1)[-1].split("<|im_end|>")[0] for r in pick]
        files_code = [r for r in rows if r["corpus"] in a.corpora]
        print(f"data {a.data.name}: {sum(bool(CODE.search(t)) for t in user) / max(len(user), 1):.0%} of {len(user)} "
              f"sampled synthetic prompts (of {len(own)}) mention code; {len(files_code)} sequences of "
              f"{', '.join(a.corpora)}")
    model, _ = load_model(a.target)
    with tempfile.TemporaryDirectory() as tmp:  # the job's prompt files, as bench/h200/job_train.sh makes them
        subprocess.run([sys.executable, str(ROOT / "bench" / "make_code_tasks.py"), str(CASES), tmp], check=True,
                       stdout=subprocess.DEVNULL)
        found = {p.stem: p for d in (Path(tmp), CASES) for p in d.glob("*.jsonl")}  # CASES' file wins
        files = [found[f] for f in FILES if f in found]
        train, _ = split_heldout(read_prompt_files(files, 2000), 8, 0.1)
    pool = synthetic_openings_pool(train, a.words, a.corpora)
    picks = np.random.default_rng(a.seed).integers(len(pool), size=a.count)
    openings = [tok.encode(pool[i], add_special_tokens=False) for i in picks.tolist()]
    print(f"target {a.target.name}  {a.count} prompts per mode, up to {a.max_tokens} tokens, T=1.0, seed {a.seed}; "
          f"openings: {a.words} words of {', '.join(a.corpora)} training prompts ({len(pool)} of them)")
    starts = sorted({tok.decode(o).strip() for o in openings}, key=len, reverse=True)
    share = lambda texts: sum(bool(CODE.search(t)) for t in texts) / max(len(texts), 1)  # noqa: E731
    print(f"{'mode':<12} {'distinct':>8} {'mention code':>12} {'opening alone':>13} {'continuation alone':>18} "
          f"{'mean chars':>10} {'s':>5}")
    examples = {}
    for mode, ops in (("bare", None), ("openings", openings)):
        t0 = time.perf_counter()
        texts = write_user_prompts(model, tok, a.count, max_tokens=a.max_tokens, seed=a.seed,
                                   batch_size=a.count, openings=ops)
        if ops is None:
            alone = cont = "-"
        else:  # each text is its opening (the longest that fits) and what the target wrote after it
            heads = [next((o for o in starts if t.startswith(o)), "") for t in texts]
            alone = f"{share(heads):.0%}"
            cont = f"{share([t[len(h):] for t, h in zip(texts, heads)]):.0%}"
        print(f"{mode:<12} {len(texts):>8} {share(texts):>12.0%} {alone:>13} {cont:>18} "
              f"{np.mean([len(t) for t in texts]) if texts else 0:>10.0f} {time.perf_counter() - t0:>5.0f}", flush=True)
        examples[mode] = texts[:3]
    for mode, texts in examples.items():
        for t in texts:
            print(f"  {mode}: {t[:140]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
