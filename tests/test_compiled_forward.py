"""The compiled target forward (worker/compiled_forward.py): the same logits, taps and cache
contents as the uncompiled forward over the same padded KV cache, and DFlash decoding through it
still equal to plain greedy decoding, token for token."""
from __future__ import annotations

import mlx.core as mx
import pytest

from tests.test_dflash import PROMPT, TARGETS, OracleDraft, _run, assert_greedy_equal
from worker.capture import HiddenCapture
from worker.compiled_forward import CompiledTarget, compilable, shared_compiled_target
from worker.models.dflash import PaddedKVCache
from worker.models.dflash_checkpoint import init_dflash_draft
from worker.sampling import greedy
from worker.spec import plain
from worker.spec.dflash import make_target_cache

FULL_ATTENTION = ("llama", "qwen2", "qwen3")
MAX_TOKENS = 37


@pytest.fixture(scope="module", params=FULL_ATTENTION)
def pair(request):
    target = TARGETS[request.param]()
    draft = init_dflash_draft(target, num_layers=2, block_size=16, seed=7)
    ref = [t for s in plain.generate(PROMPT, MAX_TOKENS, greedy, set(), model=target) for t in s.tokens]
    return target, draft, ref


def _prefilled(target, n: int):
    cache = make_target_cache(target)
    mx.eval(target(mx.array([list(range(1, n + 1))], dtype=mx.uint32), cache=cache))
    return cache


@pytest.mark.parametrize("name", FULL_ATTENTION)
def test_logits_taps_and_cache_equal_uncompiled(name, monkeypatch):
    """One- and 16-token forwards, one of them growing the buffer into a new bucket: logits and
    taps as the uncompiled forward gives them, and the caches hold the same keys afterwards."""
    monkeypatch.setattr(PaddedKVCache, "step", 32)  # small buckets: the 16-token forward crosses one
    target = TARGETS[name]()
    layers = [1, 3]
    eager_cache, compiled_cache = _prefilled(target, 20), _prefilled(target, 20)
    assert compilable(target, compiled_cache)
    cap = HiddenCapture(target, layers)
    fwd = CompiledTarget(target, HiddenCapture(target, layers))
    for tokens in ([[5]], [list(range(30, 46))], [[9]], [list(range(50, 66))]):
        x = mx.array(tokens, dtype=mx.uint32)
        with cap:
            want = target(x, cache=eager_cache)
        want_taps = cap.hidden()
        got, got_taps = fwd(x, compiled_cache)
        assert got.shape == want.shape and got_taps.shape == want_taps.shape
        assert mx.abs(got - want).max().item() < 1e-4 * max(1.0, mx.abs(want).max().item())
        assert mx.abs(got_taps - want_taps).max().item() < 1e-4 * max(1.0, mx.abs(want_taps).max().item())
        assert (got.argmax(-1) == want.argmax(-1)).all().item()
        for e, c in zip(eager_cache, compiled_cache):
            assert c.offset == e.offset and c.keys.shape == e.keys.shape
            n = e.offset
            assert mx.abs(c.keys[..., :n, :] - e.keys[..., :n, :]).max().item() < 1e-4
    assert compiled_cache[0].keys.shape[2] == 64  # 20 + 1 + 16 (crosses 32) + 1 + 16 = 54 positions


@pytest.mark.parametrize("bs", [2, 4, 16])
def test_dflash_through_compiled_target_equals_plain_greedy(pair, bs):
    """Random draft (acceptance near 0) and oracle draft (acceptance 1): the same tokens and the
    same verdicts as the uncompiled loop, and plain greedy's tokens."""
    target, draft, ref = pair
    for d in (draft, OracleDraft(draft, len(PROMPT), ref)):
        steps, out = _run(target, d, bs)
        c_steps, c_out = _run(target, d, bs, compile_target=True)
        assert c_out == out
        assert [(s.drafted, s.accepted) for s in c_steps] == [(s.drafted, s.accepted) for s in steps]
        assert_greedy_equal(c_out, ref, target)


def test_sliding_window_models_are_not_compiled():
    """gemma3_text's sliding layers need windowed masks: not compiled, decoding unchanged."""
    target = TARGETS["gemma3"]()
    assert not compilable(target, make_target_cache(target))
    draft = init_dflash_draft(target, num_layers=2, block_size=4, seed=7)
    ref = [t for s in plain.generate(PROMPT, 17, greedy, set(), model=target) for t in s.tokens]
    assert _run(target, draft, 4, max_tokens=17, compile_target=True)[1] == ref


def test_bad_caches_are_clear_errors():
    target = TARGETS["llama"]()
    fwd = CompiledTarget(target)
    with pytest.raises(ValueError, match="prefill first"):
        fwd(mx.array([[1]], dtype=mx.uint32), make_target_cache(target))
    cache = _prefilled(target, 8)
    cache[1].trim(1)
    with pytest.raises(ValueError, match="different offsets"):
        fwd(mx.array([[1]], dtype=mx.uint32), cache)


def test_sessions_share_one_compiled_target():
    target = TARGETS["qwen3"]()
    a = shared_compiled_target(target, [1, 3])
    assert shared_compiled_target(target, (1, 3)) is a
    assert shared_compiled_target(target, None) is not a
    assert shared_compiled_target(TARGETS["qwen3"](), [1, 3]) is not a


def test_plain_decoding_through_compiled_target_equals_plain(pair):
    """plain.generate(compile_target=True): a padded cache, each step one compiled graph; the
    same tokens as mlx-lm's cache uncompiled (a one-token prompt falls back: nothing to replay)."""
    target, _, ref = pair
    out = [t for s in plain.generate(PROMPT, MAX_TOKENS, greedy, set(), model=target, compile_target=True)
           for t in s.tokens]
    assert out == ref
    one = [t for s in plain.generate(PROMPT[:1], 5, greedy, set(), model=target) for t in s.tokens]
    assert [t for s in plain.generate(PROMPT[:1], 5, greedy, set(), model=target, compile_target=True)
            for t in s.tokens] == one


def test_buffers_past_max_positions_run_uncompiled(monkeypatch):
    """Past `max_positions` the forward runs op by op (MLX keeps every trace): the same values,
    and no call of the compiled function once the buffer is longer."""
    monkeypatch.setattr(PaddedKVCache, "step", 32)
    target = TARGETS["qwen2"]()
    eager_cache, cache = _prefilled(target, 20), _prefilled(target, 20)
    fwd = CompiledTarget(target, max_positions=32)
    calls = []
    traced = fwd._fns[False]
    fwd._fns[False] = lambda *a: calls.append(a[0].shape) or traced(*a)
    for tokens in ([[5]], [list(range(30, 46))], [[9]]):  # 21 fits 32; 37 and 38 need 64
        x = mx.array(tokens, dtype=mx.uint32)
        want = target(x, cache=eager_cache)
        got, taps = fwd(x, cache)
        assert taps is None
        assert mx.abs(got - want).max().item() < 1e-4 * max(1.0, mx.abs(want).max().item())
    assert calls == [(1, 1)]
    assert cache[0].offset == eager_cache[0].offset == 38


def _mamba():
    from mlx_lm.models import mamba

    mx.random.seed(5)
    m = mamba.Model(mamba.ModelArgs(model_type="mamba", vocab_size=256, hidden_size=32, intermediate_size=64,
                                    state_size=8, num_hidden_layers=2, conv_kernel=4, use_bias=False,
                                    use_conv_bias=True, time_step_rank=4))
    mx.eval(m.parameters())
    return m


def test_models_it_cannot_compile_decode_as_before():
    """compile_target on a recurrent model (mamba) or a sliding-window one (gemma3_text): mlx-lm's
    own cache and tokens; and the worker's plain mode keeps mlx-lm's cache with compile on."""
    from pathlib import Path

    from worker.config import EngineConfig
    from worker.engine.modes import LoadedModels, start_plain
    from worker.engine.types import GenerationRequest
    from worker.compiled_forward import compilable_model

    for model in (_mamba(), TARGETS["gemma3"]()):
        assert not compilable_model(model)
        ref = [t for s in plain.generate(PROMPT, 9, greedy, set(), model=model) for t in s.tokens]
        assert [t for s in plain.generate(PROMPT, 9, greedy, set(), model=model, compile_target=True)
                for t in s.tokens] == ref
        cfg = EngineConfig(model_path=Path("/tmp"), compile_forward=True)
        steps, cache = start_plain(LoadedModels(model, None, frozenset()), cfg, GenerationRequest("r", tuple(PROMPT), 9),
                                   greedy)
        assert [t for s in steps for t in s.tokens] == ref
        assert not any(type(c) is PaddedKVCache for c in cache)  # the window stays bounded


def test_a_model_that_reads_the_offset_in_python_runs_uncompiled(caplog):
    """Dynamic-NTK RoPE compares the offset with the context limit in Python: not compilable; and
    forced through CompiledTarget anyway, its failed trace falls back to the uncompiled forward."""
    from mlx_lm.models import llama

    from tests.test_dflash import _tiny
    from worker.compiled_forward import compilable_model

    target = _tiny(llama, 1, model_type="llama", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                   num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
                   tie_word_embeddings=False, rope_scaling={"type": "dynamic", "factor": 2.0},
                   max_position_embeddings=16)
    assert not compilable_model(target)
    ref = [t for s in plain.generate(PROMPT, 12, greedy, set(), model=target) for t in s.tokens]
    assert [t for s in plain.generate(PROMPT, 12, greedy, set(), model=target, compile_target=True)
            for t in s.tokens] == ref
    eager_cache, cache = _prefilled(target, 11), _prefilled(target, 11)
    fwd = CompiledTarget(target)
    for tokens in ([[5]], [[7]]):
        x = mx.array(tokens, dtype=mx.uint32)
        want = target(x, cache=eager_cache)
        got, _ = fwd(x, cache)
        assert mx.allclose(got, want, atol=1e-5).item()
        assert fwd.broken and cache[0].offset == eager_cache[0].offset
    assert "failed to trace" in caplog.text
