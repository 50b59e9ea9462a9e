"""Build a Hugging Face ``tokenizers`` tokenizer from a GGUF's vocabulary metadata (no torch).

Two vocabulary kinds are handled, named by ``tokenizer.ggml.model``:

* ``gpt2``: byte-level BPE (SmolLM2, Qwen2.5). Vocabulary and merges come from the file; the
  text splitting regex is chosen by ``tokenizer.ggml.pre`` to match the model's original
  ``tokenizer.json`` (SmolLM2 splits digits one by one; Qwen2 uses its own regex and NFC).
* ``llama``: SentencePiece BPE with byte fallback (Gemma 3). The file has scores but no merges,
  so merges are rebuilt from the vocabulary (for Gemma, ranked by position in the file).

Token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
Control tokens become special added tokens, user-defined ones plain added tokens, so both stay
whole in the input text, as llama.cpp does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

__all__ = ["GgufVocab", "build_tokenizer", "build_tokenizer_config", "vocab_from_metadata"]

log = logging.getLogger(__name__)

CONTROL, USER_DEFINED = 3, 4

_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (split regex or None for GPT-2's built-in one, digits one by one, NFC)
_BYTE_LEVEL_PRE = {
    "default": (None, False, False),
    "gpt2": (None, False, False),
    "smollm": (None, True, False),
    "qwen2": (_QWEN2_SPLIT, False, True),
    "deepseek-r1-qwen": (_QWEN2_SPLIT, False, True),
    "llama3": (_LLAMA3_SPLIT, False, False),
    "llama-bpe": (_LLAMA3_SPLIT, False, False),
}


@dataclass
class GgufVocab:
    """The tokenizer-related metadata of a GGUF.

    Attributes:
        model: ``tokenizer.ggml.model`` (``gpt2`` or ``llama``).
        pre: ``tokenizer.ggml.pre`` (pre-tokenizer name), or ``"default"``.
        architecture: ``general.architecture``.
        tokens: Token strings, index = id.
        token_types: llama.cpp token types, one per token.
        scores: SentencePiece scores (may be empty).
        merges: BPE merges as ``"left right"`` strings (may be empty).
        special_ids: ``{"bos": id, "eos": id, "unk": id, "pad": id, "eot": id, ...}`` present in the file.
        add_bos: Whether a BOS token is prepended on encode.
        add_eos: Whether an EOS token is appended on encode.
        add_space_prefix: SentencePiece's dummy prefix (a space before the text).
        chat_template: The Jinja chat template, or ``None``.
    """

    model: str
    pre: str
    architecture: str
    tokens: list[str]
    token_types: list[int]
    scores: list[float] = field(default_factory=list)
    merges: list[str] = field(default_factory=list)
    special_ids: dict[str, int] = field(default_factory=dict)
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool = False
    chat_template: str | None = None

    def token(self, role: str) -> str | None:
        """The token string for a special role (``"bos"``, ``"eos"``, ...), or ``None``."""
        token_id = self.special_ids.get(role)
        return self.tokens[token_id] if token_id is not None and 0 <= token_id < len(self.tokens) else None


def vocab_from_metadata(metadata: dict[str, Any]) -> GgufVocab:
    """Collect the tokenizer metadata of a GGUF.

    Args:
        metadata: From :func:`flashfleet.models.gguf_config.read_metadata`.

    Returns:
        A :class:`GgufVocab`.

    Raises:
        ValueError: The file has no token list.
    """
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("the GGUF has no tokenizer.ggml.tokens: cannot build a tokenizer")
    model = metadata.get("tokenizer.ggml.model", "llama")
    roles = ("bos", "eos", "unknown", "padding", "eot", "eom", "sep", "cls", "mask")
    special_ids = {
        role.replace("unknown", "unk").replace("padding", "pad"): int(metadata[f"tokenizer.ggml.{role}_token_id"])
        for role in roles
        if f"tokenizer.ggml.{role}_token_id" in metadata
    }
    return GgufVocab(
        model=model,
        pre=metadata.get("tokenizer.ggml.pre", "default"),
        architecture=metadata.get("general.architecture", ""),
        tokens=list(tokens),
        token_types=list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)),
        scores=list(metadata.get("tokenizer.ggml.scores") or []),
        merges=list(metadata.get("tokenizer.ggml.merges") or []),
        special_ids=special_ids,
        # llama.cpp adds BOS for SentencePiece vocabularies unless the file says otherwise
        add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", model == "llama")),
        add_eos=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(metadata.get("tokenizer.ggml.add_space_prefix", model == "llama")),
        chat_template=metadata.get("tokenizer.chat_template"),
    )


def _derive_merges(tokens: list[str], rank: dict[str, float]) -> list[tuple[str, str]]:
    """Merges implied by a vocabulary: every split of a token into two vocabulary tokens.

    Ordered best first by the merged token's rank (lower is better); splits of one token with the
    longer left piece first, then by the pieces' ids (as transformers' ``generate_merges`` does).
    """
    ids = {token: index for index, token in enumerate(tokens)}
    found = []
    for token in tokens:
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                found.append((rank[token], -cut, ids[left], ids[right], left, right))
    found.sort(key=lambda item: item[:4])
    return [(item[4], item[5]) for item in found]


def _byte_level_model(vocab: GgufVocab) -> Tokenizer:
    ids = {token: index for index, token in enumerate(vocab.tokens)}
    merges = [tuple(merge.split(" ", 1)) for merge in vocab.merges]
    tokenizer = Tokenizer(
        models.BPE(vocab=ids, merges=merges, dropout=None, fuse_unk=False, byte_fallback=False, unk_token=None)
    )
    if vocab.pre not in _BYTE_LEVEL_PRE:
        log.warning("unknown GGUF pre-tokenizer %r: using GPT-2's split regex", vocab.pre)
    split, digits, nfc = _BYTE_LEVEL_PRE.get(vocab.pre, _BYTE_LEVEL_PRE["default"])
    steps = []
    if digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if split is not None:
        steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False))
    else:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True))
    tokenizer.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    if nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_model(vocab: GgufVocab) -> Tokenizer:
    # Runs of spaces are stored as real spaces. User-defined ones stay so: they are added tokens,
    # matched whole (longest first) in the raw text, as SentencePiece and llama.cpp do. Any other
    # space-only token is respelled with "▁", as the model sees it after normalization.
    tokens = [
        "\u2581" * len(t) if t and not t.strip(" ") and kind != USER_DEFINED else t
        for t, kind in zip(vocab.tokens, vocab.token_types)
    ]
    if vocab.architecture.startswith("gemma") or not vocab.scores:
        rank = {token: float(index) for index, token in enumerate(tokens)}  # Gemma: file order
    else:
        rank = {token: -float(score) for token, score in zip(tokens, vocab.scores)}
    if vocab.merges:
        merges = [tuple(merge.split(" ", 1)) for merge in vocab.merges]
    else:
        merges = _derive_merges(tokens, rank)
    ids = {token: index for index, token in enumerate(tokens)}
    unk = vocab.token("unk")
    tokenizer = Tokenizer(
        models.BPE(vocab=ids, merges=merges, dropout=None, fuse_unk=True, byte_fallback=True, unk_token=unk)
    )
    replace = normalizers.Replace(" ", "\u2581")
    if vocab.add_space_prefix:
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), replace])
    else:
        tokenizer.normalizer = replace
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _post_processor(vocab: GgufVocab):
    bos, eos = vocab.token("bos"), vocab.token("eos")
    add_bos, add_eos = vocab.add_bos and bos is not None, vocab.add_eos and eos is not None
    if not (add_bos or add_eos):
        return processors.ByteLevel(trim_offsets=False) if vocab.model == "gpt2" else None
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
    special = [(vocab.tokens[vocab.special_ids[role]], vocab.special_ids[role]) for role, on in
               (("bos", add_bos), ("eos", add_eos)) if on]  # fmt: skip
    return processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair), special_tokens=special)


def build_tokenizer(vocab: GgufVocab) -> Tokenizer:
    """Build the fast tokenizer a GGUF describes.

    Args:
        vocab: From :func:`vocab_from_metadata`.

    Returns:
        A ``tokenizers.Tokenizer`` whose ids equal the GGUF token ids.

    Raises:
        ValueError: A vocabulary kind other than ``gpt2`` / ``llama``.
    """
    if vocab.model == "gpt2":
        tokenizer = _byte_level_model(vocab)
    elif vocab.model == "llama":
        tokenizer = _sentencepiece_model(vocab)
    else:
        raise ValueError(f"unsupported GGUF tokenizer model {vocab.model!r} (supported: gpt2, llama)")
    added = []
    for token, kind in zip(vocab.tokens, vocab.token_types):
        if kind == CONTROL:
            added.append(AddedToken(token, special=True, normalized=False))
        elif kind == USER_DEFINED:
            added.append(AddedToken(token, special=False, normalized=False))
    tokenizer.add_tokens(added)
    # Ids must not move: an added token already in the vocabulary keeps its id.
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(vocab.tokens):
        log.warning(
            "tokenizer has %d ids, the GGUF lists %d tokens (duplicate token strings?)",
            tokenizer.get_vocab_size(with_added_tokens=True),
            len(vocab.tokens),
        )
    processor = _post_processor(vocab)
    if processor is not None:
        tokenizer.post_processor = processor
    return tokenizer


def build_tokenizer_config(
    vocab: GgufVocab, max_length: int, chat_template: str | None = None
) -> dict[str, Any]:
    """The ``tokenizer_config.json`` dict that goes with :func:`build_tokenizer`.

    Args:
        vocab: From :func:`vocab_from_metadata`.
        max_length: ``model_max_length`` in tokens.
        chat_template: Template to use when the GGUF has none.

    Returns:
        A dict for ``AutoTokenizer.from_pretrained`` (``PreTrainedTokenizerFast``).
    """
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": vocab.token("bos"),
        "eos_token": vocab.token("eos"),
        "unk_token": vocab.token("unk"),
        "pad_token": vocab.token("pad"),
        "add_bos_token": vocab.add_bos,
        "add_eos_token": vocab.add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(max_length),
    }
    template = vocab.chat_template or chat_template
    if template:
        config["chat_template"] = template
    return config
