"""The draft vocabulary (EAGLE-3's reduced draft vocabulary on a DFlash draft).

A draft with a vocabulary scores only K rows of the target's head: its logits must equal those
columns of the full head's, its proposals must be target ids, greedy DFlash output must still be
plain greedy output (even when the target emits tokens the draft cannot propose), the vocabulary
must survive save/load, and training must score a label outside it as a miss, not as a class.
"""
from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import worker.engine.batch as batch_mod
from test_dflash import PROMPT, TARGETS, _run, assert_greedy_equal
from worker.capture import target_head_fn
from worker.models.dflash_checkpoint import (
    DraftCheckpointError,
    DraftMismatch,
    init_dflash_draft,
    load_dflash_draft,
    save_dflash_draft,
)
from worker.sampling import greedy
from worker.decoding import plain
from worker.training.defaults import choose_draft_vocab, label_token_counts
from worker.training.loss import acceptance_stats, weighted_cross_entropy

MAX_TOKENS = 29


def _quantized(name):
    target = TARGETS[name]()
    nn.quantize(target, group_size=32, bits=4)
    mx.eval(target.parameters())
    return target


@pytest.mark.parametrize("name,quantize", [("llama", False), ("qwen3", False), ("llama", True), ("qwen3", True)])
def test_head_rows_equal_the_full_heads_columns(name, quantize):
    """Untied (Linear / QuantizedLinear) and tied (Embedding / QuantizedEmbedding as_linear) heads."""
    target = _quantized(name) if quantize else TARGETS[name]()
    rows = mx.array([0, 3, 17, 64, 200, 255], dtype=mx.int32)
    h = mx.random.normal((2, 5, 64), key=mx.random.key(0))
    full = target_head_fn(target)(h)
    sub = target_head_fn(target, rows)(h)
    assert sub.shape == (2, 5, 6)
    assert mx.allclose(sub, full[..., rows], atol=1e-4).item()


@pytest.fixture(scope="module")
def llama():
    target = TARGETS["llama"]()
    ref = [t for s in plain.generate(PROMPT, MAX_TOKENS, greedy, set(), model=target) for t in s.tokens]
    return target, ref


def test_proposals_are_the_argmax_over_the_vocabulary_as_target_ids(llama):
    target, _ = llama
    draft = init_dflash_draft(target, num_layers=2, block_size=8, seed=3)
    block = mx.array([[PROMPT[-1]] + [draft.mask_token_id] * 7], dtype=mx.uint32)
    taps = mx.random.normal((1, 4, 64 * len(draft.target_layer_ids)), key=mx.random.key(1))
    full = draft(block, taps, draft.make_cache())[0]
    ids = np.array([1, 5, 9, 40, 41, 100, 180, 254])
    draft.set_vocab(ids)
    assert draft.args.draft_vocab_size == 8 and draft.vocab.tolist() == ids.tolist()
    small = draft(block, taps, draft.make_cache())[0]
    assert small.shape == (7, 8)
    assert mx.allclose(small, full[:, mx.array(ids)], atol=1e-4).item()
    want = ids[np.argmax(np.array(full)[:, ids], axis=-1)]
    assert draft.draft_tokens(small).tolist() == want.tolist()
    assert draft.draft_index(mx.array([5, 6, 254])).tolist() == [1, -1, 7]
    draft.set_vocab(None)  # lifted: the whole head again
    assert draft.vocab is None and draft(block, taps, draft.make_cache()).shape[-1] == 256


def test_bad_vocabularies_are_refused(llama):
    target, _ = llama
    draft = init_dflash_draft(target, num_layers=1, block_size=4, seed=3)
    for bad, msg in (([], "distinct"), ([3, 3, 4], "distinct"), ([1, 256], r"\[0, 256\)"), ([-1, 2], r"\[0, 256\)")):
        with pytest.raises(ValueError, match=msg):
            draft.set_vocab(bad)
    assert draft.vocab is None


@pytest.mark.parametrize("bs", [2, 4, 16])
def test_greedy_output_stays_the_targets_with_a_vocabulary_missing_its_tokens(llama, bs, monkeypatch):
    """Half of the tokens the target emits are left out of the vocabulary: they can never be
    drafted, and the output is still plain greedy output, with a random and an oracle draft."""
    target, ref = llama
    missing = sorted(set(ref))[::2]
    ids = [i for i in range(256) if i not in missing]
    draft = init_dflash_draft(target, num_layers=2, block_size=16, seed=7).set_vocab(ids)
    steps, out = _run(target, draft, bs, max_tokens=MAX_TOKENS)
    assert_greedy_equal(out, ref, target)
    # The oracle proposes the target's continuation where the vocabulary has the token, and the
    # draft's own proposal (a token of the vocabulary, so not the wanted one) where it lacks it.
    truth = PROMPT + [t for s in plain.generate(PROMPT, MAX_TOKENS + 16, greedy, set(), model=target)
                      for t in s.tokens]
    real = batch_mod.draft_block

    def vocab_oracle(d, batch, L):
        blocks = real(d, batch, L).tolist()
        for r, row in enumerate(batch.rows):
            for i in range(1, L):
                want = truth[row.n - 1 + i]
                if want not in missing:
                    blocks[r][i] = want
        return mx.array(blocks, dtype=mx.uint32)

    monkeypatch.setattr(batch_mod, "draft_block", vocab_oracle)
    steps, out = _run(target, draft, bs, max_tokens=MAX_TOKENS)
    if assert_greedy_equal(out, ref, target):
        accepted = sum(s.accepted for s in steps)
        assert 0 < accepted < sum(s.drafted for s in steps)  # the left-out tokens are the misses
        # every drafted run stops at the first token the vocabulary lacks
        n = len(PROMPT)
        for s in steps:
            run = truth[n:n + s.drafted]
            first_missing = next((k for k, t in enumerate(run) if t in missing), len(run))
            assert s.accepted == first_missing
            n += len(s.tokens)


def test_vocabulary_round_trips_and_bad_checkpoints_fail_at_load(llama, tmp_path):
    target, _ = llama
    ids = list(range(0, 256, 3))
    draft = init_dflash_draft(target, num_layers=1, block_size=4, seed=5).set_vocab(ids)
    save_dflash_draft(draft, tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == len(ids)
    loaded = load_dflash_draft(tmp_path / "d", target)
    assert loaded.vocab.tolist() == ids
    a, b = dict(tree_flatten(draft.parameters())), dict(tree_flatten(loaded.parameters()))
    assert a.keys() == b.keys()  # the vocabulary is not a weight
    assert [(s.tokens, s.accepted) for s in _run(target, loaded, 4)[0]] == \
        [(s.tokens, s.accepted) for s in _run(target, draft, 4)[0]]

    weights = mx.load(str(tmp_path / "d" / "model.safetensors"))
    cases = {
        "no tensor": ({k: v for k, v in weights.items() if k != "draft_vocab"}, None, DraftCheckpointError, "missing"),
        "size": (weights, {"draft_vocab_size": 10}, DraftCheckpointError, "draft_vocab_size 10"),
        "range": ({**weights, "draft_vocab": mx.array(ids[:-1] + [300], dtype=mx.int32)}, None, DraftMismatch, "300"),
    }
    for name, (w, cfg_change, err, msg) in cases.items():
        d = tmp_path / name.replace(" ", "_")
        d.mkdir()
        mx.save_safetensors(str(d / "model.safetensors"), w)
        (d / "config.json").write_text(json.dumps({**cfg, **(cfg_change or {})}))
        with pytest.raises(err, match=msg):
            load_dflash_draft(d, target)
    d = tmp_path / "no_vocab_size"  # a config without vocab_size: ids are checked against the target's table
    d.mkdir()
    mx.save_safetensors(str(d / "model.safetensors"), {**weights, "draft_vocab": mx.array(ids[:-1] + [300], dtype=mx.int32)})
    (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "vocab_size"}))
    with pytest.raises(DraftMismatch, match="256"):
        load_dflash_draft(d, target)
    cfg.pop("draft_vocab_size")
    d = tmp_path / "tensor_only"
    d.mkdir()
    mx.save_safetensors(str(d / "model.safetensors"), weights)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftCheckpointError, match="present"):
        load_dflash_draft(d, target)


def test_choose_draft_vocab_keeps_the_most_frequent_and_the_end_tokens():
    counts = label_token_counts([[5, 5, 5, 2, 2, 9], [2, 7, 5, 300]], vocab_size=12)
    assert counts.tolist() == [0, 0, 3, 0, 0, 4, 0, 1, 0, 1, 0, 0]  # 300 is outside the table
    ids, coverage = choose_draft_vocab(counts, 3)
    assert ids.tolist() == [2, 5, 7] and coverage == pytest.approx(8 / 9)  # ties go to the lower id
    ids, coverage = choose_draft_vocab(counts, 3, always=[11])
    assert ids.tolist() == [2, 5, 11] and coverage == pytest.approx(7 / 9)
    assert choose_draft_vocab(counts, 50)[0].tolist() == list(range(12))
    with pytest.raises(ValueError, match="cannot hold"):
        choose_draft_vocab(counts, 1, always=[1, 2])


def test_a_label_outside_the_vocabulary_is_a_miss_not_a_class():
    logits = mx.array([[[4.0, 0.0, 0.0], [0.0, 4.0, 0.0]], [[0.0, 0.0, 4.0], [4.0, 0.0, 0.0]]])
    weights = mx.ones((2, 2))
    labels = mx.array([[0, -1], [2, 0]])
    ce = weighted_cross_entropy(logits, labels, weights)
    keep = mx.array([0, 2, 3])  # the three labels inside, flattened
    inside = weighted_cross_entropy(logits.reshape(4, 3)[keep], labels.reshape(4)[keep], mx.ones(3))
    assert ce.item() == pytest.approx(inside.item(), rel=1e-6)  # the -1 label adds nothing to the loss
    acc, tau = acceptance_stats(logits, labels, weights)
    assert acc.tolist() == [1.0, 0.5]  # position 2 of block 0 counts, and misses
    assert tau.item() == pytest.approx(1 + (1 + 2) / 2)
