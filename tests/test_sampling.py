"""worker.sampling: greedy, seeded temperature / top-p samplers, validation."""
from __future__ import annotations

import math

import mlx.core as mx
import pytest
from mlx_lm import load

from worker.engine.types import InvalidRequest
from worker.sampling import greedy, make_sampler
from worker.decoding import draft_model, plain

FLAT = mx.zeros((1, 512))


def draws(sampler, logits, n):
    return [sampler(logits).tolist() for _ in range(n)]


def test_greedy_is_argmax_per_row():
    logits = mx.random.normal((5, 100), key=mx.random.key(0))
    assert greedy(logits).tolist() == mx.argmax(logits, axis=-1).tolist()
    assert make_sampler(0.0, 0.5, 7) is greedy


def test_same_seed_same_tokens_other_seed_differs():
    a = draws(make_sampler(1.0, 1.0, 123), FLAT, 20)
    assert a == draws(make_sampler(1.0, 1.0, 123), FLAT, 20)
    assert a != draws(make_sampler(1.0, 1.0, 124), FLAT, 20)
    assert len({t for row in a for t in row}) > 10  # really random over 512 equal tokens


def test_sampler_ignores_global_random_state_and_other_requests():
    ref = draws(make_sampler(0.7, 0.9, 5), FLAT, 10)
    s, other = make_sampler(0.7, 0.9, 5), make_sampler(0.7, 0.9, 6)
    got = []
    for i in range(10):
        mx.random.seed(i)
        other(FLAT)
        mx.random.uniform(shape=(3,))
        got.append(s(FLAT).tolist())
    assert got == ref


def test_temperature_follows_the_distribution():
    probs = [0.5, 0.3, 0.2]
    logits = mx.log(mx.array([probs] * 4000))
    counts = [0, 0, 0]
    for t in make_sampler(1.0, 1.0, 0)(logits).tolist():
        counts[t] += 1
    for c, p in zip(counts, probs):
        assert abs(c / 4000 - p) < 0.04
    # Low temperature sharpens towards the mode.
    sharp = make_sampler(0.05, 1.0, 0)(logits).tolist()
    assert sharp.count(0) > 3900


def test_top_p_keeps_the_nucleus_only():
    probs = [0.5, 0.3, 0.15, 0.05]
    logits = mx.log(mx.array([probs] * 4000))
    seen = set(make_sampler(1.0, 0.9, 1)(logits).tolist())
    assert seen == {0, 1, 2}  # 0.5 + 0.3 < 0.9 <= 0.5 + 0.3 + 0.15
    assert set(make_sampler(1.0, 0.5, 1)(logits).tolist()) == {0}
    assert set(make_sampler(1.0, 1e-6, 1)(logits).tolist()) == {0}


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": 1.0, "top_p": 0.0}, "top_p"),
    ({"temperature": 1.0, "top_p": 1.5}, "top_p"),
    ({"temperature": 1.0, "seed": -1}, "seed"),
    ({"temperature": 1.0, "seed": 2**64}, "seed"),
    ({"temperature": 1.0, "seed": 1.5}, "seed"),
])
def test_invalid_parameters_raise_invalid_request(kwargs, field):
    with pytest.raises(InvalidRequest, match=field):
        make_sampler(**kwargs)


def test_seeded_generation_is_reproducible(tiny_models):
    model, tok = load(str(tiny_models.llama))
    draft, _ = load(str(tiny_models.llama_near))
    prompt = tok.encode("Dzień dobry, co słychać?")

    def run_plain(seed):
        return [t for s in plain.generate(prompt, 30, make_sampler(1.0, 0.95, seed), set(), model=model)
                for t in s.tokens]

    def run_draft(seed):
        steps = draft_model.generate(prompt, 30, make_sampler(1.0, 0.95, seed), set(), model=model,
                                     draft_model=draft, num_draft_tokens=3)
        return [t for s in steps for t in s.tokens]

    assert run_plain(11) == run_plain(11)
    assert run_plain(11) != run_plain(12)
    assert run_draft(11) == run_draft(11)
    assert run_draft(11) != run_draft(12)


def test_position_keyed_rows_do_not_depend_on_batching():
    """`sample_rows` keys each row by its sequence position: one call of 6 rows, or 6 calls of
    one, give the same tokens; another seed other tokens."""
    from worker.sampling import sample_rows

    mx.random.seed(3)
    logits = mx.random.normal((6, 50)) * 3
    s = make_sampler(1.0, 0.9, seed=5)
    batched = sample_rows(s, logits, 40).tolist()
    one_by_one = [sample_rows(s, logits[i: i + 1], 40 + i).item() for i in range(6)]
    assert batched == one_by_one
    assert sample_rows(make_sampler(1.0, 0.9, seed=5), logits[2:], 42).tolist() == batched[2:]
    assert sample_rows(make_sampler(1.0, 0.9, seed=6), logits, 40).tolist() != batched
    assert sample_rows(greedy, logits, 40).tolist() == mx.argmax(logits, axis=-1).tolist()
