"""Model storage dtypes and quantized targets: `worker.loading` and `flashfleet.models.quantize`.

Tiny random models (hidden 64, MLP 128: every linear layer and the embedding is a multiple of the
quantization group of 64) are quantized to 4 and 8 bits and served by plain decoding, by DFlash
(`worker.engine.one_sequence.decode`, a tiny random draft and a draft rigged to propose the target's own greedy
continuation, so drafts are accepted) and by the engine. DFlash's greedy output must equal plain
greedy output on the quantized target, token for token, on the CPU in float32.
"""
from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx import nn
from mlx.utils import tree_flatten

from flashfleet.models.quantize import quantize_model_dir
from harness import run_request
from tiny_models import build_model_dir, model_config
from worker.capture import target_head_fn
from worker.config import EngineConfig
from worker.engine.thread import Engine
from worker.engine.types import GenerationRequest
from worker.loading import COMPUTE_DTYPE_ENV, compute_dtype, load_target, stored_dtype
from worker.models.dflash_checkpoint import init_dflash_draft, load_dflash_draft, save_dflash_draft
from worker.sampling import greedy
import worker.engine.batch as batch_mod
from worker.decoding import plain
from worker.engine import one_sequence

PROMPT = [5, 40, 77, 130, 9, 260, 31, 64, 12]
MAX_TOKENS = 29
CPU = mx.default_device().type == mx.DeviceType.cpu


def _floating(model: nn.Module) -> set:
    return {p.dtype for _, p in tree_flatten(model.parameters()) if mx.issubdtype(p.dtype, mx.floating)}


def _bf16_copy(src, out):
    """A copy of a model directory with its weights stored in bfloat16."""
    weights = {k: v.astype(mx.bfloat16) for k, v in mx.load(str(src / "model.safetensors")).items()}
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((src / name).read_bytes())
    return out


@pytest.fixture(scope="module")
def dense(tiny_models, tmp_path_factory):
    """{"untied": the tiny llama, "tied": a tied-embedding llama (its head is the embedding)}."""
    cfg = {**model_config("llama", tiny_models.vocab_size, 2), "tie_word_embeddings": True}
    tied = build_model_dir(tmp_path_factory.mktemp("tied") / "llama-tied", cfg, tiny_models.llama, seed=5)
    return {"untied": tiny_models.llama, "tied": tied}


@pytest.fixture(scope="module", params=[("untied", 4), ("untied", 8), ("tied", 4), ("tied", 8)],
                ids=lambda p: f"{p[0]}-{p[1]}bit")
def quantized(request, dense, tmp_path_factory):
    """(dense source directory, quantized copy's QuantizeResult) for one head kind and bit width."""
    kind, bits = request.param
    out = tmp_path_factory.mktemp("quantized") / f"llama-{kind}-{bits}bit"
    return dense[kind], quantize_model_dir(dense[kind], out, bits)


# --------------------------------------------------------------------------- compute dtype


def test_compute_dtype_per_device(monkeypatch):
    monkeypatch.delenv(COMPUTE_DTYPE_ENV, raising=False)
    cpu, gpu = mx.Device(mx.DeviceType.cpu), mx.Device(mx.DeviceType.gpu)
    for stored in (mx.bfloat16, mx.float16, mx.float32, None):
        assert compute_dtype(stored, cpu) == mx.float32
    assert compute_dtype(mx.bfloat16, gpu) == mx.bfloat16
    assert compute_dtype(mx.float16, gpu) == mx.float16
    assert compute_dtype(mx.float32, gpu) == mx.bfloat16  # a float32-stored model runs in 16 bits
    assert compute_dtype(None, gpu) == mx.bfloat16
    monkeypatch.setenv(COMPUTE_DTYPE_ENV, "bfloat16")
    assert compute_dtype(mx.float32, cpu) == mx.bfloat16
    monkeypatch.setenv(COMPUTE_DTYPE_ENV, "Float32")
    assert compute_dtype(mx.bfloat16, gpu) == mx.float32
    monkeypatch.setenv(COMPUTE_DTYPE_ENV, "int8")
    with pytest.raises(ValueError, match=COMPUTE_DTYPE_ENV):
        compute_dtype()


@pytest.mark.skipif(not CPU, reason="the automatic choice on a CPU")
def test_bf16_files_load_as_float32_on_the_cpu_and_decode_like_a_float32_load(tiny_models, tmp_path, monkeypatch):
    from mlx_lm import load

    monkeypatch.delenv(COMPUTE_DTYPE_ENV, raising=False)
    path = _bf16_copy(tiny_models.llama, tmp_path / "bf16")
    model, tokenizer = load_target(path)
    assert _floating(model) == {mx.float32} and stored_dtype(model) == mx.float32
    assert tokenizer.eos_token_ids == load(str(tiny_models.llama))[1].eos_token_ids
    reference, _ = load(str(path))
    assert _floating(reference) == {mx.bfloat16}
    reference.set_dtype(mx.float32)
    tokens = [t for s in plain.generate(PROMPT, MAX_TOKENS, greedy, set(), model=model) for t in s.tokens]
    want = [t for s in plain.generate(PROMPT, MAX_TOKENS, greedy, set(), model=reference) for t in s.tokens]
    assert tokens == want and len(tokens) == MAX_TOKENS

    monkeypatch.setenv(COMPUTE_DTYPE_ENV, "bfloat16")  # kept as stored
    assert _floating(load_target(path)[0]) == {mx.bfloat16}
    monkeypatch.delenv(COMPUTE_DTYPE_ENV)
    float32, _ = load_target(tiny_models.llama)  # a float32-stored model: unchanged on a CPU
    original = dict(tree_flatten(load(str(tiny_models.llama))[0].parameters()))
    assert all(mx.array_equal(v, original[k]) for k, v in tree_flatten(float32.parameters()))


def test_dflash_draft_follows_the_target_dtype(tiny_models, tmp_path, monkeypatch):
    from mlx_lm import load

    target, _ = load(str(tiny_models.llama))
    draft_dir = tmp_path / "draft"
    save_dflash_draft(init_dflash_draft(target, num_layers=1, block_size=4, dtype=mx.bfloat16), draft_dir)
    assert _floating(load_dflash_draft(draft_dir, target)) == {mx.float32}  # float32 target
    assert _floating(load_dflash_draft(draft_dir, target, dtype=None)) == {mx.bfloat16}  # the checkpoint's
    monkeypatch.setenv(COMPUTE_DTYPE_ENV, "bfloat16")
    bf16_target, _ = load_target(tiny_models.llama)
    assert _floating(load_dflash_draft(draft_dir, bf16_target)) == {mx.bfloat16}


# --------------------------------------------------------------------------- quantized copies


def test_quantized_copy_layout_and_load(quantized):
    src, result = quantized
    out = result.out_dir
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == result.bits and config["quantization"]["group_size"] == 64
    assert config["torch_dtype"] == "bfloat16" == result.dtype  # a float32 source is stored in bf16
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    stored = mx.load(str(out / "model.safetensors"))
    assert {v.dtype for k, v in stored.items() if k.endswith(".scales")} == {mx.bfloat16}
    dense_bytes = (src / "model.safetensors").stat().st_size  # float32
    assert result.weights_bytes < dense_bytes * (result.bits + 1) / 32
    assert result.bits < result.bits_per_weight < result.bits + 1

    model, _ = load_target(out)
    modules = dict(model.named_modules())
    dense_kinds = [k for k, m in modules.items() if type(m) in (nn.Linear, nn.Embedding)]
    assert dense_kinds == []  # every width is a multiple of 64: all quantized
    assert isinstance(modules["model.embed_tokens"], nn.QuantizedEmbedding)
    assert all(m.bits == result.bits for m in modules.values() if isinstance(m, nn.QuantizedLinear))
    params = dict(tree_flatten(model.parameters()))
    assert {v.dtype for k, v in params.items() if k.endswith(".weight") and "norm" not in k} == {mx.uint32}
    assert _floating(model) == {compute_dtype(mx.bfloat16)}  # scales, biases, norms: float32 on a CPU


def test_quantized_head_is_the_dequantized_matrix(quantized):
    """`target_head_fn` of a quantized target (QuantizedLinear head, or QuantizedEmbedding.as_linear
    when tied) computes hidden @ dequantized(W).T, as the model's own forward."""
    _, result = quantized
    model, _ = load_target(result.out_dir)
    head = model["lm_head"] if "lm_head" in model else model.model.embed_tokens
    w = mx.dequantize(head.weight, head.scales, head.biases, head.group_size, head.bits)
    h = mx.random.normal((3, model.args.hidden_size), key=mx.random.key(0)).astype(w.dtype)
    logits = target_head_fn(model)(h)
    assert logits.shape == (3, model.args.vocab_size)
    assert mx.allclose(logits, h @ w.T, atol=1e-3, rtol=1e-3).item()
    rows = mx.array([0, 7, 300], dtype=mx.int32)
    assert mx.allclose(target_head_fn(model, rows)(h), (h @ w.T)[:, rows], atol=1e-3, rtol=1e-3).item()


@pytest.mark.parametrize("bs", [2, 4])
def test_dflash_greedy_equals_plain_greedy_on_a_quantized_target(quantized, tmp_path, bs, monkeypatch):
    _, result = quantized
    target, _ = load_target(result.out_dir)
    ref = [t for s in plain.generate(PROMPT, MAX_TOKENS, greedy, set(), model=target) for t in s.tokens]
    assert len(ref) == MAX_TOKENS
    draft_dir = tmp_path / "draft"
    save_dflash_draft(init_dflash_draft(target, num_layers=1, block_size=4, seed=3), draft_dir)
    draft = load_dflash_draft(draft_dir, target)  # binds the quantized embedding and head
    assert _floating(draft) == _floating(target)
    steps = list(one_sequence.decode(target, PROMPT, MAX_TOKENS, greedy, (), draft=draft, block_size=bs))
    assert [t for s in steps for t in s.tokens] == ref
    # A draft rigged to propose the target's own continuation: every proposal lands.
    truth = PROMPT + ref + [0] * bs
    real = batch_mod.draft_block

    def rigged(d, batch, L):
        blocks = real(d, batch, L).tolist()
        for r, row in enumerate(batch.rows):
            blocks[r][1:] = truth[row.n: row.n + L - 1]
        return mx.array(blocks, dtype=mx.uint32)

    monkeypatch.setattr(batch_mod, "draft_block", rigged)
    steps = list(one_sequence.decode(target, PROMPT, MAX_TOKENS, greedy, (), draft=draft, block_size=bs))
    assert [t for s in steps for t in s.tokens] == ref
    assert sum(s.accepted for s in steps) >= (bs - 1) * (MAX_TOKENS // bs - 1)


def test_engine_serves_a_quantized_target_with_dflash(quantized, tmp_path):
    """The engine loads the quantized target (`worker.loading.load_target`) and a DFlash draft bound
    to its quantized embedding and head; greedy DFlash equals greedy plain decoding."""
    from mlx_lm import load

    _, result = quantized
    target, _ = load(str(result.out_dir))
    draft_dir = tmp_path / "draft"
    save_dflash_draft(init_dflash_draft(target, num_layers=1, block_size=4, seed=1), draft_dir)
    with Engine(EngineConfig(model_path=result.out_dir, draft_path=draft_dir)) as engine:
        assert engine.model.draft_mode == "dflash"
        prompt = tuple(engine.encode_prompt("Speculation pays when", None))
        plain_ids, _ = run_request(engine, GenerationRequest("p", prompt, 19, mode="plain"))
        spec_ids, done = run_request(engine, GenerationRequest("d", prompt, 19, mode="auto"))
        assert spec_ids == plain_ids and len(plain_ids) == 19
        assert done.stats.mode == "dflash" and done.stats.cycles > 0


def test_quantize_refuses_bad_bits_and_quantized_sources(quantized, tmp_path):
    src, result = quantized
    with pytest.raises(ValueError, match="bits"):
        quantize_model_dir(src, tmp_path / "x", 3)
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model_dir(result.out_dir, tmp_path / "y", 4)


def test_kv_bytes_per_token_are_those_of_the_compute_dtype(tiny_models, dflash_dir, tmp_path):
    """A bfloat16-stored model (its config says so, as a fetched one's does) computes in float32
    here (conftest.py), and so does its KV cache: the model description the worker registers and
    exports metrics from reports the bytes its caches take (the KV budget's own numbers,
    `Scheduler.bytes_per_position`), not half of them; a DFlash draft's share likewise."""
    path = _bf16_copy(tiny_models.llama, tmp_path / "bf16")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}))
    heads = cfg["num_attention_heads"]
    want = 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * (
        cfg.get("head_dim") or cfg["hidden_size"] // heads) * 4
    with Engine(EngineConfig(model_path=path, draft_path=dflash_dir, capacity=1)) as engine:
        per_position = engine._scheduler.bytes_per_position  # idle: read only
        assert engine.model.kv_bytes_per_token == per_position["plain"] == want
        assert engine.model.draft_kv_bytes_per_token == per_position["dflash"] - want > 0
