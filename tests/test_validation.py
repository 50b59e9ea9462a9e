"""Teacher-forced validation (worker/training/validation.py): which sequences, what it measures."""
from __future__ import annotations

import json

import numpy as np
import pytest
from mlx.utils import tree_flatten

from tests.test_training import _synthetic_dataset, _trainer, _write_prompts, tiny_llama
from worker.training.sequences import TokenDataset
from worker.training.loss import acceptance_stats, weighted_cross_entropy
from worker.training.validation import Validator, prompt_hash, lowest_hashes, split_validation


def _with_repeats(ds: TokenDataset) -> TokenDataset:
    """`ds` plus a second answer to each of its first 5 prompts (as --gen-samples writes)."""
    out = TokenDataset(list(ds.prompt_ids), list(ds.response_ids), list(ds.corpus), list(ds.ids))
    for i in range(5):
        out.prompt_ids.append(ds.prompt_ids[i])
        out.response_ids.append(ds.response_ids[i][::-1])
        out.corpus.append(ds.corpus[i])
        out.ids.append(ds.ids[i] + "/2")
    return out


def test_split_is_by_prompt_disjoint_and_the_same_in_a_larger_dataset():
    small = _with_repeats(_synthetic_dataset(n=60, seed=1))
    train, val = split_validation(small, fraction=0.2)
    assert 0 < len(val) < len(small) and len(train) + len(val) == len(small)
    val_prompts = {tuple(p) for p in val.prompt_ids}
    assert not val_prompts & {tuple(p) for p in train.prompt_ids}  # every answer of a prompt on one side
    assert sorted(train.ids + val.ids) == sorted(small.ids)

    big = _synthetic_dataset(n=200, seed=1)  # the same first 60 prompts (same seed), then more
    assert big.prompt_ids[:60] == small.prompt_ids[:60]
    _, big_val = split_validation(big, fraction=0.2)
    assert 20 < len(big_val) < 60  # about fraction * rows
    assert val_prompts == {tuple(p) for p in big_val.prompt_ids} & {tuple(p) for p in small.prompt_ids}


def test_split_none_and_never_all():
    ds = _synthetic_dataset(n=60, seed=2)
    train, none = split_validation(ds, 0.0)
    assert len(none) == 0 and train is ds
    one = _synthetic_dataset(n=1, seed=3)
    train, val = split_validation(one, fraction=0.999)
    assert len(val) == 0 and len(train) == 1  # a validation set never takes all the data


def test_measured_subset_is_the_lowest_hashes_in_order():
    ds = _with_repeats(_synthetic_dataset(n=30, seed=4))
    few = lowest_hashes(ds, 7)
    hashes = sorted(prompt_hash(p) for p in ds.prompt_ids)
    assert len(few) == 7 and max(prompt_hash(p) for p in few.prompt_ids) == hashes[6]
    assert few.ids == [i for i in ds.ids if i in set(few.ids)]  # ds's order kept
    assert lowest_hashes(ds, len(ds)) is ds and len(lowest_hashes(ds, 0)) == 0


def test_validator_matches_the_training_loss_and_leaves_the_weights_alone():
    target = tiny_llama()
    tr = _trainer(target, _synthetic_dataset(n=8), steps=2)
    val = _synthetic_dataset(n=3, seed=7)  # one batch (batch size 4)
    v = Validator(tr, val)
    before = {k: np.array(x) for k, x in tree_flatten(tr.draft.parameters())}
    first, second = v.run(), v.run()
    assert first is not None and (first.loss, first.tau) == (second.loss, second.tau)  # fixed anchors
    after = dict(tree_flatten(tr.draft.parameters()))
    assert all(np.array_equal(before[k], np.array(after[k])) for k in before)

    (idx, tokens, lengths, anchors, keep), = v.batches
    logits, labels, weights = tr.block_logits(tokens, lengths, anchors, keep, tr.taps(tokens))
    _, tau = acceptance_stats(logits, labels, weights)
    assert first.loss == pytest.approx(weighted_cross_entropy(logits, labels, weights).item(), rel=1e-4)
    assert first.tau == pytest.approx(tau.item(), rel=1e-5)
    assert 1.0 <= first.tau <= tr.B and first.sequences == 3 and set(first.per_corpus) == {"synthetic"}
    assert first.per_corpus["synthetic"] == pytest.approx(first.tau)
    assert Validator(tr, TokenDataset()).run() is None


def test_validation_during_training_sees_unseen_sequences_improve():
    target = tiny_llama()
    tr = _trainer(target, _synthetic_dataset(n=24), steps=60, val_every=30)
    tr.set_validation(_synthetic_dataset(n=6, seed=11))  # the same pattern, other sequences
    start = tr.validate(log=lambda _: None)
    messages = []
    tr.run(log=messages.append)
    assert [p["step"] for p in tr.val_history] == [0, 30]  # at the start (by hand) and every 30 steps
    end = tr.validate(log=messages.append)
    assert end["loss"] < start["loss"] - 0.5 and end["tau"] >= start["tau"]
    line = next(m for m in messages if m.startswith("val: step 30, loss"))
    assert line.endswith(f"; by corpus: synthetic {tr.val_history[-2]['per_corpus']['synthetic']:.2f}")


def test_cli_card_reports_validation_and_resume_keeps_the_split(tmp_path, tiny_models, capsys):
    from flashfleet.cli.draft_cmd import main

    files = _write_prompts(tmp_path)
    out = tmp_path / "draft"
    argv = ["train", "--target", str(tiny_models.llama), "--prompts", *map(str, files), "--out", str(out),
            "--max-new-tokens", "12", "--steps", "4", "--batch-size", "4", "--anchors", "4", "--block-size", "4",
            "--heldout-per-corpus", "1", "--no-eval", "--no-compile", "--quiet",
            "--val-fraction", "0.5", "--val-every", "2", "--val-max-sequences", "2"]
    assert main(argv) == 0
    card = json.loads((out / "training_card.json").read_text())
    val = card["training"]["validation"]
    n_val, held = val["sequences"], val["held_out"]
    assert n_val == 2 < held and [p["step"] for p in val["curve"]] == [0, 2, 4]  # the starting weights too
    assert val["final"]["step"] == 4 and val["final"]["sequences"] == n_val and 1.0 <= val["final"]["tau"] <= 4
    state = json.loads((tmp_path / "draft.work" / "resume" / "state.json").read_text())
    assert state["val_history"][-1] == val["final"] and state["val_fraction"] == 0.5
    assert "held out of this run's training (--val-fraction 0.5)" in (out / "TRAINING.md").read_text()
    assert f"val: {held} sequences held out of this run's training, 2 measured" in capsys.readouterr().out

    more = [*argv[:argv.index("--steps") + 1], "6", *argv[argv.index("--steps") + 2:]]
    more[more.index("--val-fraction") + 1] = "0.25"
    assert main(more) == 2  # another split would train on other sequences: one clear error
    err = capsys.readouterr().err
    assert "trained with --val-fraction 0.5 (this run: 0.25)" in err and "generate" not in err

    more[more.index("--val-fraction") + 1] = "0.5"
    more[more.index("--val-max-sequences") + 1] = "1"  # measures other rows, trains on the same: resumes
    assert main(more) == 0
    out_text = capsys.readouterr().out
    assert "resume: step 4" in out_text
    assert "--val-max-sequences 1 (the checkpoint's run measured 2): the validation points from step 4 on" in out_text
    val = json.loads((out / "training_card.json").read_text())["training"]["validation"]
    assert [(p["step"], p["sequences"]) for p in val["curve"]] == [(0, 2), (2, 2), (4, 2), (6, 1)]


def test_validation_and_checkpoint_at_the_same_step(tmp_path):
    """--val-every and --checkpoint-every coinciding (500 and 500 in the H200 job) must not crash."""
    target = tiny_llama()
    tr = _trainer(target, _synthetic_dataset(n=12), steps=6, val_every=2, checkpoint_every=2)
    tr.set_validation(_synthetic_dataset(n=3, seed=5))
    saved = []
    tr.run(checkpoint=lambda: (tr.save_state(tmp_path), saved.append(tr.step)), log=lambda _: None)
    assert [p["step"] for p in tr.val_history] == [2, 4] and saved == [2, 4, 6]
    assert json.loads((tmp_path / "state.json").read_text())["val_history"] == tr.val_history
