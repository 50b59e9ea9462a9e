"""Tiny random-weight models and real tokenizers, saved as model directories `mlx_lm.load` reads.

Tests import this module (through the session fixtures in `tests/conftest.py`) instead of
downloading anything: the machines have no model hub. Each model is a real mlx-lm architecture
(`mlx_lm/models/llama.py`, `qwen2.py`) with a few layers of width 64 and float32 random weights, so
greedy decoding is deterministic and a forward costs about a millisecond on a CPU.

The tokenizers are trained here with the `tokenizers` library on real text (`tests/data/`, whose
README names each file's source and licence):
  - `build_bpe_tokenizer`: byte-level BPE (GPT-2 / Qwen style) with ChatML special tokens and a
    ChatML chat template; every model directory uses it.
  - `build_spm_tokenizer`: SentencePiece-style BPE (Metaspace "▁" + <0xNN> byte fallback, the
    Llama 2 layout), for detokenizer tests only.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Real prompts, JSON lines {"id", "lang", "prompt"} (tests/data/README.md).
CASES_DIR = Path(__file__).parent / "data"
TRAIN_FILES = ("fortunes_pl.jsonl", "dataset_build_pl.jsonl", "enwiki_en.jsonl", "humaneval.jsonl")
TRAIN_ROWS_PER_FILE = 300

NEAR_DRAFT_NOISE = 0.1  # relative weight noise of `llama_near`

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def training_text() -> list[str]:
    """Prompts from `tests/data/` (up to the first TRAIN_ROWS_PER_FILE rows of each of TRAIN_FILES).

    Raises:
        FileNotFoundError: a file of TRAIN_FILES is missing.
    """
    rows: list[str] = []
    for name in TRAIN_FILES:
        with (CASES_DIR / name).open(encoding="utf-8") as f:
            for i, line in enumerate(f):
                if i == TRAIN_ROWS_PER_FILE:
                    break
                rows.append(json.loads(line)["prompt"])
    return rows


def build_bpe_tokenizer(out_dir: Path, vocab_size: int = 512) -> int:
    """Trains a byte-level BPE tokenizer and writes tokenizer.json + tokenizer_config.json.

    Special tokens take ids 0..2 (<|endoftext|>, <|im_start|>, <|im_end|>); EOS is <|im_end|>.

    Returns:
        The vocabulary size (model `vocab_size` must equal it).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(), trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
    })
    return tok.get_vocab_size()


def build_spm_tokenizer(out_dir: Path, vocab_size: int = 400, alphabet: int = 60) -> int:
    """Trains a SentencePiece-style BPE with byte fallback (Llama 2 layout) into `out_dir`.

    Ids 0..2 are <unk>, <s>, </s>; ids 3..258 are the byte tokens <0x00>..<0xFF>. Only `alphabet`
    characters get their own token, so rarer characters (Polish diacritics, emoji) are spelled
    with byte tokens, the case an incremental detokenizer must hold back.

    Returns:
        The vocabulary size.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(content=" ", left=1, right=0),
    ])
    specials = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 256, special_tokens=specials, limit_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(training_text(), trainer)
    spec = json.loads(tok.to_str())
    # Insert the 256 byte tokens as ordinary vocabulary entries after the specials, as Llama 2 has.
    old = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    names = specials + [f"<0x{b:02X}>" for b in range(256)] + [t for t, _ in old if t not in specials]
    spec["model"]["vocab"] = {t: i for i, t in enumerate(names)}
    spec["model"]["byte_fallback"] = True
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "tokenizer.json", spec)
    _write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
    })
    return len(names)


def model_config(model_type: str, vocab_size: int, eos_token_id: int, *, layers: int = 2,
                 max_position_embeddings: int = 512) -> dict:
    """A Hugging Face style config.json for a tiny llama / qwen2 (hidden 64, 4 heads, 2 KV heads)."""
    return {
        "model_type": model_type,
        "architectures": ["LlamaForCausalLM" if model_type == "llama" else "Qwen2ForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": layers,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rope_theta": 10000.0,
        # Untied: with tied embeddings a random model mostly repeats its input token.
        "tie_word_embeddings": False,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
    }


def build_model_dir(out_dir: Path, config: dict, tokenizer_dir: Path, seed: int) -> Path:
    """Writes config.json, model.safetensors (random float32 weights) and the tokenizer files."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    _write_json(out_dir / "config.json", config)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out_dir / name).write_bytes((tokenizer_dir / name).read_bytes())
    return out_dir


def build_perturbed_copy(src_dir: Path, out_dir: Path, noise: float, seed: int) -> Path:
    """Copies a model directory, adding Gaussian noise (std = noise x each tensor's std) to every
    weight: a draft that agrees with its source on part of the tokens."""
    import mlx.core as mx

    weights = mx.load(str(src_dir / "model.safetensors"))
    key = mx.random.key(seed)
    noisy = {}
    for name, w in sorted(weights.items()):
        key, sub = mx.random.split(key)
        noisy[name] = w + noise * mx.std(w) * mx.random.normal(w.shape, key=sub)
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), noisy, metadata={"format": "mlx"})
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (out_dir / name).write_bytes((src_dir / name).read_bytes())
    return out_dir


@dataclass(frozen=True)
class TinyModels:
    """Paths of the tiny model directories built by `build_all`.

    Attributes:
        llama: 2-layer llama target.
        llama_draft: 1-layer llama with other random weights: a draft with low acceptance.
        llama_near: the llama target with noisy weights: a draft with partial acceptance.
        qwen2: 2-layer qwen2 target.
        spm_tokenizer: a directory with only a SentencePiece-style byte-fallback tokenizer.
        vocab_size: vocabulary size shared by the three models.
        max_position_embeddings: context length of the three models, tokens.
    """

    llama: Path
    llama_draft: Path
    llama_near: Path
    qwen2: Path
    spm_tokenizer: Path
    vocab_size: int
    max_position_embeddings: int


def build_all(root: Path, max_position_embeddings: int = 512) -> TinyModels:
    """Builds every tiny model and tokenizer under `root` (about a second on a CPU)."""
    tok_dir = root / "bpe_tokenizer"
    vocab = build_bpe_tokenizer(tok_dir)
    eos = SPECIAL_TOKENS.index(EOS_TOKEN)
    ctx = max_position_embeddings

    def build(name: str, model_type: str, layers: int, seed: int) -> Path:
        cfg = model_config(model_type, vocab, eos, layers=layers, max_position_embeddings=ctx)
        return build_model_dir(root / name, cfg, tok_dir, seed)

    spm = root / "spm_tokenizer"
    build_spm_tokenizer(spm)
    llama = build("llama", "llama", 2, seed=1)
    return TinyModels(
        llama=llama,
        llama_draft=build("llama_draft", "llama", 1, seed=2),
        llama_near=build_perturbed_copy(llama, root / "llama_near", NEAR_DRAFT_NOISE, seed=4),
        qwen2=build("qwen2", "qwen2", 2, seed=3),
        spm_tokenizer=spm,
        vocab_size=vocab,
        max_position_embeddings=ctx,
    )


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, ensure_ascii=False, indent=1), encoding="utf-8")
