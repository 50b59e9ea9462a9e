"""bench/validation_gap.py on a tiny target and a random DFlash draft: rows are grouped by corpus
and `extraK:` origin, the same sequences give the same numbers in any group, a group the data
lacks is one line (exit 2); several drafts are measured on the same rows; --val-fraction keeps a
training run's held-out rows."""
import gzip
import json

import numpy as np
from mlx_lm import load

from bench_scripts import run_bench
from worker.models.dflash_checkpoint import init_dflash_draft, quantize_dflash_draft, save_dflash_draft


def _rows(ids, seed=0, corpus="code"):
    rng = np.random.default_rng(seed)
    out = []
    for i in ids:
        out.append({"corpus": corpus, "id": i, "prompt_ids": rng.integers(5, 100, 6).tolist(),
                    "response_ids": rng.integers(5, 100, 20).tolist()})
    return out


def test_groups_and_table(tmp_path, tiny_models):
    target, _ = load(str(tiny_models.llama))
    draft = init_dflash_draft(target, num_layers=1, block_size=4, seed=3)
    quantize_dflash_draft(draft, 4, 32)  # read back dequantized, as the shipped 4-bit drafts are
    save_dflash_draft(draft, tmp_path / "draft")
    data = tmp_path / "data"
    data.mkdir()
    new = _rows([f"code/{i}" for i in range(3)])
    seen = [dict(r, id="extra0:" + r["id"]) for r in new]  # the same sequences, from an earlier run
    with gzip.open(data / "train.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in new + seen + _rows(["prose/0"], seed=1, corpus="prose")
                     + _rows(["extra0:extra1:code/9"], seed=2))

    base = ["--target", tiny_models.llama, "--draft", tmp_path / "draft", "--data", data, "--anchors", 4,
            "--batch-size", 2]
    r = run_bench("validation_gap.py", *base, "--per-group", 3)
    assert r.returncode == 0, r.stderr
    table = {line.split()[0]: line.split()[1:] for line in r.stdout.splitlines()[2:]}
    assert set(table) == {"code", "extra0:code", "extra0:extra1:code", "prose"}, r.stdout
    assert table["code"][:2] == ["3", "3"] and table["prose"][:2] == ["1", "1"]  # rows, sequences
    # the same sequences under another origin: the same blocks, loss and tau (fixed anchors)
    assert table["code"][2:5] == table["extra0:code"][2:5] and table["code"][2:5] != table["prose"][2:5]
    loss, tau = float(table["code"][3]), float(table["code"][4])
    assert loss > 0 and 1.0 <= tau <= 4

    # two drafts: the same rows and anchors for each, one table row per group and draft
    other = init_dflash_draft(target, num_layers=1, block_size=4, seed=4)
    save_dflash_draft(other, tmp_path / "other")
    d = base.index("--draft") + 1
    with_drafts = lambda *ds: [*base[:d], *ds, *base[d + 1:]]  # noqa: E731
    two = run_bench("validation_gap.py", *with_drafts(tmp_path / "draft", tmp_path / "other", tmp_path / "draft"),
                    "--groups", "code", "prose")
    assert two.returncode == 0, two.stderr
    rows = [line.split() for line in two.stdout.splitlines()[2:]]
    assert [(r[0], r[-1]) for r in rows] == [("code", "1"), ("prose", "1"), ("code", "2"), ("prose", "2"),
                                             ("code", "3"), ("prose", "3")]
    assert rows[0][1:6] == rows[4][1:6] and rows[0][3] == rows[2][3]  # same draft, same numbers; same blocks
    assert rows[0][4:6] != rows[2][4:6]  # another draft, other loss and tau

    # --val-fraction: only the rows whose prompt hash falls in the held-out share
    from worker.training.validation import prompt_hash
    cut = sorted(prompt_hash(r["prompt_ids"]) for r in new)[1] + 1e-12  # two of the three code prompts
    held = run_bench("validation_gap.py", *base, "--groups", "code", "--val-fraction", cut)
    assert held.returncode == 0 and held.stdout.splitlines()[2].split()[1:3] == ["2", "2"], held.stdout
    none = run_bench("validation_gap.py", *base, "--groups", "prose", "--val-fraction", 1e-12)
    assert none.returncode == 2 and "held out at --val-fraction" in none.stderr
    nodraft = run_bench("validation_gap.py", *with_drafts(tmp_path / "draft", tmp_path), "--groups", "prose")
    assert nodraft.returncode == 2 and "no config.json" in nodraft.stderr and "Traceback" not in nodraft.stderr
    wrong = init_dflash_draft(target, num_layers=1, block_size=4, seed=3)
    save_dflash_draft(wrong, tmp_path / "wrong")
    cfg = json.loads((tmp_path / "wrong" / "config.json").read_text())
    cfg["vocab_size"] += 1  # a draft for another target
    (tmp_path / "wrong" / "config.json").write_text(json.dumps(cfg))
    mismatch = run_bench("validation_gap.py", *with_drafts(tmp_path / "draft", tmp_path / "wrong"), "--groups", "prose")
    assert mismatch.returncode == 2 and f"--draft {tmp_path / 'wrong'}:" in mismatch.stderr
    assert "Traceback" not in mismatch.stderr and "prose" not in mismatch.stdout  # before any measuring
    empty = run_bench("validation_gap.py", *base, "--val-fraction", 1e-12)
    assert empty.returncode == 2 and "no rows held out at --val-fraction 1e-12 in --data" in empty.stderr

    one = run_bench("validation_gap.py", *base, "--groups", "prose")
    assert one.returncode == 0 and [line.split()[0] for line in one.stdout.splitlines()[2:]] == ["prose"]
    bad = run_bench("validation_gap.py", *base, "--groups", "poetry")
    assert bad.returncode == 2 and "no rows in group(s) ['poetry']" in bad.stderr and "Traceback" not in bad.stderr
    no_groups = run_bench("validation_gap.py", *base, "--groups")
    assert no_groups.returncode == 2 and "expected at least one argument" in no_groups.stderr
    nowhere = [*base[:base.index("--data") + 1], tmp_path / "nowhere", *base[base.index("--data") + 2:]]
    missing = run_bench("validation_gap.py", *nowhere)
    assert missing.returncode == 2 and f"--data {tmp_path / 'nowhere'}: not a directory" in missing.stderr
    assert "Traceback" not in missing.stderr
