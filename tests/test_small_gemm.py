"""worker/small_gemm.py: which calls it takes, the swap of a model's linears, and (on CUDA) the
kernel against a float32 reference and a batched verify against cuBLAS's.

On the CPU the kernel cannot run (MLX's CUDA backend only), so the dispatch and the swap are
checked with `small_gemm` replaced by a recording reference matmul; the kernel's own tests skip.
"""
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import worker.small_gemm as sg
from worker.fusion import fuse_projections

cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="small_gemm runs on MLX's CUDA backend only")


def test_applies_only_to_few_rows_of_aligned_half_precision():
    w = mx.zeros((16, 128), dtype=mx.bfloat16)
    assert sg.applies(mx.zeros((3, 128), dtype=mx.bfloat16), w)
    assert sg.applies(mx.zeros((4, 16, 128), dtype=mx.bfloat16), w)  # 64 rows over two axes
    assert not sg.applies(mx.zeros((5, 16, 128), dtype=mx.bfloat16), w)  # 80 rows
    assert not sg.applies(mx.zeros((3, 128), dtype=mx.float32), w.astype(mx.float32))  # fp32
    assert not sg.applies(mx.zeros((3, 128), dtype=mx.float16), w)  # dtypes differ
    assert not sg.applies(mx.zeros((3, 96), dtype=mx.bfloat16), mx.zeros((16, 96), dtype=mx.bfloat16))  # K % 64
    assert not sg.applies(mx.zeros((3, 128), dtype=mx.bfloat16), mx.zeros((12, 128), dtype=mx.bfloat16))  # N % 8
    assert not sg.applies(mx.zeros((3, 64), dtype=mx.bfloat16), w)  # K differs


def test_bad_shapes_are_a_value_error_before_any_kernel():
    w = mx.zeros((16, 128), dtype=mx.bfloat16)
    with pytest.raises(ValueError, match="K % 64 == 0"):
        sg.small_gemm(mx.zeros((3, 96), dtype=mx.bfloat16), mx.zeros((16, 96), dtype=mx.bfloat16))
    with pytest.raises(ValueError, match=r"bias \(8,\)"):
        sg.small_gemm(mx.zeros((3, 128), dtype=mx.bfloat16), w, mx.zeros((8,), dtype=mx.bfloat16))


@pytest.mark.skipif(mx.cuda.is_available(), reason="checks the CPU, where nothing may change")
def test_use_small_gemm_changes_nothing_without_cuda(tiny_models):
    from mlx_lm import load

    model, _ = load(str(tiny_models.qwen2))
    assert not sg.available() and sg.use_small_gemm(model) == 0
    assert not any(isinstance(m, sg.SmallGemmLinear) for _, m in model.named_modules())


def _recording(monkeypatch):
    """small_gemm replaced by the reference matmul, recording each call's (rows, bias)."""
    calls = []

    def reference(x, w, b=None):
        assert sg.applies(x, w)
        calls.append((x.size // x.shape[-1], b is not None))
        y = x @ w.T
        return y if b is None else y + b

    monkeypatch.setattr(sg, "available", lambda: True)
    monkeypatch.setattr(sg, "small_gemm", reference)
    return calls


def test_swap_keeps_the_arrays_and_routes_rows_and_biased_calls(monkeypatch, tiny_models):
    from mlx_lm import load

    calls = _recording(monkeypatch)
    model, _ = load(str(tiny_models.qwen2))
    model.set_dtype(mx.bfloat16)
    fuse_projections(model)
    ref, _ = load(str(tiny_models.qwen2))
    ref.set_dtype(mx.bfloat16)
    fuse_projections(ref)
    layer = model.model.layers[0]
    fused = layer.self_attn.qkv_proj_fused
    weight = fused.weight
    n_layers = len(model.model.layers)
    swapped = sg.use_small_gemm(model)
    # q/k/v fused, o, gate/up fused, down per layer (and an untied head whose rows the kernel
    # can take); the class changed in place, the arrays kept
    head = 0 if model.args.tie_word_embeddings else int(model.lm_head.weight.shape[0] % 8 == 0)
    assert swapped == 4 * n_layers + head
    assert type(fused) is sg.SmallGemmLinear and fused.weight is weight
    assert sg.use_small_gemm(model) == 0  # a second call finds no plain nn.Linear left
    assert not any(isinstance(m, sg.SmallGemmLinear) for _, m in ref.named_modules())

    tokens = mx.array([[1, 2, 3, 4, 5, 6, 7, 8]], dtype=mx.uint32)
    got, want = model(tokens), ref(tokens)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=0.05)
    # 8 rows: every swapped linear (the untied head too) went through small_gemm, q/k/v with bias
    assert len(calls) == swapped and all(rows == 8 for rows, _ in calls)
    assert sum(b for _, b in calls) == n_layers  # qwen2: only q/k/v have a bias
    calls.clear()
    model(tokens[:, :1])  # one row: the biased q/k/v still (cuBLAS would run it), the rest MLX's GEMV
    assert calls == [(1, True)] * n_layers


def test_fp32_and_many_rows_fall_back_to_the_linear(monkeypatch):
    calls = _recording(monkeypatch)
    lin = nn.Linear(128, 16)
    lin.__class__ = sg.SmallGemmLinear
    x = mx.random.normal((3, 128))
    np.testing.assert_allclose(np.array(lin(x)), np.array(x @ lin.weight.T + lin.bias), rtol=1e-5, atol=1e-5)
    lin.set_dtype(mx.bfloat16)
    lin(mx.zeros((65, 128), dtype=mx.bfloat16))  # 65 rows: over MAX_ROWS
    assert calls == []
    lin(mx.zeros((64, 128), dtype=mx.bfloat16))
    assert calls == [(64, True)]


@cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("N,K,bias", [(2048, 1536, True), (1536, 8960, False), (8, 64, True), (40, 576, False),
                                      (4096, 128, True)])  # n_tiles 2, 2, 1, 1, 4
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40, 64])  # m16 tiles 1, 1, 1, 2, 3, 4
def test_kernel_matches_a_float32_reference(dtype, N, K, bias, rows):
    mx.random.seed(rows + N)
    x = mx.random.normal((rows, K)).astype(dtype)
    w = (mx.random.normal((N, K)) * K ** -0.5).astype(dtype)
    b = mx.random.normal((N,)).astype(dtype) if bias else None
    ref = x.astype(mx.float32) @ w.astype(mx.float32).T + (0 if b is None else b.astype(mx.float32))
    lib = x @ w.T if b is None else mx.addmm(b, x, w.T)
    got = sg.small_gemm(x, w, b)
    assert got.shape == (rows, N) and got.dtype == dtype
    scale = mx.abs(ref).max()
    err_lib = (mx.abs(lib.astype(mx.float32) - ref).max() / scale).item()
    err = (mx.abs(got.astype(mx.float32) - ref).max() / scale).item()
    assert err <= 2 * err_lib + 1e-3, (err, err_lib)  # as close as cuBLAS's own bf16/fp16 result


@cuda
def test_kernel_keeps_leading_axes_and_ignores_other_rows():
    x = mx.random.normal((4, 16, 128)).astype(mx.bfloat16)
    w = (mx.random.normal((24, 128)) * 0.1).astype(mx.bfloat16)
    got = sg.small_gemm(x, w)
    assert got.shape == (4, 16, 24)
    ref = x.astype(mx.float32) @ w.astype(mx.float32).T
    assert (mx.abs(got.astype(mx.float32) - ref).max() / mx.abs(ref).max()).item() < 1e-2
    # rows are independent: row 5 alone equals row 5 of the batch
    one = sg.small_gemm(x.reshape(64, 128)[5:6], w)
    assert mx.array_equal(one[0], got.reshape(64, 24)[5]).item()


@cuda
def test_a_view_at_an_odd_offset_is_read_right():
    big = mx.random.normal((1, 3 + 128)).astype(mx.bfloat16)
    x = big[:, 3:]  # one row: MLX may pass it uncopied, 6 bytes past a 16-byte boundary
    w = (mx.random.normal((16, 128)) * 0.1).astype(mx.bfloat16)
    ref = x.astype(mx.float32) @ w.astype(mx.float32).T
    got = sg.small_gemm(x, w)
    assert (mx.abs(got.astype(mx.float32) - ref).max() / mx.abs(ref).max()).item() < 1e-2


@cuda
def test_batched_verify_with_small_gemm_matches_cublas(tiny_models):
    from mlx_lm import load

    from worker.caches.rows import make_row_caches

    models = []
    for swap in (False, True):
        m, _ = load(str(tiny_models.qwen2))
        m.set_dtype(mx.bfloat16)
        fuse_projections(m)
        if swap:
            assert sg.use_small_gemm(m) > 0
        models.append(m)
    models[1].update(models[0].parameters())
    prompt = mx.array([list(range(3, 40))] * 4, dtype=mx.uint32)
    block = mx.array([[5, 9, 11, 2] * 4] * 4, dtype=mx.uint32)  # 4 rows of 16 tokens
    outs = []
    for m in models:
        cache = make_row_caches(m, 4)
        mx.eval(m(prompt, cache=cache))
        outs.append(m(block, cache=cache).astype(mx.float32))
    a, b = outs
    assert (mx.abs(a - b).max() / mx.abs(a).max()).item() < 2e-2
    assert (mx.argmax(a, -1) == mx.argmax(b, -1)).astype(mx.float32).mean().item() > 0.95


def test_pays_keeps_big_weights_on_cublas_above_sixteen_rows(monkeypatch):
    assert sg.pays(16, 17920, 1536) and sg.pays(1, 17920, 1536)
    assert not sg.pays(17, 17920, 1536) and not sg.pays(64, 1536, 8960)  # the MLP's gate/up and down
    assert sg.pays(64, 2048, 1536) and sg.pays(64, 1536, 1536)  # q/k/v and o of the 1.5B target
    calls = _recording(monkeypatch)
    monkeypatch.setattr(sg, "BIG_WEIGHT", 1000)
    lin = nn.Linear(128, 16, bias=False)  # 2,048 elements: "big" here
    lin.set_dtype(mx.bfloat16)
    lin.__class__ = sg.SmallGemmLinear
    lin(mx.zeros((17, 128), dtype=mx.bfloat16))
    assert calls == []
    lin(mx.zeros((16, 128), dtype=mx.bfloat16))
    assert calls == [(16, False)]


def _bf16_copy(src, dst):
    """A copy of a model directory with its floating weights in bf16 (the worker's GPU dtype)."""
    import shutil

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        weights = mx.load(str(f))
        mx.save_safetensors(str(f), {k: v.astype(mx.bfloat16) if mx.issubdtype(v.dtype, mx.floating) else v
                                     for k, v in weights.items()})
    return dst


def test_the_worker_swaps_its_linears_and_says_so(monkeypatch, tiny_models, caplog, tmp_path):
    import logging

    from worker.config import EngineConfig
    from worker.engine.thread import Engine

    _recording(monkeypatch)
    caplog.set_level(logging.INFO, logger="worker.engine.load")
    bf16 = _bf16_copy(tiny_models.llama, tmp_path / "llama-bf16")
    monkeypatch.setenv("FLASHFLEET_COMPUTE_DTYPE", "bfloat16")  # the tests' default is float32
    with Engine(EngineConfig(model_path=bf16, warmup=False)):
        pass
    assert "linear layers run calls of up to 64 rows as one CUDA kernel each" in caplog.text
    swapped = int(caplog.text.split("small gemm: ", 1)[1].split()[0])
    assert swapped >= 8  # 2 layers x (q/k/v fused, o, gate/up fused, down), after fusion
    caplog.clear()
    monkeypatch.setenv("FLASHFLEET_COMPUTE_DTYPE", "float32")
    with Engine(EngineConfig(model_path=tiny_models.llama, warmup=False)):  # float32: nothing to take
        pass
    assert "small gemm: no linear layer it can take" in caplog.text
    caplog.clear()
    monkeypatch.setenv("FLASHFLEET_COMPUTE_DTYPE", "bfloat16")
    with Engine(EngineConfig(model_path=bf16, warmup=False, small_gemm=False)):
        pass
    assert "small gemm: " not in caplog.text


def test_takes_only_unquantized_half_precision_linears_of_aligned_shapes():
    lin = nn.Linear(128, 16)
    assert not sg.takes(lin)  # float32
    lin.set_dtype(mx.bfloat16)
    assert sg.takes(lin)
    assert not sg.takes(nn.QuantizedLinear(128, 16))
    odd = nn.Linear(128, 12)
    odd.set_dtype(mx.float16)
    assert not sg.takes(odd)  # N % 8
    short = nn.Linear(96, 16)
    short.set_dtype(mx.float16)
    assert not sg.takes(short)  # K % 64
    assert not sg.takes(nn.Embedding(16, 128))


def test_available_needs_cuda_sm80_and_no_opt_out(monkeypatch):
    monkeypatch.setattr(sg.mx.cuda, "is_available", lambda: True)
    for info, want in (({"compute_capability_major": 9}, True), ({"compute_capability_major": 7}, False),
                       ({"architecture": "sm_90"}, True), ({"architecture": "sm_75"}, False), ({}, True)):
        monkeypatch.setattr(sg.mx, "device_info", lambda info=info: info)
        assert sg.available() is want, info
    monkeypatch.setenv("FLASHFLEET_SMALL_GEMM", "0")
    assert not sg.available()
    monkeypatch.setattr(sg.mx.cuda, "is_available", lambda: False)
    monkeypatch.delenv("FLASHFLEET_SMALL_GEMM")
    assert not sg.available()


def test_n_tiles_widens_blocks_only_while_enough_blocks_remain():
    assert sg.n_tiles(17920) == 4 and sg.n_tiles(151936) == 4  # gate/up, a head: many blocks
    assert sg.n_tiles(2048) == 2 and sg.n_tiles(1536) == 2  # 64 and 96 blocks of 16 columns
    assert sg.n_tiles(1024) == 1 and sg.n_tiles(40) == 1 and sg.n_tiles(8) == 1
    assert sg.n_tiles(3080) == 1  # 3080 % 32 != 0 and 3080 % 16 != 0


def test_fusing_after_the_swap_still_fuses(monkeypatch, tiny_models, tmp_path):
    from mlx_lm import load

    _recording(monkeypatch)
    model, _ = load(str(_bf16_copy(tiny_models.llama, tmp_path / "bf16")))
    assert sg.use_small_gemm(model) > 0
    assert fuse_projections(model) > 0
    assert type(model.model.layers[0].self_attn.qkv_proj_fused) is sg.SmallGemmLinear


def test_the_benchmark_prints_its_three_tables(monkeypatch, tiny_models, capsys, tmp_path):
    import json

    from bench import bench_small_gemm

    if not mx.cuda.is_available():
        assert bench_small_gemm.main(["--target", str(tiny_models.qwen2)]) == 2  # one line, no traceback
        assert "needs MLX's CUDA backend" in capsys.readouterr().err
        _recording(monkeypatch)  # the reference matmul stands in for the kernel
    rc = bench_small_gemm.main(["--target", str(tiny_models.qwen2), "--random-weights", "--context", "8",
                                "--reps", "1", "--rounds", "1", "--calls", "2", "--json-out", str(tmp_path / "g.json")])
    out = capsys.readouterr().out
    assert rc == 0 and "all ok: True" in out and "per call (2 calls a graph" in out
    data = json.loads((tmp_path / "g.json").read_text())
    assert {(r["rows"], r["tokens"]) for r in data["forward"]} == {(1, 1), (1, 16), (4, 16)}
    assert all(r["ms"] > 0 and 0 <= r["argmax_agree"] <= 1 for r in data["forward"])
    assert len(data["per_call"]) == 4 * 3 and all(r["small_total_us"] > 0 for r in data["per_call"])
