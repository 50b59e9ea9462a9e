"""--extra-data (`worker/training/extra_data.py`): an earlier run's data cache is reused by a later
run of the same target: greedy answers to its training prompts are not generated again, its
other sequences (target-written prompts, sampled answers) are added, held-out prompts and
repeats never enter, another target's data is refused, and ranks split the added sequences."""
import gzip
import json
import lzma

import pytest

import worker.training.answers as data_mod
from test_training import _write_prompts
from worker.training.answers import build_dataset
from worker.training.data import DataError
from worker.training.data_cache import dataset_key
from worker.training.extra_data import cache_rows, check_extra_data, load_extra_data

FP = "fingerprint-1"


def write_gzip_copy(data_dir, out_dir):
    """A data cache copied from another machine: train.jsonl gzip-compressed, meta.json and
    heldout.jsonl as they are."""
    out_dir.mkdir(parents=True)
    with gzip.open(out_dir / "train.jsonl.gz", "wb") as g:
        g.write((data_dir / "train.jsonl").read_bytes())
    for name in ("heldout.jsonl", "meta.json"):
        (out_dir / name).write_bytes((data_dir / name).read_bytes())
    return out_dir


def _cache(d, rows, *, target=FP, temperature=0.0, max_new_tokens=8, gz=False, xz=False):
    d.mkdir(parents=True)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if gz:
        with gzip.open(d / "train.jsonl.gz", "wt", encoding="utf-8") as f:
            f.write(text)
    elif xz:  # as training-data/ keeps it in git
        with lzma.open(d / "train.jsonl.xz", "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        (d / "train.jsonl").write_text(text)
    (d / "meta.json").write_text(json.dumps({"settings": {"target": target, "temperature": temperature,
                                                          "max_new_tokens": max_new_tokens}}))
    return d


def _row(corpus, pid, prompt, response):
    return {"corpus": corpus, "id": pid, "prompt_ids": prompt, "response_ids": response}


EOS = 99


def test_load_sorts_reusable_added_and_dropped_sequences(tmp_path):
    rows = [_row("code", "code/1", [1, 2], [5, 6, 7, 8, 9, 10, 11, 12]),       # ran to the cap: reusable
            _row("code", "code/2", [1, 3], [5, EOS]),                            # ended with EOS: reusable
            _row("code", "code/3", [1, 4], [5, 6, 7]),                           # cut short (time limit)
            _row("code", "code/5", [7, 7], [5, 6, 7]),                           # a prompt this run lacks
            _row("code", "code/1#sample1", [1, 2], [5, 7, 7]),                  # sampled: added
            _row("synthetic", "synthetic/0/3", [3, 4], [8, 9]),                 # target-written: added
            _row("synthetic", "synthetic/0/4", [3, 4], [8, 9]),                 # exact repeat: dropped
            _row("code", "code/7", [9, 9], [1, 2, 3]),                          # held out by its id
            _row("prose", "prose/2", [4, 4, 4], [1, 2]),                        # held out by its prompt ids
            _row("code", "code/8", [6], [1])]                                   # too short: dropped
    d = _cache(tmp_path / "run1" / "data", rows, gz=True)
    answered = [[1, 2], [1, 3], [1, 4]]
    kw = dict(target_fingerprint=FP, eos_ids=[EOS], heldout_prompt_ids=[[4, 4, 4]], heldout_ids=["code/7"])
    ex = load_extra_data([d], max_new_tokens=4, answered=answered, **kw)
    assert ex.greedy == {(1, 2): [5, 6, 7, 8], (1, 3): [5, EOS]}  # cut to this run's cap; EOS-ended kept
    assert ex.added.ids == ["extra0:code/5", "extra0:code/1#sample1", "extra0:synthetic/0/3"]
    assert ex.added.response_ids == [[5, 6, 7], [5, 7, 7], [8, 9]] and ex.corpora == ["code", "synthetic"]
    src = ex.sources[0]
    assert {k: src[k] for k in ("read", "heldout_dropped", "repeats_dropped", "superseded", "reused_offered",
                                "added")} == dict(read=10, heldout_dropped=2, repeats_dropped=2, superseded=1,
                                                  reused_offered=2, added=3)
    # A longer cap than the earlier run's: only the EOS-ended answer is complete; the one that ran
    # to the old cap is written again (not kept beside the new answer as a near-duplicate).
    ex = load_extra_data([d], max_new_tokens=9, answered=answered, **kw)
    assert set(ex.greedy) == {(1, 3)} and ex.sources[0]["superseded"] == 2
    # An answer cut by a time limit still holds this run's whole answer when it is long enough.
    ex = load_extra_data([d], max_new_tokens=3, answered=answered, **kw)
    assert ex.greedy[(1, 4)] == [5, 6, 7] and ex.sources[0]["superseded"] == 0
    # The same complete answer in a second copy is a repeat, not an incomplete answer.
    copy = _cache(tmp_path / "copy", rows[:1])
    ex = load_extra_data([d, copy], max_new_tokens=4, answered=answered, **kw)
    assert ex.sources[1]["repeats_dropped"] == 1 and ex.sources[1]["superseded"] == 0
    # This run samples its first pass (answers nothing greedily): every greedy answer is added.
    ex = load_extra_data([d], max_new_tokens=4, answered=[], **kw)
    assert not ex.greedy and "extra0:code/1" in ex.added.ids

    # Data of another target, or not a data cache: one clear error each.
    other = _cache(tmp_path / "other", rows[:1], target="fingerprint-2")
    with pytest.raises(DataError, match="another target"):
        check_extra_data([d, other], FP)
    with pytest.raises(DataError, match="no train.jsonl"):
        check_extra_data([tmp_path], FP)
    with pytest.raises(DataError, match="not a directory"):
        check_extra_data([tmp_path / "nope"], FP)


def test_xz_and_gzip_caches_read_the_same_rows(tmp_path):
    from worker.training.extra_data import cache_rows

    rows = [_row("code", f"code/{i}", [1, i], [5, 6, i]) for i in range(40)]
    plain, gz, xz = (_cache(tmp_path / n, rows, gz=n == "gz", xz=n == "xz") for n in ("plain", "gz", "xz"))
    assert (xz / "train.jsonl.xz").is_file() and not (xz / "train.jsonl").exists()
    assert list(cache_rows(xz)) == list(cache_rows(gz)) == list(cache_rows(plain)) == rows
    check_extra_data([xz], FP, read_rows=True)


@pytest.mark.parametrize("damage, says", [
    ("cut_gzip", "unreadable after line"),
    ("cut_xz", "unreadable after line"),
    ("missing_field", "not a training sequence"),
    ("bad_token", "not a training sequence"),
    ("empty", "holds 0 sequences, meta.json says 2"),
    ("null_settings", "not the meta.json of a data cache"),
    ("big_token", "below 500"),
])
def test_damaged_training_files_are_one_clear_error(tmp_path, damage, says):
    rows = [_row("code", "code/1", [1, 2], [5, 6]), _row("code", "code/2", [1, 3], [5, 6])]
    d = _cache(tmp_path / "d", rows, gz=damage == "cut_gzip", xz=damage == "cut_xz")
    meta = json.loads((d / "meta.json").read_text())
    (d / "meta.json").write_text(json.dumps({**meta, "train_sequences": 2}))
    if damage == "cut_gzip":
        whole = (d / "train.jsonl.gz").read_bytes()
        (d / "train.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    elif damage == "cut_xz":
        whole = (d / "train.jsonl.xz").read_bytes()
        (d / "train.jsonl.xz").write_bytes(whole[: len(whole) // 2])
    elif damage == "missing_field":
        (d / "train.jsonl").write_text(json.dumps({"corpus": "code"}) + "\n\n")
    elif damage == "bad_token":
        (d / "train.jsonl").write_text(json.dumps(_row("code", "c", [1], ["x", 2])) + "\n")
    elif damage == "null_settings":
        (d / "meta.json").write_text(json.dumps({"settings": None, "train_sequences": 2}))
    elif damage == "big_token":
        (d / "train.jsonl").write_text(json.dumps(_row("code", "c", [1], [2, 500])) + "\n")
    else:
        (d / "train.jsonl").write_text("\n")  # blank lines are skipped, not an error
    if damage == "big_token":  # the vocabulary is known where the data is loaded
        with pytest.raises(DataError, match=says):
            load_extra_data([d], target_fingerprint=FP, max_new_tokens=4, answered=[], eos_ids=[],
                            heldout_prompt_ids=[], heldout_ids=[], vocab_size=500)
        return
    with pytest.raises(DataError, match=says):
        check_extra_data([d], FP, read_rows=True)
    if damage in ("empty", "cut_gzip", "cut_xz"):  # a single process's load finds it too
        with pytest.raises(DataError, match=says):
            load_extra_data([d], target_fingerprint=FP, max_new_tokens=4, answered=[], eos_ids=[],
                            heldout_prompt_ids=[], heldout_ids=[])


def test_a_later_run_reuses_greedy_answers_and_adds_the_rest(tmp_path, tiny_models, monkeypatch):
    from mlx_lm import load

    target, tokenizer = load(str(tiny_models.llama))
    files = _write_prompts(tmp_path)
    kw = dict(max_new_tokens=8, heldout_per_corpus=2, heldout_fraction=0.2, target_fingerprint=FP,
              log=lambda _: None)
    first = build_dataset(target, tokenizer, files, tmp_path / "w1" / "data", synthetic=6, synthetic_max_tokens=12,
                          synthetic_temperature=1.5, **kw)
    n_synthetic = first.meta["corpora"]["synthetic"]
    assert n_synthetic > 0
    carried = write_gzip_copy(tmp_path / "w1" / "data", tmp_path / "carried")  # as a copy from another machine
    assert (carried / "train.jsonl.gz").is_file() and not (carried / "train.jsonl").exists()

    asked = []

    def counting(model, prompts, *a, **k):
        asked.append(len(prompts))
        return real(model, prompts, *a, **k)
    real = data_mod.generate_responses
    monkeypatch.setattr(data_mod, "generate_responses", counting)
    said = []
    second = build_dataset(target, tokenizer, files, tmp_path / "w2" / "data", extra_data=[carried],
                           **{**kw, "log": said.append})
    assert sum(asked) == 0  # every greedy answer came from the earlier run
    assert any("none generated (all from --extra-data)" in line for line in said), said
    n_file = len(first.train) - n_synthetic
    assert second.meta["extra_greedy_reused"] == n_file and second.meta["extra_added"] == n_synthetic
    assert sorted(zip(second.train.prompt_ids, second.train.response_ids)) == \
        sorted(zip(first.train.prompt_ids, first.train.response_ids))
    held = {tuple(h["prompt_ids"]) for h in second.heldout}
    assert held.isdisjoint(map(tuple, second.train.prompt_ids))
    # The extra data is part of the cache key; without it the key is the one it always was.
    plain_key = dataset_key(files, **{k: v for k, v in kw.items() if k not in ("log", "target_fingerprint")},
                            max_per_file=None, max_prompt_tokens=256, top_p=1.0, seed=0, samples=1,
                            sample_temperature=0.8, temperature=0.0, target_fingerprint=FP)[0]
    assert second.meta["key"] != plain_key

    # Two ranks split the added sequences between them, without overlap.
    shares = [build_dataset(target, tokenizer, files, tmp_path / f"r{r}", extra_data=[carried], shard=(r, 2), **kw)
              for r in (0, 1)]
    added = [{i for i in s.train.ids if i.startswith("extra0:")} for s in shares]
    assert added[0].isdisjoint(added[1]) and len(added[0]) + len(added[1]) == n_synthetic


def test_cli_trains_on_an_earlier_runs_data_and_says_so_in_the_card(tmp_path, tiny_models):
    from flashfleet.cli.draft_cmd import main

    files = _write_prompts(tmp_path)
    common = ["train", "--target", str(tiny_models.llama), "--prompts", *map(str, files), "--max-new-tokens", "12",
              "--steps", "2", "--batch-size", "4", "--anchors", "4", "--block-size", "4", "--heldout-per-corpus",
              "2", "--heldout-fraction", "0.2", "--no-eval", "--no-compile", "--quiet"]
    assert main([*common, "--out", str(tmp_path / "d1"), "--work-dir", str(tmp_path / "w1"),
                 "--synthetic-prompts", "4"]) == 0
    carried = write_gzip_copy(tmp_path / "w1" / "data", tmp_path / "carried")
    assert main([*common, "--out", str(tmp_path / "d2"), "--work-dir", str(tmp_path / "w2"),
                 "--extra-data", str(carried)]) == 0
    first = json.loads((tmp_path / "d1" / "training_card.json").read_text())["data"]
    card = json.loads((tmp_path / "d2" / "training_card.json").read_text())["data"]
    assert card["train_sequences"] == first["train_sequences"]  # the same sequences, none generated
    assert card["extra_greedy_reused"] + card["extra_added"] == first["train_sequences"]
    assert card["corpora"].get("synthetic") == first["corpora"]["synthetic"]
    assert f"of these, from earlier runs' data (--extra-data {carried}): " in (tmp_path / "d2" / "TRAINING.md").read_text()
    # Another target's data (a changed fingerprint) is one line and exit 2, before any training.
    meta = json.loads((carried / "meta.json").read_text())
    meta["settings"]["target"] = "another"
    (carried / "meta.json").write_text(json.dumps(meta))
    assert main([*common, "--out", str(tmp_path / "d3"), "--work-dir", str(tmp_path / "w3"),
                 "--extra-data", str(carried)]) == 2
    assert not (tmp_path / "d3").exists()


def test_cache_rows_reads_a_cache_and_names_what_is_wrong(tmp_path):
    rows = [_row("code", "code/1", [1, 2], [5, 6]), _row("synthetic", "synthetic/0/3", [3, 4], [8, 9])]
    assert list(cache_rows(_cache(tmp_path / "a", rows, gz=True))) == rows
    assert list(cache_rows(_cache(tmp_path / "b", rows), vocab=10)) == rows
    with pytest.raises(DataError, match="below 8"):  # token 9 is outside an 8-token vocabulary
        list(cache_rows(tmp_path / "b", vocab=8))
    with pytest.raises(DataError, match="not a directory"):
        list(cache_rows(tmp_path / "missing"))
