"""worker/fusion.py: fused q/k/v and gate/up projections give the unfused model's logits to float32
rounding (CPU) for mlx-lm's llama, qwen2 (biases), qwen3 and gemma3_text classes and a 4-bit
model; decoding on a fused target (plain and DFlash) equals plain greedy decoding on the unfused
one; nothing of a forward stays referenced; groups that cannot share a matmul are left alone."""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from test_dflash import MAX_TOKENS, PROMPT, TARGETS
from worker.capture import target_layers
from worker.fusion import _Fused, _Part, fuse_projections
from worker.models.dflash_checkpoint import init_dflash_draft
from worker.sampling import greedy
from worker.engine.one_sequence import decode
from worker.decoding import plain


def _param_count(model) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


def _stashes(model) -> list[_Fused]:
    out = []
    for layer in target_layers(model):
        for child in ("self_attn", "mlp"):
            part = getattr(layer[child], "q_proj" if child == "self_attn" else "gate_proj")
            if isinstance(part, _Part):
                out.append(part.fused)
    return out


@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_fused_model_gives_the_same_logits_and_greedy_output(arch):
    model = TARGETS[arch]()
    x = mx.array([PROMPT])
    ref_logits = model(x)
    ref = [t for s in plain.generate(PROMPT, MAX_TOKENS, greedy, set(), model=model) for t in s.tokens]
    n_params = _param_count(model)

    assert fuse_projections(model) == 2 * len(target_layers(model))
    attn, mlp = target_layers(model)[0]["self_attn"], target_layers(model)[0]["mlp"]
    assert "qkv_proj_fused" in attn and "q_proj" not in attn and "gate_up_proj_fused" in mlp
    assert _param_count(model) == n_params  # the fused copies replace the originals
    # The same dot products; a BLAS may block a wider matmul differently (OpenBLAS: 2.6e-5 on logits
    # up to 15), so equal to float32 rounding, and greedy decoding gives the same tokens.
    assert mx.allclose(model(x), ref_logits, rtol=1e-5, atol=1e-4).item()
    out = [t for s in plain.generate(PROMPT, MAX_TOKENS, greedy, set(), model=model) for t in s.tokens]
    assert out == ref
    # DFlash on the fused target (taps captured from its layers): still the plain greedy output.
    draft = init_dflash_draft(model, num_layers=2, block_size=4, seed=7)
    spec = [t for s in decode(model, PROMPT, MAX_TOKENS, greedy, (), draft=draft, block_size=4)
            for t in s.tokens]
    assert spec == ref
    assert all(f._outs is None and f._x is None for f in _stashes(model))  # nothing kept after a forward
    assert fuse_projections(model) == 0  # a second call finds nothing left to fuse


def test_quantized_model_fuses_with_its_scales_and_biases():
    model = TARGETS["qwen2"]()
    nn.quantize(model, group_size=32, bits=4)
    x = mx.array([PROMPT])
    ref = model(x)
    assert fuse_projections(model) == 2 * len(target_layers(model))
    fused = target_layers(model)[0]["self_attn"]["qkv_proj_fused"]
    assert isinstance(fused, nn.QuantizedLinear) and fused.bits == 4 and "bias" in fused
    assert mx.allclose(model(x), ref, rtol=1e-5, atol=1e-4).item()


def test_a_member_called_with_another_input_computes_its_own_slice():
    model = TARGETS["llama"]()
    attn = target_layers(model)[0]["self_attn"]
    x1, x2 = mx.random.normal((1, 3, 64)), mx.random.normal((1, 3, 64))
    want_k2 = attn.k_proj(x2)
    fuse_projections(model)
    q1 = attn.q_proj(x1)  # stashes k(x1), v(x1)
    k2 = attn.k_proj(x2)  # another input: must not get k(x1)
    assert mx.allclose(k2, want_k2, rtol=1e-5, atol=1e-5).item()
    assert q1.shape == (1, 3, attn.qkv_proj_fused.weight.shape[0] - 2 * k2.shape[-1])


def test_groups_that_cannot_share_a_matmul_are_left_alone():
    model = TARGETS["llama"]()
    layer = target_layers(model)[0]
    layer.self_attn.k_proj = nn.Linear(64, 32, bias=True)  # q and v have no bias: another signature
    layer.mlp.up_proj = nn.QuantizedLinear(64, 128, bias=False, group_size=32, bits=4)  # another class
    n = fuse_projections(model)
    assert n == 2 * len(target_layers(model)) - 2
    assert isinstance(layer.self_attn.q_proj, nn.Linear) and isinstance(layer.mlp.gate_proj, nn.Linear)
    assert "qkv_proj_fused" not in layer.self_attn and "gate_up_proj_fused" not in layer.mlp


def test_a_model_without_layers_is_a_type_error():
    with pytest.raises(TypeError, match="no `layers` list"):
        fuse_projections(nn.Linear(4, 4))
