"""Teacher-forced validation: how well the draft predicts answers it has never trained on.

The held-out tau at the end of a run (`evaluate.evaluate_tau`) decodes 72 prompts with the target
and costs minutes; it says nothing about *when* training stopped helping. This module holds a few
answered sequences out of the training data and measures, every `val_every` steps, the same
loss and teacher-forced tau estimate the training batches report (`loss.acceptance_stats`), so a
run shows how far the draft fits its own data better than new data (docs/training.md).

Which sequences: those whose prompt token ids hash below `fraction` (SHA-1), so a prompt is on the
same side in every run, on every process and in any mix of data (every answer to one prompt goes
with it; no cap that more data could move). A row that an earlier run trained on (`--init-from`
plus `--extra-data` of data from before validation existed) is not new to the draft: such a
run's numbers are optimistic for those rows.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import mlx.core as mx
import numpy as np

from worker.training.distributed import agree_sum
from worker.training.masks import sample_anchors
from worker.training.sequences import TokenDataset


class BlockScorer(Protocol):
    """What a `Validator` measures with (`trainer.Trainer` is one): the batch size `bsz`, the
    anchors per sequence `N`, `cfg.seed`, the target's taps of a batch and the draft's block
    logits with labels and weights (`Trainer.block_logits`)."""

    bsz: int
    N: int
    cfg: Any

    def taps(self, tokens: mx.array) -> mx.array: ...

    def block_logits(self, tokens, lengths, anchors, keep, taps) -> tuple[mx.array, mx.array, mx.array]: ...


def prompt_hash(prompt_ids: list[int]) -> float:
    """A prompt's place in [0, 1): SHA-1 of its token ids (little-endian int32)."""
    digest = hashlib.sha1(np.asarray(prompt_ids, dtype="<i4").tobytes()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_validation(data: TokenDataset, fraction: float) -> tuple[TokenDataset, TokenDataset]:
    """Splits training sequences into (train, validation) by prompt (see the module docstring).

    Args:
        data: the training sequences.
        fraction: share of prompts that validate, in [0, 1) (0: none); the expected number of
            validation sequences is fraction * len(data).

    Returns:
        (train, validation): disjoint, together all of `data`, each in `data`'s order. The
        validation set is empty when `fraction` is 0 or when it would leave no training sequence.
    """
    if fraction <= 0:
        return data, TokenDataset()
    chosen = {i for i, p in enumerate(data.prompt_ids) if prompt_hash(p) < fraction}
    if len(chosen) >= len(data):
        return data, TokenDataset()
    return (data.subset(i for i in range(len(data)) if i not in chosen),
            data.subset(i for i in range(len(data)) if i in chosen))


def lowest_hashes(data: TokenDataset, n: int) -> TokenDataset:
    """The `n` sequences of `data` whose prompts hash lowest (all of them if it has <= n), in
    `data`'s order: which validation sequences to measure when the held-out set is larger than a
    measurement should cost. Membership of the held-out set is `split_validation`'s alone, so a
    smaller measured set never puts a sequence into training."""
    if len(data) <= n:
        return data
    hashes = np.array([prompt_hash(p) for p in data.prompt_ids])
    return data.subset(sorted(np.argsort(hashes, kind="stable")[:max(n, 0)].tolist()))


@dataclass
class ValidationResult:
    """One validation: `loss` (weighted cross-entropy, nats per token, as the training loss),
    `tau` (teacher-forced acceptance length, bonus included), over `sequences` sequences and
    `blocks` blocks, all processes together; `per_corpus` {corpus: tau} of this process's rows."""

    loss: float
    tau: float
    sequences: int
    blocks: int
    per_corpus: dict

    def as_dict(self) -> dict:
        """The result as the training card keeps it (rounded; corpora sorted)."""
        return {"loss": round(self.loss, 4), "tau": round(self.tau, 3), "sequences": self.sequences,
                "blocks": self.blocks, "per_corpus": {c: round(t, 3) for c, t in sorted(self.per_corpus.items())}}

    def line(self, step: int, train_tau: Optional[float], several_ranks: bool = False) -> str:
        """The log line of this result at `step`, with the training batches' tau (`train_tau`,
        None: not known yet) and tau per corpus (this process's rows: rank 0's when
        `several_ranks`)."""
        # Per corpus too: a continued draft's pooled figure mixes rows it memorised in earlier runs
        # (file prompts) with rows new to it (target-written prompts); only the split tells
        # forgetting from learning (docs/training.md).
        by_corpus = ", ".join(f"{c} {t:.2f}" for c, t in sorted(self.per_corpus.items()))
        return (f"val: step {step}, loss {self.loss:.3f}, tau {self.tau:.2f} on {self.sequences} sequences held out"
                + (f" (training batches: {train_tau:.2f})" if train_tau is not None else "")
                + (f"; by corpus{' (rank 0)' if several_ranks else ''}: {by_corpus}" if by_corpus else ""))


class Validator:
    """Measures a trainer's draft on fixed validation sequences with fixed anchors, so successive
    results differ only by the weights.

    Args:
        trainer: the `Trainer` (a `BlockScorer`: its target, draft, anchors per sequence, batch
            size, seed).
        data: the validation sequences (`split_validation`); every process passes its own.

    The target runs per batch (online taps): the set is small. Each batch is padded to its own
    longest sequence (rounded up to 32 tokens).
    """

    def __init__(self, trainer: BlockScorer, data: TokenDataset):
        self.trainer, self.corpus = trainer, list(data.corpus)
        self.batches = []
        if not len(data):
            return
        tokens, lengths, prompt_lens = data.arrays(pad_id=0)
        order = np.argsort(lengths, kind="stable")  # similar lengths share a batch: less padding
        for b, i in enumerate(range(0, len(order), trainer.bsz)):
            idx = order[i: i + trainer.bsz]
            width = int(-(-int(lengths[idx].max()) // 32) * 32)
            rng = np.random.default_rng([trainer.cfg.seed, 2, b])
            anchors, keep = sample_anchors(rng, prompt_lens[idx], lengths[idx], trainer.N)
            self.batches.append((idx, mx.array(tokens[idx, :width]), mx.array(lengths[idx]),
                                 mx.array(anchors), mx.array(keep)))

    def __len__(self) -> int:
        return len(self.corpus)

    def run(self, group: Optional[mx.distributed.Group] = None) -> Optional[ValidationResult]:
        """One pass over the validation sequences (no gradients, weights unchanged).

        Every process of `group` must call it at the same step (one all-reduce).

        Returns:
            The result, or None when no process has validation sequences.
        """
        tr = self.trainer
        rows = len(self.corpus)
        loss_sum = w_sum = acc_sum = n_blocks = 0.0
        corpus_acc: dict[str, list[float]] = {}
        for idx, tokens, lengths, anchors, keep in self.batches:
            logits, labels, weights = tr.block_logits(tokens, lengths, anchors, keep, tr.taps(tokens))
            x = logits.astype(mx.float32)
            ce = mx.logsumexp(x, axis=-1) - mx.take_along_axis(x, labels[..., None], axis=-1)[..., 0]
            real = weights > 0
            prefix = mx.cumprod(((mx.argmax(x, axis=-1) == labels) & real).astype(mx.float32), axis=-1).sum(-1)
            n = len(idx)
            first = real[:, 0].astype(mx.float32).reshape(n, -1)  # (rows, N): blocks with a real label
            per_row = mx.stack([(prefix.reshape(n, -1) * first).sum(-1), first.sum(-1)], axis=-1)
            sums = mx.stack([(ce * weights).sum(), weights.sum()])
            mx.eval(per_row, sums)
            ls, ws = sums.tolist()
            loss_sum, w_sum = loss_sum + ls, w_sum + ws
            for r, (a, k) in zip(idx.tolist(), per_row.tolist()):
                acc_sum, n_blocks = acc_sum + a, n_blocks + k
                c = corpus_acc.setdefault(self.corpus[r], [0.0, 0.0])
                c[0], c[1] = c[0] + a, c[1] + k
        loss_sum, w_sum, acc_sum, n_blocks, rows = agree_sum([loss_sum, w_sum, acc_sum, n_blocks, rows], group)
        if not rows or not n_blocks:
            return None
        return ValidationResult(loss=loss_sum / max(w_sum, 1e-6), tau=1.0 + acc_sum / n_blocks,
                                sequences=int(rows), blocks=int(n_blocks),
                                per_corpus={c: 1.0 + a / k for c, (a, k) in corpus_acc.items() if k})
