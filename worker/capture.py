"""What DFlash needs from an unmodified mlx-lm target: tapped hidden states, embedding, LM head.

mlx-lm models return logits only. DFlash
(Chen et al. 2026, "DFlash: Block Diffusion for Flash Speculative Decoding", arXiv 2602.06036)
conditions its draft on the outputs of a few target decoder layers. `HiddenCapture` records them
without copying any model code: inside `with capture:` the chosen entries of the model's layer
list are replaced by thin proxies that call the real layer and keep its output; on exit the
original layer objects are put back. Outside the `with` block the model is untouched, so plain
decoding on the same model object pays nothing (`tests/test_dflash.py` checks the layer objects are
the originals afterwards). This works for every mlx-lm architecture whose inner model iterates
over `model.layers` (llama, qwen2, qwen3, gemma3_text, mistral, phi3, ...).

Concurrency: not thread-safe. The worker runs all MLX work for a model on one engine thread, and
the proxies are only installed for the duration of one target forward on that thread.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn


def target_layers(model: nn.Module) -> list:
    """The decoder-layer list an mlx-lm model's forward iterates over (the list object itself).

    That is the inner model's `layers` list (`model.model.layers`) when there is one: models with
    mlx-lm's `PipelineMixin` (qwen2, qwen3_moe, deepseek, ...) expose `Model.layers` as a fresh
    slice on every access, and replacing entries of a slice would change nothing.

    Raises:
        TypeError: the model exposes no `layers` list.
    """
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None) if isinstance(inner, nn.Module) else None
    if not isinstance(layers, list):
        layers = getattr(model, "layers", None)
    if not isinstance(layers, list):
        raise TypeError(f"{type(model).__name__} has no `layers` list; cannot tap hidden states")
    return layers


def target_hidden_size(model: nn.Module) -> int:
    """Hidden size D of an mlx-lm model (from `args.hidden_size`).

    Raises:
        TypeError: the model has no `args.hidden_size`.
    """
    args = getattr(model, "args", None)
    d = getattr(args, "hidden_size", None)
    if d is None:
        raise TypeError(f"{type(model).__name__} has no args.hidden_size")
    return int(d)


def embedding_module(model: nn.Module) -> nn.Module:
    """The target's token embedding module (`model.embed_tokens` or `model.model.embed_tokens`, as
    mlx-lm's models name it): an `nn.Embedding` or its quantized form.

    Raises:
        TypeError: the model has no `embed_tokens`.
    """
    inner = getattr(model, "model", None)
    emb = getattr(inner, "embed_tokens", None) if inner is not None else None
    if emb is None:
        emb = getattr(model, "embed_tokens", None)
    if emb is None:
        raise TypeError(f"{type(model).__name__} has no embed_tokens")
    return emb


def target_vocab_size(model: nn.Module) -> int:
    """Rows of the target's embedding table (token ids the draft may embed): `args.vocab_size`,
    else the embedding weight's first dimension.

    Raises:
        TypeError: neither is available (no `embed_tokens`).
    """
    args = getattr(model, "args", None)
    v = getattr(args, "vocab_size", None)
    return int(v) if v is not None else int(embedding_module(model).weight.shape[0])


def target_embed_fn(model: nn.Module) -> Callable[[mx.array], mx.array]:
    """The target's raw token embedding: ids (..., L) int -> (..., L, D) in the weights' dtype.

    Raw means without any architecture-specific input scaling (Gemma multiplies by sqrt(D) inside
    its model, not inside the embedding); DFlash drafts apply their own `input_embedding_scale`.
    """
    return embedding_module(model).__call__


def target_head_fn(model: nn.Module, rows: Optional[mx.array] = None) -> Callable[[mx.array], mx.array]:
    """The target's LM head: hidden (..., D) -> logits (..., V). Tied embeddings use `as_linear`.

    Args:
        model: the mlx-lm target.
        rows: optional (K,) int32 token ids, ascending: the head keeps only these rows, so it
            returns (..., K) logits (a draft vocabulary, `worker.models.dflash.Model.set_vocab`).
            The rows are copied once (bf16 head: K * D * 2 bytes; 4-bit: about a quarter).
    """
    head = model["lm_head"] if "lm_head" in model else embedding_module(model)
    if rows is not None:
        head = _head_rows(head, rows)
    return head.__call__ if "lm_head" in model else head.as_linear


def _head_rows(head: nn.Module, rows: mx.array) -> nn.Module:
    """A copy of `head` (Linear, QuantizedLinear, Embedding, QuantizedEmbedding) holding only the
    given output rows: every array whose first axis is the vocabulary is gathered, the rest
    (group size, bits, mode) is shared, so the copy computes what the full head computes on them."""
    V = head["weight"].shape[0]
    sub = type(head).__new__(type(head))
    nn.Module.__init__(sub)
    vars(sub).update({k: v for k, v in vars(head).items() if k not in ("_no_grad", "_training")})
    for k, v in head.items():
        sub[k] = v[rows] if isinstance(v, mx.array) and v.shape[0] == V else v
    if hasattr(sub, "num_embeddings"):
        sub.num_embeddings = int(rows.shape[0])
    sub.freeze()
    mx.eval(sub.parameters())
    return sub


class _Tap:
    """Stands in for one decoder layer: calls it and stores its output in `slots[index]`."""

    __slots__ = ("layer", "slots", "index")

    def __init__(self, layer, slots: list, index: int):
        self.layer = layer
        self.slots = slots
        self.index = index

    def __call__(self, *args, **kwargs):
        out = self.layer(*args, **kwargs)
        self.slots[self.index] = out[0] if isinstance(out, tuple) else out
        return out

    def __getattr__(self, name):  # e.g. llama reads `layer.use_sliding`
        return getattr(self.layer, name)


class HiddenCapture:
    """Records the outputs of chosen decoder layers during a target forward.

    Usage, per forward:

        cap = HiddenCapture(target, [1, 9, 17, 25, 33])   # once per session
        with cap:
            logits = target(x, cache=cache)                 # (1, L, V)
        taps = cap.hidden()                                  # (1, L, 5 * D)

    Layer id i means the output of decoder layer i (0-based), i.e. Hugging Face
    `hidden_states[i + 1]`; for the last layer this is before the final norm.

    Args:
        model: an mlx-lm model with a `layers` list.
        layer_ids: 0-based layer indices; order is the concatenation order.

    Raises:
        ValueError: empty or out-of-range layer ids.
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int]):
        self.layers = target_layers(model)
        self.layer_ids = [int(i) for i in layer_ids]
        n = len(self.layers)
        if not self.layer_ids:
            raise ValueError("no target layers to capture")
        bad = [i for i in self.layer_ids if not 0 <= i < n or self.layers[i] is None]
        if bad:
            raise ValueError(f"tapped layer ids {bad} out of range for a {n}-layer target "
                             "(or not on this pipeline rank)")
        self._unique = sorted(set(self.layer_ids))
        self._slots: list = [None] * len(self._unique)
        self._order = [self._unique.index(i) for i in self.layer_ids]
        self._originals: list = []

    def __enter__(self) -> "HiddenCapture":
        if self._originals:
            raise RuntimeError("HiddenCapture is not re-entrant")
        for k, i in enumerate(self._unique):
            layer = self.layers[i]
            if isinstance(layer, _Tap):
                raise RuntimeError(f"layer {i} is already being captured")
            self._originals.append(layer)
            self.layers[i] = _Tap(layer, self._slots, k)
        return self

    def __exit__(self, *exc) -> None:
        for i, layer in zip(self._unique, self._originals):
            self.layers[i] = layer
        self._originals = []

    def hidden(self) -> mx.array:
        """Captured outputs concatenated on the last axis: (B, L, len(layer_ids) * D).

        Raises:
            RuntimeError: a tapped layer did not run since the last call.
        """
        if any(s is None for s in self._slots):
            raise RuntimeError("a tapped layer did not run during the captured forward")
        parts = [self._slots[k] for k in self._order]
        self._slots[:] = [None] * len(self._slots)
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
