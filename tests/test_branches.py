"""Candidate blocks verified together (`dflash_generate(branches=K)`): the draft's block and copies
with its second choice at one position each, one batched compiled verify, the row accepted
furthest kept. The output stays plain greedy's token for token, the caches keep only the chosen
row, and a second choice that is right turns a rejected position into accepted ones."""
from __future__ import annotations

import mlx.core as mx
import pytest

# `pair`: (target, random 2-layer draft, plain greedy's MAX_TOKENS tokens) for llama, qwen2, qwen3
from tests.test_compiled_forward import MAX_TOKENS, pair  # noqa: F401
from tests.test_dflash import PROMPT, _run, assert_greedy_equal
from worker.sampling import greedy, make_sampler
from worker.spec.dflash import dflash_generate, make_target_cache, verdict


def _verdict(blocks, chosen):
    return verdict(mx.array(blocks, dtype=mx.uint32), mx.array(chosen, dtype=mx.uint32)).tolist()


def test_verdict():
    """[row, accepted, bonus], on the device: the row accepted furthest, the lowest on a tie."""
    blocks = [[5, 1, 2, 3], [5, 9, 2, 3], [5, 1, 7, 3]]
    # the target's choices after each position of each row
    assert _verdict(blocks, [[1, 2, 4, 0], [1, 2, 3, 0], [1, 7, 3, 8]]) == [2, 3, 8]
    assert _verdict(blocks, [[1, 8, 0, 0], [1, 8, 0, 0], [1, 8, 0, 0]]) == [0, 1, 8]  # tie: row 0
    assert _verdict(blocks, [[0, 0, 0, 0], [9, 2, 3, 4], [0, 0, 0, 0]]) == [1, 3, 4]
    assert _verdict(blocks, [[4, 4, 4, 4], [4, 4, 4, 4], [4, 4, 4, 4]]) == [0, 0, 4]  # none accepted
    assert _verdict([[5, 1]], [[2, 6]]) == [0, 0, 2]
    assert _verdict([[5, 1, 2]], [[1, 2, 7]]) == [0, 2, 7]  # all accepted: the bonus is the last


def test_propose_rows(pair):
    """Row 0 the first choices; row r the second choice at drafted position r-1; every row starts
    with the block's first token; with a draft vocabulary, target ids."""
    target, draft, _ = pair
    logits = mx.random.normal((15, draft.args.vocab_size), key=mx.random.key(3))
    first = mx.array([42], dtype=mx.uint32)
    order = mx.argsort(-logits, axis=-1)
    top1, top2 = order[:, 0].tolist(), order[:, 1].tolist()
    rows = draft.propose(logits, first, 4)
    assert rows.shape == (4, 16) and rows.dtype == mx.uint32
    want = [[42] + top1] + [[42] + top1[:r - 1] + [top2[r - 1]] + top1[r:] for r in (1, 2, 3)]
    assert rows.tolist() == want
    assert draft.propose(logits, first).tolist() == [want[0]]
    vocab = sorted(set(top1 + top2 + list(range(50))))
    draft.set_vocab(vocab)
    try:
        sub = logits[:, mx.array(vocab)]
        assert draft.propose(sub, first, 2).tolist() == want[:2]
    finally:
        draft.set_vocab(None)


@pytest.mark.parametrize("bs", [2, 4, 16])
@pytest.mark.parametrize("compile_draft", [False, True])
def test_random_draft_with_branches_equals_plain_greedy(pair, bs, compile_draft):
    target, draft, ref = pair
    steps, out = _run(target, draft, bs, compile_target=True, compile_draft=compile_draft, branches=4)
    assert_greedy_equal(out, ref, target)
    assert all(0 <= s.accepted <= s.drafted for s in steps)


class SecondChoiceOracle:
    """A real draft whose logits rank the target's greedy continuation `ref` second at the first
    drafted position (a wrong token first) and first everywhere else: one block alone is
    rejected at its first draft every cycle; the candidate row with the second choice there is
    right throughout."""

    def __init__(self, draft, prompt_len: int, ref: list[int]):
        self.draft, self.prompt_len, self.ref = draft, prompt_len, ref

    def __getattr__(self, name):
        return getattr(self.draft, name)

    def __call__(self, inputs, target_hidden, cache):
        logits = self.draft(inputs, target_hidden, cache)
        g = cache[0].offset - self.prompt_len
        want = (self.ref + [0] * 32)[g + 1: g + inputs.shape[1]]
        V = logits.shape[-1]
        wrong = (want[0] + 1) % V
        bonus = mx.zeros((len(want), V))
        bonus = bonus + 1e4 * (mx.arange(V)[None] == mx.array(want)[:, None])
        bonus[0, wrong] = 2e4
        return logits + bonus[None].astype(logits.dtype)


@pytest.mark.parametrize("bs", [4, 16])
def test_a_right_second_choice_wins_and_the_caches_keep_its_row(pair, bs):
    target, draft, ref = pair
    oracle = SecondChoiceOracle(draft, len(PROMPT), ref)
    tc, dc = make_target_cache(target), draft.make_cache()
    gen = dflash_generate(PROMPT, MAX_TOKENS, greedy, (), target=target, draft=oracle, block_size=bs,
                          target_cache=tc, draft_cache=dc, compile_target=True, branches=2)
    out, steps = [], []
    for s in gen:
        out += s.tokens
        steps.append(s)
        assert tc[0].offset == len(PROMPT) + len(out) - 1  # the target keeps committed - 1
        assert tc[0].keys.shape[0] == 1  # one row's buffers, whichever row won
    assert_greedy_equal(out, ref, target)
    full = steps[1:-1]  # the prefill's token first; the last cycle may be cut at max_tokens
    assert full and all(s.accepted == s.drafted for s in full)  # row 1 right throughout
    # one block alone: the wrong first choice is rejected every cycle
    dc1 = draft.make_cache()
    one, one_out = _run(target, oracle, bs, compile_target=True, branches=1, draft_cache=dc1)
    assert one_out == out and all(s.accepted == 0 for s in one[1:])
    # the draft's context holds the chosen row's taps: the same as one block at a time gives
    n = min(dc[0].offset, dc1[0].offset)
    assert n >= len(PROMPT) + len(out) - 2 * bs
    for a, b in zip(dc, dc1):
        assert mx.abs(a.keys[..., :n, :] - b.keys[..., :n, :]).max().item() < 1e-3


def test_rows_fall_back_to_one_block(pair, monkeypatch):
    """Sampled requests, an uncompiled verify and buffers past branch_max_positions verify one
    block: the same output as without branches."""
    target, draft, ref = pair
    import worker.compiled_forward as cf

    calls = []
    real = cf.CompiledTarget.__call__
    monkeypatch.setattr(cf.CompiledTarget, "__call__", lambda self, x, c: calls.append(x.shape[0]) or real(self, x, c))
    sampler = make_sampler(1.0, 0.9, 5)
    _, sampled = _run(target, draft, 16, sampler=sampler, compile_target=True, branches=4)
    assert sampled == _run(target, draft, 16, sampler=make_sampler(1.0, 0.9, 5), compile_target=True)[1]
    assert calls and set(calls) == {1}
    calls.clear()
    _, out = _run(target, draft, 16, compile_target=True, branches=4, branch_max_positions=len(PROMPT) + 8)
    assert_greedy_equal(out, ref, target)
    assert calls and set(calls) == {1}
    _, out = _run(target, draft, 16, compile_target=False, branches=4)
    assert_greedy_equal(out, ref, target)
    calls.clear()
    _run(target, draft, 16, compile_target=True, branches=4)
    assert 4 in calls


def test_the_rows_memory_is_counted_and_let_go(pair):
    """Between cycles a session's caches are views of K-row buffers: `nbytes` counts all K rows;
    the shared compiled forward keeps no rows after a cycle has chosen one."""
    target, draft, ref = pair
    from worker.compiled_forward import shared_compiled_target

    tc = make_target_cache(target)
    fwd = shared_compiled_target(target, draft.target_layer_ids)
    held = []
    for s in dflash_generate(PROMPT, MAX_TOKENS, greedy, (), target=target, draft=draft, block_size=4,
                             target_cache=tc, compile_target=True, branches=3):
        c = tc[0]
        held.append(c.rows_held)
        assert c.nbytes == (c.keys.nbytes + c.values.nbytes) * c.rows_held
        assert fwd._rows is None  # chosen, so the shared forward holds no K-row buffers
    assert 3 in held


def test_the_row_limit_counts_the_buffer_not_the_offset(pair, monkeypatch):
    """With a 4096-position KV bucket a buffer is past a 2048-position limit from the first
    cycle: one block a verify."""
    target, draft, ref = pair
    import worker.compiled_forward as cf
    from worker.models.dflash import PaddedKVCache

    monkeypatch.setattr(PaddedKVCache, "step", 4096)
    calls = []
    real = cf.CompiledTarget.__call__
    monkeypatch.setattr(cf.CompiledTarget, "__call__", lambda self, x, c: calls.append(x.shape[0]) or real(self, x, c))
    _, out = _run(target, draft, 16, compile_target=True, branches=4, branch_max_positions=2048)
    assert_greedy_equal(out, ref, target)
    assert calls and set(calls) == {1}


def test_rows_that_fail_to_trace_fall_back_to_one_block(pair, monkeypatch):
    """A trace of candidate rows that fails ends rows for the shared forward, not the request,
    and not one-row compiled verifies."""
    target, draft, ref = pair
    import worker.compiled_forward as cf
    from worker.compiled_forward import shared_compiled_target

    fwd = shared_compiled_target(target, draft.target_layer_ids)
    real_fn = fwd._fns[False]

    def failing(tokens, *a):
        if tokens.shape[0] > 1:
            raise RuntimeError("no trace for rows here")
        return real_fn(tokens, *a)

    monkeypatch.setitem(fwd._fns, False, failing)
    monkeypatch.setattr(fwd, "rows_broken", False)
    calls = []
    real = cf.CompiledTarget.__call__
    monkeypatch.setattr(cf.CompiledTarget, "__call__", lambda self, x, c: calls.append(x.shape[0]) or real(self, x, c))
    _, out = _run(target, draft, 16, compile_target=True, branches=4)
    assert_greedy_equal(out, ref, target)
    assert fwd.rows_broken and not fwd.broken
    assert calls.count(4) == 1 and calls[-1] == 1  # one failed try, then one row a verify


def test_default_branches_are_four_on_cuda_one_with_small_gemm_or_elsewhere(monkeypatch):
    from worker.spec import dflash

    assert dflash.default_branches() == (4 if mx.cuda.is_available() else 1)
    monkeypatch.setattr(dflash.mx.cuda, "is_available", lambda: True)
    assert dflash.default_branches() == dflash.DEFAULT_CUDA_BRANCHES == 4
    assert dflash.default_branches(small_gemm=True) == dflash.SMALL_GEMM_CUDA_BRANCHES == 1
    monkeypatch.setattr(dflash.mx.cuda, "is_available", lambda: False)
    assert dflash.default_branches() == dflash.default_branches(small_gemm=True) == 1


@pytest.mark.parametrize("configured,swapped,want", [(None, False, 3), (None, True, 5), (1, True, 1), (2, False, 2)])
def test_the_engine_passes_the_default_rows_unless_configured(monkeypatch, tmp_path, configured, swapped, want):
    """`EngineConfig.branches` None means `default_branches()`, told whether the target's linears
    run small_gemm; a number is used as given."""
    from types import SimpleNamespace

    from worker.config import EngineConfig
    from worker.engine import modes

    seen = {}
    monkeypatch.setattr(modes, "default_branches", lambda small_gemm=False: 5 if small_gemm else 3)
    monkeypatch.setattr(modes, "uses_small_gemm", lambda target: swapped)
    monkeypatch.setattr(modes, "dflash_generate", lambda *a, **kw: seen.update(kw) or iter(()))
    monkeypatch.setattr(modes, "make_target_cache", lambda target: [])
    draft = SimpleNamespace(make_cache=lambda: [], block_size=16)
    m = SimpleNamespace(target=None, draft=draft, eos_ids=frozenset(), cost_memory=None)
    req = SimpleNamespace(prompt_tokens=[1, 2], max_tokens=4)
    cfg = EngineConfig(model_path=tmp_path, adaptive_block_size=False, branches=configured)
    modes.start_dflash(m, cfg, req, greedy)
    assert seen["branches"] == want
    with pytest.raises(ValueError, match="branches"):
        EngineConfig(model_path=tmp_path, branches=0)
