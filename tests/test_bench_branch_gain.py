"""bench/bench_branch_gain.py: the candidate sets each strategy builds, and the script end to end
on a tiny random-weight target with a random DFlash draft (every candidate set holds the run's
own block, so its tau is never below the run's)."""
import json
import sys

from tiny_models import CASES_DIR

from bench_scripts import ROOT, run_bench

sys.path.insert(0, str(ROOT))
from bench.bench_branch_gain import accepted, candidate_sets  # noqa: E402


def test_candidate_sets():
    ids = [[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]]
    probs = [[0.9, 0.05, 0.03, 0.02], [0.5, 0.4, 0.05, 0.05], [0.99, 0.005, 0.003, 0.002]]
    sets = candidate_sets(ids, probs, 3)
    assert sets["first"] == [[10, 20, 30], [11, 20, 30], [12, 20, 30]]
    assert sets["each"] == [[10, 20, 30], [11, 20, 30], [10, 21, 30]]
    # joint: the first choices, then the most probable others: position 2's second choice (0.4
    # against 0.5), then its third (0.05 against 0.5 is likelier than position 1's 0.05 against 0.9)
    assert sets["joint"] == [[10, 20, 30], [10, 21, 30], [10, 22, 30]]
    assert candidate_sets(ids, probs, 5)["joint"][3:] == [[10, 23, 30], [11, 20, 30]]
    assert accepted([1, 2, 3], [1, 2, 4]) == 2 and accepted([1], [2]) == 0 and accepted([1, 2], [1]) == 1


def test_end_to_end(tmp_path, tiny_models):
    from mlx_lm import load

    from worker.models.dflash_checkpoint import init_dflash_draft, save_dflash_draft

    target, _ = load(str(tiny_models.llama))
    save_dflash_draft(init_dflash_draft(target, num_layers=1, block_size=4), tmp_path / "draft")
    r = run_bench("bench_branch_gain.py", "--target", tiny_models.llama, "--dflash-draft", tmp_path / "draft",
                  "--prompts", 1, "--max-tokens", 12, "--max-prompt-tokens", 24, "--cases", CASES_DIR,
                  "--corpora", "code", "--ks", 2, 4, "--json-out", tmp_path / "g.json", timeout=300)
    assert r.returncode == 0, r.stderr
    tau = json.loads((tmp_path / "g.json").read_text())["code"]["tau"]
    assert set(tau) == {"linear:1"} | {f"{s}:{k}" for s in ("first", "each", "joint") for k in (2, 4)}
    assert all(v >= tau["linear:1"] for v in tau.values())
    assert tau["linear:1"] >= 1.0
    assert "code     4  joint" in r.stdout
