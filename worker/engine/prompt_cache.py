"""Finished turns' KV caches kept on the worker, so a follow-up prompt prefills only its new tokens.

A thin layer over mlx-lm's `LRUPromptCache` (mlx_lm/models/cache.py, the server's prompt cache:
a trie of token sequences, nearest-prefix lookup, least recently used out first, a byte cap).
Entries are one-row `RowKVCache` lists covering a sequence's positions [0, n-1) (every token but
the last), keyed by decoding mode: a DFlash entry holds the target's layers then the draft's,
both at the same length, so trimming an entry to a shorter prefix keeps them consistent.
"""
from __future__ import annotations

from typing import Optional, Sequence

from mlx_lm.models.cache import LRUPromptCache

from worker.caches.rows import RowKVCache


class PromptCache:
    """Least-recently-used prompt caches within a byte cap.

    Args:
        max_entries: most sequences kept (0 disables the cache).
        max_bytes: most bytes kept.
    """

    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries = max_entries
        self._lru = LRUPromptCache(max_size=max(1, max_entries), max_bytes=max_bytes)

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes

    def __len__(self) -> int:
        return len(self._lru)

    def fetch(self, mode: str, tokens: Sequence[int]) -> tuple[Optional[list[RowKVCache]], int]:
        """The cached caches of the longest prefix of `tokens` (a copy), and its length.

        Returns:
            (caches, k): caches holding positions [0, k) of `tokens`, or (None, 0).
        """
        if not self.max_entries or not tokens:
            return None, 0
        caches, rest = self._lru.fetch_nearest_cache(mode, list(tokens))
        if caches is None:
            return None, 0
        return caches, len(tokens) - len(rest)

    def insert(self, mode: str, tokens: Sequence[int], caches: list[RowKVCache]) -> None:
        """Keeps `caches` (positions [0, len(tokens)) of `tokens`) under `mode`."""
        if self.max_entries and tokens:
            self._lru.insert_cache(mode, list(tokens), caches)

    def trim_to(self, n_bytes: int) -> None:
        """Evicts least recently used entries until at most n_bytes are kept."""
        self._lru.trim_to(n_bytes=max(0, n_bytes))
