"""bench/ab_dflash.py on a tiny target with a random DFlash draft: this checkout against itself
(HEAD) gives identical greedy outputs and both rows; a revision git does not know is one line."""
from mlx_lm import load

from bench_scripts import ROOT, run_bench
from tiny_models import CASES_DIR
from worker.models.dflash_checkpoint import init_dflash_draft, save_dflash_draft


def test_against_head_and_a_bad_revision(tmp_path, tiny_models):
    target, _ = load(str(tiny_models.llama))
    save_dflash_draft(init_dflash_draft(target, num_layers=1, block_size=4, seed=3), tmp_path / "draft")
    base = ["--target", tiny_models.llama, "--draft", tmp_path / "draft", "--cases", CASES_DIR, "--prompts", 1,
            "--max-tokens", 8, "--rounds", 2]
    r = run_bench("ab_dflash.py", "--rev", "HEAD", *base)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any(line.strip().startswith("this checkout:") for line in lines)
    assert any(line.strip().startswith("HEAD:") and len(line.split()) == 2 + 2 + 2 for line in lines), r.stdout
    assert "greedy outputs identical: True" in r.stdout
    saved = tmp_path / "dflash_saved.py"
    saved.write_text((ROOT / "worker" / "spec" / "dflash.py").read_text())
    f = run_bench("ab_dflash.py", "--file", saved, *base)
    assert f.returncode == 0 and "other file:" in f.stdout and "identical: True" in f.stdout, f.stderr
    bad = run_bench("ab_dflash.py", "--rev", "no-such-rev", *base)
    assert bad.returncode != 0 and "--rev no-such-rev" in bad.stderr and "Traceback" not in bad.stderr
