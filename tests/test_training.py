"""DFlash draft training (`worker/training/`, `flashfleet draft`): masks, forward, loss, loop,
checkpoints, data split and cache, tau evaluation, and the command end to end.

Everything runs on tiny random targets (width 64) on the CPU. `mx.compile` is left off in the
loop tests: on a fresh CPU machine MLX compiles each fused kernel with the system C++ compiler
the first time, which costs ~40 s once; `test_compiled_step_matches_uncompiled` (compiled and
uncompiled steps agree) runs with FLASHFLEET_TEST_COMPILE=1.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import llama, qwen3

from worker.capture import HiddenCapture
from worker.models.dflash import Model, ModelArgs
from worker.models.dflash_checkpoint import init_dflash_draft, load_dflash_draft
from worker.training import answers as data_mod
from worker.training.answers import build_dataset
from worker.training.data import DataError, read_prompt_files, split_heldout
from worker.training.sequences import TokenDataset, epoch_batches, length_buckets
from worker.training.evaluate import evaluate_tau
from worker.training.forward import block_hidden, block_inputs
from worker.training.loss import (
    acceptance_stats,
    block_targets,
    default_gamma,
    position_weights,
    weighted_cross_entropy,
)
from worker.training.masks import block_mask, context_mask, dense_mask, sample_anchors
from worker.training.defaults import (
    DraftSizeError,
    choose_draft_spec,
    choose_mask_token_id,
    default_draft_layers,
)
from worker.training.config import TrainConfig
from worker.training.step import learning_rate
from worker.training.taps_cache import CachedTaps, tap_cache_plan
from worker.training.trainer import Trainer

VOCAB = 256


def _tiny(module, seed, **kw):
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs(**kw))
    model.update(tree_map(lambda p: p * 4 if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return model


def tiny_llama(seed=1):
    return _tiny(llama, seed, model_type="llama", hidden_size=64, num_hidden_layers=6, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
                 tie_word_embeddings=False)


def tiny_qwen3(seed=2):
    return _tiny(qwen3, seed, model_type="qwen3", hidden_size=64, num_hidden_layers=6, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                 vocab_size=VOCAB, max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1e6)


def _taps(target, draft, tokens):
    cap = HiddenCapture(target, draft.target_layer_ids)
    with cap:
        target(tokens)
    return cap.hidden()


def _windowed(draft, target, window, causal):
    """The same weights as `draft`, every layer a sliding-window layer."""
    args = ModelArgs.from_dict({**draft.args.__dict__, "layer_types": ["sliding_attention"] * len(draft.layers),
                                "sliding_window": window, "is_causal": causal})
    sw = Model(args).bind(target)
    sw.update(draft.parameters())
    return sw


def _synthetic_dataset(n=12, seed=0):
    """Sequences with a learnable pattern: prompt of random ids, response = arithmetic runs."""
    rng = np.random.default_rng(seed)
    ds = TokenDataset()
    for i in range(n):
        prompt = rng.integers(3, VOCAB, size=int(rng.integers(3, 7))).tolist()
        start, stride = int(rng.integers(3, 200)), int(rng.integers(1, 4))
        response = [(start + stride * k) % (VOCAB - 3) + 3 for k in range(int(rng.integers(20, 30)))]
        ds.prompt_ids.append(prompt)
        ds.response_ids.append(response)
        ds.corpus.append("synthetic")
        ds.ids.append(str(i))
    return ds


# --------------------------------------------------------------------------- masks


def test_context_mask_never_sees_anchor_or_later():
    rng = np.random.default_rng(0)
    S, B = 40, 8
    anchors = rng.integers(1, S - 1, size=(3, 5))
    for window in (None, 6):
        m = np.array(context_mask(mx.array(anchors), S, B, window))
        assert m.shape == (3, 5, B, S)
        kv = np.arange(S)
        for b in range(3):
            for j in range(5):
                p = anchors[b, j]
                for k in range(B):
                    seen = kv[m[b, j, k]]
                    assert (seen < p).all()  # never the anchor itself, never anything after it
                    if window is None:
                        assert list(seen) == list(range(p))  # and all of the earlier context
                    else:  # as inference: query at p+k sees keys with (p+k) - kv < window
                        assert list(seen) == [v for v in range(p) if p + k - v < window]


def test_block_mask_and_dense_mask_are_block_diagonal():
    B = 4
    assert np.array(block_mask(B)).all()  # published drafts: bidirectional inside the block
    causal = np.array(block_mask(B, causal=True))
    assert (causal == np.tril(np.ones((B, B), bool))).all()
    anchors = mx.array([[5, 9, 2]])
    ctx = np.array(context_mask(anchors, 12, B))[0]
    dense = dense_mask(ctx, np.array(block_mask(B)))
    assert dense.shape == (3 * B, 12 + 3 * B)
    for j, p in enumerate([5, 9, 2]):
        rows = dense[j * B:(j + 1) * B]
        assert not rows[:, p:12].any()  # no context at or after the anchor
        own = np.zeros(3 * B, bool)
        own[j * B:(j + 1) * B] = True
        assert (rows[:, 12:] == own).all()  # its own block, no other block


def test_sample_anchors_in_response_distinct_and_reproducible():
    prompt_lens = np.array([4, 10, 3])
    lengths = np.array([30, 13, 4])  # the last has 0 valid anchors (p <= length-2 = 2 < 3)
    a, keep = sample_anchors(np.random.default_rng(7), prompt_lens, lengths, 8)
    assert a.shape == keep.shape == (3, 8)
    assert keep[0].all() and keep[1].sum() == 2 and not keep[2].any()
    for i in range(3):
        kept = a[i][keep[i]]
        assert len(set(kept)) == len(kept)
        assert ((kept >= prompt_lens[i]) & (kept <= lengths[i] - 2)).all()
    b, keep2 = sample_anchors(np.random.default_rng(7), prompt_lens, lengths, 8)
    assert (a == b).all() and (keep == keep2).all()


# --------------------------------------------------------------------------- forward


@pytest.mark.parametrize("make_target", [tiny_llama, tiny_qwen3])
def test_block_forward_equals_inference_forward(make_target):
    """Every training block equals the inference draft run on context taps[:p] (same weights)."""
    target = make_target()
    base = init_dflash_draft(target, num_layers=2, block_size=8, seed=3, dtype=mx.float32)
    tokens = mx.random.randint(3, VOCAB, (2, 24), key=mx.random.key(1))
    taps = _taps(target, base, tokens)
    anchors = mx.array([[3, 10, 20], [5, 1, 22]])
    for draft in (base, _windowed(base, target, 5, causal=False), _windowed(base, target, 6, causal=True)):
        blocks = block_inputs(tokens, anchors, 8, draft.mask_token_id)
        h = block_hidden(draft, draft.parameters(), taps, blocks, anchors).reshape(2, 3, 8, -1)
        for b in range(2):
            for j in range(3):
                p = anchors[b, j].item()
                ref = draft.hidden_states(blocks[b, j][None], taps[b:b + 1, :p], draft.make_cache())
                assert mx.allclose(ref[0], h[b, j], atol=1e-4).item(), (b, j)


def test_block_output_ignores_future_context_and_other_blocks():
    """Functional check of the masks: changing taps at positions >= p_j, or the other blocks'
    tokens, leaves block j unchanged; changing a tap before p_j changes it."""
    target = tiny_llama()
    draft = init_dflash_draft(target, num_layers=2, block_size=8, seed=3, dtype=mx.float32)
    tokens = mx.random.randint(3, VOCAB, (1, 30), key=mx.random.key(2))
    taps = _taps(target, draft, tokens)
    anchors = mx.array([[12, 20]])
    blocks = block_inputs(tokens, anchors, 8, draft.mask_token_id)
    ref = block_hidden(draft, draft.parameters(), taps, blocks, anchors)
    noise = 10 * mx.random.normal(taps.shape, key=mx.random.key(3))
    future = mx.where((mx.arange(30) >= 12)[None, :, None], taps + noise, taps)
    out = block_hidden(draft, draft.parameters(), future, blocks, anchors)
    assert mx.array_equal(out[0], ref[0]).item()  # block 0 (p = 12) never sees positions >= 12
    assert not mx.allclose(out[1], ref[1]).item()  # block 1 (p = 20) does see 12..19
    other = mx.concatenate([blocks[:, :1], mx.full(blocks[:, 1:].shape, 7, dtype=blocks.dtype)], axis=1)
    assert mx.array_equal(block_hidden(draft, draft.parameters(), taps, other, anchors)[0], ref[0]).item()
    past = mx.where((mx.arange(30) == 11)[None, :, None], taps + noise, taps)
    assert not mx.allclose(block_hidden(draft, draft.parameters(), past, blocks, anchors)[0], ref[0]).item()


# --------------------------------------------------------------------------- loss


def test_targets_weights_and_loss():
    tokens = mx.array([[10, 11, 12, 13, 14, 15, 0, 0]])
    lengths = mx.array([6])
    anchors = mx.array([[2, 4]])
    keep = mx.array([[True, True]])
    labels, weights = block_targets(tokens, lengths, anchors, keep, 4, gamma=2.0)
    assert labels[0, 0].tolist() == [13, 14, 15]
    w = [math.exp(-k / 2.0) for k in range(3)]
    assert np.allclose(np.array(weights[0, 0]), w)
    assert np.allclose(np.array(weights[0, 1]), [w[0], 0, 0])  # p + k >= length: no label
    assert default_gamma(16) == 7 and default_gamma(10) == 5 and default_gamma(8) == 4
    assert np.allclose(np.array(position_weights(16, 7.0))[[0, 7]], [1, math.exp(-1)])
    logits = mx.random.normal((1, 2, 3, 20), key=mx.random.key(0))
    lab = mx.array([[[1, 2, 3], [4, 5, 6]]])
    wt = mx.array([[[1.0, 0.5, 0.0], [1.0, 0.0, 0.0]]])
    ce = mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, lab[..., None], axis=-1)[..., 0]
    expected = (ce * wt).sum() / wt.sum()
    assert abs(weighted_cross_entropy(logits, lab, wt).item() - expected.item()) < 1e-5
    perfect = 50.0 * (mx.arange(20) == lab[..., None])
    acc, tau = acceptance_stats(perfect, lab, wt)
    assert tau.item() == pytest.approx(1 + (2 + 1) / 2)  # prefixes of real labels: 2 and 1


def test_learning_rate_schedule():
    lrs = [learning_rate(i / 100, 1e-3, 0.04) for i in range(101)]
    assert 0 < lrs[0] < lrs[3] < lrs[4] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))  # cosine: never increases after warmup
    assert lrs[-1] == pytest.approx(0, abs=1e-12)
    assert learning_rate(1.0, 1e-3, 0.04, min_lr_ratio=0.1) == pytest.approx(1e-4)


# --------------------------------------------------------------------------- the loop


def _trainer(target, ds, **kw):
    cfg = TrainConfig(target="", prompts=[], out="", batch_size=4, anchors=6, steps=kw.pop("steps", 40),
                      compile=kw.pop("compile", False), progress=False, lr=3e-3, **kw)
    draft = init_dflash_draft(target, num_layers=1, block_size=8, seed=5, dtype=mx.float32)
    return Trainer(target, draft, ds, cfg)


def test_time_schedule_leaves_out_each_length_class_first_step(monkeypatch):
    """A slow first step (traces, kernel compiles) counts against --max-minutes but must not use
    up the warmup: the LR schedule's progress runs on the time after it."""
    import types

    # A virtual clock: every step takes 0.02 s and a length class's first step 0.3 s more, however
    # fast or loaded the machine running the test is.
    clock = [0.0]
    monkeypatch.setattr("worker.training.trainer.time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    # 40 sequences: a warm class's step comes right before a cold one's first step, so the stall
    # must be charged to the cold step, not the step dispatched before it.
    tr = _trainer(tiny_llama(), _synthetic_dataset(n=40), steps=10_000, max_minutes=0.02, warmup=0.5)  # 1.2 s
    classes = {c for c, _ in tr._epoch[1]}
    step_fn = tr._build_step()
    seen, lrs = set(), []

    def slow_first(*inputs):
        lrs.append(tr.opt.learning_rate.item())
        width = inputs[0].shape[1]
        clock[0] += 0.02
        if width not in seen:  # the first step of a length class stalls
            seen.add(width)
            clock[0] += 0.3
        return step_fn(*inputs)

    tr._step_fn = slow_first
    tr.run(log=lambda _: None)
    assert len(seen) == len(classes) >= 1
    assert tr.startup_s >= 0.3 * len(seen) - 0.01
    assert tr.elapsed_s >= tr.budget_s  # the budget is wall time, stalls included
    # After the first stall (0.3 s of a 1.2 s budget) a wall-clock schedule would be a quarter
    # through, half-way up the warmup; leaving the stall out keeps the LR near the warmup's start.
    assert lrs[2] < 0.2 * tr.cfg.lr, lrs[:4]  # step 2 runs after step 0 is retired
    assert max(lrs) > 0.9 * tr.cfg.lr, lrs  # and the warmup completes within the budget


def test_training_reduces_loss():
    target = tiny_llama()
    ds = _synthetic_dataset()
    tr = _trainer(target, ds)
    fixed, _, _, _ = tr.batch(0)
    before = tr._loss(*fixed)[0].item()
    result = tr.run(log=lambda _: None)
    after = tr._loss(*fixed)[0].item()
    assert result["steps"] == 40
    assert after < 0.8 * before, (before, after)
    assert tr.history[-1]["loss"] < tr.history[0]["loss"]


@pytest.mark.skipif(not os.environ.get("FLASHFLEET_TEST_COMPILE"),
                    reason="set FLASHFLEET_TEST_COMPILE=1: a cold CPU machine spends ~40 s compiling kernels")
def test_compiled_step_matches_uncompiled():
    target = tiny_llama()
    ds = _synthetic_dataset(n=4)
    params = []
    for comp in (False, True):
        tr = _trainer(target, ds, steps=1, compile=comp)
        tr.run(log=lambda _: None)
        params.append(dict(tree_flatten(tr.draft.parameters())))
    for k in params[0]:
        assert mx.allclose(params[0][k], params[1][k], atol=1e-5).item(), k


def test_failed_compiled_step_falls_back_to_uncompiled():
    target = tiny_llama()
    ds = _synthetic_dataset(n=4)
    plain = _trainer(target, ds, steps=2)
    plain.run(log=lambda _: None)
    tr = _trainer(target, ds, steps=2, compile=True)
    messages = []

    def broken(*inputs):  # fails after touching the state, as a failed kernel would
        tr.draft.update(tree_map(lambda p: p * float("nan"), tr.draft.parameters()))
        raise RuntimeError("no such kernel")
    tr._step_fn = broken
    tr.run(log=messages.append)
    assert tr.step == 2 and not tr.cfg.compile and "without mx.compile" in messages[0]
    a, b = dict(tree_flatten(plain.draft.parameters())), dict(tree_flatten(tr.draft.parameters()))
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)


def test_checkpoint_resume_reproduces_the_same_state(tmp_path):
    target = tiny_llama()
    ds = _synthetic_dataset()
    straight = _trainer(target, ds, steps=6)
    straight.run(log=lambda _: None)

    first = _trainer(target, ds, steps=6)
    first.done = lambda: first.step >= 3  # stop after 3 of the 6 planned steps, as if interrupted
    first.run(checkpoint=lambda: first.save_state(tmp_path), log=lambda _: None)
    assert json.loads((tmp_path / "state.json").read_text())["step"] == 3

    resumed = _trainer(target, ds, steps=6)
    resumed.load_state(tmp_path)
    assert resumed.step == 3
    resumed.run(log=lambda _: None)
    a, b = dict(tree_flatten(straight.draft.parameters())), dict(tree_flatten(resumed.draft.parameters()))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)
    oa, ob = dict(tree_flatten(straight.opt.state)), dict(tree_flatten(resumed.opt.state))
    assert oa.keys() == ob.keys() and all(mx.array_equal(oa[k], ob[k]).item() for k in oa)

    other = Trainer(target, init_dflash_draft(target, num_layers=2, block_size=8, dtype=mx.float32), ds,
                    resumed.cfg)
    with pytest.raises(ValueError, match="another draft shape"):
        other.load_state(tmp_path)


def test_cached_taps_train_like_online_taps():
    target = tiny_llama()
    ds = _synthetic_dataset(n=6)
    online = _trainer(target, ds, steps=3)
    online.run(log=lambda _: None)
    cached = _trainer(target, ds, steps=3)
    assert cached.widths == [32, 64] and cached.tokens.shape[1] == 64
    # each sequence's taps padded to its class's width only (3 taps x D=64, float32)
    assert cached.tap_cache_bytes() == sum(32 if n <= 32 else 64 for n in cached.lengths) * 3 * 64 * 4
    assert _trainer(target, ds, length_buckets=1).tap_cache_bytes() == 6 * 64 * 3 * 64 * 4
    cached.precompute_taps(progress=False)
    cached.run(log=lambda _: None)
    a, b = dict(tree_flatten(online.draft.parameters())), dict(tree_flatten(cached.draft.parameters()))
    assert all(mx.allclose(a[k], b[k], atol=1e-5).item() for k in a)


def test_taps_cached_for_the_classes_that_fit_train_like_online_taps():
    target = tiny_llama()
    ds = _synthetic_dataset(n=6)
    online = _trainer(target, ds, steps=4)
    online.run(log=lambda _: None)
    partial = _trainer(target, ds, steps=4)
    sizes = partial.class_tap_bytes()
    assert len(sizes) == 2 and all(sizes) and sum(sizes) == partial.tap_cache_bytes()
    assert partial.classes_to_cache(sum(sizes)) == [0, 1]
    assert partial.classes_to_cache(min(sizes) - 1) == []
    big = int(np.argmax(sizes))
    assert partial.classes_to_cache(max(sizes)) == [big]  # the subset with the most bytes that fits
    assert {partial.batch(s)[3] for s in range(4)} == {0, 1}  # the run below steps in both classes
    assert tap_cache_plan(partial, sum(sizes) / 2**30) == ([0, 1], f"taps: caching the target's taps of all "
                                                        f"sequences ({sum(sizes) / 2**30:.3g} GiB)")
    classes, message = tap_cache_plan(partial, max(sizes) / 2**30)
    assert classes == [big] and f"caching length classes [{partial.widths[big]}]" in message
    assert tap_cache_plan(partial, (min(sizes) - 1) / 2**30)[0] == []
    gappy = _synthetic_dataset(n=4)
    gappy.response_ids[0] = gappy.response_ids[0] * 5  # one long sequence: the middle classes stay empty
    g = _trainer(target, gappy, length_buckets=4)
    g_sizes = g.class_tap_bytes()
    assert len(g_sizes) == 4 and g_sizes.count(0) == 2
    assert tap_cache_plan(g, sum(g_sizes) / 2**30)[1].startswith("taps: caching the target's taps of all sequences")
    spread = _synthetic_dataset(n=40, seed=4)
    spread.response_ids = [r * (1 + i % 20) for i, r in enumerate(spread.response_ids)]  # up to ~600 tokens
    many = _trainer(target, spread, length_buckets=20)  # 20 classes of 32-token steps: the greedy path
    m_sizes = many.class_tap_bytes()
    assert len(m_sizes) > 12 and many.classes_to_cache(sum(m_sizes)) == [c for c, b in enumerate(m_sizes) if b]
    top = int(np.argmax(m_sizes))
    assert many.classes_to_cache(m_sizes[top]) == [top] and many.classes_to_cache(0) == []
    partial.precompute_taps(progress=False, classes=[big])
    assert partial.taps_cached[big] is not None and partial.taps_cached[1 - big] is None
    assert partial.taps_cached[big].shape[:2] == ((partial.bucket_of == big).sum(), partial.widths[big])
    partial.run(log=lambda _: None)
    a, b = dict(tree_flatten(online.draft.parameters())), dict(tree_flatten(partial.draft.parameters()))
    assert all(mx.allclose(a[k], b[k], atol=1e-5).item() for k in a)


def test_cached_taps_read_rows_across_parts_as_one_array_would():
    whole = mx.arange(7 * 3 * 2, dtype=mx.float32).reshape(7, 3, 2)
    cached = CachedTaps([whole[0:3], whole[3:6], whole[6:7]], 3)
    assert cached.shape == (7, 3, 2) and cached.nbytes == whole.nbytes
    rows = np.array([6, 0, 4, 4, 2])
    assert mx.array_equal(cached.rows(rows), whole[mx.array(rows)]).item()
    with pytest.raises(ValueError, match="must hold 3 rows"):
        CachedTaps([whole[0:2], whole[2:5]], 3)


def test_a_length_class_whose_taps_do_not_fit_runs_online_and_the_run_goes_on():
    """Computing one class's taps can run the device out of memory (78.7 GiB on an H200). The
    backend's error drops that class's cache (logged) and training goes on, its steps running
    the target, with the same weights as an online run."""
    target = tiny_llama()
    ds = _synthetic_dataset(n=6)
    online = _trainer(target, ds, steps=4)
    online.run(log=lambda _: None)
    t = _trainer(target, ds, steps=4)
    big = int(np.argmax(t.class_tap_bytes()))
    real_taps, calls = t.taps, []

    def taps_failing_for_the_big_class(tokens):
        calls.append(tokens.shape[1])
        if tokens.shape[1] == t.widths[big] and len(calls) > 1:  # fails after one batch is held
            raise RuntimeError("[cudaMallocAsync] out of memory")
        return real_taps(tokens)

    t.taps, lines = taps_failing_for_the_big_class, []
    t.precompute_taps(progress=False, log=lines.append)
    t.taps = real_taps
    assert t.taps_cached[big] is None and t.taps_cached[1 - big] is not None
    assert len(lines) == 1 and f"length class {t.widths[big]} did not fit in memory" in lines[0]
    t.run(log=lambda _: None)
    a, b = dict(tree_flatten(online.draft.parameters())), dict(tree_flatten(t.draft.parameters()))
    assert all(mx.allclose(a[k], b[k], atol=1e-5).item() for k in a)

    def taps_with_a_bug(tokens):  # not an allocation failure: it must surface
        raise RuntimeError("a tapped layer did not run during the captured forward")

    t.taps = taps_with_a_bug
    with pytest.raises(RuntimeError, match="did not run"):
        t.precompute_taps(progress=False, log=lines.append)


def test_batches_are_a_function_of_epoch_and_stay_in_one_length_class():
    lengths = np.array([5, 40, 100, 200, 640, 300, 17, 650, 33, 120, 180, 500])
    widths, cls = length_buckets(lengths, 672, 4)
    assert widths == [192, 352, 512, 672] and all(lengths <= np.asarray(widths)[cls])
    assert all(c == 0 or lengths[i] > widths[c - 1] for i, c in enumerate(cls))  # the narrowest width
    batches = epoch_batches(cls, 4, epoch=2, seed=3)
    assert set(np.concatenate([r for _, r in batches])) == set(range(12))  # every row each epoch
    assert all(len(r) == 4 and (cls[r] == c).all() for c, r in batches)
    again = epoch_batches(cls, 4, epoch=2, seed=3)
    assert all(c1 == c2 and (r1 == r2).all() for (c1, r1), (c2, r2) in zip(batches, again))
    other = epoch_batches(cls, 4, epoch=3, seed=3)
    assert any(not (r1 == r2).all() for (_, r1), (_, r2) in zip(batches, other))
    assert length_buckets(lengths, 672, 1)[0] == [672]


# --------------------------------------------------------------------------- data


def _write_prompts(tmp_path):
    code = tmp_path / "code.jsonl"
    code.write_text("".join(json.dumps({"id": f"c{i}", "prompt": f"def f{i}(x):\n    return x + {i}"}) + "\n"
                            for i in range(12)))
    prose = tmp_path / "prose.txt"
    prose.write_text("".join(f"The number {i} is written as {i}.\n" for i in range(10)) + "\n")
    return [code, prose]


def test_heldout_split_is_disjoint_stable_and_by_prompt(tmp_path):
    files = _write_prompts(tmp_path)
    prompts = read_prompt_files(files)
    assert len(prompts) == 22 and {p.corpus for p in prompts} == {"code", "prose"}
    train, held = split_heldout(prompts, per_corpus=3, fraction=0.2)
    assert {p.text for p in train}.isdisjoint({p.text for p in held})
    assert len(train) + len(held) == len(prompts)
    assert sum(p.corpus == "code" for p in held) == 2 and sum(p.corpus == "prose" for p in held) == 2
    again = split_heldout(list(reversed(prompts)), per_corpus=3, fraction=0.2)[1]
    assert {p.text for p in again} == {p.text for p in held}  # independent of file order
    assert split_heldout(prompts, per_corpus=0)[1] == []


def test_build_dataset_caches_and_keeps_heldout_out(tmp_path, tiny_models, monkeypatch):
    from mlx_lm import load

    target, tokenizer = load(str(tiny_models.llama))
    files = _write_prompts(tmp_path)
    kw = dict(max_new_tokens=8, heldout_per_corpus=2, heldout_fraction=0.2, log=lambda _: None)
    split = build_dataset(target, tokenizer, files, tmp_path / "cache", **kw)
    assert len(split.train) + len(split.heldout) <= 22 and len(split.heldout) == 4
    held_prompts = {tuple(h["prompt_ids"]) for h in split.heldout}
    assert held_prompts.isdisjoint({tuple(p) for p in split.train.prompt_ids})
    assert all(1 < len(r) <= 8 for r in split.train.response_ids)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert all(p[0] == im_start for p in split.train.prompt_ids)  # the target's own chat template

    def no_generation(*a, **k):
        raise AssertionError("a rerun must reuse the cache")
    monkeypatch.setattr(data_mod, "generate_responses", no_generation)
    again = build_dataset(target, tokenizer, files, tmp_path / "cache", **kw)
    assert again.train.response_ids == split.train.response_ids and again.meta["key"] == split.meta["key"]
    with pytest.raises(AssertionError, match="reuse"):  # other settings: a new key, generation again
        build_dataset(target, tokenizer, files, tmp_path / "cache", **{**kw, "max_new_tokens": 9})


def test_user_turn_prefix_is_the_template_up_to_the_users_text(tiny_models):
    from mlx_lm import load

    from worker.training.synthetic import SyntheticPromptError, user_turn_prefix

    _, tokenizer = load(str(tiny_models.llama))
    prefix = user_turn_prefix(tokenizer)
    full = tokenizer.apply_chat_template([{"role": "user", "content": "def add(a, b):"}], add_generation_prompt=True)
    assert prefix == [tokenizer.convert_tokens_to_ids("<|im_start|>"), *tokenizer.encode("user\n")]
    assert list(full[:len(prefix)]) == prefix and len(full) > len(prefix)

    class NoTemplate:
        chat_template = None
    with pytest.raises(SyntheticPromptError, match="no chat template"):
        user_turn_prefix(NoTemplate())

    class Rewrites:  # a template that does not carry the user's text verbatim
        chat_template = "x"

        def apply_chat_template(self, messages, **kw):
            return "<|im_start|>user\n" + messages[0]["content"].upper()
    with pytest.raises(SyntheticPromptError, match="verbatim"):
        user_turn_prefix(Rewrites())


def test_target_written_prompts_are_distinct_and_end_at_a_special_token(tiny_models):
    from mlx_lm import load

    from worker.training.synthetic import write_user_prompts

    target, tokenizer = load(str(tiny_models.llama))
    texts = write_user_prompts(target, tokenizer, 12, max_tokens=10, temperature=1.5, seed=3, batch_size=5,
                               min_chars=4)
    assert 0 < len(texts) <= 12 and len(set(texts)) == len(texts)
    assert all(len(t) >= 4 and t == t.strip() for t in texts)
    special = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    assert not any(m in t for t in texts for m in special)
    assert write_user_prompts(target, tokenizer, 12, max_tokens=10, temperature=1.5, seed=3, batch_size=5,
                              min_chars=4) == texts  # seeded
    assert write_user_prompts(target, tokenizer, 0) == []
    with pytest.raises(ValueError, match="temperature > 0"):
        write_user_prompts(target, tokenizer, 4, temperature=0.0)


def test_build_dataset_adds_target_written_prompts(tmp_path, tiny_models, monkeypatch):
    """--synthetic-prompts: the file prompts' answers are unchanged, the target's own prompts are
    answered after them (templated like any prompt), none is held out, and the option is part of
    the cache key only when used."""
    from mlx_lm import load

    target, tokenizer = load(str(tiny_models.llama))
    files = _write_prompts(tmp_path)
    kw = dict(max_new_tokens=8, heldout_per_corpus=2, heldout_fraction=0.2, log=lambda _: None)
    plain = build_dataset(target, tokenizer, files, tmp_path / "plain", **kw)
    more = build_dataset(target, tokenizer, files, tmp_path / "more", synthetic=8, synthetic_max_tokens=12,
                         synthetic_temperature=1.5, **kw)
    own = [i for i, c in enumerate(more.train.corpus) if c == "synthetic"]
    assert own and own == list(range(len(plain.train), len(more.train)))  # after the first pass
    assert more.train.response_ids[:len(plain.train)] == plain.train.response_ids
    assert len(own) <= more.meta["synthetic_prompts_written"] <= 8
    assert more.meta["corpora"]["synthetic"] == len(own)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert all(more.train.prompt_ids[i][0] == im_start and more.train.ids[i].startswith("synthetic/0/") for i in own)
    assert more.heldout == plain.heldout
    assert "synthetic" not in plain.meta["settings"] and more.meta["key"] != plain.meta["key"]

    def no_generation(*a, **k):
        raise AssertionError("a rerun must reuse the cache")
    monkeypatch.setattr(data_mod, "generate_responses", no_generation)
    again = build_dataset(target, tokenizer, files, tmp_path / "more", synthetic=8, synthetic_max_tokens=12,
                          synthetic_temperature=1.5, **kw)
    assert again.train.ids == more.train.ids
    with pytest.raises(DataError, match="synthetic"):
        build_dataset(target, tokenizer, files, tmp_path / "bad", synthetic=-1, **kw)


def test_synthetic_prompts_fail_early_and_never_repeat_a_prompt_file(tmp_path, tiny_models, monkeypatch):
    """Problems with --synthetic-prompts are DataErrors before any generation; a written prompt
    that equals a prompt of the files (held-out ones above all) is dropped, not trained on."""
    from mlx_lm import load

    target, tokenizer = load(str(tiny_models.llama))
    files = _write_prompts(tmp_path)
    kw = dict(max_new_tokens=6, heldout_per_corpus=2, heldout_fraction=0.2, log=lambda _: None)

    def no_generation(*a, **k):
        raise AssertionError("must fail before generating")
    with monkeypatch.context() as m:
        m.setattr(data_mod, "generate_responses", no_generation)
        m.setattr(tokenizer._tokenizer, "chat_template", None)
        with pytest.raises(DataError, match="no chat template"):
            build_dataset(target, tokenizer, files, tmp_path / "a", synthetic=4, **kw)
    clash = tmp_path / "synthetic.txt"
    clash.write_text("hello there, what is this\n")
    with monkeypatch.context() as m:
        m.setattr(data_mod, "generate_responses", no_generation)
        with pytest.raises(DataError, match="rename it"):
            build_dataset(target, tokenizer, [*files, clash], tmp_path / "b", synthetic=4, **kw)
        with pytest.raises(DataError, match="temperature"):
            build_dataset(target, tokenizer, files, tmp_path / "c", synthetic=4, synthetic_temperature=0.0, **kw)

    held = split_heldout(read_prompt_files(files), 2, 0.2)[1]
    written = [held[0].text, "  " + held[1].text.replace(" ", "  "), "A brand new question about lists?"]
    monkeypatch.setattr(data_mod, "write_user_prompts", lambda *a, **k: list(written))
    split = build_dataset(target, tokenizer, files, tmp_path / "d", synthetic=3, **kw)
    own = [p for p, c in zip(split.train.prompt_ids, split.train.corpus) if c == "synthetic"]
    assert split.meta["synthetic_prompts_written"] == 1 and len(own) <= 1
    assert {tuple(h["prompt_ids"]) for h in split.heldout}.isdisjoint(map(tuple, split.train.prompt_ids))


def test_opening_text_keeps_the_first_words_as_written():
    from worker.training.synthetic import opening_text

    assert opening_text("def add(a, b):\n    return a + b", 4) == "def add(a, b):\n    return"
    assert opening_text("  Write Python code that sorts", 2) == "Write Python"
    assert opening_text("two words ", 5) == "two words"
    with pytest.raises(ValueError, match="at least one word"):
        opening_text("x", 0)


def test_target_written_prompts_start_with_their_openings(tiny_models, monkeypatch):
    """--synthetic-openings: message i is its opening plus the target's continuation; a message
    whose continuation is empty, blank or never started (time limit) is dropped, not kept as
    the opening alone."""
    from mlx_lm import load

    from worker.training import synthetic as synthetic_mod
    from worker.training.synthetic import write_user_prompts

    target, tokenizer = load(str(tiny_models.llama))
    starts = ["def sort_list(xs):", "The number seven"]
    openings = [tokenizer.encode(starts[i % 2], add_special_tokens=False) for i in range(10)]
    texts = write_user_prompts(target, tokenizer, 10, max_tokens=6, temperature=1.5, seed=2, batch_size=4,
                               min_chars=4, openings=openings)
    assert texts and all(t.startswith(starts[0]) or t.startswith(starts[1]) for t in texts)
    with pytest.raises(ValueError, match="one per message"):
        write_user_prompts(target, tokenizer, 3, openings=openings)

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    more = tokenizer.encode(" and returns it sorted", add_special_tokens=False)
    rows = [[], [eos], [*tokenizer.encode("  \n", add_special_tokens=False), eos], [*more, eos]]
    seen_prompts = []

    def fake_generate(model, prompts, *a, **k):
        seen_prompts.extend(prompts)
        return rows
    monkeypatch.setattr(synthetic_mod, "generate_responses", fake_generate)
    got = write_user_prompts(target, tokenizer, 4, min_chars=4, openings=[openings[0]] * 4)
    assert got == [tokenizer.decode(openings[0] + more).strip()]
    prefix = synthetic_mod.user_turn_prefix(tokenizer)
    assert all(p == prefix + openings[0] for p in seen_prompts)


def test_openings_of_text_without_spaces_are_a_phrase():
    from worker.training.synthetic import OPENING_CHARS_PER_WORD, opening_text

    long = "请写一个函数计算两个数的最大公约数并给出测试用例" * 3
    assert opening_text(long, 2) == long[:2 * OPENING_CHARS_PER_WORD]


def test_build_dataset_synthetic_openings_come_from_chosen_training_prompts(tmp_path, tiny_models, monkeypatch):
    """Openings are the first words of training prompts of the chosen corpora, never of a
    held-out prompt, the same for the same seed; they are part of the cache key (absent at 0
    words, so older caches keep theirs); a corpus no file gives, or none left for training, is a
    DataError before any generation."""
    from mlx_lm import load

    target, tokenizer = load(str(tiny_models.llama))
    files = _write_prompts(tmp_path)
    kw = dict(max_new_tokens=4, heldout_per_corpus=2, heldout_fraction=0.2, log=lambda _: None)
    held = {p.text for p in split_heldout(read_prompt_files(files), 2, 0.2)[1]}
    seen = []

    def fake_write(model, tok, count, **k):
        if k["openings"] is None:
            return [f"a question without an opening {i}" for i in range(count)]
        seen.append([tok.decode(o) for o in k["openings"]])
        return [f"{tok.decode(o)} and then something new {i}" for i, o in enumerate(k["openings"])]
    monkeypatch.setattr(data_mod, "write_user_prompts", fake_write)
    split = build_dataset(target, tokenizer, files, tmp_path / "o", synthetic=60, synthetic_openings=(2, ("code",)), **kw)
    code_train = [p.text for p in read_prompt_files(files) if p.corpus == "code" and p.text not in held]
    drawn = seen[0]
    assert len(drawn) == 60 and all(o.startswith("def f") and o.count(" ") == 1 for o in drawn)
    assert set(drawn) <= {" ".join(t.split()[:2]) for t in code_train}
    assert set(drawn).isdisjoint(" ".join(t.split()[:2]) for t in held)  # each code prompt's opening is its own
    assert split.meta["settings"]["synthetic_openings"] == [2, ["code"]]
    build_dataset(target, tokenizer, files, tmp_path / "o2", synthetic=60, synthetic_openings=(2, ("code",)), **kw)
    assert seen[1] == drawn  # seeded
    build_dataset(target, tokenizer, files, tmp_path / "o3", synthetic=60, synthetic_openings=(2, ("code",)),
                  **{**kw, "seed": 1})
    assert seen[2] != drawn
    again = build_dataset(target, tokenizer, files, tmp_path / "o", synthetic=60, synthetic_openings=(2, ("code",)), **kw)
    assert len(seen) == 3 and again.meta["key"] == split.meta["key"]  # the cache, not a new draw
    bare = build_dataset(target, tokenizer, files, tmp_path / "b", synthetic=6, **kw)
    zero = build_dataset(target, tokenizer, files, tmp_path / "z", synthetic=6, synthetic_openings=(0, ()), **kw)
    assert "synthetic_openings" not in bare.meta["settings"] and zero.meta["key"] == bare.meta["key"]

    def no_generation(*a, **k):
        raise AssertionError("must fail before generating")
    monkeypatch.setattr(data_mod, "generate_responses", no_generation)
    with pytest.raises(DataError, match="no prompt file of that name"):
        build_dataset(target, tokenizer, files, tmp_path / "x", synthetic=6, synthetic_openings=(2, ("humaneval",)), **kw)
    with pytest.raises(DataError, match="needs --synthetic-openings"):
        build_dataset(target, tokenizer, files, tmp_path / "y", synthetic=6, synthetic_openings=(0, ("code",)), **kw)
    train = split_heldout(read_prompt_files(files), 2, 0.2)[0]
    with pytest.raises(DataError, match="no training prompt of code"):  # e.g. every code prompt held out
        data_mod.synthetic_openings_pool([p for p in train if p.corpus != "code"], 2, ["code"])
    assert data_mod.synthetic_openings_pool(train, 1, []) == [p.text.split()[0] for p in train]

    def empty_pool(*a):
        raise DataError("no openings left")
    monkeypatch.setattr(data_mod, "synthetic_openings_pool", empty_pool)
    with pytest.raises(DataError, match="no openings left"):  # before the first pass generates anything
        build_dataset(target, tokenizer, files, tmp_path / "w", synthetic=6, synthetic_openings=(2, ("code",)), **kw)


def test_batched_generation_matches_one_by_one(tiny_models):
    from mlx_lm import load

    target, tokenizer = load(str(tiny_models.llama))
    prompts = [[1, 5, 9, 30], [1, 7], [1, 100, 101, 102, 103, 104, 3]]
    batched = data_mod.generate_responses(target, prompts, 6, [2], batch_size=3)
    single = [data_mod.generate_responses(target, [p], 6, [2], batch_size=1)[0] for p in prompts]
    assert batched == single and all(len(r) == 6 or r[-1] == 2 for r in batched)


# --------------------------------------------------------------------------- defaults, evaluation


class _FakeTokenizer:
    def __init__(self, n, added, eos):
        self._n, self.added_tokens_decoder, self.eos_token_ids = n, {i: None for i in added}, [eos]
        self.eos_token_id, self.bos_token_id, self.pad_token_id = eos, 1, 0

    def __len__(self):
        return self._n


def test_defaults_from_the_target():
    # SmolLM2-135M's shape (30 layers, d 576, 9/3 heads, MLP 1536, vocab 49152, specials 0..16):
    # weights are never evaluated, so building it costs nothing.
    smol = llama.Model(llama.ModelArgs(model_type="llama", hidden_size=576, num_hidden_layers=30,
                                       intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                                       head_dim=64, rms_norm_eps=1e-5, vocab_size=49152, tie_word_embeddings=True))
    tok = _FakeTokenizer(49152, range(17), eos=2)
    assert default_draft_layers(30) == 2 and default_draft_layers(36) == 2 and default_draft_layers(6) == 1
    spec = choose_draft_spec(smol, tok, {0, 1, 2, 5}, max_draft_mib=15)
    assert spec.num_layers == 2 and spec.target_layer_ids == [1, 8, 14, 20, 27] and spec.block_size == 16
    assert spec.mask_token_id == 16  # the highest special token no text uses
    assert spec.intermediate_size < 1536 and spec.num_params(smol) * 2 <= 15 * 2**20
    full = choose_draft_spec(smol, tok, set())
    assert full.intermediate_size == 1536 and full.num_params(smol) * 2 > 16 * 2**20
    # A padded embedding table (Qwen: 151936 rows, 151665 tokens): the first row past the tokenizer.
    assert choose_mask_token_id(_FakeTokenizer(151665, [151643, 151644], 151645), 151936, set()) == 151665
    # No spare special token: the highest id no text uses.
    assert choose_mask_token_id(_FakeTokenizer(256, [0, 1, 2], 2), 256, {255, 254}) == 253
    with pytest.raises(DraftSizeError, match="max-draft-mib"):
        choose_draft_spec(smol, tok, set(), max_draft_mib=1, draft_layers=2)


def test_evaluate_tau_time_limit_starts_after_the_first_prompt(monkeypatch):
    """The first prompt of a cold GPU is mostly kernel compiles: a limit shorter than it still
    measures the prompts that fit after it, and a limit ends the run once passed."""
    import time as _time

    import worker.training.evaluate as evaluate

    calls = []

    def fake(target, draft, ids, max_new, eos, block_size):
        _time.sleep(0.4 if not calls else 0.02)
        calls.append(ids)
        return {"cycles": 2, "accepted": 2, "tokens": 4}

    monkeypatch.setattr(evaluate, "acceptance_on_prompt", fake)
    prompts = [{"corpus": f"c{i % 3}", "prompt_ids": [i + 1, i + 2]} for i in range(9)]
    draft = type("Draft", (), {"block_size": 4})()
    res = evaluate.evaluate_tau(None, draft, prompts, 4, eos_ids=[], max_seconds=0.3, progress=False)
    assert res["all"]["prompts"] == 9  # 0.4 s of "compiles" did not use up the 0.3 s
    calls.clear()
    res = evaluate.evaluate_tau(None, draft, prompts, 4, eos_ids=[], max_seconds=0.05, progress=False)
    assert 2 <= res["all"]["prompts"] < 9


def test_evaluate_tau_is_at_least_one():
    target = tiny_llama()
    draft = init_dflash_draft(target, num_layers=1, block_size=4, seed=1)
    prompts = [{"corpus": "a", "prompt_ids": [3, 17, 42, 99]}, {"corpus": "b", "prompt_ids": [5, 6, 7]},
               {"corpus": "a", "prompt_ids": [9, 10]}]
    res = evaluate_tau(target, draft, prompts, 12, eos_ids=[], progress=False)
    assert set(res["per_corpus"]) == {"a", "b"} and res["per_corpus"]["a"]["prompts"] == 2
    for v in list(res["per_corpus"].values()) + [res["all"]]:
        assert 1.0 <= v["tau"] <= 4.0 and v["cycles"] > 0
        assert v["tokens"] == 12 * v["prompts"]
    # Per prompt, keyed by the prompt's ids: the pooled figures are their sums.
    per = res["per_prompt"]
    assert [r["corpus"] for r in per] == ["a", "b", "a"] and len({r["key"] for r in per}) == 3
    assert sum(r["cycles"] for r in per) == res["all"]["cycles"]
    lo, hi = res["all"]["interval"]
    assert lo <= res["all"]["tau"] <= hi


def test_tau_interval_and_paired_difference():
    from worker.training.evaluate import paired_tau_difference, pooled_tau_interval, prompt_key

    assert prompt_key([1, 2, 3]) == prompt_key((1, 2, 3)) != prompt_key([1, 2, 4])
    rows = [{"corpus": "c" if i % 2 else "p", "key": str(i), "cycles": 10, "accepted": a}
            for i, a in enumerate([5, 30, 12, 20, 8, 25, 15, 18])]
    lo, hi = pooled_tau_interval(rows)
    assert lo < 1 + sum(r["accepted"] for r in rows) / 80 < hi and pooled_tau_interval(rows) == [lo, hi]
    assert pooled_tau_interval(rows[:1]) is None  # one prompt: no spread to resample
    same = paired_tau_difference({"per_prompt": rows}, {"per_prompt": rows})
    assert same["difference"] == 0 and same["interval"] == [0, 0] and same["prompts"] == 8
    # Every prompt one accepted draft per cycle better: +1.0 exactly, whatever the prompts' spread,
    # while the two drafts' own intervals overlap.
    better = [dict(r, accepted=r["accepted"] + 10) for r in rows]
    d = paired_tau_difference({"per_prompt": better}, {"per_prompt": rows})
    assert d["difference"] == pytest.approx(1.0) and d["interval"] == [pytest.approx(1.0)] * 2
    assert pooled_tau_interval(better)[0] < hi
    only_c = paired_tau_difference({"per_prompt": better}, {"per_prompt": rows}, corpora=["c"])
    assert only_c["prompts"] == 4
    assert paired_tau_difference({"per_prompt": rows}, {"per_corpus": {}}) is None  # an older card
    assert paired_tau_difference({"per_prompt": rows}, {"per_prompt": [dict(rows[0], key="x")]}) is None
    one = paired_tau_difference({"per_prompt": better[:1]}, {"per_prompt": rows[:1]})
    assert one["difference"] == pytest.approx(1.0) and one["interval"] is None  # no spread from one prompt
    # Prompts without cycles: no tau on that side, and resamples without cycles are not scored.
    dry = [dict(r, cycles=0, accepted=0) for r in rows]
    none = paired_tau_difference({"per_prompt": dry}, {"per_prompt": rows})
    assert none["new"] is None and none["difference"] is None and none["interval"] is None
    mixed = [dict(r, cycles=0, accepted=0) if i < 6 else r for i, r in enumerate(rows)]
    d = paired_tau_difference({"per_prompt": mixed}, {"per_prompt": rows})
    assert d["interval"][0] <= d["difference"] <= d["interval"][1]
    # A prompt held twice pairs as the sum of its rows.
    twice = paired_tau_difference({"per_prompt": rows + rows[:1]}, {"per_prompt": rows + rows[:1]})
    assert twice["prompts"] == 8 and twice["difference"] == 0


# --------------------------------------------------------------------------- command line


def test_cli_train_writes_a_loadable_draft_and_resumes(tmp_path, tiny_models, capsys):
    from mlx_lm import load

    from flashfleet.cli.draft_cmd import main

    files = _write_prompts(tmp_path)
    out = tmp_path / "draft"
    argv = ["train", "--target", str(tiny_models.llama), "--prompts", *map(str, files), "--out", str(out),
            "--max-new-tokens", "12", "--steps", "6", "--batch-size", "4", "--anchors", "4", "--block-size", "4",
            "--heldout-per-corpus", "2", "--heldout-fraction", "0.2", "--eval-max-new-tokens", "8",
            "--no-compile", "--checkpoint-every", "3", "--quiet"]
    assert main(argv) == 0
    card = json.loads((out / "training_card.json").read_text())
    assert card["training"]["steps"] == 6 and card["draft"]["block_size"] == 4
    assert set(card["eval"]["trained"]["per_corpus"]) == {"code", "prose"}
    assert all(v["tau"] >= 1.0 for v in card["eval"]["trained"]["per_corpus"].values())
    assert "tau trained" in (out / "TRAINING.md").read_text()
    assert (tmp_path / "draft.work" / "resume" / "state.json").is_file()
    target, _ = load(str(tiny_models.llama))
    draft = load_dflash_draft(out, target, dtype=None)  # the checkpoint's own dtype
    assert draft.block_size == 4 and {v.dtype for _, v in tree_flatten(draft.parameters())} == {mx.bfloat16}

    capsys.readouterr()
    # resumed, with no room for the taps (tap_cache_plan's other cases: the test below)
    assert main([*argv[:argv.index("--steps") + 1], "9", *argv[argv.index("--steps") + 2:],
                 "--cache-taps-gib", str(20 * 2**10 / 2**30)]) == 0
    card = json.loads((out / "training_card.json").read_text())
    assert card["training"]["resumed_from_step"] == 6 and card["training"]["steps"] == 9
    printed = capsys.readouterr().out
    assert "taps: not cached (the smallest length class takes" in printed, printed
    assert main(["train", "--target", str(tiny_models.llama), "--prompts", str(tmp_path / "missing.jsonl"),
                 "--out", str(out)]) == 2


def test_cli_train_quantized_draft_is_smaller_and_evaluated_both_ways(tmp_path, tiny_models):
    from mlx_lm import load

    from flashfleet.cli.draft_cmd import main

    files = _write_prompts(tmp_path)
    out = tmp_path / "draft"
    argv = ["train", "--target", str(tiny_models.llama), "--prompts", *map(str, files), "--out", str(out),
            "--max-new-tokens", "12", "--steps", "4", "--batch-size", "4", "--anchors", "4", "--block-size", "4",
            "--heldout-per-corpus", "2", "--heldout-fraction", "0.2", "--eval-max-new-tokens", "8",
            "--no-compile", "--quiet", "--quantize-bits", "4", "--quantize-group-size", "32"]
    assert main(argv) == 0
    card = json.loads((out / "training_card.json").read_text())
    assert card["draft"]["quantization"] == {"group_size": 32, "bits": 4}
    assert set(card["eval"]) == {"trained", "unquantized"}
    assert "tau unquantized" in (out / "TRAINING.md").read_text()
    full = tmp_path / "draft.work" / "unquantized" / "model.safetensors"
    assert (out / "model.safetensors").stat().st_size < 0.5 * full.stat().st_size
    target, _ = load(str(tiny_models.llama))
    draft = load_dflash_draft(out, target)
    assert type(draft.layers[0].self_attn.q_proj).__name__ == "QuantizedLinear"

    only = tmp_path / "only"  # --no-eval-unquantized: the saved draft's tau alone
    assert main([*argv[:argv.index("--out") + 1], str(only), *argv[argv.index("--out") + 2:],
                 "--no-eval-unquantized"]) == 0
    assert set(json.loads((only / "training_card.json").read_text())["eval"]) == {"trained"}


def test_generation_order_interleaves_corpora():
    from worker.training.data import Prompt, interleave_by_corpus

    ps = [Prompt("code", f"c{i}", f"code {i}") for i in range(3)] + [Prompt("pl", f"p{i}", f"pl {i}") for i in range(2)]
    out = interleave_by_corpus(ps)
    assert [p.id for p in out] == ["c0", "p0", "c1", "p1", "c2"]
    assert sorted(p.id for p in out) == sorted(p.id for p in ps)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_static_batch_generation_equals_plain_greedy(arch):
    """Left-padded static batches (generation.generate_responses) give each prompt exactly the
    target's one-prompt greedy continuation, cut after its first EOS; gemma3's sliding window (8)
    is shorter than prompt + answer, so the batched rotating cache really wraps."""
    from test_dflash import TARGETS

    from worker.sampling import greedy
    from worker.decoding import plain
    from worker.training.generation import SYNC_EVERY, generate_responses

    target = TARGETS[arch]()
    prompts = [[3, 17, 42, 99, 7, 250, 31, 64, 12, 5, 77], [9, 4], [200, 1, 2, 3, 4, 5], [60]]
    n = 2 * SYNC_EVERY + 5  # crosses two sync points
    refs = [[t for s in plain.generate(p, n, greedy, set(), model=target) for t in s.tokens] for p in prompts]
    eos = refs[0][6]  # a token the first answer produces: that row must end there
    want = [r[:r.index(eos) + 1] if eos in r else r for r in refs]
    # Ended rows dropped at the first check (0), by the default rule, or never (2): same answers.
    for compact_at in (0.0, 0.5, 2.0):
        got = generate_responses(target, prompts, n, [eos], batch_size=3, compact_at=compact_at)  # batches 3 + 1
        assert got == want, compact_at
    assert len(got[0]) <= 7 and got[0][-1] == eos
    assert any(len(w) > SYNC_EVERY for w in want[1:3])  # a row of the first batch decodes past the drop
    with pytest.raises(ValueError, match="at least one token"):
        generate_responses(target, [[1], []], 4, [eos])


def test_sampled_pass_order_is_seeded_and_covers_every_corpus_early():
    from worker.training.data import sampled_pass_order

    corpora = ["code"] * 50 + ["en"] * 30 + ["pl"] * 5
    a, b = sampled_pass_order(corpora, 1), sampled_pass_order(corpora, 2)
    assert sorted(a) == list(range(len(corpora))) and sorted(b) == sorted(a)  # permutations
    assert a == sampled_pass_order(corpora, 1)  # reproducible
    assert a[:20] != b[:20]  # another seed answers other prompts first (what a time cap keeps)
    assert {corpora[i] for i in a[:3]} == {"code", "en", "pl"}  # round-robin over corpora
    code_order = [i for i in a if corpora[i] == "code"]
    assert code_order != sorted(code_order)  # shuffled within a corpus, not file order


def test_build_dataset_extra_sampled_answers(tmp_path, tiny_models):
    """--gen-samples 2: every training prompt is answered once greedily (as with 1 sample) and
    once more sampled; held-out prompts are still never answered; the settings key changes."""
    from mlx_lm import load

    target, tokenizer = load(str(tiny_models.llama))
    files = _write_prompts(tmp_path)
    kw = dict(max_new_tokens=8, heldout_per_corpus=2, heldout_fraction=0.2, log=lambda _: None)
    one = build_dataset(target, tokenizer, files, tmp_path / "one", **kw)
    two = build_dataset(target, tokenizer, files, tmp_path / "two", samples=2, sample_temperature=1.5, **kw)
    first = [i for i, x in enumerate(two.train.ids) if "#sample" not in x]
    extra = [i for i, x in enumerate(two.train.ids) if x.endswith("#sample1")]
    assert [two.train.response_ids[i] for i in first] == one.train.response_ids
    assert len(first) + len(extra) == len(two.train) and len(extra) >= len(first) - 2
    greedy_of = dict(zip(one.train.ids, one.train.response_ids))
    resampled = [two.train.response_ids[i] != greedy_of.get(two.train.ids[i].split("#")[0]) for i in extra]
    assert any(resampled)  # T=1.5 on a random model: the extra answers are not the greedy ones
    # The sampled pass answers in a shuffled order; at temperature 0 its answers are the greedy ones,
    # so each must land on its own prompt's id.
    again = build_dataset(target, tokenizer, files, tmp_path / "again", samples=2, sample_temperature=0.0, **kw)
    pairs = [(x.split("#")[0], r) for x, r in zip(again.train.ids, again.train.response_ids) if "#sample1" in x]
    assert len(pairs) >= len(first) - 2 and all(r == greedy_of[i] for i, r in pairs)
    held = {tuple(h["prompt_ids"]) for h in two.heldout}
    assert held.isdisjoint({tuple(p) for p in two.train.prompt_ids})
    assert two.meta["key"] != one.meta["key"]
    with pytest.raises(DataError, match="samples"):
        build_dataset(target, tokenizer, files, tmp_path / "bad", samples=0, **kw)


def test_cli_train_init_from_continues_a_saved_draft(tmp_path, tiny_models):
    """--init-from: the run starts from a saved (here 4-bit) draft's dequantized weights and shape
    instead of a random draft, so on the same data its first loss is below a fresh draft's; a
    shape option that contradicts the checkpoint is a one-line error (exit 2)."""
    from mlx_lm import load

    from flashfleet.cli.draft_cmd import main
    from worker.models.dflash_checkpoint import dequantized_weights

    files = _write_prompts(tmp_path)
    common = ["--target", str(tiny_models.llama), "--prompts", *map(str, files), "--max-new-tokens", "12",
              "--batch-size", "4", "--anchors", "4", "--block-size", "4", "--heldout-per-corpus", "2",
              "--heldout-fraction", "0.2", "--no-eval", "--no-compile", "--quiet", "--lr", "3e-3",
              "--work-dir", str(tmp_path / "work")]
    first = tmp_path / "first"
    assert main(["train", *common, "--out", str(first), "--steps", "60", "--quantize-bits", "4",
                 "--quantize-group-size", "32", "--no-resume"]) == 0
    fresh, cont = tmp_path / "fresh", tmp_path / "cont"
    assert main(["train", *common, "--out", str(fresh), "--steps", "1", "--no-resume", "--log-every", "1"]) == 0
    assert main(["train", *common, "--out", str(cont), "--steps", "1", "--no-resume", "--log-every", "1",
                 "--init-from", str(first)]) == 0
    loss = {d: json.loads((d / "training_card.json").read_text())["training"]["curve"][0]["loss"]
            for d in (fresh, cont)}
    assert loss[cont] < loss[fresh]
    card = json.loads((cont / "training_card.json").read_text())
    assert card["training"]["init_from"] == str(first) and "--init-from" in (cont / "TRAINING.md").read_text()
    target, _ = load(str(tiny_models.llama))
    w = dequantized_weights(load_dflash_draft(first, target))
    assert "layers.0.self_attn.q_proj.weight" in w and all(v.dtype == mx.float32 for v in w.values())
    assert main(["train", *common, "--out", str(tmp_path / "bad"), "--steps", "1", "--no-resume",
                 "--init-from", str(first), "--mask-token-id", "7"]) == 2


def test_cli_train_init_from_another_targets_draft_fails_before_any_work(tmp_path, tiny_models, capsys,
                                                                         monkeypatch):
    """A draft made for another target (here the shipped 0.5B one: hidden 896 against 64) is refused
    by the preflight, before the target generates data."""
    from flashfleet.cli.draft_cmd import main
    import worker.training.train as train_mod

    monkeypatch.setattr(train_mod, "train_draft", lambda *a, **k: pytest.fail("training started"))
    shipped = Path(__file__).resolve().parents[1] / "flashfleet" / "drafts" / "Qwen2.5-Coder-0.5B-Instruct"
    files = _write_prompts(tmp_path)
    assert main(["train", "--target", str(tiny_models.llama), "--prompts", *map(str, files),
                 "--out", str(tmp_path / "d"), "--init-from", str(shipped), "--quiet"]) == 2
    assert "draft hidden_size 896 != target hidden size 64" in capsys.readouterr().err


def test_cli_eval_takes_the_dflash_keyword(tmp_path, tiny_models, capsys, monkeypatch):
    """`draft eval --draft dflash` evaluates the draft shipped for --target, as `worker` and `up`
    resolve it; a target without one is a one-line error before it loads."""
    from mlx_lm import load

    import flashfleet.models.drafts as drafts
    from flashfleet.cli.draft_cmd import main
    from worker.models.dflash_checkpoint import save_dflash_draft

    files = _write_prompts(tmp_path)
    common = ["eval", "--target", str(tiny_models.llama), "--draft", "dflash", "--prompts", str(files[0]),
              "--max-new-tokens", "4", "--max-prompts-per-file", "1", "--quiet", "--json"]
    assert main(common) == 2
    assert "no DFlash draft ships for model" in capsys.readouterr().err
    target, _ = load(str(tiny_models.llama))
    shipped = tmp_path / "shipped"
    save_dflash_draft(init_dflash_draft(target, num_layers=1, block_size=4, seed=1, dtype=mx.float32), shipped)
    monkeypatch.setattr(drafts, "shipped_draft_dir", lambda model: shipped)
    assert main(common) == 0
    assert json.loads(capsys.readouterr().out)["all"]["prompts"] == 1
    # A catalog model's name is a target or a classic draft, never a DFlash draft: said so, not
    # "does not exist".
    for cmd in (common, ["vocab", "--target", str(tiny_models.llama), "--draft", "dflash", "--out",
                         str(tmp_path / "v"), "--size", "8", "--data", str(files[0])]):
        bad = [a if a != "dflash" else "SmolLM2-135M-Instruct" for a in cmd]
        assert main(bad) == 2
        assert "SmolLM2-135M-Instruct is a catalog model, not a DFlash draft" in capsys.readouterr().err


def test_cli_train_with_a_draft_vocabulary_saves_resumes_and_continues_it(tmp_path, tiny_models, capsys):
    """--draft-vocab K: the saved draft proposes from the K most frequent answer tokens (the
    card says how much of the data they cover), a resumed run keeps them, a resumed run asked
    for another K is a one-line error, and --init-from carries them on unless told otherwise."""
    from mlx_lm import load

    from flashfleet.cli.draft_cmd import main
    from worker.training.sequences import TokenDataset
    from worker.training.defaults import choose_draft_vocab, label_token_counts

    files = _write_prompts(tmp_path)
    common = ["--target", str(tiny_models.llama), "--prompts", *map(str, files), "--max-new-tokens", "12",
              "--batch-size", "4", "--anchors", "4", "--block-size", "4", "--heldout-per-corpus", "2",
              "--heldout-fraction", "0.2", "--eval-max-new-tokens", "8", "--no-compile", "--quiet",
              "--lr", "3e-3", "--log-every", "1"]
    out, work = tmp_path / "draft", tmp_path / "work"
    argv = ["train", *common, "--out", str(out), "--work-dir", str(work), "--steps", "30", "--draft-vocab", "40",
            "--checkpoint-every", "10"]
    assert main(argv) == 0
    card = json.loads((out / "training_card.json").read_text())
    curve = card["training"]["curve"]
    assert curve[-1]["loss"] < curve[0]["loss"]  # it trains through the smaller head
    vocab = card["draft"]["draft_vocab"]
    assert vocab["size"] == 40 and 0 < vocab["coverage"] <= 1
    assert "draft vocabulary: the 40 most frequent" in (out / "TRAINING.md").read_text()
    printed = capsys.readouterr().out
    assert "vocab: the draft proposes from 40 of" in printed, printed
    target, tokenizer = load(str(tiny_models.llama))
    draft = load_dflash_draft(out, target)
    data = TokenDataset.load(work / "data" / "train.jsonl")
    want, _ = choose_draft_vocab(label_token_counts(data.response_ids, draft.args.vocab_size), 40,
                                        always=tokenizer.eos_token_ids)
    assert draft.vocab.tolist() == want.tolist()
    # (the card's coverage is over the training split, which the validation share leaves out of data)
    assert set(tokenizer.eos_token_ids) <= set(draft.vocab.tolist())

    assert main([*argv[:argv.index("--steps") + 1], "35", *argv[argv.index("--steps") + 2:]]) == 0  # resumed
    card = json.loads((out / "training_card.json").read_text())
    assert card["training"]["resumed_from_step"] == 30 and card["draft"]["draft_vocab"]["size"] == 40
    assert load_dflash_draft(out, target).vocab.tolist() == want.tolist()
    capsys.readouterr()
    assert main([*argv[:argv.index("--draft-vocab") + 1], "20", *argv[argv.index("--draft-vocab") + 2:]]) == 2
    assert "--draft-vocab 20 (the checkpoint has 40)" in capsys.readouterr().err

    cont = tmp_path / "cont"  # --init-from keeps the vocabulary; --draft-vocab 0 lifts it
    assert main(["train", *common, "--out", str(cont), "--steps", "1", "--no-resume", "--no-eval",
                 "--work-dir", str(work), "--init-from", str(out)]) == 0
    assert load_dflash_draft(cont, target).vocab.tolist() == want.tolist()
    assert main(["train", *common, "--out", str(cont), "--steps", "1", "--no-resume", "--no-eval",
                 "--work-dir", str(work), "--init-from", str(out), "--draft-vocab", "0"]) == 0
    assert load_dflash_draft(cont, target).vocab is None
    # A plain rerun into a finished draft with no checkpoint of it to continue refuses unasked.
    capsys.readouterr()
    again = ["train", *common, "--out", str(cont), "--steps", "1", "--no-eval",
             "--work-dir", str(tmp_path / "other-work"), "--init-from", str(out)]
    assert main(again) == 2
    assert f"--out {cont} already holds a draft" in capsys.readouterr().err
    assert main([*again, "--overwrite"]) == 0


def test_cli_vocab_gives_a_saved_draft_a_vocabulary_from_a_data_cache(tmp_path, tiny_models, capsys):
    """`flashfleet draft vocab`: the same vocabulary `train --draft-vocab` would choose from the
    same answers (.jsonl or .xz), the weights untouched; --size 0 lifts it; bad data exits 2."""
    import lzma

    from mlx_lm import load

    from flashfleet.cli.draft_cmd import main
    from worker.models.dflash_checkpoint import init_dflash_draft, save_dflash_draft
    from worker.training.defaults import choose_draft_vocab, label_token_counts

    target, tokenizer = load(str(tiny_models.llama))
    src = tmp_path / "src"
    save_dflash_draft(init_dflash_draft(target, num_layers=1, block_size=4, seed=2), src)
    rows = [{"corpus": "c", "id": str(i), "prompt_ids": [1, 2], "response_ids": [5 + i % 7, 9, 9, 11 + i % 3]}
            for i in range(30)]
    data = tmp_path / "train.jsonl.xz"
    with lzma.open(data, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    out = tmp_path / "out"
    base = ["vocab", "--target", str(tiny_models.llama), "--draft", str(src), "--data", str(data)]
    assert main([*base, "--size", "6", "--out", str(out)]) == 0
    assert "covering" in capsys.readouterr().out
    got = load_dflash_draft(out, target)
    counts = label_token_counts([r["response_ids"] for r in rows], got.args.vocab_size)
    assert got.vocab.tolist() == choose_draft_vocab(counts, 6, always=tokenizer.eos_token_ids)[0].tolist()
    a, b = (dict(tree_flatten(load_dflash_draft(d, target).parameters())) for d in (src, out))
    assert all(mx.array_equal(a[k], b[k]) for k in a)
    assert main([*base[:-1], str(out / "model.safetensors"), "--size", "0", "--out", str(out)]) == 2
    assert "not a data cache" in capsys.readouterr().err
    assert main([*base, "--size", "0", "--out", str(out)]) == 0
    assert load_dflash_draft(out, target).vocab is None


@pytest.mark.parametrize("bad", [["--gen-samples", "0"], ["--gen-sample-temperature", "0"], ["--gen-top-p", "1.5"],
                                 ["--gen-temperature", "-1"], ["--gen-batch-size", "0"], ["--anchors", "0"],
                                 ["--batch-size", "0"], ["--steps", "-3"], ["--max-new-tokens", "0"],
                                 ["--block-size", "1"]])
def test_cli_train_rejects_bad_values_before_loading_anything(bad, capsys):
    from flashfleet.cli.draft_cmd import main

    with pytest.raises(SystemExit) as e:  # argparse: exit 2 and the flag's name, nothing loaded
        main(["train", "--target", "/nonexistent", "--prompts", "x.jsonl", "--out", "/tmp/never", *bad])
    assert e.value.code == 2 and bad[0] in capsys.readouterr().err


def test_cli_train_input_errors_are_one_line_exit_2(tmp_path, tiny_models, monkeypatch, capsys):
    """A directory as a prompt file, a rerun whose data options changed under an existing
    checkpoint (caught before any generation), and eval with nothing to evaluate: exit 2."""
    from flashfleet.cli.draft_cmd import main

    files = _write_prompts(tmp_path)
    base = ["train", "--target", str(tiny_models.llama), "--out", str(tmp_path / "d"), "--max-new-tokens", "8",
            "--steps", "2", "--batch-size", "4", "--anchors", "4", "--block-size", "4", "--heldout-per-corpus", "2",
            "--heldout-fraction", "0.2", "--no-eval", "--no-compile", "--quiet"]
    assert main([*base, "--prompts", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert main([*base, "--prompts", *map(str, files)]) == 0

    def no_generation(*a, **k):
        raise AssertionError("must fail before generating")
    monkeypatch.setattr(data_mod, "generate_responses", no_generation)
    assert main([*base, "--prompts", *map(str, files), "--gen-samples", "2"]) == 2
    assert "--no-resume" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["eval", "--target", str(tiny_models.llama), "--draft", str(tmp_path / "d"),
                 "--prompts", str(empty), "--quiet"]) == 2
    assert "no prompts to evaluate" in capsys.readouterr().err


def test_time_cut_data_is_flagged_on_reuse_and_can_be_regenerated(tmp_path, tiny_models, monkeypatch):
    from mlx_lm import load

    target, tokenizer = load(str(tiny_models.llama))
    files = _write_prompts(tmp_path)
    kw = dict(max_new_tokens=8, heldout_per_corpus=2, heldout_fraction=0.2, gen_batch_size=2)
    first = build_dataset(target, tokenizer, files, tmp_path / "c", gen_max_seconds=1e-9, log=lambda _: None, **kw)
    assert first.meta["generation_stopped_by_time_limit"]
    lines = []
    build_dataset(target, tokenizer, files, tmp_path / "c", log=lines.append, **kw)
    assert any("reusing" in x for x in lines) and any("--regenerate-data" in x for x in lines)
    again = build_dataset(target, tokenizer, files, tmp_path / "c", regenerate=True, log=lambda _: None, **kw)
    assert len(again.train) > len(first.train) and not again.meta["generation_stopped_by_time_limit"]


def test_prompt_writing_cut_by_the_time_limit_says_so(tmp_path, tiny_models, monkeypatch):
    """Fewer target-written prompts than asked for: the log line says whether the time limit,
    not repeats, cut them, and what to change."""
    import time

    from mlx_lm import load

    real = data_mod.write_user_prompts

    def slow(*a, max_seconds=None, **k):  # writing that uses up its share of the time
        time.sleep(max_seconds or 0)
        return real(*a, max_seconds=max_seconds, **k)
    monkeypatch.setattr(data_mod, "write_user_prompts", slow)

    target, tokenizer = load(str(tiny_models.llama))
    files = _write_prompts(tmp_path)
    kw = dict(max_new_tokens=8, heldout_per_corpus=2, heldout_fraction=0.2, gen_batch_size=2, synthetic=4,
              synthetic_max_tokens=12, synthetic_temperature=1.5)
    cut, free = [], []
    build_dataset(target, tokenizer, files, tmp_path / "cut", gen_max_seconds=3, log=cut.append, **kw)
    build_dataset(target, tokenizer, files, tmp_path / "free", log=free.append, **kw)
    wrote = [x for x in cut if "distinct new prompts" in x]
    assert wrote and "stopped at its limit" in wrote[0] and "--gen-max-minutes" in wrote[0]
    assert not any("stopped at its limit" in x for x in free if "distinct new prompts" in x)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_copy_target_layers_takes_matching_weights_only(arch):
    """Draft layer i of n starts as target layer L-n+i where names and shapes match: attention
    always, the MLP only at the target's width; Gemma's offset-style norm scales never."""
    from test_dflash import TARGETS

    from worker.capture import target_layers
    from worker.training.defaults import DraftSpec, copy_target_layers, make_draft

    target = TARGETS[arch]()
    L = len(target_layers(target))
    taps, mask = [1, L - 2], 0
    for mlp in (target.args.intermediate_size, 32):
        draft = make_draft(target, DraftSpec(2, 8, taps, mask, mlp), seed=0)
        before = dict(tree_flatten(draft.parameters()))
        copied = copy_target_layers(draft, target)
        after = dict(tree_flatten(draft.parameters()))
        src = dict(tree_flatten(target_layers(target)[L - 1].parameters()))
        assert "layers.1.self_attn.q_proj.weight" in copied
        assert mx.array_equal(after["layers.1.self_attn.o_proj.weight"], src["self_attn.o_proj.weight"]).item()
        assert ("layers.1.mlp.down_proj.weight" in copied) == (mlp == target.args.intermediate_size)
        norms = [k for k in copied if "layernorm" in k]
        assert (norms == []) == (arch == "gemma3") and "norm.weight" not in copied
        untouched = [k for k in after if k not in copied]
        assert "fc.weight" in untouched and all(mx.array_equal(after[k], before[k]).item() for k in untouched)
    if arch == "llama":  # a 4-bit target: its layers are dequantized on the way
        nn.quantize(target, group_size=32, bits=4)
        draft = make_draft(target, DraftSpec(2, 8, taps, mask, 32), seed=0)
        assert "layers.1.self_attn.q_proj.weight" in copy_target_layers(draft, target)
        q = target_layers(target)[L - 1].self_attn.q_proj
        want = mx.dequantize(q.weight, q.scales, q.biases, q.group_size, q.bits)
        assert mx.allclose(draft.layers[1].self_attn.q_proj.weight, want.astype(mx.float32)).item()


def test_preflight_catches_bad_inputs_without_loading_weights(tmp_path, tiny_models):
    """`preflight` (run once by the --processes launcher): a clash with the --init-from draft's
    shape, a directory that is no draft, an unloadable tokenizer with --synthetic-prompts and an
    unparsable prompt file are clear errors; good inputs pass."""
    from mlx_lm import load

    from worker.models.dflash_checkpoint import init_dflash_draft, save_dflash_draft
    from worker.training.data import DataError
    from worker.training.config import TrainConfigError
    from worker.training.preflight import preflight

    files = [str(f) for f in _write_prompts(tmp_path)]
    target, _ = load(str(tiny_models.llama))
    save_dflash_draft(init_dflash_draft(target, num_layers=1, block_size=4, seed=0), tmp_path / "init")
    save_dflash_draft(init_dflash_draft(target, num_layers=2, block_size=4, seed=0), tmp_path / "init2")
    base = dict(target=str(tiny_models.llama), prompts=files, out=str(tmp_path / "out"))
    preflight(TrainConfig(**base, init_from=str(tmp_path / "init"), synthetic_prompts=4))  # all good
    preflight(TrainConfig(**base, init_from=str(tmp_path / "init"), draft_layers=2))  # grows: fine
    with pytest.raises(TrainConfigError, match=r"--draft-layers 1 \(the draft has 2; it can grow, not shrink\)"):
        preflight(TrainConfig(**base, init_from=str(tmp_path / "init2"), draft_layers=1))
    with pytest.raises(TrainConfigError, match="--init-from: .*no config.json"):
        preflight(TrainConfig(**base, init_from=str(tmp_path)))
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((Path(tiny_models.llama) / "config.json").read_text())
    preflight(TrainConfig(**{**base, "target": str(bare)}))  # no tokenizer needed without synthetic
    with pytest.raises(DataError, match="cannot load the tokenizer"):
        preflight(TrainConfig(**{**base, "target": str(bare)}, synthetic_prompts=4))
    with pytest.raises(DataError, match="temperature > 0"):
        preflight(TrainConfig(**base, synthetic_prompts=4, synthetic_temperature=0.0))
    preflight(TrainConfig(**base, synthetic_prompts=4, synthetic_openings=3, synthetic_openings_from=["code"]))
    with pytest.raises(DataError, match="give --synthetic-prompts"):
        preflight(TrainConfig(**base, synthetic_openings=3))
    with pytest.raises(DataError, match="no prompt file of that name"):
        preflight(TrainConfig(**base, synthetic_prompts=4, synthetic_openings=3, synthetic_openings_from=["cod"]))
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    with pytest.raises(DataError, match="invalid JSON"):
        preflight(TrainConfig(**{**base, "prompts": [bad]}))
    other = tmp_path / "other-data"  # --extra-data written for another target
    other.mkdir()
    (other / "train.jsonl").write_text("")
    (other / "meta.json").write_text(json.dumps({"settings": {"target": "someone-else"}}))
    with pytest.raises(DataError, match="another target"):
        preflight(TrainConfig(**base, extra_data=[str(other)]))


def test_training_card_says_how_synthetic_prompts_began():
    """TRAINING.md names the openings of the synthetic prompts when they had any (the shipped
    1.5B draft's real card, with and without them)."""
    from worker.training.card import render_card

    card = json.loads((Path(__file__).resolve().parents[1] / "flashfleet" / "drafts" / "Qwen2.5-Coder-1.5B-Instruct"
                       / "training_card.json").read_text())
    card["data"] |= {"synthetic_prompts": 13000}  # as a run that had the target write prompts records it
    card["data"] |= {"synthetic_openings": 0, "synthetic_openings_from": []}  # as a bare run records them
    bare = render_card(card)
    assert "prompts written by the target itself" in bare and "begun with" not in bare
    card["data"] |= {"synthetic_openings": 4, "synthetic_openings_from": ["code_requests", "humaneval"]}
    opened = render_card(card)
    assert "each begun with the first 4 words of a training prompt of code_requests, humaneval" in opened
    assert "tokens after the opening" in opened and "after the opening" not in bare


def test_ctrl_c_stops_at_a_step_boundary_with_a_checkpoint_that_resumes(tmp_path):
    """The first SIGINT during training lets the step in flight finish, saves the checkpoint and
    raises TrainingInterrupted; resuming from it ends where an uninterrupted run ends."""
    import signal

    from worker.training.interrupt import TrainingInterrupted

    target = tiny_llama()
    ds = _synthetic_dataset()
    straight = _trainer(target, ds, steps=6)
    straight.run(log=lambda _: None)

    first = _trainer(target, ds, steps=6)
    batch = first.batch
    first.batch = lambda step: (signal.raise_signal(signal.SIGINT) if step == 3 else None, batch(step))[1]
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN under nohup or in a background job
    with pytest.raises(TrainingInterrupted) as info:
        first.run(checkpoint=lambda: first.save_state(tmp_path), log=lambda _: None)
    saved = json.loads((tmp_path / "state.json").read_text())["step"]
    assert info.value.saved and info.value.step == saved == first.step and 3 <= saved < 6
    assert signal.getsignal(signal.SIGINT) == before  # restored

    resumed = _trainer(target, ds, steps=6)
    resumed.load_state(tmp_path)
    resumed.run(log=lambda _: None)
    a, b = dict(tree_flatten(straight.draft.parameters())), dict(tree_flatten(resumed.draft.parameters()))
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)


def test_cli_says_how_to_resume_after_ctrl_c(tmp_path, tiny_models, capsys, monkeypatch):
    import worker.training.train as train_mod
    from flashfleet.cli.draft_cmd import main
    from worker.training.interrupt import TrainingInterrupted

    def interrupted(cfg):
        raise TrainingInterrupted(17, saved=True)

    monkeypatch.setattr(train_mod, "train_draft", interrupted)
    files = _write_prompts(tmp_path)
    out = tmp_path / "d"
    assert main(["train", "--target", str(tiny_models.llama), "--prompts", *map(str, files),
                 "--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert "interrupted at step 17" in err and f"{out}.work/resume" in err and "run the same command" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("flags, message", [
    (["--target-layer-ids", "1", "999"], "--target-layer-ids [999] out of range: the target has"),
    (["--target-layer-ids", "1", "1"], "repeats a layer"),
    (["--mask-token-id", "10000000"], "--mask-token-id 10000000 out of range"),
])
def test_cli_train_checks_taps_and_mask_before_any_work(tmp_path, tiny_models, capsys, monkeypatch, flags,
                                                        message):
    import worker.training.train as train_mod
    from flashfleet.cli.draft_cmd import main

    monkeypatch.setattr(train_mod, "build_dataset", lambda *a, **k: pytest.fail("generation started"))
    files = _write_prompts(tmp_path)
    assert main(["train", "--target", str(tiny_models.llama), "--prompts", *map(str, files),
                 "--out", str(tmp_path / "d"), *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--lr", "-1"], "argument --lr: must be a number in [0, inf)"),
    (["--heldout-fraction", "1.5"], "argument --heldout-fraction: must be a number in [0, 1)"),
    (["--draft-layers", "0"], "argument --draft-layers: must be >= 1"),
    (["--warmup", "nan"], "argument --warmup: must be a number in [0, 1)"),
    (["--grad-clip", "-0.5"], "argument --grad-clip: must be a number in [0, inf)"),
])
def test_cli_train_rejects_out_of_range_numbers(capsys, flags, message):
    from flashfleet.cli.draft_cmd import main

    with pytest.raises(SystemExit) as info:
        main(["train", "--target", "t", "--prompts", "p", "--out", "o", *flags])
    assert info.value.code == 2 and message in capsys.readouterr().err
