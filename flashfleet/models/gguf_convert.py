"""Convert a GGUF file into an HF/MLX model directory that ``mlx_lm.load`` reads.

Output files: ``config.json``, ``generation_config.json``, ``model.safetensors`` (dense, dtype of
choice), ``tokenizer.json`` and ``tokenizer_config.json`` (with the GGUF's chat template).
Quantized GGUF blocks are dequantized with the ``gguf`` package; no torch is needed.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from .gguf_config import build_config, build_generation_config, read_metadata
from .gguf_tensors import plan_tensors
from .gguf_tokenizer import build_tokenizer, build_tokenizer_config, vocab_from_metadata
from .safetensors_stream import DTYPES, write_streaming

__all__ = ["ConversionResult", "convert_gguf"]


@dataclass(frozen=True)
class ConversionResult:
    """What :func:`convert_gguf` wrote.

    Attributes:
        out_dir: The model directory.
        architecture: GGUF ``general.architecture``.
        model_type: ``config.json`` ``model_type``.
        n_tensors: Tensors written.
        weights_bytes: Size of ``model.safetensors`` in bytes.
        seconds: Wall time of the conversion in seconds.
    """

    out_dir: Path
    architecture: str
    model_type: str
    n_tensors: int
    weights_bytes: int
    seconds: float


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    dtype: str = "float32",
    chat_template: str | None = None,
    extra_eos_tokens: tuple[str, ...] = (),
    progress: bool = True,
) -> ConversionResult:
    """Convert a GGUF (llama, qwen2 or gemma3) into a model directory.

    Args:
        gguf_path: The GGUF file.
        out_dir: Directory to write into (created; existing files with the same names are replaced).
        dtype: Stored weight dtype: ``"float32"`` (default here, exact), ``"bfloat16"`` (what
            ``flashfleet models fetch`` stores; workers cast at load) or ``"float16"``.
        chat_template: Chat template to use when the GGUF carries none.
        extra_eos_tokens: Token strings that also stop generation (added to
            ``generation_config.json``'s ``eos_token_id`` when in the vocabulary).
        progress: Show a tqdm progress bar over tensors (on stderr).

    Returns:
        A :class:`ConversionResult`.

    Raises:
        ValueError: Unsupported architecture, tokenizer kind, tensor name or dtype.
        FileNotFoundError: ``gguf_path`` does not exist.
    """
    from gguf import GGUFReader
    from tqdm import tqdm

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    started = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(str(gguf_path))
    metadata = read_metadata(reader)
    tensor_names = {tensor.name for tensor in reader.tensors}
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise ValueError(f"{gguf_path} has no token_embd.weight tensor")
    vocab_size = int(embedding.shape[-1])

    config = build_config(metadata, tensor_names, vocab_size, dtype)
    arch = metadata["general.architecture"]
    planned = plan_tensors(reader.tensors, arch, config["num_attention_heads"], config["num_key_value_heads"])

    vocab = vocab_from_metadata(metadata)
    tokenizer = build_tokenizer(vocab)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(
        out_dir / "tokenizer_config.json",
        build_tokenizer_config(vocab, config["max_position_embeddings"], chat_template),
    )
    eos_ids = [vocab.special_ids[role] for role in ("eos", "eot", "eom") if role in vocab.special_ids]
    for token in extra_eos_tokens:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            eos_ids.append(token_id)
    eos_ids = list(dict.fromkeys(eos_ids))
    config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", build_generation_config(config, eos_ids))

    bar = tqdm(planned, desc=f"converting {gguf_path.name}", unit="tensor", disable=not progress)
    weights_bytes = write_streaming(
        out_dir / "model.safetensors",
        [(plan.name, plan.shape) for plan in planned],
        (plan.materialize() for plan in bar),
        dtype=dtype,
        metadata={"format": "mlx", "source": gguf_path.name},
    )
    bar.close()
    return ConversionResult(
        out_dir=out_dir,
        architecture=arch,
        model_type=config["model_type"],
        n_tensors=len(planned),
        weights_bytes=weights_bytes,
        seconds=time.perf_counter() - started,
    )
