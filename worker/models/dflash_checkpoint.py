"""Read, write and randomly initialise DFlash drafts in the published (z-lab / SpecForge) layout.

Layout of a draft directory (e.g. `z-lab/Qwen3-8B-DFlash-b16`):

- `config.json`: a Qwen3 config (`model_type: "qwen3"`, `architectures: ["DFlashDraftModel"]`)
  with the draft's layer sizes, top-level `block_size`, `num_target_layers`, and
  `dflash_config: {"target_layer_ids": [...], "mask_token_id": int}`.
- `*.safetensors`: flat names (`fc.weight`, `hidden_norm.weight`, `norm.weight`, `layers.{i}.…`),
  no embedding and no LM head (both are borrowed from the target).
- Optional, flashfleet's small shipped drafts: `quantization: {"group_size", "bits"}` in config.json
  and MLX affine-quantized linear layers (`.weight` uint32 + `.scales` + `.biases`), the convention
  of mlx-lm's `convert -q`; `quantize_dflash_draft` makes them.
- Optional, a draft vocabulary (`Model.set_vocab`): `draft_vocab_size: K` in config.json (EAGLE-3's
  field name) and a `draft_vocab` tensor, (K,) int32 ascending target ids. A loader that does not
  know them would run the draft over the whole head (the weights do not depend on the vocabulary).

Loading validates the draft against the target at load time (hidden size, tapped layers in range,
target depth, vocabulary, mask id) and raises `DraftMismatch` with the numbers on both sides, so a
wrong pairing fails before the first request rather than as garbage acceptance.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map_with_path

from worker.capture import embedding_module, target_hidden_size, target_layers, target_vocab_size
from worker.models.dflash import Model, ModelArgs, default_target_layer_ids

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
VOCAB_TENSOR = "draft_vocab"


class DraftCheckpointError(ValueError):
    """The draft directory is unreadable or malformed (missing file, field or tensor)."""


class DraftMismatch(DraftCheckpointError):
    """The draft was not built for this target (hidden size, taps, depth or vocabulary differ)."""


def read_draft_config(path: Path) -> dict:
    """The parsed config.json of a draft directory.

    Raises:
        DraftCheckpointError: `path` missing or not a directory, no config.json in it, or it is
            not valid JSON.
    """
    if not path.exists():
        raise DraftCheckpointError(f"{path} does not exist (a draft is a directory with {CONFIG_FILE})")
    if not path.is_dir():
        raise DraftCheckpointError(f"{path} is not a directory (a draft is a directory with {CONFIG_FILE})")
    cfg_path = path / CONFIG_FILE
    if not cfg_path.is_file():
        raise DraftCheckpointError(f"{path}: no {CONFIG_FILE}")
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise DraftCheckpointError(f"{cfg_path}: invalid JSON ({e})") from e


def check_draft_matches_target(args: ModelArgs, target: nn.Module) -> None:
    """Raises DraftMismatch unless a draft with `args` can run against `target`.

    Checks: draft hidden_size == target D (the draft consumes target embeddings and feeds the
    target's head); every tapped layer id < target depth; `num_target_layers`, when the config has
    it, equals the target depth; `vocab_size`, when present, equals the target's; the mask id is a
    row of the target's embedding table.

    Raises:
        DraftMismatch: on the first failed check; DraftCheckpointError when the mask id is absent.
    """
    D = target_hidden_size(target)
    if args.hidden_size != D:
        raise DraftMismatch(
            f"draft hidden_size {args.hidden_size} != target hidden size {D}: a DFlash draft "
            "shares the target's embedding and LM head"
        )
    n_layers = len(target_layers(target))
    bad = [i for i in args.target_layer_ids if not 0 <= i < n_layers]
    if bad:
        raise DraftMismatch(
            f"draft taps target layers {args.target_layer_ids}; {bad} out of range for a "
            f"{n_layers}-layer target"
        )
    if args.num_target_layers is not None and args.num_target_layers != n_layers:
        raise DraftMismatch(
            f"draft was trained for a {args.num_target_layers}-layer target, this one has {n_layers}"
        )
    V = target_vocab_size(target)
    if args.vocab_size is not None and args.vocab_size != V:
        raise DraftMismatch(f"draft vocab_size {args.vocab_size} != target vocab size {V}")
    if args.mask_token_id is None:
        raise DraftCheckpointError("draft config has no dflash_config.mask_token_id")
    if not 0 <= args.mask_token_id < V:
        raise DraftMismatch(f"mask_token_id {args.mask_token_id} outside the target vocabulary [0, {V})")


def _cast(model: nn.Module, dtype: Optional[mx.Dtype]) -> None:
    if dtype is not None:
        model.update(tree_map_with_path(
            lambda _, p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p,
            model.parameters(),
        ))


FOLLOW_TARGET = "target"


def load_dflash_draft(path: str | Path, target: nn.Module, *,
                      dtype: Optional[mx.Dtype] | str = FOLLOW_TARGET) -> Model:
    """Loads a DFlash draft directory, checks it against `target`, and binds it to it.

    Args:
        path: directory with config.json and one or more *.safetensors files.
        target: the mlx-lm target model the draft will run with.
        dtype: cast floating weights (quantized layers: their scales and biases) to this dtype;
            `FOLLOW_TARGET` (default) takes the target's compute dtype (`target_dtype`: float32
            on a CPU worker, the 16-bit dtype on a GPU), None keeps the checkpoint's.

    Returns:
        The draft `Model`, weights evaluated, bound to the target's embedding and head.

    Raises:
        DraftCheckpointError: missing/invalid files, fields, tensors or tensor shapes.
        DraftMismatch: the draft does not fit this target (see `check_draft_matches_target`).
    """
    path = Path(path)
    cfg = read_draft_config(path)
    archs = cfg.get("architectures") or ["DFlashDraftModel"]
    if "DFlashDraftModel" not in archs:
        raise DraftCheckpointError(f"{path}: architectures {archs} is not a DFlash draft")
    try:
        args = ModelArgs.from_dict(cfg)
    except (TypeError, ValueError) as e:
        raise DraftCheckpointError(f"{path}/{CONFIG_FILE}: {e}") from e
    check_draft_matches_target(args, target)

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DraftCheckpointError(f"{path}: no *.safetensors files")
    weights: dict = {}
    for f in files:
        weights.update(mx.load(str(f)))
    vocab = weights.pop(VOCAB_TENSOR, None)
    if (vocab is None) != (args.draft_vocab_size is None):
        raise DraftCheckpointError(
            f"{path}: config.json draft_vocab_size is {args.draft_vocab_size} but the "
            f"{VOCAB_TENSOR} tensor is {'missing' if vocab is None else 'present'}; both or neither")
    if vocab is not None and args.vocab_size is None:  # ids are checked against the target's table
        args.vocab_size = target_vocab_size(target)
    model = Model(args)
    if vocab is not None:
        if vocab.ndim != 1 or vocab.size != args.draft_vocab_size:
            raise DraftCheckpointError(
                f"{path}: {VOCAB_TENSOR} has shape {tuple(vocab.shape)}, config.json says "
                f"draft_vocab_size {args.draft_vocab_size}")
        try:
            model.set_vocab(np.array(vocab))
        except ValueError as e:
            raise DraftMismatch(f"{path}: {e}") from e
    weights = model.sanitize(weights)
    if args.quantization:
        q = args.quantization
        try:
            nn.quantize(model, group_size=int(q["group_size"]), bits=int(q["bits"]),
                        class_predicate=lambda p, m: f"{p}.scales" in weights)
        except (KeyError, TypeError, ValueError) as e:
            raise DraftCheckpointError(f"{path}/{CONFIG_FILE}: bad quantization {q}: {e}") from e
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise DraftCheckpointError(f"{path}: weights do not match config.json: {e}") from e
    _cast(model, target_dtype(target) if isinstance(dtype, str) and dtype == FOLLOW_TARGET else dtype)
    mx.eval(model.parameters())
    return model.bind(target)


def save_dflash_draft(model: Model, path: str | Path) -> None:
    """Writes `model` as config.json + model.safetensors in the published layout.

    The output loads with `load_dflash_draft` and with the z-lab loaders (same field and tensor
    names). An existing directory is reused; existing files of the same names are overwritten.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    a = model.args
    cfg = {k: v for k, v in asdict(a).items() if v is not None and k != "rope_parameters"}
    cfg["dflash_config"] = dict(a.dflash_config)
    cfg["architectures"] = ["DFlashDraftModel"]
    cfg["model_type"] = "qwen3"
    cfg["block_size"] = int(a.block_size)
    cfg.setdefault("tie_word_embeddings", False)
    cfg.setdefault("hidden_act", "silu")
    weights = dict(tree_flatten(model.parameters()))
    dtypes = {v.dtype for v in weights.values() if mx.issubdtype(v.dtype, mx.floating)}
    if len(dtypes) == 1:
        cfg["torch_dtype"] = {mx.bfloat16: "bfloat16", mx.float16: "float16", mx.float32: "float32"}.get(
            dtypes.pop(), None)
    if model.vocab is not None:
        weights[VOCAB_TENSOR] = model.vocab
    (path / CONFIG_FILE).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    mx.save_safetensors(str(path / WEIGHTS_FILE), weights, metadata={"format": "pt"})


def quantizable(model: Model, group_size: int) -> list[str]:
    """Paths of the draft's Linear layers whose input width is a multiple of `group_size`."""
    return [p for p, m in model.named_modules()
            if isinstance(m, nn.Linear) and m.weight.shape[-1] % group_size == 0]


def quantize_dflash_draft(model: Model, bits: int = 4, group_size: int = 64) -> Model:
    """Quantizes the draft's linear layers in place (MLX affine quantization, `mx.quantize`).

    Every `nn.Linear` whose input width is a multiple of `group_size` becomes an
    `nn.QuantizedLinear` (weights packed to `bits` per value, one float scale and bias per group
    in the weights' dtype); norms stay in floating point. At 4 bits and groups of 64 a weight
    costs 4.5 bits, 0.28x of bfloat16. The embedding and LM head are the target's and untouched.
    `args.quantization` is set, so `save_dflash_draft` records it and `load_dflash_draft`
    rebuilds the same layers.

    Args:
        model: a draft (bound or not); its floating weights should already be in the dtype to
            keep for scales and biases (e.g. bfloat16).
        bits: 2, 3, 4, 5, 6 or 8.
        group_size: 32, 64 or 128.

    Returns:
        `model`, quantized.

    Raises:
        ValueError: unsupported bits / group_size, or no layer can be quantized with it.
    """
    if bits not in (2, 3, 4, 5, 6, 8) or group_size not in (32, 64, 128):
        raise ValueError(f"unsupported quantization: bits {bits}, group size {group_size}")
    if not quantizable(model, group_size):
        raise ValueError(f"no linear layer of this draft has an input width divisible by {group_size}")
    nn.quantize(model, group_size=group_size, bits=bits,
                class_predicate=lambda p, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % group_size == 0)
    model.args.quantization = {"group_size": int(group_size), "bits": int(bits)}
    mx.eval(model.parameters())
    return model


def dequantized_weights(model: nn.Module, dtype: mx.Dtype = mx.float32) -> dict[str, mx.array]:
    """A module's weights as plain floating arrays, quantized layers expanded (`mx.dequantize`).

    Used to continue training a saved draft (`flashfleet draft train --init-from`: a 4-bit
    checkpoint becomes the float weights of an unquantized draft of the same shape) and to start
    a draft from a (possibly quantized) target's layers.

    Args:
        model: a draft or any MLX module (e.g. one target decoder layer), quantized or not.
        dtype: dtype of the returned arrays.

    Returns:
        {parameter name: array} with the names of an unquantized `Model` (`q_proj.weight`, ...).
    """
    out = {}
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)}
    for name, m in quantized.items():
        out[f"{name}.weight"] = mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits).astype(dtype)
        if "bias" in m:
            out[f"{name}.bias"] = m.bias.astype(dtype)
    for k, v in tree_flatten(model.parameters()):
        if k.rsplit(".", 1)[0] not in quantized:
            out[k] = v.astype(dtype)
    return out


def quantized_bytes_per_param(bits: int, group_size: int, scale_bytes: int = 2) -> float:
    """Stored bytes per weight of an affine-quantized matrix: bits/8 + (scale + bias) per group."""
    return bits / 8 + 2 * scale_bytes / group_size


def target_dtype(target: nn.Module) -> mx.Dtype:
    """The floating dtype `target` computes in: its embedding's weight dtype, or for a quantized
    embedding the dtype of its scales (bfloat16 when neither is floating)."""
    emb = embedding_module(target)
    for name in ("weight", "scales"):
        w = getattr(emb, name, None)
        if w is not None and mx.issubdtype(w.dtype, mx.floating):
            return w.dtype
    return mx.bfloat16


def init_dflash_draft(
    target: nn.Module,
    num_layers: int,
    block_size: int = 16,
    target_layer_ids: Optional[Sequence[int]] = None,
    mask_token_id: Optional[int] = None,
    *,
    num_taps: int = 5,
    intermediate_size: Optional[int] = None,
    num_attention_heads: Optional[int] = None,
    num_key_value_heads: Optional[int] = None,
    head_dim: Optional[int] = None,
    tokenizer_vocab_size: Optional[int] = None,
    seed: int = 0,
    dtype: Optional[mx.Dtype] = None,
) -> Model:
    """A randomly initialised draft shaped for `target` (the starting point for training).

    Sizes default to the target's (hidden size, heads, head_dim, MLP width, RoPE, eps), as the
    published drafts do (design note §4.3).

    Args:
        target: the mlx-lm target model.
        num_layers: draft depth (published drafts: 5; 8 for Qwen3-Coder).
        block_size: B, tokens per draft block including the last committed token.
        target_layer_ids: tapped target layers; default `default_target_layer_ids(L, num_taps)`.
        mask_token_id: MASK id; default the first id past the tokenizer's vocabulary when
            `tokenizer_vocab_size` is given and the embedding table is padded beyond it, else the
            last row of the table. Any fixed row works for correctness (output is always the
            target's); a spare row keeps the MASK embedding distinct from real text.
        seed: seed of the weight initialisation (same seed, same weights).
        dtype: weight dtype; default the target embedding's floating dtype.

    Raises:
        DraftMismatch: explicit taps or mask id do not fit the target.
    """
    targs = target.args
    D = target_hidden_size(target)
    n_heads = num_attention_heads or targs.num_attention_heads
    n_kv = num_key_value_heads or getattr(targs, "num_key_value_heads", None) or n_heads
    hd = head_dim or getattr(targs, "head_dim", None) or D // n_heads
    V = target_vocab_size(target)
    L = len(target_layers(target))
    if target_layer_ids is None:
        target_layer_ids = default_target_layer_ids(L, num_taps)
    if mask_token_id is None:
        mask_token_id = tokenizer_vocab_size if tokenizer_vocab_size and tokenizer_vocab_size < V else V - 1
    args = ModelArgs(
        hidden_size=D,
        num_hidden_layers=num_layers,
        intermediate_size=intermediate_size or targs.intermediate_size,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=hd,
        rms_norm_eps=float(getattr(targs, "rms_norm_eps", 1e-6)),
        vocab_size=V,
        rope_theta=float(getattr(targs, "rope_theta", None) or 1_000_000.0),
        rope_scaling=getattr(targs, "rope_scaling", None),
        max_position_embeddings=int(getattr(targs, "max_position_embeddings", None) or 40960),
        block_size=block_size,
        num_target_layers=L,
        dflash_config={"target_layer_ids": [int(i) for i in target_layer_ids],
                       "mask_token_id": int(mask_token_id)},
    )
    check_draft_matches_target(args, target)
    model = Model(args)
    key = mx.random.key(seed)
    params = tree_flatten(model.parameters())
    keys = mx.random.split(key, len(params))
    new = []
    for (name, p), k in zip(params, keys):
        if p.ndim == 2:  # Linear weight (out, in): U(-1/sqrt(in), 1/sqrt(in)), as nn.Linear
            s = p.shape[1] ** -0.5
            p = mx.random.uniform(-s, s, p.shape, key=k)
        elif name.endswith(".bias"):
            p = mx.zeros_like(p)
        new.append((name, p))
    model.load_weights(new)
    _cast(model, dtype or target_dtype(target))
    mx.eval(model.parameters())
    return model.bind(target)
