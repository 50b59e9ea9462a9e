"""A training run's settings (`TrainConfig`, filled by `flashfleet draft train`) and dtypes by name."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx


class TrainConfigError(ValueError):
    """A checkpoint that does not belong to this run (another draft shape or other data)."""


DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


@dataclass
class TrainConfig:
    """Everything `train_draft` needs; the CLI fills it from flags. Units are in the names.

    Target and files:
        target: model directory or fetched catalog name (`flashfleet.models.resolve_model`).
        prompts: prompt files (.jsonl with a `prompt` field, or one prompt per line).
        out: output directory of the draft (published layout) and its training card.
        work_dir: data cache + resumable state; default `<out>.work` (kept out of `out`, so `out`
            can be committed as is).
    Draft shape (None: chosen from the target, see `choose_draft_spec`):
        draft_layers, num_taps (taps spread over layers 1..L-3), target_layer_ids, mask_token_id,
        block_size (B), intermediate_size, max_draft_mib (shrink the MLP, then the depth, until
        the saved draft fits).
    Data:
        max_prompts_per_file, max_prompt_tokens, max_new_tokens, heldout_per_corpus,
        heldout_fraction, gen_temperature (0: greedy), gen_top_p, gen_samples (answers per
        training prompt; the extra ones sampled at gen_sample_temperature), synthetic_prompts
        (prompts the target writes itself, Magpie: `answers.build_dataset`), synthetic_max_tokens,
        synthetic_temperature, synthetic_openings (words; each synthetic prompt starts with the
        first words of a training prompt, of the corpora synthetic_openings_from or all; 0: none),
        extra_data (earlier runs' data cache directories of this target:
        their greedy answers to this run's prompts are reused, their other sequences added;
        `extra_data.load_extra_data`), gen_batch_size, gen_max_minutes, regenerate_data (ignore a
        matching data cache).
    Training:
        batch_size (sequences per step), anchors (N per sequence), gamma (None: paper's value
        for B), lr, weight_decay, warmup (fraction of the run), min_lr_ratio (cosine floor),
        grad_clip (global norm), epochs, steps (overrides epochs), max_minutes (training wall
        time; the cosine schedule then runs on the time fraction), seed, compute_dtype and
        target_dtype ("auto": bfloat16 on a GPU, float32 on a CPU), save_dtype, init_from (a
        saved draft directory, quantized or not, whose shape and weights the run starts from
        instead of a random draft: training continues across sessions; an explicit larger
        draft_layers / intermediate_size grows it, computing the same function at step 0,
        `grow.grow_weights`), init_layers ("target":
        a new draft's layers start as copies of the target's last layers, `copy_target_layers`;
        "random"), draft_vocab (K: the draft proposes from the K most frequent tokens of the
        training answers, `defaults.choose_draft_vocab`, EAGLE-3's reduced draft vocabulary; 0:
        from the whole head; None: an --init-from draft's own vocabulary, else the whole head),
        quantize_bits
        (None: keep `save_dtype`; 4 or 8: the saved draft's linear layers are MLX-quantized with
        `quantize_group_size`, the size budget counts the quantized bytes, and the unquantized
        draft is kept in the work dir and evaluated too, so the card shows what it costs), compile,
        cache_taps_gib (compute the target taps once and keep them in memory, the paper's
        "offline" mode, for the length classes that fit this many GiB together (all of them when
        the dataset fits); the other classes' batches run the target; 0: always online, one
        target forward per batch), length_buckets (batches come from one of this many length
        classes and are padded to its width, not the dataset's; 1: off), checkpoint_every
        (steps; Ctrl-C also saves one, at the end of the step in flight: `TrainingInterrupted`),
        resume, overwrite (replace a draft already in `out` that this run does not continue;
        resume=False implies it),
        log_every (steps between loss-curve points).
    Evaluation:
        eval (tau on the held-out prompts at the end), eval_max_new_tokens, eval_max_minutes,
        eval_untrained (also measure the untrained draft), eval_unquantized (with quantize_bits,
        also measure the draft before quantization: what quantizing costs), progress (tqdm bars);
        val_fraction (share of prompts whose answers are held out of training, by a hash of the
        prompt, for teacher-forced validation: `validation.split_validation`; 0: none),
        val_max_sequences (at most this many of them measured, the lowest prompt hashes: the
        cost of a validation on large data) and val_every (steps between validations, and one
        before a new run's first step; 0: only at the end).
    """

    target: str
    prompts: Sequence[str]
    out: str
    work_dir: Optional[str] = None
    draft_layers: Optional[int] = None
    num_taps: int = 5
    target_layer_ids: Optional[list[int]] = None
    mask_token_id: Optional[int] = None
    block_size: int = 16
    intermediate_size: Optional[int] = None
    max_draft_mib: Optional[float] = None
    max_prompts_per_file: Optional[int] = None
    max_prompt_tokens: int = 256
    max_new_tokens: int = 256
    heldout_per_corpus: int = 8
    heldout_fraction: float = 0.1
    gen_temperature: float = 0.0
    gen_top_p: float = 1.0
    gen_samples: int = 1
    gen_sample_temperature: float = 0.8
    synthetic_prompts: int = 0
    synthetic_max_tokens: int = 128
    synthetic_temperature: float = 1.0
    synthetic_openings: int = 0
    synthetic_openings_from: Sequence[str] = ()
    extra_data: Sequence[str] = ()
    gen_batch_size: int = 64
    gen_max_minutes: Optional[float] = None
    regenerate_data: bool = False
    batch_size: int = 16
    anchors: int = 64
    gamma: Optional[float] = None
    lr: float = 6e-4
    weight_decay: float = 0.01
    warmup: float = 0.04
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    epochs: float = 6.0
    steps: Optional[int] = None
    max_minutes: Optional[float] = None
    seed: int = 0
    compute_dtype: str = "auto"
    target_dtype: str = "auto"
    save_dtype: str = "bfloat16"
    init_from: Optional[str] = None
    init_layers: str = "target"
    draft_vocab: Optional[int] = None
    quantize_bits: Optional[int] = None
    quantize_group_size: int = 64
    compile: bool = True
    cache_taps_gib: float = 8.0
    length_buckets: int = 4
    checkpoint_every: int = 200
    overwrite: bool = False
    resume: bool = True
    log_every: int = 10
    eval: bool = True
    eval_max_new_tokens: int = 128
    eval_max_minutes: Optional[float] = None
    eval_untrained: bool = False
    eval_unquantized: bool = True
    val_fraction: float = 0.005
    val_max_sequences: int = 256
    val_every: int = 500
    progress: bool = True


def resolve_dtype(name: str) -> mx.Dtype:
    """"auto" -> bfloat16 on a GPU, float32 on a CPU (bf16 matmuls skip BLAS there); else by name.

    Raises:
        ValueError: unknown dtype name.
    """
    if name == "auto":
        return mx.bfloat16 if mx.default_device().type == mx.DeviceType.gpu else mx.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]

