"""bench/compare_drafts.py: two cards' held-out tau with intervals, paired when both hold
per-prompt results, the pooled figure only for an older card; a card without an evaluation is
one line and exit 2."""
import json

from bench_scripts import run_bench


def _card(path, per_prompt, with_rows=True):
    corpora = {}
    for r in per_prompt:
        c = corpora.setdefault(r["corpus"], {"cycles": 0, "accepted": 0, "prompts": 0})
        c["cycles"] += r["cycles"]
        c["accepted"] += r["accepted"]
        c["prompts"] += 1
    per_corpus = {k: {"tau": (v["accepted"] + v["cycles"]) / v["cycles"], "cycles": v["cycles"],
                      "prompts": v["prompts"], "tokens": 0} for k, v in corpora.items()}
    ev = {"per_corpus": per_corpus, "all": {}}
    if with_rows:
        ev["per_prompt"] = per_prompt
    path.write_text(json.dumps({"eval": {"trained": ev}}))
    return path


def test_compare_paired_and_unpaired(tmp_path):
    old = [{"corpus": c, "key": f"{c}{i}", "cycles": 10, "accepted": 5 + i} for c in ("humaneval", "enwiki_en")
           for i in range(4)]
    new = [dict(r, accepted=r["accepted"] + (5 if r["corpus"] == "humaneval" else 0)) for r in old]
    a, b = _card(tmp_path / "new.json", new), _card(tmp_path / "old.json", old)
    out = run_bench("compare_drafts.py", a, b, "--corpora", "humaneval")
    assert out.returncode == 0, out.stderr
    rows = {line.split("|")[1].strip(): line for line in out.stdout.splitlines() if line.startswith("| ")}
    assert "+0.500 (+0.500 to +0.500), 4 shared" in rows["humaneval"]  # 5 more accepted per 10 cycles
    assert "+0.250" in rows["all"] and "8 shared" in rows["all"]
    older = _card(tmp_path / "older.json", old, with_rows=False)
    out = run_bench("compare_drafts.py", a, older, "--corpora", "humaneval")
    assert out.returncode == 0 and "a card without per-prompt results" in out.stdout
    row = next(line for line in out.stdout.splitlines() if line.startswith("| humaneval"))
    assert row.split("|")[4].strip() == "1.650"  # the old card's pooled tau, from its corpus figures
    (tmp_path / "none.json").write_text("{}")
    bad = run_bench("compare_drafts.py", a, tmp_path / "none.json")
    assert bad.returncode == 2 and "no 'trained' evaluation" in bad.stderr and "Traceback" not in bad.stderr


def test_an_eval_json_compares_like_a_card(tmp_path):
    """`flashfleet draft eval --json` prints the evaluation itself (no card around it): it pairs
    with a card's, so a shipped draft measured again by hand compares with a new card."""
    old = [{"corpus": "humaneval", "key": f"h{i}", "cycles": 10, "accepted": 5} for i in range(3)]
    new = [dict(r, accepted=8) for r in old]
    card = _card(tmp_path / "new.json", new)
    bare = tmp_path / "old_eval.json"
    bare.write_text(json.dumps(json.loads(_card(tmp_path / "old.json", old).read_text())["eval"]["trained"]))
    out = run_bench("compare_drafts.py", card, bare, "--corpora", "humaneval")
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("| humaneval"))
    assert "+0.300" in row and "3 shared" in row
