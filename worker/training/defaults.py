"""Draft shapes chosen from the target (one job: sensible defaults a user can override).

The published DFlash drafts (Chen et al. 2026, arXiv 2602.06036; z-lab checkpoints and SpecForge
configs) copy the target's hidden size,
heads, MLP width, RoPE and eps; tap 5 target layers spread over layers 1..L-3; use an unused
embedding row as the MASK token; and use blocks of 16. The depth and, when a size budget is
given, the MLP width are chosen here for small on-prem targets.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from worker.capture import target_hidden_size, target_layers, target_vocab_size
from worker.models.dflash import Model, default_target_layer_ids
from worker.models.dflash_checkpoint import dequantized_weights, init_dflash_draft


class DraftSizeError(ValueError):
    """No draft shape fits the size budget (`--max-draft-mib`) with the user's fixed settings."""


def default_draft_layers(num_target_layers: int) -> int:
    """About one draft layer per 15 target layers, 1..5 (2 for 24-36-layer targets).

    The published drafts use 5 layers for 36-layer targets (paper Table 6: 3 -> 5 -> 8 layers
    raise tau slowly) and SpecForge's fresh-draft default is 1; a short on-prem training run and
    a draft that must stay cheap next to a small target sit between the two.
    """
    return max(1, min(5, round(num_target_layers / 15)))


def draft_num_params(hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int,
                     head_dim: int, num_taps: int) -> int:
    """Parameter count of a DFlash draft (no embedding, no head): layers + fc + norms."""
    attn = hidden * head_dim * (2 * heads + 2 * kv_heads) + 2 * head_dim
    per_layer = attn + 3 * hidden * intermediate + 2 * hidden
    return layers * per_layer + num_taps * hidden * hidden + 2 * hidden


@dataclass(frozen=True)
class DraftSpec:
    """The shape of a draft to train (what `init_dflash_draft` takes).

    Attributes:
        num_layers: draft decoder layers.
        block_size: B, tokens per block (last committed token + B-1 drafts).
        target_layer_ids: tapped target layers (0-based layer outputs).
        mask_token_id: the MASK token's embedding row.
        intermediate_size: draft MLP width.
    """

    num_layers: int
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    intermediate_size: int

    def num_params(self, target) -> int:
        """Parameters of this draft for `target` (hidden size and heads come from the target)."""
        a = target.args
        heads = a.num_attention_heads
        kv = getattr(a, "num_key_value_heads", None) or heads
        hd = getattr(a, "head_dim", None) or target_hidden_size(target) // heads
        return draft_num_params(target_hidden_size(target), self.num_layers, self.intermediate_size, heads, kv, hd,
                                len(self.target_layer_ids))


def choose_mask_token_id(tokenizer, vocab_size: int, used: set[int]) -> int:
    """An embedding row no real text uses, for the MASK token.

    Order of preference: the first row past the tokenizer's vocabulary when the embedding table
    is padded beyond it (Qwen: the z-lab drafts' 151669 is exactly that); else the highest
    special/added token that is not BOS/EOS/PAD/UNK and never occurs in `used` (the training
    data and held-out prompts); else the highest id not in `used`.

    Args:
        tokenizer: the target's tokenizer (mlx-lm wrapper or Hugging Face).
        vocab_size: rows of the target's embedding table.
        used: token ids seen in the data (and the chat template).

    Returns:
        A token id in [0, vocab_size).
    """
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        n_tok = len(hf)
    except TypeError:
        n_tok = vocab_size
    if n_tok < vocab_size:
        return n_tok
    reserved = set(getattr(tokenizer, "eos_token_ids", []) or [])
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        v = getattr(hf, name, None)
        if isinstance(v, int):
            reserved.add(v)
    added = getattr(hf, "added_tokens_decoder", {}) or {}
    for tid in sorted((int(t) for t in added), reverse=True):
        if tid < vocab_size and tid not in reserved and tid not in used:
            return tid
    for tid in range(vocab_size - 1, -1, -1):
        if tid not in used and tid not in reserved:
            return tid
    return vocab_size - 1


def choose_draft_spec(
    target,
    tokenizer,
    used_ids: set[int],
    *,
    draft_layers: Optional[int] = None,
    num_taps: int = 5,
    target_layer_ids: Optional[Sequence[int]] = None,
    mask_token_id: Optional[int] = None,
    block_size: int = 16,
    intermediate_size: Optional[int] = None,
    max_draft_mib: Optional[float] = None,
    bytes_per_param: float = 2,
) -> DraftSpec:
    """Draft shape from the target, with the user's overrides (None: choose).

    Defaults: `default_draft_layers(L)` layers, `num_taps` taps spread over target layers 1..L-3
    (`default_target_layer_ids`, z-lab's rule), an unused mask id (`choose_mask_token_id`), the
    target's MLP width, block size 16 (paper). With `max_draft_mib`, the MLP width is reduced
    (multiples of 128, down to D) and then the depth (down to 1), each only where the user left it
    unset, until the draft, stored at `bytes_per_param` (2 for bfloat16, 0.5625 for 4-bit groups of
    64 with bfloat16 scales), fits.

    Args:
        target: the mlx-lm target (only its config and layer list are read).
        tokenizer: its tokenizer (for the mask id).
        used_ids: token ids the data uses (the mask id avoids them).

    Returns:
        A `DraftSpec`.

    Raises:
        DraftSizeError: the draft cannot fit `max_draft_mib`.
    """
    L = len(target_layers(target))
    layers = draft_layers or default_draft_layers(L)
    taps = [int(i) for i in target_layer_ids] if target_layer_ids else default_target_layer_ids(L, num_taps)
    mask = mask_token_id if mask_token_id is not None else choose_mask_token_id(
        tokenizer, target_vocab_size(target), used_ids)
    inter = intermediate_size or int(target.args.intermediate_size)
    spec = DraftSpec(layers, block_size, taps, int(mask), inter)
    if max_draft_mib:
        budget = max_draft_mib * 2**20 / bytes_per_param
        D = target_hidden_size(target)
        while spec.num_params(target) > budget:
            smaller = (spec.intermediate_size - 1) // 128 * 128
            if intermediate_size is None and smaller >= D:
                spec = DraftSpec(spec.num_layers, block_size, taps, spec.mask_token_id, smaller)
            elif draft_layers is None and spec.num_layers > 1:
                spec = DraftSpec(spec.num_layers - 1, block_size, taps, spec.mask_token_id, inter)
            else:
                raise DraftSizeError(f"a draft of {spec.num_layers} layer(s), MLP {spec.intermediate_size} and "
                                     f"{len(taps)} taps has {spec.num_params(target)} parameters: over "
                                     f"--max-draft-mib {max_draft_mib}")
    return spec


def make_draft(target, spec: DraftSpec, seed: int, from_target: bool = False) -> Model:
    """A freshly initialised float32 draft of shape `spec`, bound to `target`; with `from_target`
    its decoder layers start as copies of the target's last ones (`copy_target_layers`)."""
    draft = init_dflash_draft(target, num_layers=spec.num_layers, block_size=spec.block_size,
                              target_layer_ids=spec.target_layer_ids, mask_token_id=spec.mask_token_id,
                              intermediate_size=spec.intermediate_size, seed=seed, dtype=mx.float32)
    if from_target:
        copy_target_layers(draft, target)
    return draft


def _copyable_weights(layer: nn.Module) -> dict[str, mx.array]:
    """A target layer's linear weights/biases (dequantized) and plain `nn.RMSNorm` scales, float32.

    Other norm classes are skipped on purpose: Gemma's RMSNorm stores `weight` as an offset from
    1, which the draft's standard RMSNorm would misread."""
    modules = dict(layer.named_modules())

    def copyable(name: str) -> bool:
        m = modules.get(name.rpartition(".")[0])
        return isinstance(m, (nn.Linear, nn.QuantizedLinear)) or type(m) is nn.RMSNorm

    return {k: v for k, v in dequantized_weights(layer).items() if copyable(k)}


def copy_target_layers(draft: Model, target) -> list[str]:
    """Starts the draft's decoder layers from the target's last ones: draft layer i of n takes
    every weight of target layer L-n+i whose name and shape match (the attention projections,
    standard RMSNorm scales, and the MLP when the draft keeps the target's width). The rest keeps
    its random initialisation, the final norm included: copying the target's final norm as well
    left the loss after 150 CPU steps at 6.39 instead of 4.67 (docs/training.md).

    Why: the draft works in the target's hidden space and through the target's LM head, so the
    target's top layers are a far better start than noise. Measured on the CPU with SmolLM2-135M
    (docs/training.md): after 150 steps the training loss was 4.67 with copied layers against
    6.56 from random weights.

    Args:
        draft: a float32 draft bound to `target`.
        target: the mlx-lm target (weights may be quantized; they are dequantized).

    Returns:
        The draft parameter names that were copied.
    """
    from mlx.utils import tree_flatten

    layers = target_layers(target)
    copied = []
    for i, layer in enumerate(draft.layers):
        src = _copyable_weights(layers[len(layers) - len(draft.layers) + i])
        mine = dict(tree_flatten(layer.parameters()))
        take = [(k, v.astype(mine[k].dtype)) for k, v in src.items() if k in mine and mine[k].shape == v.shape]
        layer.load_weights(take, strict=False)
        copied += [f"layers.{i}.{k}" for k, _ in take]
    mx.eval(draft.parameters())
    return copied


def label_token_counts(responses: Sequence[Sequence[int]], vocab_size: int, group=None) -> np.ndarray:
    """How often each token id occurs in the training answers (the draft's labels), summed over
    all ranks' shards so every rank chooses the same draft vocabulary: (vocab_size,) int64."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for r in responses:
        ids = np.asarray(r, dtype=np.int64)
        counts += np.bincount(ids[(ids >= 0) & (ids < vocab_size)], minlength=vocab_size)
    if group is not None:
        counts = np.array(mx.distributed.all_sum(mx.array(counts.astype(np.int32)), group=group)).astype(np.int64)
    return counts


def choose_draft_vocab(counts: np.ndarray, size: int, always: Sequence[int] = ()) -> tuple[np.ndarray, float]:
    """The draft vocabulary: the `size` most frequent label tokens (ties by lower id), plus the
    `always` ids (end-of-sequence tokens: an answer must be able to end inside a block).

    EAGLE-3's recipe (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large
    Language Models via Training-Time Test", draft vocabulary of the 32 K most frequent tokens).

    Args:
        counts: (V,) int, `label_token_counts`.
        size: K, 1 <= K; a K of V or more keeps every id.
        always: ids kept whatever their count (they count towards K).

    Returns:
        (ids (K,) int64 ascending, the share of the counted tokens they cover in [0, 1]).

    Raises:
        ValueError: size < 1, or more `always` ids than size.
    """
    V = counts.shape[0]
    always = sorted({int(i) for i in always if 0 <= int(i) < V})
    if size < 1 or len(always) > size:
        raise ValueError(f"a draft vocabulary of {size} tokens cannot hold the {len(always)} always kept")
    order = np.lexsort((np.arange(V), -counts))  # by count descending, then id
    rest = order[~np.isin(order, always)][: max(0, min(size, V) - len(always))]
    ids = np.sort(np.concatenate([np.asarray(always, dtype=np.int64), rest.astype(np.int64)]))
    total = counts.sum()
    return ids, float(counts[ids].sum() / total) if total else 1.0


def used_token_ids(sequences: Sequence[Sequence[int]], vocab_size: int, group=None) -> set[int]:
    """Token ids in `sequences` (the training prompts and answers and the held-out prompts), over
    all ranks' shards (so every rank picks the same mask token); ids outside [0, vocab_size) are
    kept here but not shared with the other ranks."""
    used: set[int] = set()
    for ids in sequences:
        used.update(ids)
    if group is not None:
        seen = np.zeros(vocab_size, dtype=np.float32)
        seen[[i for i in used if 0 <= i < vocab_size]] = 1
        seen = np.array(mx.distributed.all_sum(mx.array(seen), group=group))
        used |= set(np.flatnonzero(seen).tolist())
    return used


def set_draft_vocab(draft: Model, size: Optional[int], init_vocab: Optional[mx.array],
                    responses: Sequence[Sequence[int]], always: Sequence[int], group,
                    log: Callable[[str], None]) -> Optional[dict]:
    """Gives the draft the vocabulary `--draft-vocab` asks for and logs it.

    Args:
        draft: the draft (`Model.set_vocab`).
        size: K (the K most frequent tokens of `responses`, `choose_draft_vocab`); 0: the whole
            head; None: `init_vocab` (an --init-from draft's own) if given, else the whole head.
        init_vocab: (K,) int ids of an --init-from draft's vocabulary, or None.
        responses: the training answers (this rank's; counts are summed over `group`).
        always: ids kept in a chosen vocabulary (the end-of-sequence tokens).
        group: the data-parallel group or None.
        log: the message.

    Returns:
        {"size", "coverage"} (the share of the training answers' tokens inside it), or None for
        the whole head.
    """
    V = int(draft.args.vocab_size)
    if size is None and init_vocab is not None:
        ids = np.array(init_vocab)
    elif size:
        ids = None
    else:
        draft.set_vocab(None)
        return None
    counts = label_token_counts(responses, V, group)
    if ids is None:
        ids, _ = choose_draft_vocab(counts, size, always=always)
    draft.set_vocab(ids)
    total = counts.sum()
    coverage = float(counts[ids].sum() / total) if total else 1.0
    log(f"vocab: the draft proposes from {ids.size} of {V} tokens"
        + (" (the --init-from draft's)" if size is None else "")
        + f", covering {100 * coverage:.2f}% of the training answers' tokens")
    return {"size": int(ids.size), "coverage": round(coverage, 5)}
