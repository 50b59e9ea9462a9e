"""The compiled DFlash draft (worker/compiled_draft.py): the same proposals and the same cached
context as the eager draft for every number of new context positions, and DFlash decoding through
it still equal to plain greedy decoding, token for token, at low and at full acceptance."""
from __future__ import annotations

import mlx.core as mx
import pytest

from tests.test_dflash import PROMPT, TARGETS, _run, assert_greedy_equal
from worker.compiled_draft import CompiledDraft, shared_compiled_draft
from worker.models.dflash import PaddedKVCache
from worker.models.dflash_checkpoint import init_dflash_draft
from worker.sampling import greedy
from worker.spec import plain

MAX_TOKENS = 37


def _draft_and_taps(name: str, n: int, seed: int = 7):
    target = TARGETS[name]()
    draft = init_dflash_draft(target, num_layers=2, block_size=16, seed=seed)
    width = len(draft.target_layer_ids) * draft.args.hidden_size
    taps = mx.random.normal((1, n, width), key=mx.random.key(seed))
    return target, draft, taps


def _two_caches(name: str, n: int, context: int):
    """(draft, taps (1, n, width), two draft caches each holding the first `context` taps)."""
    _, draft, taps = _draft_and_taps(name, n)
    caches = draft.make_cache(), draft.make_cache()
    for c in caches:
        draft.extend_context(taps[:, :context], c)
    return draft, taps, *caches


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_proposals_and_cache_equal_eager(name, monkeypatch):
    """Calls with 0, 1, 5, 16 and 3 new context positions at block lengths 16, 4 and 2, one of
    them growing the buffer into a new bucket: the compiled draft proposes what the eager one
    does and leaves the same context K/V at the same offset."""
    monkeypatch.setattr(PaddedKVCache, "step", 32)  # small buckets: the calls cross one
    draft, taps, eager_cache, compiled_cache = _two_caches(name, 60, 12)
    fwd = CompiledDraft(draft)
    at = 12
    for S, L in ((0, 16), (1, 16), (5, 4), (16, 16), (3, 2)):
        block = mx.array([[7 + S] + [int(draft.mask_token_id)] * (L - 1)], dtype=mx.uint32)
        new = taps[:, at: at + S] if S else None
        rows = min(3, L)  # candidate blocks too (`Model.propose`)
        want = draft.propose(draft(block, new, eager_cache)[0], block[0, :1], rows)
        got = fwd(block, new, compiled_cache, rows)
        at += S
        assert got.shape == want.shape == (rows, L) and got.dtype == want.dtype == mx.uint32
        assert got.tolist() == want.tolist()
        assert all(r[0] == 7 + S for r in got.tolist())
        for e, c in zip(eager_cache, compiled_cache):
            assert c.offset == e.offset == at
            assert mx.abs(c.keys[..., :at, :] - e.keys[..., :at, :]).max().item() < 1e-4
            assert mx.abs(c.values[..., :at, :] - e.values[..., :at, :]).max().item() < 1e-4
    assert compiled_cache[0].keys.shape[2] == 64  # 12 + 16 rows of padding + a block: past 32
    assert not fwd.broken


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_queue_equals_a_call_with_the_kept_taps(name, monkeypatch):
    """`queue` with the first token, S and the taps still arrays (rows past S garbage): the
    blocks and the cached context `__call__` gives for the first S taps, offsets left to the
    caller; once it adds S the caches match. Across a bucket, at block lengths 16, 8 and 4."""
    monkeypatch.setattr(PaddedKVCache, "step", 32)
    draft, taps, called, queued = _two_caches(name, 80, 10)
    fwd = CompiledDraft(draft)
    at = 10
    for n, S, L, rows in ((16, 16, 16, 1), (16, 5, 8, 3), (8, 1, 4, 2), (16, 9, 16, 4)):
        new = taps[:, at: at + n] + 0  # positions S..n-1 are not context (another verify's rejects)
        first = mx.array([40 + S], dtype=mx.uint32)
        block = mx.concatenate([first[None], mx.full((1, L - 1), int(draft.mask_token_id), mx.uint32)], axis=1)
        want = fwd(block, new[:, :S], called, rows)
        got = fwd.queue(first, new, mx.array(S, dtype=mx.int32), L, queued, rows)
        assert {c.offset for c in queued} == {at}  # the caller moves the offsets
        for c in queued:
            c.offset += S
        at += S
        assert got.tolist() == want.tolist()
        for a, b in zip(called, queued):
            assert a.offset == b.offset == at
            assert mx.abs(a.keys[..., :at, :] - b.keys[..., :at, :]).max().item() < 1e-5
            assert mx.abs(a.values[..., :at, :] - b.values[..., :at, :]).max().item() < 1e-5
    assert queued[0].keys.shape[2] > 32 and not fwd.broken
    # what it cannot run compiled it leaves to the caller: a block longer than the draft's
    assert fwd.queue(first, mx.zeros((1, 17, taps.shape[-1])), mx.array(1, dtype=mx.int32), 4, queued) is None
    fwd.max_positions = 8
    assert fwd.queue(first, new, mx.array(1, dtype=mx.int32), 4, queued) is None
    assert {c.offset for c in queued} == {at}


def test_more_pending_taps_than_a_block_run_eagerly():
    """More new context positions than the padded rows (after plain steps): eager, same result."""
    target, draft, taps = _draft_and_taps("qwen2", 40)
    eager_cache, compiled_cache = draft.make_cache(), draft.make_cache()
    for c in (eager_cache, compiled_cache):
        draft.extend_context(taps[:, :4], c)
    fwd = CompiledDraft(draft)
    block = mx.array([[3] + [int(draft.mask_token_id)] * 15], dtype=mx.uint32)
    want = draft.propose(draft(block, taps[:, 4:24], eager_cache)[0], block[0, :1])
    got = fwd(block, taps[:, 4:24], compiled_cache)
    assert got.tolist() == want.tolist() and compiled_cache[0].offset == eager_cache[0].offset == 24


def test_first_call_without_a_cache_runs_eagerly():
    """An empty draft cache (a one-token prompt: nothing prefilled) has no buffer to trace over."""
    target, draft, taps = _draft_and_taps("llama", 1)
    cache = draft.make_cache()
    block = mx.array([[3] + [int(draft.mask_token_id)] * 15], dtype=mx.uint32)
    blocks = CompiledDraft(draft)(block, taps, cache)
    assert blocks.shape == (1, 16) and cache[0].offset == 1


def test_caches_at_different_offsets_are_a_clear_error():
    target, draft, taps = _draft_and_taps("llama", 8)
    cache = draft.make_cache()
    draft.extend_context(taps, cache)
    cache[1].trim(2)
    with pytest.raises(ValueError, match="different offsets"):
        CompiledDraft(draft)(mx.array([[1, 2]], dtype=mx.uint32), None, cache)


def test_sessions_share_one_compiled_draft_until_the_head_changes():
    """Traces are kept on the draft; binding the same target again keeps them, a new draft
    vocabulary (a new head) drops them."""
    target, draft, _ = _draft_and_taps("qwen3", 1)
    first = shared_compiled_draft(draft)
    draft.bind(target)
    assert shared_compiled_draft(draft) is first
    draft.set_vocab(list(range(64)))
    assert shared_compiled_draft(draft) is not first


class _OracleProposals:
    """Wraps a CompiledDraft: the compiled forward runs (its cache grows as in a real run), then
    its proposals are replaced by the target's greedy continuation `ref`, so every block is
    accepted in full and the next call injects a whole block of taps."""

    def __init__(self, fwd: CompiledDraft, prompt_len: int, ref: list[int]):
        self.fwd, self.prompt_len, self.ref, self.calls, self.queued = fwd, prompt_len, ref, 0, 0

    def __call__(self, block, taps, cache, rows=1):
        got = self.fwd(block, taps, cache, rows)
        self.calls += 1
        g = cache[0].offset - self.prompt_len
        return self._right(block[0, :1].tolist(), g, block.shape[1], got.shape[0])

    def queue(self, first, taps, n_new, L, cache, rows=1):
        got = self.fwd.queue(first, taps, n_new, L, cache, rows)
        if got is None:
            return None
        self.calls += 1
        self.queued += 1
        g = cache[0].offset + n_new.item() - self.prompt_len  # the caller advances the offset later
        return self._right(first.tolist(), g, L, got.shape[0])

    def _right(self, first: list, g: int, L: int, rows: int) -> mx.array:
        return mx.array([first + (self.ref + [0] * 32)[g + 1: g + L]] * rows, dtype=mx.uint32)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("bs", [2, 4, 16])
def test_dflash_through_compiled_draft_equals_plain_greedy(name, bs, monkeypatch):
    """Random draft (acceptance near 0): the same tokens and verdicts as the eager draft. Oracle
    proposals through the compiled forward (acceptance 1, a whole block of new context each
    call): plain greedy's tokens. Both with the compiled verify, as the worker runs them."""
    target = TARGETS[name]()
    draft = init_dflash_draft(target, num_layers=2, block_size=16, seed=7)
    ref = [t for s in plain.generate(PROMPT, MAX_TOKENS, greedy, set(), model=target) for t in s.tokens]
    steps, out = _run(target, draft, bs, compile_target=True)
    c_steps, c_out = _run(target, draft, bs, compile_target=True, compile_draft=True)
    assert c_out == out
    assert [(s.drafted, s.accepted) for s in c_steps] == [(s.drafted, s.accepted) for s in steps]
    assert_greedy_equal(c_out, ref, target)

    oracle = _OracleProposals(shared_compiled_draft(draft), len(PROMPT), ref)
    monkeypatch.setattr("worker.spec.dflash.shared_compiled_draft", lambda d: oracle)
    o_steps, o_out = _run(target, draft, bs, compile_target=True, compile_draft=True)
    assert oracle.calls == len(o_steps) - 1 and not oracle.fwd.broken
    assert oracle.queued >= oracle.calls - 3  # all but the first and those near max_tokens queued early
    assert all(s.accepted == s.drafted for s in o_steps[1:-1])
    assert_greedy_equal(o_out, ref, target)


def test_new_weights_drop_the_compiled_draft():
    """`update` (loading weights) and `update_modules` (quantizing) drop the shared compiled
    draft, whose traces hold the old weights."""
    import mlx.nn as nn

    target, draft, _ = _draft_and_taps("llama", 1)
    first = shared_compiled_draft(draft)
    draft.update(draft.parameters())
    second = shared_compiled_draft(draft)
    assert second is not first
    nn.quantize(draft, group_size=32, bits=8, class_predicate=lambda p, m: isinstance(m, nn.Linear)
                and m.weight.shape[-1] % 32 == 0)
    assert shared_compiled_draft(draft) is not second
