"""Shared fixtures. Keep additive: one fixture per shared resource."""
from __future__ import annotations

import os

# Before MLX loads: its CUDA build (and M5-class Metal) runs float32 matmuls and attention in TF32
# by default, so a 16-token verify rounds differently from a 1-token step and the float32
# token-for-token tests would test the GPU's rounding, not the engine (seen on an H200: 4 of 170
# engine tests). MLX_ENABLE_TF32=0 keeps them in full float32; no effect on the CPU.
os.environ.setdefault("MLX_ENABLE_TF32", "0")
# A worker casts its target to its device's compute dtype at load (worker/loading.py: bfloat16 on a
# GPU). The tiny test models are float32 and the token-for-token tests compare float32 runs, so
# they stay float32 on a GPU as on the CPU; tests of the automatic choice unset this.
os.environ.setdefault("FLASHFLEET_COMPUTE_DTYPE", "float32")

import pytest  # noqa: E402

from tiny_models import TinyModels, build_all  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    """Tiny random-weight llama / qwen2 model directories and tokenizers, built once per run."""
    return build_all(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture(scope="session")
def dflash_dir(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory):
    """A random one-layer DFlash draft (block size 4) for the tiny llama, saved as a checkpoint
    directory (acceptance near 0: it tests the machinery, not a speedup)."""
    from mlx_lm import load

    from worker.models.dflash_checkpoint import init_dflash_draft, save_dflash_draft

    target, _ = load(str(tiny_models.llama))
    out = tmp_path_factory.mktemp("dflash") / "tiny-dflash"
    save_dflash_draft(init_dflash_draft(target, num_layers=1, block_size=4), out)
    return out


@pytest.fixture
def etcd(tmp_path):
    """A real etcd on a free loopback port in a temporary directory (tests/etcd_server.py);
    the test skips when the etcd binary is not installed."""
    from etcd_server import ETCD, SKIP_REASON, EtcdServer

    if ETCD is None:
        pytest.skip(SKIP_REASON)
    server = EtcdServer(tmp_path)
    yield server
    server.stop()
