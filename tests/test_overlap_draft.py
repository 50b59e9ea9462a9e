"""The next cycle's draft queued behind the verify (`dflash_generate(overlap_draft=True)`, the
default with the compiled draft): its first token and new context come from the verdict on the
device, so the host reads nothing before queueing it. The output, the verdicts and the caches must
be those of the serial order (draft after the read-back) and of plain greedy decoding."""
from __future__ import annotations

import mlx.core as mx
import pytest

from tests.test_compiled_draft import _OracleProposals
from tests.test_dflash import MAX_TOKENS, PROMPT, VOCAB, _run, assert_greedy_equal, pair  # noqa: F401
from worker.compiled_draft import shared_compiled_draft
from worker.sampling import greedy, make_sampler
from worker.spec.cost_model import AdaptiveBlockPolicy
from worker.spec.dflash import dflash_generate, make_target_cache


class _CountingQueue:
    """Counts the drafts queued behind a verify (and those that could not be)."""

    def __init__(self, monkeypatch, draft):
        fwd = shared_compiled_draft(draft)
        self.queued = self.refused = 0
        real = fwd.queue

        def queue(*a, **kw):
            out = real(*a, **kw)
            self.queued += out is not None
            self.refused += out is None
            return out
        monkeypatch.setattr(fwd, "queue", queue)


@pytest.mark.parametrize("bs", [2, 4, 16])
def test_overlap_gives_the_serial_steps_and_plain_greedy(pair, bs, monkeypatch):
    """Random draft (acceptance near 0: each cycle keeps one position), one row and 4 candidate
    rows (rows need the compiled verify: gemma3's sliding window keeps it to one): token for token
    and verdict for verdict the serial order's, which is plain greedy's."""
    target, draft, ref = pair
    for rows in (1, 4):
        kw = dict(compile_target=True, compile_draft=True, branches=rows)
        serial, s_out = _run(target, draft, bs, overlap_draft=False, **kw)
        counter = _CountingQueue(monkeypatch, draft)
        steps, out = _run(target, draft, bs, **kw)
        monkeypatch.undo()
        assert out == s_out
        assert [(s.drafted, s.accepted) for s in steps] == [(s.drafted, s.accepted) for s in serial]
        assert_greedy_equal(out, ref, target)
        # all but the first cycle and those within one block of max_tokens (no draft to waste)
        assert counter.queued >= len(steps) - 2 - bs and counter.refused == 0


def test_cache_invariants_every_cycle_with_the_draft_queued(pair, monkeypatch):
    """After each Step: the target cache holds committed - 1 positions; the draft context holds
    every position the target kept once the next draft is queued (behind the verify or before the
    yield), else all but the last cycle's kept positions (pending)."""
    target, draft, _ = pair
    counter = _CountingQueue(monkeypatch, draft)
    tc, dc = make_target_cache(target), draft.make_cache()
    gen = dflash_generate(PROMPT, MAX_TOKENS, greedy, (), target=target, draft=draft, block_size=4,
                          target_cache=tc, draft_cache=dc, compile_target=True, compile_draft=True)
    n_seq, pending = len(PROMPT), 0
    for s in gen:
        n_seq += len(s.tokens)
        remaining = len(PROMPT) + MAX_TOKENS - n_seq
        pending = 0 if remaining > 1 else s.accepted + 1 if s.drafted else pending + 1
        assert {c.offset for c in tc} == {n_seq - 1}
        assert {c.offset for c in dc} == {n_seq - 1 - pending}
    assert {c.offset for c in tc} == {len(PROMPT) + MAX_TOKENS - 1}
    assert counter.queued > 0


def test_closing_with_a_draft_queued_rolls_back(pair, monkeypatch):
    """A session closed after a Step whose next draft is already queued (the draft context then
    holds every kept position): the target keeps the committed positions, the draft no more."""
    target, draft, _ = pair
    counter = _CountingQueue(monkeypatch, draft)
    tc, dc = make_target_cache(target), draft.make_cache()
    gen = dflash_generate(PROMPT, MAX_TOKENS, greedy, (), target=target, draft=draft, block_size=4,
                          target_cache=tc, draft_cache=dc, compile_draft=True)
    n = sum(len(next(gen).tokens) for _ in range(4))
    assert counter.queued == 3  # the prefill step, then cycles 1-3, each of which queued the next draft
    assert {c.offset for c in dc} == {len(PROMPT) + n - 1}
    gen.close()
    assert {c.offset for c in tc} == {len(PROMPT) + n - 1}
    assert all(c.offset <= len(PROMPT) + n - 1 for c in dc)


def test_seeded_sampling_is_the_same_with_the_draft_queued(pair, monkeypatch):
    """At T > 0 (one row; the sampler's draws are keyed by position) the queued order samples
    exactly what the serial one does."""
    target, draft, _ = pair
    counter = _CountingQueue(monkeypatch, draft)
    runs = [_run(target, draft, 4, sampler=make_sampler(1.0, 1.0, 5), compile_draft=True, overlap_draft=o)
            for o in (False, True)]
    assert runs[0][1] == runs[1][1]
    assert [(s.drafted, s.accepted) for s in runs[0][0]] == [(s.drafted, s.accepted) for s in runs[1][0]]
    assert counter.queued > 0


def test_adaptive_policy_with_the_draft_queued_keeps_greedy_output(pair, monkeypatch):
    """The policy picks the next size before it has seen the cycle that queues its draft; the
    output stays plain greedy's, and it still explores plain steps and several sizes."""
    target, draft, ref = pair
    counter = _CountingQueue(monkeypatch, draft)
    policy = AdaptiveBlockPolicy(16, min_samples=1, explore_every=5, probe_every=3)
    steps, out = _run(target, draft, 16, policy=policy, compile_target=True, compile_draft=True)
    assert_greedy_equal(out, ref, target)
    assert {s.drafted + 1 for s in steps[1:]} >= {1, 2, 16}
    assert counter.queued > 0


def test_eos_inside_an_overlapped_cycle_ends_there(pair, monkeypatch):
    """EOS among the committed tokens of a cycle whose next draft was queued: output ends at the
    EOS, the caches roll back to it."""
    target, draft, ref = pair
    k = next(i for i in range(5, len(ref)) if ref[i] not in ref[:i])
    counter = _CountingQueue(monkeypatch, draft)
    tc, dc = make_target_cache(target), draft.make_cache()
    steps, out = _run(target, draft, 4, eos={ref[k]}, target_cache=tc, draft_cache=dc, compile_draft=True)
    assert_greedy_equal(out, ref[: k + 1], target)
    assert {c.offset for c in tc} == {len(PROMPT) + k}
    assert all(c.offset <= len(PROMPT) + k for c in dc)
    assert counter.queued == len(steps) - 1  # the last cycle's draft was queued too, then dropped


def test_a_draft_that_cannot_be_queued_runs_after_the_read_back(pair, monkeypatch):
    """Buffers past the compiled draft's limit: nothing is queued, the draft runs eagerly after
    the read-back, the output is unchanged."""
    target, draft, ref = pair
    monkeypatch.setattr(shared_compiled_draft(draft), "max_positions", 16)
    counter = _CountingQueue(monkeypatch, draft)
    _, out = _run(target, draft, 4, compile_draft=True)
    assert_greedy_equal(out, ref, target)
    assert counter.queued == 0 and counter.refused > 0


class _SecondRowRight(_OracleProposals):
    """Proposals whose row 0 is wrong at its first draft and whose other rows are the target's
    greedy continuation: row 1 wins every cycle, so the next draft's context must be row 1's
    taps, all of them (a queued draft that took row 0's, or only one position, differs)."""

    def _right(self, first: list, g: int, L: int, rows: int) -> mx.array:
        right = first + (self.ref + [0] * 32)[g + 1: g + L]
        wrong = right[:1] + [(right[1] + 1) % VOCAB] + right[2:]
        return mx.array([wrong] + [right] * (rows - 1), dtype=mx.uint32)


@pytest.mark.parametrize("bs", [4, 16])
def test_the_queued_draft_takes_the_winning_rows_taps(pair, bs, monkeypatch):
    """Row 1 wins every cycle with every draft accepted: the queued order commits plain greedy's
    tokens, accepts what the serial order does, and leaves the draft the same context K/V."""
    target, draft, ref = pair
    runs = {}
    for overlap in (False, True):
        fwd = shared_compiled_draft(draft)
        oracle = _SecondRowRight(fwd, len(PROMPT), ref)
        monkeypatch.setattr("worker.spec.dflash.shared_compiled_draft", lambda d: oracle)
        dc = draft.make_cache()
        steps, out = _run(target, draft, bs, compile_target=True, compile_draft=True, branches=2,
                          overlap_draft=overlap, draft_cache=dc)
        monkeypatch.undo()
        assert_greedy_equal(out, ref, target)
        runs[overlap] = steps, dc, oracle.queued
    (s_steps, s_dc, s_queued), (q_steps, q_dc, q_queued) = runs[False], runs[True]
    assert s_queued == 0 and q_queued > 0
    # the same verdicts, except that the queued order plans the last block before it knows the
    # cycle before it ended within one block of max_tokens (a longer block, cut at max_tokens)
    assert [(s.drafted, s.accepted) for s in q_steps[:-1]] == [(s.drafted, s.accepted) for s in s_steps[:-1]]
    if target.model_type != "gemma3_text":  # rows need the compiled verify (gemma3 has none)
        assert all(s.accepted == s.drafted for s in q_steps[1:-1])  # row 1 right throughout
    n = min(s_dc[0].offset, q_dc[0].offset)
    assert n >= len(PROMPT) + MAX_TOKENS - 2 * bs
    for a, b in zip(s_dc, q_dc):
        assert mx.abs(a.keys[..., :n, :] - b.keys[..., :n, :]).max().item() < 1e-4
        assert mx.abs(a.values[..., :n, :] - b.values[..., :n, :]).max().item() < 1e-4
