"""worker.decoding.draft_model: golden parity with plain greedy decoding, the acceptance rule, k
shrinking, EOS inside an accepted run, and cache rollback.

Targets are tiny random llama and qwen2 models (float32). Drafts: a 1-layer random llama
(acceptance near 0), a noisy copy of the llama target (partial acceptance), and the target itself
(acceptance exactly 1).
"""
from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from worker.sampling import greedy, make_sampler
from worker.decoding import draft_model, plain

MAX_TOKENS = 37  # not a multiple of k + 1 for k in {1, 2, 4}
PROMPT_TEXT = "Pchnąć w tę łódź jeża lub ośm skrzyń fig. def add(a, b):"


@pytest.fixture(scope="module")
def models(tiny_models):
    loaded = {name: load(str(getattr(tiny_models, name)))[0]
              for name in ("llama", "qwen2", "llama_draft", "llama_near")}
    _, tok = load(str(tiny_models.llama))
    return loaded, tok.encode(PROMPT_TEXT)


def run_plain(model, prompt, max_tokens=MAX_TOKENS, eos=frozenset()):
    return [t for s in plain.generate(prompt, max_tokens, greedy, set(eos), model=model) for t in s.tokens]


def run_spec(model, draft, prompt, k, max_tokens=MAX_TOKENS, eos=frozenset(), **kw):
    steps = list(draft_model.generate(prompt, max_tokens, kw.pop("sampler", greedy), set(eos), model=model,
                                      draft_model=draft, num_draft_tokens=k, **kw))
    return [t for s in steps for t in s.tokens], steps


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("target, draft", [
    ("llama", "llama_draft"), ("llama", "llama_near"), ("llama", "self"),
    ("qwen2", "llama_draft"), ("qwen2", "self"),
])
def test_greedy_equals_plain(models, target, draft, k):
    loaded, prompt = models
    model = loaded[target]
    expected = run_plain(model, prompt)
    tokens, steps = run_spec(model, model if draft == "self" else loaded[draft], prompt, k)
    assert tokens == expected
    assert len(tokens) == MAX_TOKENS
    drafted = sum(s.drafted for s in steps)
    accepted = sum(s.accepted for s in steps)
    assert all(s.drafted <= k and s.accepted <= s.drafted for s in steps)
    assert all(len(s.tokens) == s.accepted + 1 for s in steps)
    if draft == "self":
        assert accepted == drafted > 0  # acceptance exactly 1.0
        assert len(steps) == -(-MAX_TOKENS // (k + 1))
    if draft == "llama_draft":
        assert accepted / drafted < 0.3
    if draft == "llama_near" and k == 4:
        assert 0 < accepted < drafted and any(0 < s.accepted < s.drafted for s in steps)


def test_chunked_prefill_gives_the_same_tokens(models):
    loaded, prompt = models
    model = loaded["llama"]
    expected = run_plain(model, prompt)
    assert len(prompt) > 8
    chunked = [t for s in plain.generate(prompt, MAX_TOKENS, greedy, set(), model=model, prefill_step_tokens=3)
               for t in s.tokens]
    assert chunked == expected
    tokens, _ = run_spec(model, loaded["llama_near"], prompt, 2, prefill_step_tokens=4)
    assert tokens == expected


def test_k_shrinks_near_max_tokens(models):
    loaded, prompt = models
    model = loaded["llama"]
    _, steps = run_spec(model, model, prompt, k=4, max_tokens=7)
    assert [s.drafted for s in steps] == [4, 1]  # 5 tokens, then k = 7 - 5 - 1
    _, steps = run_spec(model, model, prompt, k=4, max_tokens=6)
    assert [s.drafted for s in steps] == [4, 0]  # the last token needs no draft


@pytest.mark.parametrize("draft", ["self", "llama_near"])
def test_eos_inside_accepted_run_ends_generation(models, draft):
    loaded, prompt = models
    model = loaded["llama"]
    expected = run_plain(model, prompt)
    eos = {expected[9]}
    cut = expected[: expected.index(expected[9]) + 1]
    assert run_plain(model, prompt, eos=eos) == cut
    tokens, steps = run_spec(model, model if draft == "self" else loaded[draft], prompt, 4, eos=eos)
    assert tokens == cut
    assert steps[-1].tokens[-1] in eos


def recording(sampler, calls):
    def rec(logits):
        out = sampler(logits)
        calls.append(out)
        return out
    return rec


# 0.1: random tiny models are near-flat, so hotter sampling almost never meets a greedy draft.
@pytest.mark.parametrize("temperature", [0.0, 0.1])
def test_accepted_tokens_are_the_targets_choices(models, temperature):
    """Every committed token is the target's own choice; drafts are accepted exactly up to the
    first disagreement (greedy and sampled)."""
    loaded, prompt = models
    model = loaded["llama"]
    target_calls, draft_calls = [], []
    sampler = recording(make_sampler(temperature, 1.0, 3), target_calls)
    _, steps = run_spec(model, loaded["llama_near"], prompt, 3, sampler=sampler,
                        draft_sampler=recording(greedy, draft_calls))
    assert len(target_calls) == len(steps)
    d = 0
    for step, chosen in zip(steps, target_calls):
        chosen = chosen.tolist()
        drafts = [x.item() for x in draft_calls[d:d + step.drafted]]
        d += step.drafted
        n = step.accepted
        assert len(chosen) == step.drafted + 1
        assert step.tokens == chosen[: n + 1]
        assert drafts[:n] == chosen[:n]
        if n < step.drafted:
            assert drafts[n] != chosen[n]
    assert sum(s.accepted for s in steps) > 0


def test_caches_hold_only_committed_tokens_after_close(models):
    loaded, prompt = models
    model, draft = loaded["llama"], loaded["llama_near"]
    cache, draft_cache = make_prompt_cache(model), make_prompt_cache(draft)
    gen = draft_model.generate(prompt, MAX_TOKENS, greedy, set(), model=model, draft_model=draft,
                               num_draft_tokens=4, cache=cache, draft_cache=draft_cache)
    n = sum(len(next(gen).tokens) for _ in range(4))
    gen.close()  # a prefetched draft for cycle 5 was in flight
    # The target holds prompt + committed tokens except the last (the next verify's input).
    assert cache[0].offset == len(prompt) + n - 1
    assert len(prompt) + n - 2 <= draft_cache[0].offset <= len(prompt) + n
    # Decoding on from the rolled-back caches continues the same greedy sequence.
    expected = run_plain(model, prompt)
    logits = model(mx.array([[expected[n - 1]]]), cache=cache)
    assert mx.argmax(logits[0, -1]).item() == expected[n]


def test_cycles_report_their_times(models):
    loaded, prompt = models
    model = loaded["llama"]
    tokens, steps = run_spec(model, loaded["llama_near"], prompt, 3)
    assert tokens == run_plain(model, prompt)
    assert all(s.verify_s > 0 and s.draft_s > 0 for s in steps if s.drafted)


def test_rejects_untrimmable_cache_and_bad_arguments(models):
    loaded, prompt = models
    model = loaded["llama"]
    with pytest.raises(ValueError, match="trimmable target cache"):
        next(draft_model.generate(prompt, 5, greedy, set(), model=model, draft_model=model,
                                  cache=[ArraysCache(1) for _ in model.layers]))
    with pytest.raises(ValueError, match="num_draft_tokens"):
        next(draft_model.generate(prompt, 5, greedy, set(), model=model, draft_model=model, num_draft_tokens=0))
    with pytest.raises(ValueError, match="empty"):
        next(draft_model.generate([], 5, greedy, set(), model=model, draft_model=model))


def test_accept_prefix_rule():
    from worker.decoding.base import accept_prefix
    assert accept_prefix([5, 6, 7], [5, 6, 7, 8], set()) == (3, [5, 6, 7, 8])  # all + bonus
    assert accept_prefix([5, 9, 7], [5, 6, 7, 8], set()) == (1, [5, 6])  # stop at a mismatch
    assert accept_prefix([1, 2], [3, 2, 4], set()) == (0, [3])  # only the target's token
    assert accept_prefix([5, 2, 7], [5, 2, 7, 8], {2}) == (3, [5, 2])  # cut after EOS
    assert accept_prefix([], [4], set()) == (0, [4])
