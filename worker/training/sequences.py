"""Tokenised training sequences (`TokenDataset`) and the padded batches drawn from them.

`length_buckets` + `epoch_batches`: right-padded batches for the trainer, each from one length
class and padded to its width, a pure function of (seed, epoch), so a resumed run sees the same
batches.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class TokenDataset:
    """Tokenised training sequences: templated prompt + the target's response.

    Attributes:
        prompt_ids / response_ids: per sequence, token ids.
        corpus / ids: per sequence, the prompt's corpus and id.
    """

    prompt_ids: list[list[int]] = field(default_factory=list)
    response_ids: list[list[int]] = field(default_factory=list)
    corpus: list[str] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Total tokens (prompt + response) over all sequences."""
        return sum(len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids))

    @property
    def num_response_tokens(self) -> int:
        """Total response (target-written) tokens."""
        return sum(len(r) for r in self.response_ids)

    def subset(self, indices) -> "TokenDataset":
        """The sequences at `indices` (any iterable of ints), in that order."""
        idx = list(indices)
        return TokenDataset([self.prompt_ids[i] for i in idx], [self.response_ids[i] for i in idx],
                            [self.corpus[i] for i in idx], [self.ids[i] for i in idx])

    def save(self, path: Path) -> None:
        """Writes one JSON line per sequence: corpus, id, prompt_ids, response_ids."""
        with path.open("w", encoding="utf-8") as f:
            for c, i, p, r in zip(self.corpus, self.ids, self.prompt_ids, self.response_ids):
                f.write(json.dumps({"corpus": c, "id": i, "prompt_ids": p, "response_ids": r}) + "\n")

    @classmethod
    def load(cls, path: Path) -> "TokenDataset":
        """Reads what `save` wrote."""
        ds = cls()
        with path.open(encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                ds.corpus.append(row["corpus"])
                ds.ids.append(row["id"])
                ds.prompt_ids.append(row["prompt_ids"])
                ds.response_ids.append(row["response_ids"])
        return ds

    def arrays(self, pad_id: int = 0, multiple: int = 32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Right-padded token matrix of the whole dataset.

        Args:
            pad_id: filler after each sequence's end (never attended to by real tokens, never a
                label).
            multiple: the padded length S is rounded up to a multiple of this.

        Returns:
            tokens (n, S) int32, lengths (n,) int32, prompt_lens (n,) int32.
        """
        lengths = np.array([len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids)], np.int32)
        S = int(math.ceil(max(int(lengths.max()), 2) / multiple) * multiple)
        tokens = np.full((len(self), S), pad_id, dtype=np.int32)
        for i, (p, r) in enumerate(zip(self.prompt_ids, self.response_ids)):
            tokens[i, : len(p) + len(r)] = p + r
        prompt_lens = np.array([len(p) for p in self.prompt_ids], np.int32)
        return tokens, lengths, prompt_lens


def length_buckets(lengths: np.ndarray, width: int, count: int, multiple: int = 32) -> tuple[list[int], np.ndarray]:
    """Width classes for padded batches: `count` widths up to `width`, and each sequence's class.

    Batches drawn from one class are padded only to its width, so short sequences stop paying
    for the longest one (in the target forward, the attention masks and the taps cache).

    Args:
        lengths: (n,) int sequence lengths, tokens, each <= width.
        width: the padded length of the whole dataset.
        count: number of classes (1: every batch is padded to `width`).
        multiple: widths are rounded up to this.

    Returns:
        (widths ascending, without duplicates; (n,) int class of each sequence: the narrowest
        width that holds it).
    """
    widths = sorted({min(width, -(-math.ceil(width * k / count) // multiple) * multiple)
                     for k in range(1, count + 1)})
    return widths, np.searchsorted(np.asarray(widths), lengths, side="left")


def epoch_batches(bucket_of: np.ndarray, batch_size: int, epoch: int, seed: int) -> list[tuple[int, np.ndarray]]:
    """The batches of one epoch, each from one length class (`length_buckets`), in training order.

    Every class is shuffled and cut into batches (its last batch is filled up with its first
    rows again), then the order of all batches is shuffled. A pure function of its arguments, so
    resuming at a step reproduces the batch.

    Returns:
        [(class, row indices (batch_size,) int64)]; every row appears in the epoch at least once.
    """
    rng = np.random.default_rng([seed, epoch])
    batches = []
    for c in np.unique(bucket_of):
        rows = rng.permutation(np.flatnonzero(bucket_of == c))
        need = -(-len(rows) // batch_size) * batch_size
        rows = np.resize(rows, need)  # repeats the class's first rows to fill its last batch
        batches += [(int(c), rows[i: i + batch_size].astype(np.int64)) for i in range(0, need, batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]

