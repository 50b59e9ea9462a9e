"""Growing a trained DFlash draft into a larger one that computes the same function.

`flashfleet draft train --init-from DRAFT --intermediate-size N --draft-layers M` with N or M
above the saved draft's continues training a wider and/or deeper draft without losing what the
saved one learned: its output at the first step is the saved draft's, to rounding.

How (function-preserving growth, as Net2Net, Chen et al. 2016, and zero-initialised residual
branches, Goyal et al. 2017 / Fixup, Zhang et al. 2019):
- a wider SwiGLU MLP `down(silu(gate x) * up x)`: the new hidden units get the fresh draft's
  random `gate`/`up` rows and zero `down` columns, so they add nothing until trained, while their
  gradients are not zero (the `down` columns see `silu(gate x) * up x`);
- a new decoder layer (appended after the saved ones, before the final norm): the fresh draft's
  random weights with `o_proj` and `down_proj` set to zero, so both residual branches add zero
  and the layer is the identity until trained.

Why: on the H200 a small draft is bound by kernel launches, not by bytes: a 3-layer draft of the
1.5B target took 1.61 ms per forward with an MLP of 256 and of 1024, with a fourth layer 1.83 ms. A draft
trained on 40 K sequences memorised less of its data than one trained on 20 K (training-batch tau
about 3.5 against 2.74 held out, where the smaller run had 3.9-5.1 against 2.4-3.0), so width is
the cheap capacity to try; restarting from random weights would throw away the training behind
the shipped one.
"""
from __future__ import annotations

import re

import mlx.core as mx

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
# Output projections of the residual branches: zero in a new layer, so the layer adds nothing.
ZEROED_IN_NEW_LAYERS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


class GrowError(ValueError):
    """The saved draft cannot become the asked one by growing (a smaller size, another shape)."""


def grow_weights(saved: dict[str, mx.array], fresh: dict[str, mx.array]) -> dict[str, mx.array]:
    """The weights of the larger draft `fresh` describes, computing what `saved` computes.

    Args:
        saved: {name: array} of the trained draft (unquantized names, as
            `dflash_checkpoint.dequantized_weights` gives), with L_s layers and MLP width I_s.
        fresh: {name: array} of a freshly initialised draft of the wanted shape (L >= L_s layers,
            MLP width I >= I_s; everything else the same shapes): where the new parameters'
            random values come from.

    Returns:
        {name: array} with `fresh`'s names and shapes, float32: `saved`'s values where they exist;
        MLP `gate_proj`/`up_proj` rows I_s.. from `fresh` and `down_proj` columns I_s.. zero; for
        layers L_s.., `fresh`'s weights with `o_proj` and `down_proj` zero.

    Raises:
        GrowError: a saved weight missing from `fresh`, or a shape that is not the same or
            grown along the MLP width.
    """
    extra = sorted(set(saved) - set(fresh))
    if extra:
        raise GrowError(f"the saved draft has weights the new one lacks (fewer layers?): {', '.join(extra[:4])}")
    out = {}
    for name, new in fresh.items():
        old = saved.get(name)
        if old is None:  # a new layer's weight
            m = _LAYER.match(name)
            if m is None:
                raise GrowError(f"{name}: not in the saved draft and not part of a new layer")
            out[name] = mx.zeros_like(new) if m.group(2) in ZEROED_IN_NEW_LAYERS else new
        elif old.shape == new.shape:
            out[name] = old
        elif name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")) and _grown(old, new, axis=0):
            out[name] = mx.concatenate([old, new[old.shape[0]:]], axis=0)
        elif name.endswith("mlp.down_proj.weight") and _grown(old, new, axis=1):
            pad = mx.zeros((new.shape[0], new.shape[1] - old.shape[1]), dtype=new.dtype)
            out[name] = mx.concatenate([old.astype(new.dtype), pad], axis=1)
        else:
            raise GrowError(f"{name}: saved shape {tuple(old.shape)} cannot grow into {tuple(new.shape)} "
                            "(only the MLP width and the number of layers can grow)")
    return {k: v.astype(mx.float32) for k, v in out.items()}


def _grown(old: mx.array, new: mx.array, axis: int) -> bool:
    """`new` is `old` lengthened along `axis` only."""
    same = all(o == n for i, (o, n) in enumerate(zip(old.shape, new.shape)) if i != axis)
    return old.ndim == new.ndim and same and new.shape[axis] > old.shape[axis]
