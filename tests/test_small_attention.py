"""worker.small_attention: which calls it takes, how compiled forwards route attention to it,
and (on CUDA) the kernel against a float32 reference and MLX's own attention."""
from __future__ import annotations

import logging

import mlx.core as mx
import pytest

import worker.small_attention as sa
from worker.fusion import fuse_projections

cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="small_attention runs on MLX's CUDA backend only")


def _qkv(B=1, L=16, S=40, H=12, Hkv=2, D=128, dtype=mx.bfloat16, seed=0, kv_rows=1):
    mx.random.seed(seed)
    q = mx.random.normal((B, L, H, D)).astype(dtype).transpose(0, 2, 1, 3)  # as mlx-lm makes it
    k = mx.random.normal((kv_rows, Hkv, S, D)).astype(dtype)
    v = mx.random.normal((kv_rows, Hkv, S, D)).astype(dtype)
    return q, k, v


def _mask(L, S, dtype=mx.bfloat16):
    visible = mx.arange(S)[None, :] <= (S - L + mx.arange(L))[:, None]
    return mx.where(visible, 0.0, float("-inf")).astype(dtype)


def _reference(q, k, v, scale, mask=None):
    """The formula in float32 with MLX ops (GQA by repeating K/V heads)."""
    B, H, L, D = q.shape
    k = mx.broadcast_to(k, (B, *k.shape[1:])).astype(mx.float32)
    v = mx.broadcast_to(v, (B, *v.shape[1:])).astype(mx.float32)
    rep = H // k.shape[1]
    k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
    s = q.astype(mx.float32) @ k.transpose(0, 1, 3, 2) * scale
    if mask is not None:
        s = s + mask.astype(mx.float32)
    return mx.softmax(s, axis=-1) @ v


def test_applies_to_few_queries_of_half_precision_with_additive_or_no_mask():
    q, k, v = _qkv()
    assert sa.applies(q, k, v) and sa.applies(q, k, v, _mask(16, 40))
    assert sa.applies(q, k, v, _mask(16, 40)[None, None])  # (1, 1, L, S)
    assert sa.applies(q, k, v, mx.zeros((1, 12, 16, 40), mx.bfloat16))
    assert not sa.applies(q, k, v, "causal")  # mlx-lm's prefill: cuDNN's flash kernels
    assert not sa.applies(q, k, v, _mask(16, 40) == 0)  # boolean
    assert not sa.applies(q, k, v, _mask(16, 40, mx.float32))  # not q's dtype (MLX refuses it too)
    assert not sa.applies(*_qkv(L=0))
    assert not sa.applies(q, k, v, _mask(16, 39))  # does not broadcast to S keys
    assert not sa.applies(q, k, v, mx.zeros((3, 12, 16, 40), mx.bfloat16))  # 3 rows, q has 1
    assert not sa.applies(q, k, v, sinks=mx.zeros((12,)))
    assert not sa.applies(*_qkv(dtype=mx.float32))
    assert not sa.applies(*_qkv(L=sa.MAX_QUERIES + 1))
    assert sa.applies(*_qkv(L=sa.MAX_QUERIES)) and sa.applies(*_qkv(L=1))
    assert not sa.applies(*_qkv(D=96)) and sa.applies(*_qkv(D=64))
    assert not sa.applies(*_qkv(H=12, Hkv=5))  # H % H_kv
    assert not sa.applies(*_qkv(H=34, Hkv=2))  # 17 query heads a KV head
    q4, k4, v4 = _qkv(B=4)
    assert sa.applies(q4, k4, v4) and sa.applies(q4, mx.concatenate([k4] * 4), mx.concatenate([v4] * 4))
    assert not sa.applies(q4, mx.concatenate([k4] * 2), mx.concatenate([v4] * 2))  # 2 caches for 4 rows
    assert not sa.applies(q, k, v[..., :64])


def test_shared_memory_limits_which_groups_and_head_dims_fit():
    for g in range(1, sa.MAX_GROUP + 1):
        c = sa.chunk(g)
        assert c % 32 == 0 and g * c <= sa.SCORE_FLOATS and c >= 512
    assert sa.fits(6, 128) and sa.fits(7, 64) and sa.fits(16, 128) and sa.fits(8, 256)
    assert not sa.fits(16, 256)  # its queries and scores would pass 48 KiB
    assert not sa.applies(*_qkv(H=32, Hkv=2, D=256))


def test_bad_inputs_are_a_value_error_before_any_kernel():
    q, k, v = _qkv(dtype=mx.float32)
    with pytest.raises(ValueError, match="not taken"):
        sa.small_attention(q, k, v, 0.1)
    with pytest.raises(ValueError, match="n_splits must be >= 1"):
        sa.small_attention(*_qkv(), 0.1, n_splits=0)


def test_long_contexts_split_their_keys_within_one_wave_of_blocks():
    assert sa.splits(32, 272) == 1 and sa.splits(32, 2 * sa.SPLIT_KEYS - 1) == 1  # short: one kernel
    assert sa.splits(sa.SPLIT_BLOCKS, 100_000) == 1  # the blocks fill the GPU already
    for blocks in (1, 2, 16, 32, 64, 96):
        for keys in (1024, 1040, 2064, 4112, 32_768):
            n = sa.splits(blocks, keys)
            assert n >= 1 and keys // n >= sa.SPLIT_KEYS
            assert n == 1 or blocks * n <= sa.SPLIT_BLOCKS
            assert n & (n - 1) == 0  # a power of two: few compiled kernels as a context grows
            assert n >= sa.splits(blocks, keys - 512)  # more keys never fewer splits
    assert sa.splits(32, 4112) == 4 and sa.splits(2, 32_768) == 64  # a verify at 4K; one token at 32K


def test_attention_is_mlx_own_where_the_kernel_cannot_run():
    q, k, v = _qkv(L=4, S=12, H=4, Hkv=2, D=64, dtype=mx.float32)
    mask = _mask(4, 12, mx.float32)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    got = sa.attention(q, k, v, scale=0.125, mask=mask)
    assert mx.array_equal(got, want)


def test_attention_splits_long_contexts_only_when_switched_on(monkeypatch):
    calls = []
    monkeypatch.setattr(sa, "available", lambda: True)
    monkeypatch.setattr(sa, "small_attention", lambda q, k, v, scale, mask, n_splits: calls.append(n_splits))
    q, k, v = _qkv(S=4112)
    sa.attention(q, k, v, scale=0.1, mask=None)
    monkeypatch.setattr(sa, "SPLIT_LONG_CONTEXTS", True)
    sa.attention(q, k, v, scale=0.1, mask=None)
    sa.attention(*_qkv(S=272), scale=0.1, mask=None)
    assert calls == [1, sa.splits(32, 4112), 1] and calls[1] > 1


def test_available_needs_cuda_sm80_and_no_opt_out(monkeypatch):
    monkeypatch.setattr(sa.mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sa.mx, "device_info", lambda: {"compute_capability_major": 9})
    assert sa.available()
    monkeypatch.setattr(sa.mx, "device_info", lambda: {"compute_capability_major": 7})
    assert not sa.available()
    monkeypatch.setattr(sa.mx, "device_info", lambda: {"compute_capability_major": 9})
    monkeypatch.setenv("FLASHFLEET_SMALL_ATTENTION", "0")
    assert not sa.available()
    monkeypatch.delenv("FLASHFLEET_SMALL_ATTENTION")
    monkeypatch.setattr(sa.mx.cuda, "is_available", lambda: False)
    assert not sa.available()


def test_patched_sdpa_routes_and_always_restores():
    original = mx.fast.scaled_dot_product_attention
    with sa.patched_sdpa():
        assert mx.fast.scaled_dot_product_attention is sa.attention
    assert mx.fast.scaled_dot_product_attention is original
    with pytest.raises(RuntimeError):
        with sa.patched_sdpa():
            raise RuntimeError("a failed trace")
    assert mx.fast.scaled_dot_product_attention is original
    with sa.patched_sdpa(False):
        assert mx.fast.scaled_dot_product_attention is original


def _recording(monkeypatch):
    """On the CPU: `available` true and the kernel replaced by the float32 reference, output in
    the kernel's layout (a transposed (B, L, H, D) array); records each call's (rows, queries)."""
    calls = []

    def fake(q, k, v, scale, mask=None, n_splits=1):
        assert sa.applies(q, k, v, mask) and n_splits == 1
        calls.append((q.shape[0], q.shape[2]))
        return _reference(q, k, v, scale, mask).astype(q.dtype).transpose(0, 2, 1, 3).reshape(
            q.shape[0], q.shape[2], q.shape[1], q.shape[3]).transpose(0, 2, 1, 3)
    monkeypatch.setattr(sa, "available", lambda: True)
    monkeypatch.setattr(sa, "small_attention", fake)
    return calls


def _target(dtype=mx.bfloat16):
    """A random 2-layer qwen2 of head dim 64 (the tiny test models' 16 is not one it takes)."""
    from mlx_lm.models import qwen2

    args = qwen2.ModelArgs(model_type="qwen2", hidden_size=256, num_hidden_layers=2, intermediate_size=512,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=300,
                           rope_theta=10000.0, tie_word_embeddings=False)
    mx.random.seed(1)
    m = qwen2.Model(args)
    m.set_dtype(dtype)
    mx.eval(m.parameters())
    return m


def test_use_small_attention_marks_only_where_available(monkeypatch, tiny_models):
    from mlx_lm import load

    m, _ = load(str(tiny_models.qwen2))
    if not mx.cuda.is_available():
        assert sa.use_small_attention(m) is False and not sa.uses_small_attention(m)
    monkeypatch.setattr(sa, "available", lambda: True)
    assert sa.use_small_attention(m) is True and sa.uses_small_attention(m)
    assert sa.use_small_attention(m, False) is False and not sa.uses_small_attention(m)


def test_a_marked_compiled_verify_traces_apart_and_attends_through_the_kernel(monkeypatch):
    """The mark switches the compiled target between two traces: with it every layer's attention
    of the verify goes to `small_attention` (here the float32 reference), and the logits equal
    the unmarked forward's; without it the kernel is not called."""
    from worker.compiled_forward import CompiledTarget
    from worker.spec.dflash import make_target_cache

    calls = _recording(monkeypatch)
    m = _target()
    fuse_projections(m)
    prompt = mx.array([list(range(3, 30))], dtype=mx.uint32)
    block = mx.array([[5, 9, 11, 2] * 4], dtype=mx.uint32)
    fwd = CompiledTarget(m)
    outs = {}
    for marked in (False, True, False):
        sa.use_small_attention(m, marked)
        cache = make_target_cache(m)
        mx.eval(m(prompt, cache=cache))
        before = len(calls)
        logits, _ = fwd(block, cache)
        outs.setdefault(marked, logits.astype(mx.float32))
        assert len(calls) - before == (len(m.layers) if marked and before == 0 else 0)  # traced once
    assert calls == [(1, 16)] * len(m.layers)
    a, b = outs[False], outs[True]
    assert (mx.abs(a - b).max() / mx.abs(a).max()).item() < 2e-2
    assert mx.fast.scaled_dot_product_attention is sa._mlx_sdpa


def test_the_worker_marks_its_models_and_says_so(monkeypatch, tiny_models, caplog, tmp_path):
    from tests.test_small_gemm import _bf16_copy
    from worker.config import EngineConfig
    from worker.engine.thread import Engine

    _recording(monkeypatch)
    caplog.set_level(logging.INFO, logger="worker.engine.thread")
    bf16 = _bf16_copy(tiny_models.llama, tmp_path / "llama-bf16")
    with Engine(EngineConfig(model_path=bf16, warmup=False)):  # on by default
        pass
    assert "small attention: compiled verifies, steps and drafts attend with one CUDA kernel" in caplog.text
    caplog.clear()
    with Engine(EngineConfig(model_path=bf16, warmup=False, small_attention=False)):
        pass
    assert "small attention" not in caplog.text


def test_the_benchmarks_refuse_to_run_without_cuda(capsys):
    if mx.cuda.is_available():
        pytest.skip("checks the message off CUDA")
    from bench.bench_small_attention import main

    assert main([]) == 2
    assert "needs MLX's CUDA backend" in capsys.readouterr().err
    from bench.bench_dflash import main as dflash_main

    with pytest.raises(SystemExit):
        dflash_main(["--target", "x", "--small-attention"])
    assert "add --small-gemm" in capsys.readouterr().err


def _rows_mask(B, L, S, dtype):
    """(B, 1, L, S): per row and query another visible range; row 2 sees no key before 1,400
    (its whole first chunk of scores, and its first key splits, hidden)."""
    hi = (mx.array([S - L - 37 * b for b in range(B)])[:, None] + mx.arange(L)[None, :])[:, None, :, None]
    lo = mx.array([1400 if b == 2 else 0 for b in range(B)])[:, None, None, None]
    j = mx.arange(S)[None, None, None, :]
    return mx.where((j >= lo) & (j <= hi), 0.0, float("-inf")).astype(dtype)


CASES = [  # (rows, queries, keys, query heads, KV heads, head dim, mask): one block a query
    (1, 16, 272, 12, 2, 128, "tail"), (1, 16, 3000, 12, 2, 128, "tail"),  # 3 chunks of 1,344 keys
    (4, 16, 1040, 12, 2, 128, "tail"), (1, 1, 300, 12, 2, 128, "tail"), (1, 64, 700, 14, 2, 64, "tail"),
    (2, 16, 500, 8, 8, 64, None), (1, 16, 600, 16, 1, 128, "rows"), (3, 8, 333, 8, 1, 256, "tail"),
    (3, 16, 2900, 12, 2, 128, "rows"),  # own K/V and visible length per row; row 2's first chunk hidden
]


@cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("B,L,S,H,Hkv,D,mask_kind", CASES)
def test_kernel_matches_a_float32_reference(dtype, B, L, S, H, Hkv, D, mask_kind):
    q, k, v = _qkv(B, L, S, H, Hkv, D, dtype, kv_rows=B if mask_kind == "rows" else 1)
    mask = None
    if mask_kind == "tail":
        mask = _mask(L, S, dtype)
    elif mask_kind == "rows":
        mask = _rows_mask(B, L, S, dtype)
    scale = D ** -0.5
    ref = _reference(q, k, v, scale, mask)
    got = sa.small_attention(q, k, v, scale, mask)
    assert got.shape == (B, H, L, D) and got.dtype == dtype
    lib = mx.fast.scaled_dot_product_attention(q, mx.broadcast_to(k, (B, *k.shape[1:])),
                                               mx.broadcast_to(v, (B, *v.shape[1:])), scale=scale, mask=mask)
    top = mx.abs(ref).max().item()
    e_ours = mx.abs(got.astype(mx.float32) - ref).max().item() / top
    e_lib = mx.abs(lib.astype(mx.float32) - ref).max().item() / top
    assert e_ours <= max(1.5 * e_lib, 4e-3), (e_ours, e_lib)


@cuda
@pytest.mark.parametrize("B,L,S,H,Hkv,D,mask_kind,n_splits", [
    (1, 16, 272, 12, 2, 128, "tail", 3), (1, 4, 5, 4, 2, 64, "tail", 4),  # 5 keys in 4: the last split empty
    (3, 16, 2900, 12, 2, 128, "rows", 6),  # row 2: its first 2 splits (484 keys each) see no key
    (2, 16, 1100, 8, 8, 64, None, 2), (1, 1, 2100, 12, 2, 128, "tail", 9)])
def test_keys_split_over_blocks_match_one_block_and_the_reference(B, L, S, H, Hkv, D, mask_kind, n_splits):
    q, k, v = _qkv(B, L, S, H, Hkv, D, kv_rows=B if mask_kind == "rows" else 1)
    mask = {"tail": lambda: _mask(L, S), "rows": lambda: _rows_mask(B, L, S, mx.bfloat16),
            None: lambda: None}[mask_kind]()
    scale = D ** -0.5
    ref = _reference(q, k, v, scale, mask)
    one = sa.small_attention(q, k, v, scale, mask, n_splits=1).astype(mx.float32)
    split = sa.small_attention(q, k, v, scale, mask, n_splits=n_splits)
    assert split.shape == (B, H, L, D) and split.dtype == mx.bfloat16
    top = mx.abs(ref).max().item()
    e_split = mx.abs(split.astype(mx.float32) - ref).max().item() / top
    e_one = mx.abs(one - ref).max().item() / top
    assert e_split <= max(1.5 * e_one, 4e-3), (e_split, e_one)


@cuda
def test_a_query_that_sees_no_key_gets_zeros_split_or_not():
    q, k, v = _qkv(1, 4, 1200, 4, 2, 64)
    mask = mx.zeros((4, 1200), mx.bfloat16)
    mask[2] = float("-inf")
    for n in (1, 3):
        got = sa.small_attention(q, k, v, 0.125, mask, n_splits=n)
        assert mx.all(got[:, :, 2] == 0).item() and not mx.any(mx.isnan(got)).item()


@cuda
def test_a_query_that_sees_no_key_gets_zeros_and_the_others_are_untouched():
    q, k, v = _qkv(1, 4, 100, 4, 2, 64)
    mask = mx.zeros((4, 100), mx.bfloat16)
    mask[2] = float("-inf")
    got = sa.small_attention(q, k, v, 0.125, mask).astype(mx.float32)
    ref = _reference(q, k, v, 0.125, mask)
    assert mx.all(got[:, :, 2] == 0).item()
    keep = mx.array([0, 1, 3])
    assert mx.abs(got[:, :, keep] - ref[:, :, keep]).max().item() < 2e-2 * mx.abs(ref[:, :, keep]).max().item()


@cuda
def test_compiled_verify_with_small_attention_matches_cudnn():
    from worker.compiled_forward import CompiledTarget
    from worker.spec.dflash import make_target_cache

    m = _target()
    fuse_projections(m)
    prompt = mx.array([list(range(3, 40))], dtype=mx.uint32)
    block = mx.array([[5, 9, 11, 2] * 4] * 4, dtype=mx.uint32)  # 4 candidate rows of 16 tokens
    outs = []
    fwd = CompiledTarget(m)
    for marked in (False, True):
        assert sa.use_small_attention(m, marked) is marked
        cache = make_target_cache(m)
        mx.eval(m(prompt, cache=cache))
        outs.append(fwd(block, cache)[0].astype(mx.float32))
    a, b = outs
    assert (mx.abs(a - b).max() / mx.abs(a).max()).item() < 2e-2
    assert (mx.argmax(a, -1) == mx.argmax(b, -1)).astype(mx.float32).mean().item() > 0.95


def test_the_verify_benchmark_times_a_split_copy_traced_with_splits_on(monkeypatch, tiny_models):
    """bench_small_gemm.forward_rows with --attention --split on the CPU (the kernel replaced by
    MLX's own, any shape taken, 3 splits proposed): the 'attn' copy's trace calls the kernel with
    one block, the 'split' copy's with the proposed splits, and SPLIT_LONG_CONTEXTS is restored."""
    from bench.bench_small_gemm import forward_rows

    seen = []

    def kernel(q, k, v, scale, mask=None, n_splits=1):
        seen.append(n_splits)
        B, H = q.shape[:2]
        k, v = (mx.repeat(mx.broadcast_to(a, (B, *a.shape[1:])), H // k.shape[1], axis=1) for a in (k, v))
        return sa._mlx_sdpa(q, k, v, scale=scale, mask=mask)
    monkeypatch.setattr(sa, "available", lambda: True)
    monkeypatch.setattr(sa, "applies", lambda *a, **kw: True)
    monkeypatch.setattr(sa, "splits", lambda blocks, keys: 3)
    monkeypatch.setattr(sa, "small_attention", kernel)
    rows = forward_rows(str(tiny_models.llama), False, 8, [(1, 4)], reps=1, rounds=1, attention=True, split=True)
    assert [r["path"] for r in rows] == ["cublas", "small", "attn", "split"]
    assert set(seen) == {1, 3} and sa.SPLIT_LONG_CONTEXTS is False
    with sa.split_long_contexts():
        assert sa.SPLIT_LONG_CONTEXTS is True
    assert sa.SPLIT_LONG_CONTEXTS is False
