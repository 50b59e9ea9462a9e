"""Penalties and logit bias (worker/engine/penalties.py): the math against mlx-lm's logits
processors, the per-position state of a DFlash verify, validation, and in the engine: greedy DFlash
output equals greedy plain output with penalties and with a logit bias (a random draft and an
oracle draft whose drafts are accepted), a bias that forces or bans a token, and the refusals."""
from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import (make_frequency_penalty, make_logits_processors, make_presence_penalty,
                                 make_repetition_penalty)

import worker.engine.batch as batch_mod
from harness import run_request
from worker.config import EngineConfig
from worker.engine.penalties import RowPenalties, validate_penalties
from worker.engine.thread import Engine
from worker.engine.types import GenerationRequest, InvalidRequest, SamplingParams

V = 300
PROMPT = [3, 7, 7, 11, 250]
OUTPUT = [7, 11, 11, 11, 42, 99, 3]


def _logits(rows: int = 1, seed: int = 0) -> mx.array:
    return mx.random.normal((rows, V), key=mx.random.key(seed)) * 4


def _mlx_lm(logits: mx.array, params: SamplingParams, prompt, output) -> mx.array:
    """mlx-lm's processors in `make_logits_processors`' order, each over the tokens it counts
    here: the repetition penalty over prompt + output, presence and frequency over the output,
    with windows that hold every token."""
    context = list(prompt) + list(output)
    logits = mx.array(logits)  # a copy: mlx-lm's processors write into the array they are given
    bias = make_logits_processors(logit_bias=dict(params.logit_bias)) if params.logit_bias else []
    for proc in bias:
        logits = proc(mx.array(context), logits)
    if params.repetition_penalty != 1.0:
        logits = make_repetition_penalty(params.repetition_penalty, len(context))(mx.array(context), logits)
    if params.presence_penalty:
        logits = make_presence_penalty(params.presence_penalty, len(output))(mx.array(output), logits)
    if params.frequency_penalty:
        logits = make_frequency_penalty(params.frequency_penalty, len(output))(mx.array(output), logits)
    return logits


@pytest.mark.parametrize("params", [
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=0.7),
    SamplingParams(frequency_penalty=-1.2, presence_penalty=0.4),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.6),
    SamplingParams(logit_bias=((7, 5.0), (42, -100.0), (250, 2.5))),
    SamplingParams(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                   logit_bias=((11, 3.0), (0, -4.0))),
], ids=["presence", "frequency", "frequency-negative+presence", "repetition", "repetition-below-1", "bias", "all"])
def test_penalties_equal_mlx_lms_processors(params):
    logits = _logits()
    state = RowPenalties(params, PROMPT, V)
    state.advance(OUTPUT[:3])
    state.advance(OUTPUT[3:])
    ours = state.apply(logits)
    ref = _mlx_lm(logits, params, PROMPT, OUTPUT)
    changed = np.flatnonzero(np.array(ref[0]) != np.array(logits[0]))
    assert changed.size > 0  # the parameters do change some logits
    np.testing.assert_allclose(np.array(ours), np.array(ref), rtol=1e-6, atol=1e-5)


def test_presence_and_frequency_count_the_output_not_the_prompt():
    logits = _logits()
    state = RowPenalties(SamplingParams(presence_penalty=1.0, frequency_penalty=1.0), PROMPT, V)
    out = np.array(state.apply(logits)[0])
    np.testing.assert_array_equal(out, np.array(logits[0]))  # no output yet: nothing penalised
    state.advance([250, 250])
    out = np.array(state.apply(logits)[0])
    assert out[250] == pytest.approx(float(logits[0, 250]) - 3.0)
    assert out[3] == float(logits[0, 3])  # a prompt token


def test_a_verify_position_counts_the_drafts_before_it():
    """Position j of a block [b, d_1 .. d_{L-1}] is penalised as a plain step after d_1 .. d_j."""
    params = SamplingParams(presence_penalty=0.3, frequency_penalty=0.9, repetition_penalty=1.4,
                            logit_bias=((5, 1.0),))
    drafted = [5, 9, 5, 200]
    logits = _logits(len(drafted) + 1, seed=3)
    state = RowPenalties(params, PROMPT, V)
    state.advance(OUTPUT)
    block = np.array(state.apply(logits, mx.array(drafted, dtype=mx.uint32)))
    for j in range(len(drafted) + 1):
        alone = RowPenalties(params, PROMPT, V)
        alone.advance(OUTPUT + drafted[:j])
        np.testing.assert_allclose(block[j], np.array(alone.apply(logits[j:j + 1])[0]), rtol=1e-6, atol=1e-5)
    assert not np.allclose(block[0], block[3])  # the drafts did change the state


def test_draft_vocabulary_columns_take_their_tokens_penalties():
    params = SamplingParams(frequency_penalty=1.0, logit_bias=((9, 4.0),))
    state = RowPenalties(params, PROMPT, V)
    state.advance([9, 12, 12])
    logits = _logits(2, seed=5)
    ids = mx.array([2, 9, 12, 100], dtype=mx.int32)
    np.testing.assert_allclose(np.array(state.apply(logits[:, ids], ids=ids)),
                               np.array(state.apply(logits)[:, ids]), rtol=1e-6)


@pytest.mark.parametrize("params, field", [
    (SamplingParams(presence_penalty=2.5), "presence_penalty"),
    (SamplingParams(frequency_penalty=-2.01), "frequency_penalty"),
    (SamplingParams(frequency_penalty=float("nan")), "frequency_penalty"),
    (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
    (SamplingParams(repetition_penalty=11.0), "repetition_penalty"),
    (SamplingParams(logit_bias=((V, 1.0),)), "logit_bias"),
    (SamplingParams(logit_bias=((-1, 1.0),)), "logit_bias"),
    (SamplingParams(logit_bias=((3, 101.0),)), "logit_bias"),
    (SamplingParams(logit_bias=((3, 1.0), (3, 2.0))), "logit_bias"),
    (SamplingParams(logit_bias=tuple((t, 1.0) for t in range(1025))), "logit_bias"),
])
def test_out_of_range_values_are_refused_naming_the_field(params, field):
    with pytest.raises(InvalidRequest, match=field):
        validate_penalties(params, V if field != "logit_bias" or len(params.logit_bias) < 1000 else 5000)


# ----- in the engine (tiny random llama, float32 on the CPU) ---------------------------------------

PROMPTS = ["The river", "Once upon a time in a small village by the sea, there lived", "1, 2, 3, 4,"]
PENALTIES = [SamplingParams(frequency_penalty=1.5, presence_penalty=0.5),
             SamplingParams(repetition_penalty=1.8),
             SamplingParams(presence_penalty=2.0, repetition_penalty=1.3, logit_bias=((17, 3.0), (40, -100.0)))]


def _run(engine, prompt, mode, sampling, max_tokens=24):
    return run_request(engine, GenerationRequest(f"{mode}-{time.time_ns()}", tuple(prompt), max_tokens,
                                                 sampling=sampling, mode=mode))[0]


@pytest.fixture(scope="module")
def dflash_engine(tiny_models, dflash_dir):
    cfg = EngineConfig(model_path=tiny_models.llama, draft_path=dflash_dir, capacity=8, adaptive_block_size=False)
    with Engine(cfg) as engine:
        yield engine


def test_penalties_change_greedy_output_and_dflash_equals_plain(dflash_engine):
    engine = dflash_engine
    prompts = [engine.encode_prompt(p, None) for p in PROMPTS]
    changed = 0
    for prompt in prompts:
        free = _run(engine, prompt, "plain", SamplingParams())
        for params in PENALTIES:
            plain = _run(engine, prompt, "plain", params)
            assert _run(engine, prompt, "dflash", params) == plain, params
            changed += plain != free
    assert changed >= len(prompts) * len(PENALTIES) - 1  # the penalties do change the output


def test_accepted_drafts_count_in_the_penalties_of_the_positions_after_them(dflash_engine, monkeypatch):
    """An oracle draft proposes the penalised plain output, so whole blocks are accepted: each
    verified position must be chosen under the counts of the drafts before it."""
    engine = dflash_engine
    prompts = [engine.encode_prompt(p, None) for p in PROMPTS]
    params = SamplingParams(frequency_penalty=2.0, repetition_penalty=1.5)
    truth = {}
    for i, prompt in enumerate(prompts):
        truth[i] = list(prompt) + _run(engine, prompt, "plain", params, 30)
        assert len(set(truth[i][len(prompt):])) > 5
    real = batch_mod.draft_block
    current: dict[str, int] = {}

    def oracle(draft, batch, L):
        blocks = real(draft, batch, L).tolist()
        for r, row in enumerate(batch.rows):
            seq = truth[current[row.request_id]]
            for k in range(1, L):
                pos = row.n - 1 + k
                blocks[r][k] = seq[pos] if pos < len(seq) else 0
        return mx.array(blocks, dtype=mx.uint32)

    monkeypatch.setattr(batch_mod, "draft_block", oracle)
    for i, prompt in enumerate(prompts):
        rid = f"oracle-{i}"
        current[rid] = i
        tokens, done = run_request(engine, GenerationRequest(rid, tuple(prompt), 30, sampling=params, mode="dflash"))
        assert tokens == truth[i][len(prompt):]
        assert done.stats.accepted_tokens >= done.stats.drafted_tokens - 3  # the drafts were accepted


def test_seeded_sampling_with_penalties_is_the_same_in_plain_and_dflash(dflash_engine):
    engine = dflash_engine
    prompt = engine.encode_prompt(PROMPTS[1], None)
    params = SamplingParams(temperature=0.8, seed=11, frequency_penalty=1.0, logit_bias=((5, 2.0),))
    plain = _run(engine, prompt, "plain", params)
    assert _run(engine, prompt, "plain", params) == plain
    assert _run(engine, prompt, "dflash", params) == plain


def test_logit_bias_forces_and_bans_a_token(dflash_engine):
    engine = dflash_engine
    prompt = engine.encode_prompt(PROMPTS[0], None)
    free = _run(engine, prompt, "plain", SamplingParams(), 12)
    forced = 123 if 123 not in free else 124
    for mode in ("plain", "dflash"):
        assert _run(engine, prompt, mode, SamplingParams(logit_bias=((forced, 100.0),)), 12) == [forced] * 12
        banned = _run(engine, prompt, mode, SamplingParams(logit_bias=tuple((t, -100.0) for t in set(free))), 12)
        assert banned and not set(banned) & set(free)


def test_bad_values_are_refused_at_submit_naming_the_field(dflash_engine):
    engine = dflash_engine
    prompt = tuple(engine.encode_prompt(PROMPTS[0], None))
    with pytest.raises(InvalidRequest, match="repetition_penalty"):
        engine.submit(GenerationRequest("bad", prompt, 4, sampling=SamplingParams(repetition_penalty=0)),
                      lambda ev: None)
    with pytest.raises(InvalidRequest, match=r"logit_bias token ids must be integers in \[0, 512\)"):
        engine.submit(GenerationRequest("bad", prompt, 4, sampling=SamplingParams(logit_bias=((512, 1.0),))),
                      lambda ev: None)


def test_a_resumed_session_counts_its_output_so_far(dflash_engine):
    """A migrated session (its output so far sent as resume tokens) is penalised as if it had
    never moved: the tokens it resumes after count as output, not as prompt."""
    import queue

    from worker.engine.types import DoneEvent, TokenEvent

    engine = dflash_engine
    prompt = tuple(engine.encode_prompt(PROMPTS[1], None))
    params = SamplingParams(frequency_penalty=2.0, presence_penalty=1.0)
    for mode in ("plain", "dflash"):
        events: queue.Queue = queue.Queue()
        engine.submit(GenerationRequest(f"full-{mode}", prompt, 24, sampling=params, mode=mode), events.put)
        streamed = []
        while not isinstance(ev := events.get(timeout=60), DoneEvent):
            assert isinstance(ev, TokenEvent), ev
            streamed.append(ev)
        full = [t for e in streamed for t in e.token_ids]
        cut = len(streamed) // 2  # the client received the first `cut` events
        seen = tuple(t for e in streamed[:cut] for t in e.token_ids)
        assert 0 < len(seen) < len(full)
        rest, _ = run_request(engine, GenerationRequest(f"resumed-{mode}", prompt, 24, sampling=params, mode=mode,
                                                        resume_tokens=seen,
                                                        resume_text="".join(e.text for e in streamed[:cut])))
        assert list(seen) + rest == full
