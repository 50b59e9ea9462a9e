"""Writes code-writing prompts for draft training into OUT_DIR, as two corpora:

- `code_tasks.jsonl`: HumanEval's training split only (the prompts `split_heldout` keeps for
  training, so none is a rewording of a held-out prompt), each asked in TASKS' ways (implement,
  test, explain, port, refactor, ...).
- `code_requests.jsonl`: the programming tasks of `bench/code_requests.txt` (one per line, written
  for this project), each asked in Python in every STYLES way and in LANGS_PER_TASK other
  languages (rotating over LANGUAGES), so answers cover many languages and idioms.

Coder targets answer code prompts with code, and HumanEval alone gives ~120 training prompts;
these give the target a few thousand distinct code answers to learn from.

    python bench/make_code_tasks.py CASES_DIR OUT_DIR [--per-corpus 8 --fraction 0.1]

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
    "Implement this function in Rust, with the docstring as a doc comment.\n\n{code}",
    "Implement this function in C++.\n\n{code}",
    "Give two different Python implementations of this function and compare them.\n\n{code}",
    "Implement this function and add input validation that raises ValueError on bad input.\n\n{code}",
    "Write this function as a method of a small Python class, with an example of its use.\n\n{code}",
)
STYLES = (
    "Write a {lang} function that {task}.",
    "In {lang}, write code that {task}. Include a short usage example.",
    "Write {lang} code that {task}, with comments explaining each step.",
    "Write a {lang} function that {task}, and unit tests for it.",
)
LANGUAGES = ("JavaScript", "TypeScript", "Go", "Rust", "C", "C++", "Java", "C#", "Ruby", "Bash")
LANGS_PER_TASK = 4


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--per-corpus", type=int, default=8)
    ap.add_argument("--fraction", type=float, default=0.1)
    a = ap.parse_args(argv)
    prompts = read_prompt_files([a.cases / "humaneval.jsonl"])
    train, held = split_heldout(prompts, a.per_corpus, a.fraction)
    a.out_dir.mkdir(parents=True, exist_ok=True)
    tasks_path = a.out_dir / "code_tasks.jsonl"
    with tasks_path.open("w", encoding="utf-8") as f:
        for p in train:
            for i, task in enumerate(TASKS):
                f.write(json.dumps({"id": f"{p.id}/task{i}", "lang": "code",
                                    "prompt": task.format(code=p.text.strip("\n"))}) + "\n")
    print(f"{tasks_path}: {len(train) * len(TASKS)} prompts from {len(train)} training prompts "
          f"({len(held)} held out, never used)")
    requests = [t.strip() for t in (Path(__file__).parent / "code_requests.txt").read_text().splitlines()
                if t.strip()]
    req_path, n = a.out_dir / "code_requests.jsonl", 0
    with req_path.open("w", encoding="utf-8") as f:
        for i, task in enumerate(requests):
            asks = [("Python", s) for s in STYLES]
            asks += [(LANGUAGES[(i * LANGS_PER_TASK + j) % len(LANGUAGES)], STYLES[(i + j) % len(STYLES)])
                     for j in range(LANGS_PER_TASK)]
            for lang, style in asks:
                f.write(json.dumps({"id": f"req{i}/{lang}/{STYLES.index(style)}", "lang": "code",
                                    "prompt": style.format(lang=lang, task=task)}) + "\n")
                n += 1
    print(f"{req_path}: {n} prompts from {len(requests)} tasks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
