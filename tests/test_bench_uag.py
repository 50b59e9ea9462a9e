"""bench/bench_uag.py's cache of plain greedy outputs (--refs) keeps outputs of another dtype or
another BLAS apart: the reference the oracle replays is the one the target computes now."""
import sys

import mlx.core as mx

from bench_scripts import ROOT

sys.path.insert(0, str(ROOT / "bench"))

from bench_uag import reference_key  # noqa: E402


def test_reference_key_tells_dtypes_and_blas_apart():
    prompt, env = [1, 2, 3], {"LD_PRELOAD": "/x/libscipy_openblas.so:/y/_cblas_forward.so"}
    key = reference_key("/models/Qwen2.5-Coder-0.5B-Instruct", prompt, 32, mx.float32, env)
    assert key == reference_key("Qwen2.5-Coder-0.5B-Instruct", prompt, 32, mx.float32, env)
    assert key != reference_key("Qwen2.5-Coder-0.5B-Instruct", prompt, 32, mx.bfloat16, env)
    assert key != reference_key("Qwen2.5-Coder-0.5B-Instruct", prompt, 32, mx.float32, {})
    assert key != reference_key("Qwen2.5-Coder-0.5B-Instruct", prompt, 16, mx.float32, env)
