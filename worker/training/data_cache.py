"""The on-disk data cache of a run: its key, and the training sequences and held-out prompts.

`answers.build_dataset` writes `meta.json` (key, settings, generation statistics), `train.jsonl`
(`TokenDataset.save`) and `heldout.jsonl` under the cache directory, the meta last (it marks the
cache complete); a rerun whose key matches loads them instead of generating again.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from worker.training.data import check_prompt_file
from worker.training.sequences import TokenDataset

DATA_FORMAT = 3  # bump when the cached layout or the generation recipe changes
CACHE_FILES = ("meta.json", "train.jsonl", "heldout.jsonl")


@dataclass
class DataSplit:
    """What `answers.build_dataset` returns.

    Attributes:
        train: the target-written training sequences.
        heldout: held-out prompts (never trained on): corpus, id and templated prompt ids.
        meta: the cache key and generation statistics (written to the training card).
    """

    train: TokenDataset
    heldout: list[dict]
    meta: dict


def dataset_key(
    prompt_files: Sequence[str | Path],
    *,
    max_per_file: Optional[int],
    max_prompt_tokens: int,
    max_new_tokens: int,
    heldout_per_corpus: int,
    heldout_fraction: float,
    temperature: float,
    top_p: float,
    seed: int,
    samples: int,
    sample_temperature: float,
    target_fingerprint: str,
    synthetic: int = 0,
    synthetic_max_tokens: int = 128,
    synthetic_temperature: float = 1.0,
    synthetic_top_p: float = 0.95,
    synthetic_openings: Optional[tuple[int, Sequence[str]]] = None,
    extra: Optional[list] = None,
) -> tuple[str, dict]:
    """The data cache key of `answers.build_dataset`: what decides the training sequences.

    It covers the prompt files' names and contents (sha256), every argument here and the data
    format version; not the generation batch size or time limit (greedy answers do not depend on
    them; sampled ones change with the batch size).

    Returns:
        (16-hex-digit key, the settings it was computed from).

    Raises:
        FileNotFoundError: a prompt file is missing or is a directory.
    """
    files = [Path(p) for p in prompt_files]
    for f in files:
        check_prompt_file(f)
    settings = dict(format=DATA_FORMAT, max_per_file=max_per_file, max_prompt_tokens=max_prompt_tokens,
                    max_new_tokens=max_new_tokens, heldout_per_corpus=heldout_per_corpus,
                    heldout_fraction=heldout_fraction, temperature=temperature, top_p=top_p, seed=seed,
                    samples=samples, sample_temperature=sample_temperature if samples > 1 else None,
                    target=target_fingerprint,
                    files=[[f.name, hashlib.sha256(f.read_bytes()).hexdigest()] for f in files])
    if synthetic:  # absent otherwise, so caches made before the option still match
        settings["synthetic"] = [synthetic, synthetic_max_tokens, synthetic_temperature, synthetic_top_p]
        if synthetic_openings and synthetic_openings[0]:  # absent without openings, as above
            settings["synthetic_openings"] = [int(synthetic_openings[0]), sorted(synthetic_openings[1])]
    if extra:  # `extra_data.extra_data_key` of --extra-data (absent without it, as above)
        settings["extra_data"] = extra
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16], settings


def load_cache(cache_dir: Path, key: str, shard: tuple[int, int], log: Callable[[str], None]) -> Optional[DataSplit]:
    """The cached `DataSplit` in `cache_dir` when it is complete and was written with `key` for
    `shard` (rank, world size), else None (nothing cached, or other settings)."""
    meta_path, train_path, held_path = (cache_dir / n for n in CACHE_FILES)
    if not (meta_path.is_file() and train_path.is_file() and held_path.is_file()):
        return None
    meta = json.loads(meta_path.read_text())
    if meta.get("key") != key or meta.get("shard", [0, 1]) != list(shard):
        return None
    log(f"data: reusing {cache_dir} (key {key})")
    if meta.get("generation_stopped_by_time_limit"):
        log(f"data: note: that data was cut by a generation time limit at {meta['train_sequences']} "
            "sequences; --regenerate-data (or deleting the directory) generates it again")
    heldout = [json.loads(line) for line in held_path.read_text(encoding="utf-8").splitlines()]
    return DataSplit(TokenDataset.load(train_path), heldout, meta)


def save_cache(cache_dir: Path, split: DataSplit) -> None:
    """Writes `split` to `cache_dir` (created), meta.json last: it marks the cache complete."""
    meta_path, train_path, held_path = (cache_dir / n for n in CACHE_FILES)
    cache_dir.mkdir(parents=True, exist_ok=True)
    split.train.save(train_path)
    held_path.write_text("".join(json.dumps(h) + "\n" for h in split.heldout), encoding="utf-8")
    meta_path.write_text(json.dumps(split.meta, indent=1) + "\n")
