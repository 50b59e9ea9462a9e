"""Training sequences from earlier runs' data caches (`flashfleet draft train --extra-data DIR`).

A draft gains held-out tau from prompts it has not seen (docs/training.md), so data should
accumulate across runs and machines instead of being generated again: each run's data cache
(`WORK/data/` or `WORK/data-rank{r}of{W}/`: `meta.json` + `train.jsonl`, or it compressed as
`train.jsonl.xz` or `train.jsonl.gz`) can be handed to a later run. There,

- a greedy answer to a prompt this run answers greedily anyway (same templated prompt ids) is
  reused and that prompt is not generated again, when the answer is complete: it ended with EOS,
  or it ran to its run's token cap and that cap is at least this run's (it is cut to this run's
  cap: greedy decoding's answer is a prefix of the longer one). An incomplete one (cut by a time
  limit or a smaller cap) is dropped, and this run answers the prompt itself;
- every other sequence (answers to prompts the target wrote, sampled answers, greedy answers to
  prompts outside this run's files) is added as it is;
- a sequence whose prompt is one of this run's held-out prompts (same templated ids, or the same
  file prompt id) is dropped, and exact repeats are dropped.

The data must come from the same target: its `meta.json` fingerprint (`target.target_fingerprint`:
config + weight file sizes and ends) must equal this target's.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import lzma
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

from worker.training.data import DataError
from worker.training.sequences import TokenDataset
from worker.training.synthetic import SYNTHETIC_CORPUS

SAMPLE_MARK = "#sample"  # ids of sampled (not greedy) answers to file prompts end with #sample{k}


@dataclass
class ExtraData:
    """Sequences read from earlier data caches, ready for `answers.build_dataset`.

    Attributes:
        greedy: templated prompt ids (tuple) -> a complete greedy answer (token ids, at most the
            cap of the run that reads it), for prompts this run answers greedily.
        added: every other usable sequence (corpus and id kept; ids prefixed `extra{k}:`).
        sources: one dict per directory: path, sequences read, held-out ones dropped, repeats
            (or too short) dropped, incomplete greedy answers superseded by this run's, greedy
            answers offered for reuse, sequences added.
    """

    greedy: dict = field(default_factory=dict)
    added: TokenDataset = field(default_factory=TokenDataset)
    sources: list = field(default_factory=list)

    @property
    def corpora(self) -> list[str]:
        """Corpus names among the added sequences (sorted)."""
        return sorted(set(self.added.corpus))


TRAIN_FILES = ("train.jsonl", "train.jsonl.xz", "train.jsonl.gz")  # a cache's training file, first found
_OPENERS = {".gz": gzip.open, ".xz": lzma.open}  # xz keeps git's copy 38% smaller than gzip -9


def _train_file(d: Path) -> Path:
    if not d.is_dir():
        raise DataError(f"--extra-data {d}: not a directory (give a data cache directory: WORK/data or "
                        "WORK/data-rank*of*)")
    for name in TRAIN_FILES:
        if (d / name).is_file():
            return d / name
    raise DataError(f"--extra-data {d}: no {', '.join(TRAIN_FILES)} (give a data cache directory: "
                    "WORK/data or WORK/data-rank*of*)")


def extra_data_key(dirs: Sequence[str | Path]) -> list:
    """The sha256 of each directory's training file, in order: what the data cache key of a run
    with --extra-data covers (not the paths: a moved or renamed copy keeps the key).

    Raises:
        DataError: a directory without a readable training file.
    """
    out = []
    for d in map(Path, dirs):
        h = hashlib.sha256()
        try:
            with open(_train_file(d), "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
        except OSError as e:
            raise DataError(f"--extra-data {d}: unreadable ({e})") from None
        out.append(h.hexdigest())
    return out


def _int_list(v, vocab: Optional[int]) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t
                                       and (vocab is None or t < vocab) for t in v)


def training_file_rows(path: Path, vocab: Optional[int] = None) -> Iterator[dict]:
    """The rows of a training file (train.jsonl, or it as .xz or .gz: the suffix decides), each checked (corpus and id strings, prompt_ids and
    response_ids lists of token ids, below `vocab` when given); blank lines skipped.

    Raises:
        DataError: a line that is not JSON or lacks a field, a token id out of range, or a cut
            or corrupt gzip or xz file.
    """
    opener = _OPENERS.get(path.suffix, open)
    n = 0
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{n}: invalid JSON ({e})") from None
                if not (isinstance(row, dict) and isinstance(row.get("corpus"), str) and isinstance(row.get("id"), str)
                        and _int_list(row.get("prompt_ids"), vocab) and _int_list(row.get("response_ids"), vocab)):
                    raise DataError(f"{path}:{n}: not a training sequence (needs corpus and id strings, "
                                    "prompt_ids and response_ids lists of token ids"
                                    + (f" below {vocab}, the target's vocabulary)" if vocab else ")"))
                yield row
    except (EOFError, OSError, UnicodeDecodeError, zlib.error, lzma.LZMAError) as e:
        raise DataError(f"{path}: unreadable after line {n} ({type(e).__name__}: {e}); copy it again") from None


def cache_rows(directory: str | Path, vocab: Optional[int] = None) -> Iterator[dict]:
    """The training sequences of one data cache directory (WORK/data, WORK/data-rank*of*, or a
    copy of one with train.jsonl compressed, as in training-data/), read and checked row by row: dicts with `corpus`
    and `id` (str) and `prompt_ids` and `response_ids` (lists of int token ids, below `vocab`
    when given), in file order. Nothing is held in memory beyond one row.

    Raises:
        DataError: not a directory, no train.jsonl[.xz|.gz] in it, or a bad row or cut file (the
            message names the file and line; its `--extra-data` prefix is the training flag's).
    """
    return training_file_rows(_train_file(Path(directory)), vocab)


def check_extra_data(dirs: Sequence[str | Path], target_fingerprint: str, *, read_rows: bool = False) -> list[dict]:
    """Checks that every directory is a complete data cache written for this target; returns
    their meta.json contents, in order (`settings` a dict, `train_sequences` an int or None).

    Args:
        read_rows: also read every training file through (`training_file_rows`) and compare its sequence
            count with meta.json's (what the --processes launcher does before starting ranks).

    Raises:
        DataError: a directory that is missing, without meta.json or training file, written by
            another target (its fingerprint differs), or (read_rows) with a bad or cut file.
    """
    out = []
    for d in map(Path, dirs):
        train = _train_file(d)
        meta_path = d / "meta.json"
        if not meta_path.is_file():
            raise DataError(f"--extra-data {d}: no meta.json (not a complete data cache)")
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
            raise DataError(f"{meta_path}: unreadable or invalid JSON ({e})") from None
        settings = meta.get("settings") if isinstance(meta, dict) else None
        if not isinstance(settings, dict) or not isinstance(settings.get("max_new_tokens", 0), int) \
                or not isinstance(meta.get("train_sequences", 0), int):
            raise DataError(f"{meta_path}: not the meta.json of a data cache (needs a settings object, integer "
                            "max_new_tokens and train_sequences)")
        if settings.get("target") != target_fingerprint:
            raise DataError(f"--extra-data {d}: written by another target (fingerprint {settings.get('target')}, "
                            f"this target {target_fingerprint}); a draft must learn its own target's answers")
        if read_rows:
            _check_count(d, train, sum(1 for _ in training_file_rows(train)), meta)
        out.append(meta)
    return out


def _check_count(d: Path, train: Path, n: int, meta: dict) -> None:
    want = meta.get("train_sequences")
    if want is not None and n != want:
        raise DataError(f"--extra-data {d}: {train.name} holds {n} sequences, meta.json says {want} "
                        "(a cut or emptied copy?)")


def load_extra_data(
    dirs: Sequence[str | Path],
    *,
    target_fingerprint: str,
    max_new_tokens: int,
    answered: Iterable[Sequence[int]],
    eos_ids: Iterable[int],
    heldout_prompt_ids: Iterable[Sequence[int]],
    heldout_ids: Iterable[str],
    vocab_size: Optional[int] = None,
) -> ExtraData:
    """Reads earlier runs' data caches for this run.

    Args:
        dirs: data cache directories (each with meta.json and train.jsonl, .jsonl.xz or .jsonl.gz).
        target_fingerprint: this run's target (`target.target_fingerprint`); each meta.json's must
            equal it.
        max_new_tokens: this run's answer cap; longer answers are truncated to it.
        answered: templated ids of the prompts this run answers greedily in its first pass, on
            any rank (empty when that pass samples). A greedy answer to one of them is reused
            (`ExtraData.greedy`) when it holds this run's whole answer: it ended with EOS, or it
            has at least `max_new_tokens` tokens (greedy decoding's first tokens do not depend on
            where it stops). A shorter one (cut by a time limit or a smaller cap) is dropped:
            this run writes the prompt's answer again. Greedy answers to other prompts are added
            like every other sequence.
        eos_ids: the target's EOS token ids.
        heldout_prompt_ids: this run's held-out prompts, templated token ids.
        heldout_ids: this run's held-out prompt ids ("corpus/row").
        vocab_size: the target's vocabulary; a token id at or above it is an error.

    Returns:
        An `ExtraData`. Sequences shorter than 2 response tokens after truncation are dropped.

    Raises:
        DataError: as `check_extra_data` with read_rows (a file holding other than meta.json's
            count of sequences included), or a line that is not a training sequence.
    """
    if not dirs:  # the usual run: nothing to read, no sets to build
        return ExtraData()
    held_ids = {tuple(p) for p in heldout_prompt_ids}
    held_names = set(heldout_ids)
    mine = {tuple(p) for p in answered}
    eos = set(eos_ids)
    out, seen = ExtraData(), set()
    metas = check_extra_data(dirs, target_fingerprint)
    for k, (d, meta) in enumerate(zip(map(Path, dirs), metas)):
        was_greedy = not meta["settings"].get("temperature")
        src = dict(dir=str(d), read=0, heldout_dropped=0, repeats_dropped=0, superseded=0, reused_offered=0,
                   added=0)
        for row in training_file_rows(_train_file(d), vocab_size):
            src["read"] += 1
            pid, corpus = row["id"], row["corpus"]
            prompt, full = tuple(row["prompt_ids"]), row["response_ids"]
            response = full[:max_new_tokens]
            if prompt in held_ids or (corpus != SYNTHETIC_CORPUS and pid.split(SAMPLE_MARK)[0] in held_names):
                src["heldout_dropped"] += 1
                continue
            if len(response) < 2 or (prompt, tuple(response)) in seen:
                src["repeats_dropped"] += 1
                continue
            seen.add((prompt, tuple(response)))
            is_greedy = was_greedy and corpus != SYNTHETIC_CORPUS and SAMPLE_MARK not in pid
            if is_greedy and prompt in mine:
                if prompt in out.greedy:  # another copy's complete answer came first
                    src["repeats_dropped"] += 1
                elif full[-1] in eos or len(full) >= max_new_tokens:
                    out.greedy[prompt] = response
                    src["reused_offered"] += 1
                else:
                    src["superseded"] += 1  # incomplete: this run answers the prompt itself
                continue
            out.added.prompt_ids.append(list(prompt))
            out.added.response_ids.append(response)
            out.added.corpus.append(corpus)
            out.added.ids.append(f"extra{k}:{pid}")
            src["added"] += 1
        _check_count(d, _train_file(d), src["read"], meta)
        out.sources.append(src)
    return out


def shard_of(ds: TokenDataset, rank: int, world_size: int) -> TokenDataset:
    """Every `world_size`-th sequence from `rank` on (a data-parallel rank's share)."""
    return TokenDataset(ds.prompt_ids[rank::world_size], ds.response_ids[rank::world_size],
                        ds.corpus[rank::world_size], ds.ids[rank::world_size])
