"""The training loop (`Trainer`): batches, the compiled step, validation points, checkpoints.

Recipe (Chen et al. 2026, "DFlash: Block Diffusion for Flash Speculative Decoding", arXiv
2602.06036, §4.2 and App. A.1; SpecForge `specforge/algorithms/common/dflash_family_model.py`):

- features: the frozen target runs once per batch on the clean prompt + response, and the outputs
  of the tapped layers are captured (`worker.capture.HiddenCapture`; online, or cached per length
  class: `taps_cache`);
- blocks: N random anchors per sequence, re-drawn every step; each starts a block
  `[x_p, MASK x (B-1)]` that sees the context before p and its own block (`masks`, `forward`);
- loss: cross-entropy with position weights exp(-(k-1)/gamma) (`loss`);
- optimisation: AdamW, linear warmup then cosine decay, gradient clipping (`step`); the embedding
  and LM head are the target's and stay frozen (they are not draft parameters at all).

Speed: fixed batch shapes (sequences right-padded to their length class's width, N anchors per
sequence), so the whole step is one `mx.compile`d function traced once per class. Master weights
and AdamW moments are float32; the forward runs in `compute_dtype` (bfloat16 on a GPU) on a cast
copy of the weights. The host prepares batch n+1 while the device runs step n, and reads step
n-1's loss (one sync per step).

Several processes (`mlx.launch`, `worker.training.distributed`): data-parallel; each rank trains on
its own share of the data and the step averages the gradients over ranks.
"""
from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_map
from tqdm import tqdm

from worker.capture import HiddenCapture, target_hidden_size
from worker.models.dflash import Model
from worker.training.checkpoint import load_state, save_state
from worker.training.config import TrainConfig, resolve_dtype
from worker.training.distributed import agree_sum, size_of
from worker.training.forward import block_hidden, block_inputs, cast_tree
from worker.training.interrupt import TrainingInterrupted, sigint_as_flag
from worker.training.loss import acceptance_stats, block_targets, default_gamma, weighted_cross_entropy
from worker.training.masks import sample_anchors
from worker.training.run_log import RunLog
from worker.training.sequences import TokenDataset, epoch_batches, length_buckets
from worker.training.step import build_step, learning_rate
from worker.training.taps_cache import CachedTaps, classes_to_cache, compute_class_taps
from worker.training.validation import Validator


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
        itemsize = self.draft.target_embedding(mx.array([0])).dtype.size
        rows = np.bincount(self.bucket_of, minlength=len(self.widths))
        return [int(r) * w * d * itemsize for r, w in zip(rows, self.widths)]

    def tap_cache_bytes(self) -> int:
        """Bytes the taps of the whole dataset take (sum of `class_tap_bytes`)."""
        return sum(self.class_tap_bytes())

    def classes_to_cache(self, budget_bytes: float) -> list[int]:
        """The length classes whose taps to cache within `budget_bytes` (`taps_cache.classes_to_cache`
        over `class_tap_bytes`). Empty if none fits."""
        return classes_to_cache(self.class_tap_bytes(), budget_bytes)

    def precompute_taps(self, progress: bool = True, classes: Optional[Sequence[int]] = None,
                        log: Callable[[str], None] = print) -> None:
        """Runs the target once over the sequences of `classes` (default: all) and keeps their taps
        in memory (`taps_cache.compute_class_taps`); steps of those classes then read their batch's
        taps instead of running the target (paper: "offline"), the other classes' steps run it.
        A class whose taps do not fit in memory is dropped, logged, and runs online."""
        classes = set(range(len(self.widths)) if classes is None else classes)
        self.taps_cached = [None] * len(self.widths)
        total = int(sum((self.bucket_of == c).sum() for c in classes))
        with tqdm(total=total, desc="target taps", unit="seq", disable=not progress, dynamic_ncols=True) as bar:
            for c in sorted(classes):
                self.taps_cached[c] = compute_class_taps(self.taps, self.tokens, np.flatnonzero(self.bucket_of == c),
                                                         self.widths[c], self.bsz, bar.update, log)

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
        logits = draft.head(h[:, 1:])
        labels, weights = block_targets(tokens, lengths, anchors, keep, self.B, self.gamma)
        labels = draft.draft_index(labels)  # -1 outside a draft vocabulary: scored as a miss
        return logits, labels.reshape(-1, self.B - 1), weights.reshape(-1, self.B - 1)

    def _loss(self, tokens, lengths, anchors, keep, taps):
        logits, labels, weights = self.block_logits(tokens, lengths, anchors, keep, taps)
        loss = weighted_cross_entropy(logits, labels, weights)
        acc, tau = acceptance_stats(logits, labels, weights)
        return loss, acc, tau

    def _build_step(self):
        return build_step(self.draft, self.opt, self._loss, self.cfg.grad_clip, self.group, self.cfg.compile)

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
        log(result.line(self.step, train_tau, several_ranks=self.world > 1))
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
        """Writes float32 weights, AdamW state, step, elapsed time, history and `extra` to `path`/
        (`checkpoint.save_state`: an interrupted save leaves the previous checkpoint readable)."""
        save_state(path, self.draft, self.opt, {"step": self.step, "elapsed_s": self.elapsed_s,
                                                "startup_s": self.startup_s, "history": self.history,
                                                "val_history": self.val_history, **(extra or {})})

    def load_state(self, path: Path) -> dict:
        """Restores what `save_state` wrote (before the first step), the draft vocabulary
        included. Returns the JSON metadata.

        Raises:
            TrainConfigError: the checkpoint's draft shape differs from this draft's.
        """
        meta = load_state(path, self.draft, self.opt)
        self.step, self.elapsed_s, self.history = int(meta["step"]), float(meta["elapsed_s"]), meta["history"]
        self.val_history = meta.get("val_history", [])
        self.startup_s = float(meta.get("startup_s", 0.0))
        self._local = [self.elapsed_s, self.startup_s]
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
        cfg = self.cfg
        if self._step_fn is None:
            self._step_fn = self._build_step()
        record = RunLog(self.total_steps, self.step, cfg.log_every, cfg.progress)
        bar = record.bar
        pending = None  # (outputs, labels, step, epoch) of the step in flight

        def prepare():
            # Called when exactly the steps before the one in flight are retired (on every rank
            # alike, whatever retired early), so the LR is a function of agreed values only.
            return self.batch(self.step), learning_rate(self.progress(), cfg.lr, cfg.warmup, cfg.min_lr_ratio)

        next_batch = prepare() if not self.done() else None
        t_prev = time.perf_counter()
        first = True
        stop = [False]  # set by Ctrl-C (`sigint_as_flag`): checked once per step
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
            record.add(loss_v, tau_v, labels, dt)
            if record.window_full() or self.done() or step + 1 == self.total_steps:
                self.history.append(record.point(step, epoch, lr, gnorm.item(), acc.tolist(), self.elapsed_s))
            if self.budget_s:  # the bar's end follows whichever limit comes first (steady rate)
                rate = max(step + 1 - len(warm), 1) / max(self.elapsed_s - self.startup_s, 1e-9)
                bar.total = min(self.total_steps, max(self.step, int(self.step + rate * (self.budget_s - self.elapsed_s))))
            bar.update(1)

        with contextlib.ExitStack() as guard:
            if self.group is None:  # several ranks must stop together: there Ctrl-C stays as it is
                guard.enter_context(sigint_as_flag(stop))
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
        return {"steps": self.step, "elapsed_s": round(self.elapsed_s, 1), **record.summary()}
