"""Train a DFlash draft for a target: data, defaults, the training loop, checkpoints, the card.

Recipe (Chen et al. 2026, "DFlash: Block Diffusion for Flash Speculative Decoding", arXiv
2602.06036, §4.2 and App. A.1; SpecForge `specforge/algorithms/common/dflash_family_model.py`):

- data: the target answers the prompts with its own chat template (`data.build_dataset`);
- features: the frozen target runs once per batch on the clean prompt + response, and the outputs
  of the tapped layers are captured (`worker.capture.HiddenCapture`; online, nothing cached);
- blocks: N random anchors per sequence, re-drawn every step; each starts a block
  `[x_p, MASK x (B-1)]` that sees the context before p and its own block (`masks`, `forward`);
- loss: cross-entropy with position weights exp(-(k-1)/gamma) (`loss`);
- optimisation: AdamW, linear warmup then cosine decay, gradient clipping; the embedding and LM
  head are the target's and stay frozen (they are not draft parameters at all).

Speed: fixed batch shapes (sequences right-padded to one length S, N anchors per sequence), so the
whole step (draft forward, loss, backward, clipping, AdamW) is one `mx.compile`d function traced
once. Master weights and AdamW moments are float32; the forward runs in `compute_dtype`
(bfloat16 on a GPU) on a cast copy of the weights. The host prepares batch n+1 while the device
runs step n, and reads step n-1's loss (one sync per step).

Several processes (`mlx.launch`, `worker.training.distributed`): data-parallel; each rank answers
and trains on its own share of the prompts and the step averages the gradients over ranks.

Files: the draft in the published layout (`save_dflash_draft`: config.json + model.safetensors,
in `save_dtype`), `training_card.json` and `TRAINING.md` go to `out`; the data cache and the
resumable training state (float32 weights + AdamW moments) go to `work_dir`.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from worker.capture import HiddenCapture, target_hidden_size, target_layers, target_vocab_size
from worker.models.dflash import Model, ModelArgs
from worker.models.dflash_checkpoint import (load_dflash_draft, quantize_dflash_draft, quantized_bytes_per_param,
                                             save_dflash_draft)
from worker.training.card import render_card, tau_line
from worker.training.data import (SYNTHETIC_CORPUS, DataSplit, TokenDataset, build_dataset, dataset_key, epoch_batches,
                                  length_buckets)
from worker.training.defaults import (DraftSpec, choose_draft_spec, choose_draft_vocab, label_token_counts,
                                      make_draft)
from worker.training.distributed import agree_sum, broadcast_tree, leave_gpu_headroom, rank_of, size_of, world
from worker.training.evaluate import evaluate_tau
from worker.training.extra_data import extra_data_key
from worker.training.forward import block_hidden, block_inputs, cast_tree
from worker.training.loss import acceptance_stats, block_targets, default_gamma, weighted_cross_entropy
from worker.training.masks import sample_anchors
from worker.training.validation import Validator, lowest_hashes, split_validation

STATE_FORMAT = 1


class TrainConfigError(ValueError):
    """A checkpoint that does not belong to this run (another draft shape or other data)."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) during `Trainer.run`: the step in flight finished, a checkpoint was saved
    (when the run has one), and training stopped; the same command resumes from `step`."""

    def __init__(self, step: int, saved: bool):
        super().__init__(f"interrupted at step {step}")
        self.step, self.saved = step, saved


@contextlib.contextmanager
def _sigint_as_flag(flag: list):
    """While active (main thread of a single process only), the first Ctrl-C sets flag[0] so the
    training loop stops at a step boundary, where the state is consistent; a second one
    interrupts at once as usual."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        flag[0] = True
        signal.signal(signal.SIGINT, previous)  # the next Ctrl-C is the default KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
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
        (prompts the target writes itself, Magpie: `data.build_dataset`), synthetic_max_tokens,
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


def target_fingerprint(path: Path) -> str:
    """Identifies a target directory's weights: config.json plus the size and edges of each
    safetensors file (cheap; a full hash of large weights would take long)."""
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read())
    return h.hexdigest()[:16]


def resolve_target(ref: str | os.PathLike) -> Path:
    """A model directory (with config.json) as is, else a fetched catalog name through
    `flashfleet.models.resolve_model` (imported only then: the flashfleet package loads gRPC).

    Raises:
        FileNotFoundError / NotADirectoryError: as `resolve_model`.
    """
    path = Path(ref).expanduser()
    if (path / "config.json").is_file():
        return path.resolve()
    from flashfleet.models import resolve_model

    return resolve_model(ref)


def load_target(path: Path, dtype: mx.Dtype):
    """mlx_lm.load, cast to `dtype`, frozen, evaluated. Returns (model, tokenizer)."""
    from mlx_lm import load

    model, tokenizer = load(str(path))
    model.set_dtype(dtype)
    model.freeze()
    mx.eval(model.parameters())
    return model, tokenizer


# --------------------------------------------------------------------------- schedule


def learning_rate(progress: float, lr: float, warmup: float, min_lr_ratio: float = 0.0) -> float:
    """Linear warmup over the first `warmup` fraction, then cosine decay to lr * min_lr_ratio.

    Args:
        progress: fraction of the run done, in [0, 1] (steps or wall time, whichever is further).
        lr: peak learning rate.
        warmup: warmup fraction (paper: 0.04).
        min_lr_ratio: floor of the decay, as a fraction of lr.

    Returns:
        The learning rate (never exactly 0 during warmup).
    """
    p = min(max(progress, 0.0), 1.0)
    if warmup > 0 and p < warmup:
        return lr * max(p / warmup, 0.01)
    t = (p - warmup) / max(1.0 - warmup, 1e-9)
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * t)))


# --------------------------------------------------------------------------- trainer


class CachedTaps:
    """One length class's cached target taps, kept as the batches that computed them.

    parts: mx.arrays (rows, width, n_taps * D), every one `rows_per_part` rows but the last;
    row r of the class (its `Trainer.local` index) is row r % rows_per_part of part r //
    rows_per_part. Kept apart because joining them (`mx.concatenate`) holds the class twice at
    its peak: 2 x 78.7 GiB did not fit the H200's 139 GiB."""

    def __init__(self, parts: Sequence[mx.array], rows_per_part: int):
        if any(p.shape[0] != rows_per_part for p in parts[:-1]) or not 0 < parts[-1].shape[0] <= rows_per_part:
            raise ValueError(f"every part but the last must hold {rows_per_part} rows")
        self.parts, self.per = list(parts), rows_per_part
        self.shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])

    @property
    def nbytes(self) -> int:
        """Bytes held (sum of the parts)."""
        return sum(p.nbytes for p in self.parts)

    def rows(self, local: np.ndarray) -> mx.array:
        """The taps of rows `local` (int array, (n,)) in that order: (n, width, n_taps * D).
        One slice per row and one concatenation: a few kernels per training step."""
        return mx.concatenate([self.parts[r // self.per][r % self.per: r % self.per + 1] for r in map(int, local)])


class Trainer:
    """The training loop over a fixed dataset; owns the draft's float32 weights and AdamW state.

    Not thread-safe: all MLX work runs on the calling thread.

    Args:
        target: the frozen mlx-lm target (taps are computed from it per batch).
        draft: a float32 draft bound to `target` (its weights are trained in place).
        data: the training sequences.
        cfg: batch_size, anchors, gamma, lr, weight_decay, warmup, min_lr_ratio, grad_clip,
            epochs / steps / max_minutes, seed, compute_dtype, compile.
        group: the data-parallel process group (`distributed.world()`), or None for one process.
            Each rank passes its own data shard; the step averages gradients and the logged loss
            over ranks (each rank's mean loss counts equally) and hands every rank rank 0's clock,
            so weights, learning rate and the stopping step are the same on every rank.
            `batch_size` is per rank.
    """

    def __init__(self, target, draft: Model, data: TokenDataset, cfg: TrainConfig,
                 group: Optional[mx.distributed.Group] = None):
        self.target, self.draft, self.cfg = target, draft, cfg
        self.group, self.world = group, size_of(group)
        self.tokens, self.lengths, self.prompt_lens = data.arrays(pad_id=0)
        self.n = len(data)
        self.bsz = cfg.batch_size
        # Length classes: a batch is padded to its class's width, not the longest sequence's.
        self.widths, self.bucket_of = length_buckets(self.lengths, self.tokens.shape[1], cfg.length_buckets)
        self.local = np.zeros(self.n, dtype=np.int64)  # row -> index within its class (taps cache)
        for c in range(len(self.widths)):
            members = np.flatnonzero(self.bucket_of == c)
            self.local[members] = np.arange(len(members))
        self._epoch: tuple[int, list] = (0, epoch_batches(self.bucket_of, self.bsz, 0, cfg.seed))
        self.per_epoch = len(self._epoch[1])
        self.B = draft.block_size
        self.N = cfg.anchors
        self.gamma = cfg.gamma or default_gamma(self.B)
        self.cdt = resolve_dtype(cfg.compute_dtype)
        # Ranks' shards differ in size: the planned step count comes from their mean epoch.
        per_epoch = agree_sum([self.per_epoch], group)[0] / self.world
        self.total_steps = cfg.steps or max(1, math.ceil(cfg.epochs * per_epoch))
        self.budget_s = cfg.max_minutes * 60 if cfg.max_minutes else None
        self.step = 0
        # The run's clock: this process's wall time (`_local`) and the value decisions use
        # (`elapsed_s`, `startup_s`): the same on one process, rank 0's (passed through the
        # step's all-reduce) with several, so every rank stops at the same step with the same LR.
        self._local = [0.0, 0.0]  # elapsed_s, startup_s measured here
        self.elapsed_s = 0.0
        # Wall time of each length class's first step in a run (tracing, kernel compiles): it
        # counts against the time budget but not in the LR schedule's progress, so a slow
        # start does not eat the warmup.
        self.startup_s = 0.0
        self._warm_classes: set[int] = set()  # per process: a resumed run compiles again
        self.history: list[dict] = []
        self.cap = HiddenCapture(target, draft.target_layer_ids)
        self.opt = optim.AdamW(learning_rate=cfg.lr, weight_decay=cfg.weight_decay)
        self.opt.init(draft.trainable_parameters())
        self._step_fn = None
        self.taps_cached: Optional[list[Optional[CachedTaps]]] = None  # per length class, rows in `local` order
        self.validator: Optional[Validator] = None  # set_validation
        self.val_history: list[dict] = []

    def class_tap_bytes(self) -> list[int]:
        """Bytes the taps of each length class take, each sequence padded to its class's width:
        rows in class * width * n_taps * D * dtype size (one entry per class)."""
        d = target_hidden_size(self.target) * len(self.draft.target_layer_ids)
        itemsize = self.draft._embed(mx.array([0])).dtype.size
        rows = np.bincount(self.bucket_of, minlength=len(self.widths))
        return [int(r) * w * d * itemsize for r, w in zip(rows, self.widths)]

    def tap_cache_bytes(self) -> int:
        """Bytes the taps of the whole dataset take (sum of `class_tap_bytes`)."""
        return sum(self.class_tap_bytes())

    def classes_to_cache(self, budget_bytes: float) -> list[int]:
        """The length classes whose taps to cache within `budget_bytes`: the subset with the most
        bytes that fits (a class is cached whole or not at all; a step's time saved is about
        proportional to its tokens, so bytes cached measure the saving); with more than 12
        classes, the largest first that fit. Empty if none fits."""
        sizes = self.class_tap_bytes()
        if len(sizes) > 12:  # 2^n subsets stop being instant: largest classes first that fit
            chosen, total = [], 0
            for c in sorted(range(len(sizes)), key=lambda c: -sizes[c]):
                if sizes[c] and total + sizes[c] <= budget_bytes:
                    chosen.append(c)
                    total += sizes[c]
            return sorted(chosen)
        best: tuple[int, list[int]] = (0, [])
        for mask in range(1, 1 << len(sizes)):  # the default 4 length classes: 15 subsets
            chosen = [c for c in range(len(sizes)) if mask >> c & 1 and sizes[c] > 0]
            total = sum(sizes[c] for c in chosen)
            if best[0] < total <= budget_bytes:
                best = (total, chosen)
        return best[1]

    def precompute_taps(self, progress: bool = True, classes: Optional[Sequence[int]] = None,
                        log: Callable[[str], None] = print) -> None:
        """Runs the target once over the sequences of `classes` (default: all) in batches and
        keeps their taps in memory (`CachedTaps`, the batches as computed: no concatenation, which
        would need the class's bytes twice, which ran an H200 out of memory); steps of those classes
        then read their batch's taps instead of running the target (paper: "offline"), the other
        classes' steps run it as before. A class whose taps do not fit in memory (the backend
        raises while computing them) is dropped, logged, and runs online: the run goes on."""
        from tqdm import tqdm

        classes = set(range(len(self.widths)) if classes is None else classes)
        self.taps_cached = [None] * len(self.widths)
        total = int(sum((self.bucket_of == c).sum() for c in classes))
        with tqdm(total=total, desc="target taps", unit="seq", disable=not progress, dynamic_ncols=True) as bar:
            for c in sorted(classes):
                members, parts = np.flatnonzero(self.bucket_of == c), []
                try:
                    for i in range(0, len(members), self.bsz):
                        t = self.taps(mx.array(self.tokens[members[i: i + self.bsz], :self.widths[c]]))
                        mx.eval(t)
                        parts.append(t)
                        bar.update(len(members[i: i + self.bsz]))
                except RuntimeError as e:  # MLX's allocation failures (CUDA, Metal) are RuntimeErrors
                    if not any(w in str(e).lower() for w in ("out of memory", "malloc", "allocat")):
                        raise  # a bug, not a full device: say so instead of training online quietly
                    parts = t = None  # free what was computed before clearing the cache
                    mx.clear_cache()
                    log(f"taps: length class {self.widths[c]} did not fit in memory ({str(e)[:120]}); "
                        "its steps run the target")
                    continue
                if parts:
                    self.taps_cached[c] = CachedTaps(parts, self.bsz)

    # -- the compiled step -------------------------------------------------------------------

    def block_logits(self, tokens, lengths, anchors, keep, taps):
        """The draft's logits for every block of a batch, with labels and loss weights.

        Args:
            tokens (Bsz, S) int, lengths (Bsz,) int, anchors / keep (Bsz, N), taps (Bsz, S,
            n_taps * D): as `batch` returns them.

        Returns:
            logits (Bsz*N, B-1, V) in the compute dtype (the target's frozen head; V = K with a
            draft vocabulary), labels (Bsz*N, B-1) int32 as indices into those logits (-1 for a
            token outside the draft vocabulary) and weights (Bsz*N, B-1) float32
            (`loss.block_targets`).
        """
        draft = self.draft
        params = cast_tree(draft.parameters(), self.cdt)
        blocks = block_inputs(tokens, anchors, self.B, draft.mask_token_id)
        h = block_hidden(draft, params, taps, blocks, anchors)  # (Bsz*N, B, D)
        logits = draft._head(h[:, 1:])
        labels, weights = block_targets(tokens, lengths, anchors, keep, self.B, self.gamma)
        labels = draft.draft_index(labels)  # -1 outside a draft vocabulary: scored as a miss
        return logits, labels.reshape(-1, self.B - 1), weights.reshape(-1, self.B - 1)

    def _loss(self, tokens, lengths, anchors, keep, taps):
        logits, labels, weights = self.block_logits(tokens, lengths, anchors, keep, taps)
        loss = weighted_cross_entropy(logits, labels, weights)
        acc, tau = acceptance_stats(logits, labels, weights)
        return loss, acc, tau

    def _build_step(self):
        draft, opt, clip, group, w = self.draft, self.opt, self.cfg.grad_clip, self.group, self.world
        loss_and_grad = nn.value_and_grad(draft, self._loss)

        def step(tokens, lengths, anchors, keep, taps, clock):
            (loss, acc, tau), grads = loss_and_grad(tokens, lengths, anchors, keep, taps)
            if group is not None:  # the step's only collectives, so ranks issue them in one order
                grads = nn.average_gradients(grads, group)
                loss, acc, tau = (mx.distributed.all_sum(x, group=group) / w for x in (loss, acc, tau))
                clock = mx.distributed.all_sum(clock, group=group)
            if clip and clip > 0:
                grads, gnorm = optim.clip_grad_norm(grads, clip)
            else:
                gnorm = mx.sqrt(sum((g * g).sum() for _, g in tree_flatten(grads)))
            opt.update(draft, grads)
            return loss, acc, tau, gnorm, clock

        if self.cfg.compile:
            state = [draft.state, opt.state]
            step = partial(mx.compile, inputs=state, outputs=state)(step)
        return step

    def _first_compiled_step(self, inputs, log: Callable[[str], None]):
        """Runs the first compiled step synchronously; if compiling or running it fails (a
        backend without some fused kernel, say), restores the weights and optimizer state and
        continues uncompiled instead of losing the run."""
        params = tree_map(lambda x: x, self.draft.parameters())
        opt_state = tree_map(lambda x: x, self.opt.state)
        try:
            outs = self._step_fn(*inputs)
            mx.eval(outs, self.draft.parameters(), self.opt.state)
            return outs
        except Exception as e:  # noqa: BLE001 - any failure of the compiled path
            if self.group is not None:
                # Its collectives may have run: a retry here would pair with the other ranks'
                # next step. Fail, and the launcher stops every rank.
                raise
            log(f"train: the compiled step failed ({type(e).__name__}: {e}); continuing without mx.compile")
            self.draft.update(params)
            self.opt.state = opt_state
            self.cfg.compile = False
            self._step_fn = self._build_step()
            return self._step_fn(*inputs)

    def taps(self, tokens: mx.array) -> mx.array:
        """Target layer outputs of a batch: (Bsz, S) ids -> (Bsz, S, n_taps * D).

        Lazy: only the layers up to the deepest tap are ever computed (nothing reads the rest)."""
        with self.cap:
            self.target(tokens)
        return mx.stop_gradient(self.cap.hidden())

    def batch(self, step: int):
        """Host-side batch of `step` (a pure function of seed and step).

        Returns:
            (tokens, lengths, anchors, keep, taps) as mx arrays (taps: cached rows, or a lazy
            target forward), label tokens in the batch, epoch, length class."""
        e, j = divmod(step, self.per_epoch)
        if self._epoch[0] != e:
            self._epoch = (e, epoch_batches(self.bucket_of, self.bsz, e, self.cfg.seed))
        c, idx = self._epoch[1][j]
        epoch = e + j / self.per_epoch
        lengths, prompt_lens = self.lengths[idx], self.prompt_lens[idx]
        rng = np.random.default_rng([self.cfg.seed, 1, step])
        anchors, keep = sample_anchors(rng, prompt_lens, lengths, self.N)
        labels = int((np.minimum(self.B - 1, lengths[:, None] - 1 - anchors) * keep).sum())
        tokens = mx.array(self.tokens[idx, :self.widths[c]])
        cached = None if self.taps_cached is None else self.taps_cached[c]
        taps = self.taps(tokens) if cached is None else cached.rows(self.local[idx])
        return (tokens, mx.array(lengths), mx.array(anchors), mx.array(keep), taps), labels, epoch, c

    def set_validation(self, data: TokenDataset) -> None:
        """Sequences to validate on every `val_every` steps (`validation.split_validation`; this
        process's share). With several processes every rank calls this, even with none."""
        self.validator = Validator(self, data)

    def validate(self, log: Callable[[str], None] = print) -> Optional[dict]:
        """Teacher-forced loss and tau on the validation sequences now (`validation.Validator`),
        appended to `val_history` and logged. Its time counts as training time (the budget), not
        in the steps' tokens/s. Every process of the group must call it at the same step.

        Returns:
            {"step", "loss", "tau", "sequences", "blocks", "per_corpus", "train_tau"}, or None
            without validation sequences."""
        if self.validator is None:
            return None
        t0 = time.perf_counter()
        result = self.validator.run(self.group)
        self._local[0] += time.perf_counter() - t0
        if result is None:
            return None
        train_tau = self.history[-1]["train_tau"] if self.history else None
        point = {"step": self.step, **result.as_dict(), "train_tau": train_tau}
        self.val_history.append(point)
        # Per corpus too: a continued draft's pooled figure mixes rows it memorised in earlier runs
        # (file prompts) with rows new to it (target-written prompts); only the split tells
        # forgetting from learning (docs/training.md).
        by_corpus = ", ".join(f"{c} {t:.2f}" for c, t in sorted(result.per_corpus.items()))
        log(f"val: step {self.step}, loss {result.loss:.3f}, tau {result.tau:.2f} on {result.sequences} sequences "
            f"held out" + (f" (training batches: {train_tau:.2f})" if train_tau is not None else "")
            + (f"; by corpus{' (rank 0)' if self.group is not None and self.group.size() > 1 else ''}: {by_corpus}"
               if by_corpus else ""))
        return point

    def progress(self) -> float:
        """Fraction of the run done: steps or wall time, whichever is further. The wall-time
        fraction leaves out the first step of each length class (`startup_s`, traces and kernel
        compiles) from both the time spent and the budget."""
        p = self.step / self.total_steps
        if self.budget_s:
            run_s = self.budget_s - self.startup_s
            p = max(p, (self.elapsed_s - self.startup_s) / run_s if run_s > 0 else 1.0)
        return p

    def done(self) -> bool:
        """Whether the planned steps or the time budget are used up."""
        return self.step >= self.total_steps or (self.budget_s is not None and self.elapsed_s >= self.budget_s)

    # -- checkpoints ---------------------------------------------------------------------------

    def save_state(self, path: Path, extra: Optional[dict] = None) -> None:
        """Writes float32 weights, AdamW state, step, elapsed time and history to `path`/.

        Files are written under temporary names and renamed, the JSON last, so an interrupted
        save leaves the previous checkpoint readable."""
        path.mkdir(parents=True, exist_ok=True)
        arrays = {f"param/{k}": v for k, v in tree_flatten(self.draft.parameters())}
        arrays.update({f"opt/{k}": v for k, v in tree_flatten(self.opt.state)})
        if self.draft.vocab is not None:
            arrays["vocab"] = self.draft.vocab
        mx.save_safetensors(str(path / "state.tmp.safetensors"), arrays)
        os.replace(path / "state.tmp.safetensors", path / "state.safetensors")
        meta = {"format": STATE_FORMAT, "step": self.step, "elapsed_s": self.elapsed_s, "startup_s": self.startup_s,
                "draft_args": _args_dict(self.draft.args), "history": self.history, "val_history": self.val_history,
                **(extra or {})}
        (path / "state.tmp.json").write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(path / "state.tmp.json", path / "state.json")

    def load_state(self, path: Path) -> dict:
        """Restores what `save_state` wrote (before the first step), the draft vocabulary
        included. Returns the JSON metadata.

        Raises:
            TrainConfigError: the checkpoint's draft shape differs from this draft's.
        """
        meta = json.loads((path / "state.json").read_text())
        arrays = mx.load(str(path / "state.safetensors"))
        self.draft.set_vocab(None if "vocab" not in arrays else np.array(arrays["vocab"]))  # the checkpoint's
        if meta.get("draft_args") != _args_dict(self.draft.args):
            raise TrainConfigError(f"{path}: checkpoint is for another draft shape; start over with --no-resume")
        self.draft.load_weights([(k[6:], v) for k, v in arrays.items() if k.startswith("param/")], strict=True)
        self.opt.state = tree_unflatten([(k[4:], v) for k, v in arrays.items() if k.startswith("opt/")])
        self.opt.init(self.draft.trainable_parameters())
        self.step, self.elapsed_s, self.history = int(meta["step"]), float(meta["elapsed_s"]), meta["history"]
        self.val_history = meta.get("val_history", [])
        self.startup_s = float(meta.get("startup_s", 0.0))
        self._local = [self.elapsed_s, self.startup_s]
        mx.eval(self.draft.parameters(), self.opt.state)
        self._step_fn = None  # the compiled step captured the old state objects
        return meta

    # -- the loop ------------------------------------------------------------------------------

    def run(self, checkpoint: Optional[Callable[[], None]] = None, log: Callable[[str], None] = print) -> dict:
        """Trains until `steps`/`epochs` are done or `max_minutes` of training time has passed.

        Args:
            checkpoint: called every `checkpoint_every` steps and at the end (saves state).
            log: one-line messages.

        Returns:
            {"steps", "elapsed_s", "loss", "train_tau", "accuracy"} of the last logged window, and
            "label_tokens_per_s": supervised block positions per second over this call.
        """
        from tqdm import tqdm

        cfg = self.cfg
        if self._step_fn is None:
            self._step_fn = self._build_step()
        bar = tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step",
                   disable=not cfg.progress, dynamic_ncols=True)
        window = {"loss": 0.0, "tau": 0.0, "n": 0, "labels": 0, "t": 0.0}
        total = {"labels": 0, "t": 0.0}
        last = {}
        pending = None  # (outputs, labels, step, epoch) of the step in flight

        def prepare():
            # Called when exactly the steps before the one in flight are retired (on every rank
            # alike, whatever retired early), so the LR is a function of agreed values only.
            return self.batch(self.step), learning_rate(self.progress(), cfg.lr, cfg.warmup, cfg.min_lr_ratio)

        next_batch = prepare() if not self.done() else None
        t_prev = time.perf_counter()
        first = True
        stop = [False]  # set by Ctrl-C (`_sigint_as_flag`): checked once per step
        warm = self._warm_classes  # length classes whose first step (traces, compiles) is done

        def retire(p):
            nonlocal t_prev
            (loss, acc, tau, gnorm, clock), labels, step, epoch, lr, c = p
            loss_v, tau_v = loss.item(), tau.item()  # the one host sync per step
            if not math.isfinite(loss_v):
                raise FloatingPointError(f"loss is {loss_v} at step {step}")
            now = time.perf_counter()
            dt = now - t_prev
            t_prev = now
            self._local[0] += dt
            if c not in warm:
                warm.add(c)
                self._local[1] += dt
            # One process: its own clock. Several: rank 0's as of this step's dispatch.
            self.elapsed_s, self.startup_s = self._local if self.group is None else clock.tolist()
            window["loss"] += loss_v
            window["tau"] += tau_v
            window["n"] += 1
            window["labels"] += labels
            window["t"] += dt
            total["labels"] += labels
            total["t"] += dt
            if window["n"] >= cfg.log_every or self.done() or step + 1 == self.total_steps:
                tps = window["labels"] / max(window["t"], 1e-9)
                last.update(loss=window["loss"] / window["n"], train_tau=window["tau"] / window["n"],
                            accuracy=[round(a, 4) for a in acc.tolist()], label_tokens_per_s=tps)
                self.history.append({"step": step + 1, "epoch": round(epoch, 3), "loss": round(last["loss"], 4),
                                     "train_tau": round(last["train_tau"], 3), "lr": lr, "grad_norm": round(gnorm.item(), 3),
                                     "elapsed_s": round(self.elapsed_s, 1), "label_tok_per_s": round(tps)})
                bar.set_postfix(loss=f"{last['loss']:.3f}", tau=f"{last['train_tau']:.2f}", lr=f"{lr:.2e}",
                                tok_s=f"{tps:,.0f}", ep=f"{epoch:.1f}")
                window.update(loss=0.0, tau=0.0, n=0, labels=0, t=0.0)
            if self.budget_s:  # the bar's end follows whichever limit comes first (steady rate)
                rate = max(step + 1 - len(warm), 1) / max(self.elapsed_s - self.startup_s, 1e-9)
                bar.total = min(self.total_steps, max(self.step, int(self.step + rate * (self.budget_s - self.elapsed_s))))
            bar.update(1)

        with contextlib.ExitStack() as guard:
            if self.group is None:  # several ranks must stop together: there Ctrl-C stays as it is
                guard.enter_context(_sigint_as_flag(stop))
            guard.callback(bar.close)
            while next_batch is not None:
                if stop[0]:
                    if pending is not None:
                        retire(pending)
                        pending = None
                    bar.close()
                    if checkpoint:
                        checkpoint()
                    raise TrainingInterrupted(self.step, saved=checkpoint is not None)
                (inputs, labels, epoch, c), lr = next_batch
                if c not in warm and pending is not None:
                    # Steps are dispatched before the previous one is retired; a cold class's
                    # trace and compiles must land in its own step's time, not the one before.
                    retire(pending)
                    pending = None
                self.opt.learning_rate = lr
                # Several ranks: the step sums this over ranks, and only rank 0's is non-zero, so
                # every rank reads back rank 0's clock exactly (x + 0 is exact in any order).
                clock = self._local if self.group is None or self.group.rank() == 0 else [0.0, 0.0]
                inputs = (*inputs, mx.array(clock, dtype=mx.float32))
                if first and cfg.compile:
                    outs = self._first_compiled_step(inputs, log)
                else:
                    outs = self._step_fn(*inputs)
                first = False
                mx.async_eval(outs)
                step = self.step
                self.step += 1
                if pending is not None:
                    retire(pending)
                pending = (outs, labels, step, epoch, lr, c)
                next_batch = None
                if cfg.val_every and self.validator is not None and self.step % cfg.val_every == 0 \
                        and not self.done():
                    retire(pending)
                    pending = None
                    self.validate(log=log)
                    t_prev = time.perf_counter()  # validation time is in elapsed_s, not in a step's
                if not self.done():  # prepared while the device runs this step
                    next_batch = prepare()
                    if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0 and checkpoint:
                        if pending is not None:  # a validation at this step retired it already
                            retire(pending)
                            pending = None
                        checkpoint()
            if pending is not None:
                retire(pending)
                pending = None
        if checkpoint:
            checkpoint()
        if total["t"] > 0:
            last["label_tokens_per_s"] = total["labels"] / total["t"]
        return {"steps": self.step, "elapsed_s": round(self.elapsed_s, 1), **last}


def tap_cache_plan(trainer: Trainer, cache_taps_gib: float) -> tuple[list[int], str]:
    """Which length classes' taps to cache within `cache_taps_gib` GiB (`Trainer.classes_to_cache`)
    and the log line that says so (what is cached, what it takes, what is left to run online)."""
    sizes, classes = trainer.class_tap_bytes(), trainer.classes_to_cache(cache_taps_gib * 2**30)
    gib = lambda b: f"{b / 2**30:.3g} GiB"  # noqa: E731 - tiny test data and 100 GiB runs alike
    if classes == [c for c, size in enumerate(sizes) if size]:  # every class that holds sequences
        return classes, f"taps: caching the target's taps of all sequences ({gib(sum(sizes))})"
    if classes:
        return classes, (f"taps: all would take {gib(sum(sizes))}, over --cache-taps-gib {cache_taps_gib:g}: caching "
                         f"length classes {[trainer.widths[c] for c in classes]} "
                         f"({gib(sum(sizes[c] for c in classes))}); the other classes' steps run the target")
    return classes, (f"taps: not cached (the smallest length class takes {gib(min((s for s in sizes if s), default=0))}, "
                     f"over --cache-taps-gib {cache_taps_gib:g}); every step runs the target")


def _args_dict(args: ModelArgs) -> dict:
    d = asdict(args)
    d.pop("rope_parameters", None)
    return json.loads(json.dumps(d))


# --------------------------------------------------------------------------- the whole job


def _used_ids(split: DataSplit, vocab_size: int, group=None) -> set[int]:
    """Token ids in the training data and held-out prompts, over all ranks' shards (so every
    rank picks the same mask token)."""
    used: set[int] = set()
    for p, r in zip(split.train.prompt_ids, split.train.response_ids):
        used.update(p)
        used.update(r)
    for h in split.heldout:
        used.update(h["prompt_ids"])
    if group is not None:
        seen = np.zeros(vocab_size, dtype=np.float32)
        seen[[i for i in used if 0 <= i < vocab_size]] = 1
        seen = np.array(mx.distributed.all_sum(mx.array(seen), group=group))
        used |= set(np.flatnonzero(seen).tolist())
    return used


def _set_draft_vocab(draft: Model, cfg: TrainConfig, split: DataSplit, init_vocab: Optional[mx.array],
                     tokenizer, group, log: Callable[[str], None]) -> Optional[dict]:
    """Gives the draft the vocabulary `cfg.draft_vocab` asks for (see `TrainConfig`) and logs it.

    Returns:
        {"size", "coverage"} (the share of the training answers' tokens inside it), or None for
        the whole head.
    """
    V = int(draft.args.vocab_size)
    if cfg.draft_vocab is None and init_vocab is not None:
        ids = np.array(init_vocab)
    elif cfg.draft_vocab:
        ids = None
    else:
        draft.set_vocab(None)
        return None
    counts = label_token_counts(split.train.response_ids, V, group)
    if ids is None:
        ids, _ = choose_draft_vocab(counts, cfg.draft_vocab, always=getattr(tokenizer, "eos_token_ids", ()) or ())
    draft.set_vocab(ids)
    total = counts.sum()
    coverage = float(counts[ids].sum() / total) if total else 1.0
    log(f"vocab: the draft proposes from {ids.size} of {V} tokens"
        + (" (the --init-from draft's)" if cfg.draft_vocab is None else "")
        + f", covering {100 * coverage:.2f}% of the training answers' tokens")
    return {"size": int(ids.size), "coverage": round(coverage, 5)}


def _file_mib(path: Path) -> float:
    return round(path.stat().st_size / 2**20, 2)


def _init_checkpoint(cfg: TrainConfig, target) -> tuple[DraftSpec, DraftSpec, dict, Optional[mx.array]]:
    """Shapes and float32 weights of the draft in `cfg.init_from` (dequantized if it is 4/8-bit).

    Returns:
        (the saved draft's shape, the shape to train: the saved one grown to an explicit larger
        --draft-layers / --intermediate-size (`grow.grow_weights`), its weights, its draft
        vocabulary or None).

    Raises:
        TrainConfigError: the directory is not a draft for this target, or an explicit shape
            option (--target-layer-ids, --mask-token-id, or a --draft-layers /
            --intermediate-size below the draft's) disagrees with it. The block size is the
            checkpoint's too.
    """
    from worker.models.dflash_checkpoint import DraftCheckpointError, DraftMismatch, dequantized_weights

    try:
        init = load_dflash_draft(cfg.init_from, target)
    except (DraftCheckpointError, DraftMismatch) as e:
        raise TrainConfigError(f"--init-from: {e}") from e
    a = init.args
    saved = DraftSpec(a.num_hidden_layers, a.block_size, list(a.dflash_config["target_layer_ids"]),
                      int(a.dflash_config["mask_token_id"]), a.intermediate_size)
    return saved, _grown_init_shape(cfg, saved), dequantized_weights(init), init.vocab


def _clashes(asked: dict, bad: Callable[[object, object], bool], has: str, note: str = "") -> list[str]:
    """'FLAG WANT (HAS HAVE[NOTE])' for each {flag: (want, have)} asked explicitly (want not None)
    with bad(want, have); `has` names the owner, e.g. "the draft has"."""
    return [f"{flag} {want} ({has} {have}{note})" for flag, (want, have) in asked.items()
            if want is not None and bad(want, have)]


def _grown_init_shape(cfg: TrainConfig, saved: DraftSpec) -> DraftSpec:
    """The shape to train from an --init-from draft of shape `saved`: its own, with an explicit
    larger --draft-layers / --intermediate-size grown into.

    Raises:
        TrainConfigError: an explicit option that disagrees with the draft (taps, mask token) or
            would shrink it (fewer layers, a narrower MLP).
    """
    clash = _clashes({"--target-layer-ids": (cfg.target_layer_ids, saved.target_layer_ids),
                      "--mask-token-id": (cfg.mask_token_id, saved.mask_token_id)},
                     lambda want, have: want != have, "the draft has")
    clash += _clashes({"--draft-layers": (cfg.draft_layers, saved.num_layers),
                       "--intermediate-size": (cfg.intermediate_size, saved.intermediate_size)},
                      lambda want, have: want < have, "the draft has", "; it can grow, not shrink")
    if clash:
        raise TrainConfigError(f"--init-from {cfg.init_from} fixes the draft's shape; drop or change " + ", ".join(clash))
    return DraftSpec(cfg.draft_layers or saved.num_layers, saved.block_size, saved.target_layer_ids,
                     saved.mask_token_id, cfg.intermediate_size or saved.intermediate_size)


def _check_resumed_shape(cfg: TrainConfig, spec: DraftSpec, state_dir: Path, vocab_size: Optional[int]) -> None:
    """Raises TrainConfigError when an explicit --draft-layers / --intermediate-size / --draft-vocab
    (`vocab_size`: the checkpoint's draft vocabulary, None for the whole head) differs from
    the shape of the checkpoint being resumed (e.g. a new growth asked in an old work dir), which
    would otherwise train the old shape without a word."""
    clash = _clashes({"--draft-layers": (cfg.draft_layers, spec.num_layers),
                      "--intermediate-size": (cfg.intermediate_size, spec.intermediate_size)},
                     lambda want, have: want != have, "the checkpoint has")
    clash += _clashes({"--draft-vocab": (cfg.draft_vocab, vocab_size or 0)},
                      lambda want, have: want != have, "the checkpoint has")
    if clash:
        raise TrainConfigError(f"{state_dir}: resuming a checkpoint of another shape: " + ", ".join(clash)
                               + "; rerun with --no-resume (or another --work-dir) to start this shape")


def _check_grown_size(cfg: TrainConfig, spec: DraftSpec, target, bytes_per_param: float) -> None:
    """Raises TrainConfigError when a draft grown from --init-from would exceed --max-draft-mib
    (a fresh draft is shrunk to fit instead; a grown one has the size the options ask for)."""
    mib = spec.num_params(target) * bytes_per_param / 2**20
    if cfg.max_draft_mib is not None and mib > cfg.max_draft_mib:
        raise TrainConfigError(f"--init-from {cfg.init_from} grown to {spec.num_layers} layer(s), MLP "
                               f"{spec.intermediate_size} is {mib:.1f} MiB, over --max-draft-mib {cfg.max_draft_mib:g}: "
                               "raise the budget or ask for less")


def _target_config(target_path: Path) -> dict:
    """The target's config.json (a multimodal one's text_config merged in), or {} when it cannot
    be read (the loader reports that itself)."""
    try:
        c = json.loads((target_path / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return {**c.get("text_config", {}), **c} if isinstance(c, dict) else {}


def _check_init_against_target(cfg: TrainConfig, draft_config: dict, target_path: Path) -> None:
    """An --init-from draft made for another target (hidden size, a tap past its last layer, a
    mask id outside its vocabulary) fails before the target answers any prompt, as `draft eval`
    does, instead of after data generation."""
    t = _target_config(target_path)
    hidden, layers, vocab = (t.get(k) for k in ("hidden_size", "num_hidden_layers", "vocab_size"))
    d = draft_config["dflash_config"]
    if hidden is not None and int(draft_config["hidden_size"]) != hidden:
        raise TrainConfigError(f"--init-from {cfg.init_from}: draft hidden_size {draft_config['hidden_size']} "
                               f"!= target hidden size {hidden}: that draft belongs to another target")
    bad = [i for i in d["target_layer_ids"] if layers is not None and not 0 <= int(i) < layers]
    if bad:
        raise TrainConfigError(f"--init-from {cfg.init_from}: taps {bad} are past the target's {layers} layers")
    if vocab is not None and not 0 <= int(d["mask_token_id"]) < vocab:
        raise TrainConfigError(f"--init-from {cfg.init_from}: mask_token_id {d['mask_token_id']} is outside "
                               f"the target's vocabulary ({vocab} rows)")


def _check_taps_and_mask(cfg: TrainConfig, target_path: Path) -> None:
    """Explicit --target-layer-ids and --mask-token-id against the target's config.json, before
    any weights load or the target answers a prompt (a tap past the last layer used to fail only
    when the draft was built, after data generation)."""
    if not (cfg.target_layer_ids or cfg.mask_token_id is not None):
        return
    layers, vocab = (_target_config(target_path).get(k) for k in ("num_hidden_layers", "vocab_size"))
    bad = [i for i in cfg.target_layer_ids or () if layers is not None and not 0 <= i < layers]
    if bad:
        raise TrainConfigError(f"--target-layer-ids {bad} out of range: the target has {layers} layers "
                               f"(0..{layers - 1})")
    if cfg.target_layer_ids and len(set(cfg.target_layer_ids)) != len(cfg.target_layer_ids):
        raise TrainConfigError(f"--target-layer-ids {cfg.target_layer_ids} repeats a layer")
    if cfg.mask_token_id is not None and vocab is not None and not 0 <= cfg.mask_token_id < vocab:
        raise TrainConfigError(f"--mask-token-id {cfg.mask_token_id} out of range: the target's vocabulary "
                               f"has {vocab} rows")


def preflight(cfg: TrainConfig) -> None:
    """The input checks of `train_draft` that need no model weights, for the launcher of
    `flashfleet draft train --processes N`: run there once, a bad input is one message and exit 2
    instead of one traceback-free message per rank after every rank has loaded the target.

    Checks: the target resolves to a model directory; every prompt file exists and parses;
    explicit taps and mask id fit the target's config.json; --out holds no draft unless this run
    continues its checkpoint or `overwrite` is set;
    `--synthetic-prompts` inputs (`data.check_synthetic_inputs`, reading only the tokenizer);
    `--extra-data` directories (complete caches of this target: `extra_data.check_extra_data`);
    an --init-from directory is a DFlash draft made for this target (hidden size, taps, mask id
    against its config.json) whose shape agrees with explicit shape options.
    Checkpoint compatibility is still checked by the ranks (it needs the data key).

    Raises:
        FileNotFoundError / NotADirectoryError: target or a prompt file missing.
        DataError: a prompt file that does not parse, or unusable synthetic-prompt inputs.
        TrainConfigError: an --init-from directory that is no draft, or whose shape clashes.
    """
    from worker.models.dflash_checkpoint import DraftCheckpointError, read_draft_config
    from worker.training.data import DataError, check_synthetic_inputs, read_prompt_files

    path = resolve_target(cfg.target)
    read_prompt_files(cfg.prompts, cfg.max_prompts_per_file)
    _check_taps_and_mask(cfg, path)
    out = Path(cfg.out)
    work = Path(cfg.work_dir) if cfg.work_dir else out.with_name(out.name + ".work")
    # A plain rerun that finds a finished draft and no checkpoint to continue would quietly train
    # a new one over it; --no-resume (start over) and --overwrite say that is meant.
    if (out / "config.json").is_file() and cfg.resume and not cfg.overwrite \
            and not (work / "resume" / "state.json").is_file():
        raise TrainConfigError(f"--out {out} already holds a draft and there is no checkpoint of it to "
                               f"continue in {work}/resume: pass --overwrite (or --no-resume) to replace "
                               "it, or another --out")
    if (cfg.synthetic_openings or cfg.synthetic_openings_from) and not cfg.synthetic_prompts:
        raise DataError("--synthetic-openings / --synthetic-openings-from shape the prompts the target writes: "
                        "give --synthetic-prompts N too")
    if cfg.synthetic_prompts:
        from mlx_lm.utils import load_tokenizer

        try:
            tokenizer = load_tokenizer(path)
        except (OSError, ValueError) as e:
            raise DataError(f"{path}: cannot load the tokenizer ({str(e).splitlines()[0]})") from None
        check_synthetic_inputs([Path(p) for p in cfg.prompts], cfg.synthetic_temperature, tokenizer,
                               (cfg.synthetic_openings, tuple(cfg.synthetic_openings_from)))
    if cfg.extra_data:
        from worker.training.extra_data import check_extra_data

        check_extra_data(cfg.extra_data, target_fingerprint(path), read_rows=True)
    if cfg.init_from:
        try:
            c = read_draft_config(Path(cfg.init_from).expanduser())
            d = c["dflash_config"]
            spec = DraftSpec(int(c["num_hidden_layers"]), int(c.get("block_size", cfg.block_size)),
                             list(d["target_layer_ids"]), int(d["mask_token_id"]), int(c["intermediate_size"]))
            int(c["hidden_size"])
        except DraftCheckpointError as e:
            raise TrainConfigError(f"--init-from: {e}") from e
        except (KeyError, TypeError, ValueError) as e:
            raise TrainConfigError(f"--init-from {cfg.init_from}: not a DFlash draft config ({e!r} missing or bad)") from e
        _check_init_against_target(cfg, c, path)
        _grown_init_shape(cfg, spec)


def _thinned(points: list, n: int) -> list:
    """About `n` evenly spaced points of a curve, the last one always included once."""
    out = points[:: max(1, len(points) // n)]
    return out + points[-1:] if points and out[-1] is not points[-1] else out


def _data_totals(split: DataSplit, prompt_files: Sequence[str], group) -> dict:
    """The data's meta over all ranks: counts and generation rate summed, generation time the
    ranks' mean, corpora counted per prompt file and for the synthetic prompts (called on every
    rank alike)."""
    meta = dict(split.meta)
    if group is None:
        return meta
    stems = sorted({Path(p).stem for p in prompt_files} | {SYNTHETIC_CORPUS} | set(meta.get("extra_corpora", [])))
    counts = ("train_sequences", "train_tokens", "response_tokens", "ended_with_eos", "synthetic_prompts_written",
              "extra_greedy_reused", "extra_added")
    cut = int(bool(meta.get("generation_stopped_by_time_limit")))
    summed = agree_sum([meta.get(k, 0) for k in counts] + [cut] + [meta["corpora"].get(c, 0) for c in stems],
                       group, dtype=mx.int32)
    meta.update(zip(counts, summed))
    meta["generation_stopped_by_time_limit"] = summed[len(counts)] > 0
    meta["corpora"] = {c: v for c, v in zip(stems, summed[len(counts) + 1:]) if v}
    rate, secs = agree_sum([meta.get("generation_tokens_per_s", 0.0), meta.get("generation_s", 0.0)], group)
    meta["generation_tokens_per_s"] = round(rate, 1)  # all ranks together
    meta["generation_s"] = round(secs / group.size(), 1)  # the ranks' mean
    return meta


def train_draft(cfg: TrainConfig, log: Callable[[str], None] = print) -> dict:
    """Builds the data, trains the draft, saves it, measures tau, writes the training card.

    Args:
        cfg: the run's settings (`TrainConfig`).
        log: one-line progress messages (tqdm bars are separate, on stderr).

    Under `mlx.launch` with several processes (`distributed.world()`), every rank runs this:
    rank r answers its share of the prompts into `work/data-rank{r}of{W}`, training is data
    parallel (`Trainer`), and rank 0 alone saves the draft, evaluates it and writes the card
    (data counts summed over ranks); the other ranks return `{"rank": r}` after training.
    Resuming needs `work_dir` on a file system every rank sees.

    Returns:
        The training card (also written to `out/training_card.json`).

    Raises:
        FileNotFoundError / NotADirectoryError: target or prompt files missing.
        DataError: unusable prompt files or data.
        DraftSizeError: no draft shape fits --max-draft-mib.
        TrainConfigError: a checkpoint of another draft shape or other data.
        DraftMismatch: explicit taps or mask id that do not fit the target.
    """
    t_start = time.perf_counter()
    group = world()
    rank, n_ranks = rank_of(group), size_of(group)
    if rank:  # one voice: rank 0 logs and shows progress
        log, cfg = (lambda _msg: None), replace(cfg, progress=False)
    if (limit := leave_gpu_headroom(group)) is not None:
        log(f"memory: MLX limit {limit / 2**30:.1f} GiB per GPU (headroom for NCCL)")
    target_path = resolve_target(cfg.target)
    out = Path(cfg.out)
    work = Path(cfg.work_dir) if cfg.work_dir else out.with_name(out.name + ".work")
    tdt = resolve_dtype(cfg.target_dtype)
    log(f"target: {target_path} ({tdt}); device {mx.default_device()}; out {out}; work {work}"
        + (f"; data parallel over {n_ranks} processes" if group is not None else ""))
    fingerprint = target_fingerprint(target_path)
    if cfg.extra_data:  # before loading the target: another target's data is known now
        from worker.training.extra_data import check_extra_data

        check_extra_data(cfg.extra_data, fingerprint)
    target, tokenizer = load_target(target_path, tdt)

    data_kw = dict(max_per_file=cfg.max_prompts_per_file, max_prompt_tokens=cfg.max_prompt_tokens,
                   max_new_tokens=cfg.max_new_tokens, heldout_per_corpus=cfg.heldout_per_corpus,
                   heldout_fraction=cfg.heldout_fraction, temperature=cfg.gen_temperature, top_p=cfg.gen_top_p,
                   seed=cfg.seed, samples=cfg.gen_samples, sample_temperature=cfg.gen_sample_temperature,
                   synthetic=cfg.synthetic_prompts, synthetic_max_tokens=cfg.synthetic_max_tokens,
                   synthetic_temperature=cfg.synthetic_temperature,
                   synthetic_openings=(cfg.synthetic_openings, tuple(cfg.synthetic_openings_from)),
                   target_fingerprint=fingerprint)
    state_dir = work / "resume"
    resuming = cfg.resume and (state_dir / "state.json").is_file()
    seen_by = agree_sum([resuming], group)[0]
    if 0 < seen_by < n_ranks:
        raise TrainConfigError(f"{state_dir}: only {seen_by:.0f} of {n_ranks} processes see the checkpoint; "
                               "give every rank the same --work-dir (a shared file system) or use --no-resume")
    if resuming:  # before generating: a mismatch is known now
        saved = json.loads((state_dir / "state.json").read_text())
        extra = extra_data_key(cfg.extra_data) if cfg.extra_data else None
        if saved.get("data_key") != dataset_key(cfg.prompts, **data_kw, extra=extra)[0]:
            raise TrainConfigError(f"{state_dir}: the checkpoint was trained on other data (prompt files or data "
                                   "options changed); rerun with --no-resume to start over on the new data")
        if saved.get("val_fraction", 0.0) != cfg.val_fraction:  # it decides which sequences train
            raise TrainConfigError(f"{state_dir}: the checkpoint was trained with --val-fraction "
                                   f"{saved.get('val_fraction', 0.0)} (this run: {cfg.val_fraction}), which "
                                   "holds other sequences out of training: rerun with that value, or --no-resume")
        if saved.get("world_size", 1) != n_ranks:
            raise TrainConfigError(f"{state_dir}: the checkpoint was trained by {saved.get('world_size', 1)} "
                                   f"process(es), this run has {n_ranks}; each rank's data shard would change: "
                                   "rerun with as many processes, or --no-resume")
    data_dir = work / "data" if group is None else work / f"data-rank{rank}of{n_ranks}"
    split = build_dataset(target, tokenizer, cfg.prompts, data_dir, gen_batch_size=cfg.gen_batch_size,
                          gen_max_seconds=cfg.gen_max_minutes * 60 if cfg.gen_max_minutes else None,
                          regenerate=cfg.regenerate_data, shard=(rank, n_ranks), progress=cfg.progress,
                          extra_data=cfg.extra_data, log=log, **data_kw)
    data_meta = _data_totals(split, cfg.prompts, group)
    if group is not None:
        log(f"data: {data_meta['train_sequences']} sequences, {data_meta['response_tokens']} response tokens "
            f"over {n_ranks} processes (each trains on its own)")

    resumed, init_weights, saved_spec, grown_from, init_vocab = None, None, None, None, None
    if cfg.quantize_bits:
        bytes_per_param = quantized_bytes_per_param(cfg.quantize_bits, cfg.quantize_group_size,
                                                    DTYPES[cfg.save_dtype].size)
        stored = f"{cfg.quantize_bits}-bit (groups of {cfg.quantize_group_size}, {cfg.save_dtype} scales)"
    else:
        bytes_per_param, stored = DTYPES[cfg.save_dtype].size, cfg.save_dtype
    if resuming:
        saved = json.loads((state_dir / "state.json").read_text())  # its data key was checked above
        args = saved["draft_args"]
        dc = args["dflash_config"]
        spec = DraftSpec(args["num_hidden_layers"], args["block_size"], dc["target_layer_ids"], dc["mask_token_id"],
                         args["intermediate_size"])
        _check_resumed_shape(cfg, spec, state_dir, args.get("draft_vocab_size"))
        grown_from = saved.get("grown_from")
    elif cfg.init_from:
        saved_spec, spec, init_weights, init_vocab = _init_checkpoint(cfg, target)
        if spec != saved_spec:
            _check_grown_size(cfg, spec, target, bytes_per_param)
            grown_from = {"layers": saved_spec.num_layers, "intermediate_size": saved_spec.intermediate_size}
    else:
        spec = choose_draft_spec(
            target, tokenizer, _used_ids(split, target_vocab_size(target), group),
            draft_layers=cfg.draft_layers, num_taps=cfg.num_taps,
            target_layer_ids=cfg.target_layer_ids, mask_token_id=cfg.mask_token_id, block_size=cfg.block_size,
            intermediate_size=cfg.intermediate_size, max_draft_mib=cfg.max_draft_mib,
            bytes_per_param=bytes_per_param)
    from_target = cfg.init_layers == "target" and init_weights is None and not resuming
    draft = make_draft(target, spec, cfg.seed, from_target=from_target)
    if from_target:
        log(f"init: draft layers start from the target's last {spec.num_layers} (--init-layers target)")
    if init_weights is not None:
        if grown_from:
            from worker.training.grow import grow_weights

            init_weights = grow_weights(init_weights, dict(tree_flatten(draft.parameters())))
        draft.load_weights(list(init_weights.items()), strict=True)
        mx.eval(draft.parameters())
        log(f"init: weights from {cfg.init_from}" + (
            f", grown from {saved_spec.num_layers} layer(s), MLP {saved_spec.intermediate_size} to "
            f"{spec.num_layers}, MLP {spec.intermediate_size} (the same function at step 0)" if grown_from else ""))
    draft.update(broadcast_tree(draft.parameters(), group))
    vocab_meta = None
    if not resuming:  # a resumed run takes the checkpoint's (`load_state`)
        vocab_meta = _set_draft_vocab(draft, cfg, split, init_vocab, tokenizer, group, log)
    n_params = spec.num_params(target)
    log(f"draft: {spec.num_layers} layer(s), taps {spec.target_layer_ids}, mask id {spec.mask_token_id}, "
        f"B={spec.block_size}, MLP {spec.intermediate_size}, {n_params / 1e6:.2f} M parameters "
        f"({n_params * bytes_per_param / 2**20:.1f} MiB saved as {stored})")

    train_data, val_data = split_validation(split.train, cfg.val_fraction)
    trainer = Trainer(target, draft, train_data, cfg, group)
    trainer.set_validation(lowest_hashes(val_data, -(-cfg.val_max_sequences // n_ranks)))  # per rank
    if resuming:
        resumed = trainer.load_state(state_dir)
        log(f"resume: step {trainer.step}, {trainer.elapsed_s:.0f} s trained, from {state_dir}")
        before = saved.get("val_max_sequences", cfg.val_max_sequences)
        if before != cfg.val_max_sequences:  # training is unchanged; the curve's rows are not
            log(f"val: --val-max-sequences {cfg.val_max_sequences} (the checkpoint's run measured {before}): the "
                f"validation points from step {trainer.step} on are measured on other rows than the earlier ones")
    elif rank == 0 and state_dir.exists():  # rank 0 alone writes (and clears) the checkpoint
        for f in state_dir.glob("state*"):
            f.unlink(missing_ok=True)
    if cfg.cache_taps_gib:
        classes, message = tap_cache_plan(trainer, cfg.cache_taps_gib)
        log(message)
        if classes:
            trainer.precompute_taps(cfg.progress, classes, log)
    log(f"train: {trainer.n} sequences (S={trainer.tokens.shape[1]}, batch widths {trainer.widths}), "
        f"batch {trainer.bsz}" + (f" per rank x {n_ranks} ranks" if group is not None else "") + f", {trainer.N} anchors, "
        f"gamma {trainer.gamma}, up to {trainer.total_steps} steps"
        + (f" or {cfg.max_minutes} min" if cfg.max_minutes else "") + f", compute {trainer.cdt}")
    n_val, n_measured = agree_sum([len(val_data), len(trainer.validator)], group)
    log(f"val: {n_val:.0f} sequences held out of this run's training, {n_measured:.0f} measured (teacher-forced)"
        + (f" every {cfg.val_every} steps" if cfg.val_every else " at the end") if n_val else
        "val: no validation sequences (--val-fraction 0, or too little data)")
    save = lambda: trainer.save_state(state_dir, {"data_key": split.meta["key"], "world_size": n_ranks,  # noqa: E731
                                                  "val_fraction": cfg.val_fraction,
                                                  "val_max_sequences": cfg.val_max_sequences,
                                                  "grown_from": grown_from})
    if trainer.step == 0 and cfg.val_every:
        # Where the starting weights stand (an --init-from draft may know validation rows from
        # earlier runs): without this point a curve cannot tell forgetting from learning.
        trainer.validate(log=log)  # every rank, like the later points
    result = trainer.run(checkpoint=save if rank == 0 else None, log=log)
    if not trainer.val_history or trainer.val_history[-1]["step"] != trainer.step:
        trainer.validate(log=log)  # every rank: the result is summed over them
        if rank == 0:
            save()  # the checkpoint holds the final point too
    label_rate = agree_sum([result.get("label_tokens_per_s", 0.0)], group)[0]  # all processes together
    if rank:
        return {"rank": rank, "steps": result["steps"]}

    sdt = DTYPES[cfg.save_dtype]
    draft.update(cast_tree(draft.parameters(), sdt))
    full_dir = work / "unquantized"
    if cfg.quantize_bits:  # keep the unquantized draft beside the data, evaluate both
        save_dflash_draft(draft, full_dir)
        quantize_dflash_draft(draft, cfg.quantize_bits, cfg.quantize_group_size)
    save_dflash_draft(draft, out)
    log(f"saved: {out} ({_file_mib(out / 'model.safetensors')} MiB)")

    evals = {}
    if cfg.eval and not split.heldout:
        log("eval: no held-out prompts (--heldout-per-corpus 0, or corpora of one prompt): tau not measured")
    if cfg.eval and split.heldout:
        eos = tokenizer.eos_token_ids
        eval_s = cfg.eval_max_minutes * 60 if cfg.eval_max_minutes else None
        edt = resolve_dtype(cfg.compute_dtype)
        trained = load_dflash_draft(out, target, dtype=None if cfg.quantize_bits else edt)
        evals["trained"] = evaluate_tau(target, trained, split.heldout, cfg.eval_max_new_tokens, eos,
                                        max_seconds=eval_s, progress=cfg.progress, desc="tau trained")
        log("tau (trained): " + tau_line(evals["trained"]))
        if cfg.quantize_bits and cfg.eval_unquantized:
            full = load_dflash_draft(full_dir, target, dtype=edt)
            evals["unquantized"] = evaluate_tau(target, full, split.heldout, cfg.eval_max_new_tokens, eos,
                                                max_seconds=eval_s, progress=cfg.progress, desc="tau unquantized")
            log("tau (unquantized): " + tau_line(evals["unquantized"]))
        if cfg.eval_untrained:
            untrained = make_draft(target, spec, cfg.seed, from_target=cfg.init_layers == "target")
            untrained.update(cast_tree(untrained.parameters(), resolve_dtype(cfg.compute_dtype)))
            evals["untrained"] = evaluate_tau(target, untrained, split.heldout, cfg.eval_max_new_tokens, eos,
                                              max_seconds=eval_s, progress=cfg.progress, desc="tau untrained")
            log("tau (untrained): " + tau_line(evals["untrained"]))

    card = {
        "format": "flashfleet-dflash-training-card/1",
        "method": "DFlash (arXiv 2602.06036) block-diffusion draft; recipe of paper §4.2 / SpecForge OnlineDFlashModel",
        "target": {"path": str(target_path), "name": target_path.name, "fingerprint": fingerprint,
                   "layers": len(target_layers(target)), "hidden_size": target_hidden_size(target),
                   "vocab_size": target_vocab_size(target), "dtype": str(tdt)},
        "draft": {"layers": spec.num_layers, "target_layer_ids": spec.target_layer_ids,
                  "mask_token_id": spec.mask_token_id, "block_size": spec.block_size,
                  "intermediate_size": spec.intermediate_size, "parameters": n_params,
                  "dtype": cfg.save_dtype, "quantization": draft.args.quantization,
                  "draft_vocab": vocab_meta if vocab_meta or draft.vocab is None else {"size": int(draft.vocab.size)},
                  "file_mib": _file_mib(out / "model.safetensors")},
        "data": {k: data_meta.get(k) for k in ("train_sequences", "heldout_prompts", "train_tokens", "response_tokens",
                                                "ended_with_eos", "generation_s", "generation_tokens_per_s",
                                                "generation_stopped_by_time_limit", "corpora", "key",
                                                "synthetic_prompts_written", "extra_greedy_reused", "extra_added",
                                                "extra_data")}
        | {"files": [Path(p).name for p in cfg.prompts], "max_prompts_per_file": cfg.max_prompts_per_file,
           "max_prompt_tokens": cfg.max_prompt_tokens, "max_new_tokens": cfg.max_new_tokens,
           "gen_temperature": cfg.gen_temperature, "gen_samples": cfg.gen_samples,
           "gen_sample_temperature": cfg.gen_sample_temperature, "synthetic_prompts": cfg.synthetic_prompts,
           "synthetic_max_tokens": cfg.synthetic_max_tokens, "synthetic_temperature": cfg.synthetic_temperature,
           "synthetic_openings": cfg.synthetic_openings, "synthetic_openings_from": list(cfg.synthetic_openings_from),
           "seed": cfg.seed,
           "heldout_per_corpus": {c: sum(1 for h in split.heldout if h["corpus"] == c)
                                  for c in sorted({h["corpus"] for h in split.heldout})}},
        "training": {"steps": result["steps"],
                     # as the progress bar and the curve count them: batches of (rank 0's) data
                     "epochs": round(result["steps"] / trainer.per_epoch, 2),
                     "elapsed_s": result["elapsed_s"], "batch_size": trainer.bsz, "processes": n_ranks,
                     "anchors": trainer.N,
                     "seq_len": int(trainer.tokens.shape[1]), "gamma": trainer.gamma, "lr": cfg.lr,
                     "warmup": cfg.warmup, "min_lr_ratio": cfg.min_lr_ratio, "weight_decay": cfg.weight_decay,
                     "grad_clip": cfg.grad_clip, "compute_dtype": str(trainer.cdt), "compiled": cfg.compile,
                     "max_minutes": cfg.max_minutes, "planned_steps": trainer.total_steps,
                     "resumed_from_step": resumed["step"] if resumed else None,
                     "init_from": str(cfg.init_from) if cfg.init_from else None,
                     "grown_from": grown_from,
                     "init_layers": None if cfg.init_from or resumed else cfg.init_layers,
                     "final_loss": round(result.get("loss", float("nan")), 4),
                     "final_train_tau": round(result.get("train_tau", float("nan")), 3),
                     "final_accuracy_per_position": result.get("accuracy"),
                     "label_tokens_per_s": round(label_rate),
                     "curve": _thinned(trainer.history, 40),
                     "validation": {"fraction": cfg.val_fraction, "every": cfg.val_every, "held_out": int(n_val),
                                    "sequences": int(n_measured),
                                    "final": trainer.val_history[-1] if trainer.val_history else None,
                                    "curve": _thinned(trainer.val_history, 40)}},
        "eval": evals,
        "environment": {"mlx": mx.__version__, "device": str(mx.default_device()), "python": platform.python_version(),
                        "argv": sys.argv},
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    (out / "training_card.json").write_text(json.dumps(card, indent=1) + "\n")
    (out / "TRAINING.md").write_text(render_card(card))
    log(f"card: {out / 'training_card.json'}; total {card['wall_s']} s")
    return card


