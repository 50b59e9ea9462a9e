"""Shared fixtures. Keep additive: one fixture per shared resource."""
from __future__ import annotations

import pytest

from tiny_models import TinyModels, build_all


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    """Tiny random-weight llama / qwen2 model directories and tokenizers, built once per run."""
    return build_all(tmp_path_factory.mktemp("tiny_models"))
