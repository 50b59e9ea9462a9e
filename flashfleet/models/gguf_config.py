"""GGUF metadata -> ``config.json`` / ``generation_config.json`` for mlx-lm (and transformers).

mlx-lm 0.32 reads ``rope_theta`` (and Gemma's ``rope_local_base_freq``) at the top level of
``config.json``; transformers 5 writes ``rope_parameters``. Both are written here, so a model
never silently falls back to a default rope base (SmolLM2 needs 100000, not 10000).
"""

from __future__ import annotations

from typing import Any

__all__ = ["SUPPORTED_ARCHITECTURES", "build_config", "build_generation_config", "read_metadata"]

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "gemma3")

# Arrays that are large and only needed by the tokenizer builder.
_BIG_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


def read_metadata(reader) -> dict[str, Any]:
    """All key/value metadata of a GGUF as plain Python values.

    Args:
        reader: A ``gguf.GGUFReader``.

    Returns:
        ``{key: value}``; strings as ``str``, arrays as lists, scalars as ``int``/``float``/``bool``.
    """
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        metadata[key] = field.contents()
    return metadata


def _get(metadata: dict, arch: str, name: str, default: Any = None) -> Any:
    return metadata.get(f"{arch}.{name}", default)


def _rope_scaling(metadata: dict, arch: str) -> dict | None:
    kind = _get(metadata, arch, "rope.scaling.type")
    if not kind or kind == "none":
        return None
    return {"type": kind, "rope_type": kind, "factor": float(_get(metadata, arch, "rope.scaling.factor", 1.0))}


def _sliding_window_pattern(value: Any) -> int:
    """Gemma 3's period of global layers: every sixth by default (llama.cpp's value).

    Newer GGUFs state it, as a number or as one flag per layer (True: sliding).
    """
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, (list, tuple)) and value and not all(value):
        return list(value).index(False) + 1
    return 6


def build_config(metadata: dict, tensor_names: set[str], vocab_size: int, dtype: str) -> dict[str, Any]:
    """The ``config.json`` dict for a GGUF.

    Args:
        metadata: From :func:`read_metadata`.
        tensor_names: GGUF tensor names (``output.weight`` absent means tied embeddings).
        vocab_size: Rows of the token embedding matrix.
        dtype: Stored weight dtype name (``float32``, ``bfloat16``, ``float16``).

    Returns:
        A config dict with ``model_type`` mlx-lm understands (``llama``, ``qwen2``, ``gemma3_text``).

    Raises:
        ValueError: Unsupported ``general.architecture``.
    """
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; this converter handles {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    n_head = int(_get(metadata, arch, "attention.head_count"))
    hidden = int(_get(metadata, arch, "embedding_length"))
    head_dim = int(_get(metadata, arch, "attention.key_length", hidden // n_head))
    rope_theta = float(_get(metadata, arch, "rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": int(_get(metadata, arch, "feed_forward_length")),
        "num_hidden_layers": int(_get(metadata, arch, "block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(_get(metadata, arch, "attention.head_count_kv", n_head)),
        "head_dim": head_dim,
        "max_position_embeddings": int(_get(metadata, arch, "context_length", 4096)),
        "rms_norm_eps": float(_get(metadata, arch, "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(metadata, arch),
        "vocab_size": int(vocab_size),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "dtype": dtype,
    }
    if arch == "llama":
        config.update(
            model_type="llama",
            architectures=["LlamaForCausalLM"],
            hidden_act="silu",
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            mlp_bias=False,
            rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        )
    elif arch == "qwen2":
        config.update(
            model_type="qwen2",
            architectures=["Qwen2ForCausalLM"],
            hidden_act="silu",
            use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        )
    else:  # gemma3
        pattern = _sliding_window_pattern(_get(metadata, arch, "attention.sliding_window_pattern"))
        # Older llama.cpp hard-codes the sliding layers' rope base for Gemma 3; newer files state it.
        local_base = float(_get(metadata, arch, "rope.freq_base_swa", 10000.0))
        layers = config["num_hidden_layers"]
        config.update(
            model_type="gemma3_text",
            architectures=["Gemma3ForCausalLM"],
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=head_dim,
            sliding_window=int(_get(metadata, arch, "attention.sliding_window", 512)),
            sliding_window_pattern=pattern,
            layer_types=[
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
            ],
            rope_local_base_freq=local_base,
            final_logit_softcapping=_get(metadata, arch, "final_logit_softcapping"),
            attn_logit_softcapping=_get(metadata, arch, "attn_logit_softcapping"),
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": rope_theta},
                "sliding_attention": {"rope_type": "default", "rope_theta": local_base},
            },
        )
    return config


def build_generation_config(config: dict[str, Any], eos_token_ids: list[int]) -> dict[str, Any]:
    """The ``generation_config.json`` dict (mlx-lm takes its ``eos_token_id`` list as stop ids).

    Args:
        config: From :func:`build_config`.
        eos_token_ids: Every token id that ends a generation.

    Returns:
        ``{"bos_token_id", "eos_token_id", "pad_token_id"}`` (eos as a list when several).
    """
    eos: int | list[int] | None = eos_token_ids[0] if len(eos_token_ids) == 1 else list(eos_token_ids)
    return {
        "bos_token_id": config.get("bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": config.get("pad_token_id"),
    }
