"""Writes `code_tasks.jsonl`: more code-writing prompts for draft training, from HumanEval's
training split only (the prompts `split_heldout` keeps for training), so none of them is a
rewording of a held-out prompt.

Coder targets answer code prompts with code; HumanEval alone gives ~120 training prompts. Asking
for the same functions in other ways (implement, test, explain, rewrite, port) gives the target
~5x as many distinct code answers to learn from.

    python bench/make_code_tasks.py CASES_DIR OUT.jsonl [--per-corpus 8 --fraction 0.1]

The held-out arguments must match the ones given to `flashfleet draft train`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from worker.training.data import read_prompt_files, split_heldout  # noqa: E402

TASKS = (
    "Complete this Python function. Reply with the whole function only.\n\n{code}",
    "Write pytest unit tests for the following function.\n\n{code}",
    "Explain step by step how to implement this function, then give the code.\n\n{code}",
    "Implement this function in JavaScript, keeping the docstring as a comment.\n\n{code}",
    "Implement this function without using any imports, with type hints and comments.\n\n{code}",
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--per-corpus", type=int, default=8)
    ap.add_argument("--fraction", type=float, default=0.1)
    a = ap.parse_args(argv)
    prompts = read_prompt_files([a.cases / "humaneval.jsonl"])
    train, held = split_heldout(prompts, a.per_corpus, a.fraction)
    with a.out.open("w", encoding="utf-8") as f:
        for p in train:
            for i, task in enumerate(TASKS):
                f.write(json.dumps({"id": f"{p.id}/task{i}", "lang": "code",
                                    "prompt": task.format(code=p.text.strip("\n"))}) + "\n")
    print(f"{a.out}: {len(train) * len(TASKS)} prompts from {len(train)} training prompts "
          f"({len(held)} held out, never used)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
