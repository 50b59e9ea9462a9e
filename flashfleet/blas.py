"""Debian's OpenBLAS under MLX's CPU wheel, for worker processes on Linux.

MLX's `mlx[cpu]` wheel links a reference BLAS; preloading Debian's OpenBLAS
(`apt-get install libopenblas0-pthread`) makes a CPU worker's float32 matmuls much faster
(../shared/models/README.md: SmolLM2 in float32 decodes at 10.2 against 6.7 tokens/s on two
cores). A library must be preloaded when the process starts, so `flashfleet up`
sets it in its workers' environment and a worker started by hand re-executes itself with it
(`worker/__main__.py`). One BLAS thread per worker: small matrix-vector products get slower with
more.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Mapping, Optional

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
OFF_SWITCH = "FLASHFLEET_OPENBLAS"  # "0": leave the process's BLAS alone


def openblas_env(env: Mapping[str, str] | None = None, library: str = OPENBLAS) -> Optional[dict[str, str]]:
    """`env` (default os.environ) with OpenBLAS preloaded, or None where that does not apply: not
    Linux, the library not installed, `LD_PRELOAD` already set (the user chose), or
    `FLASHFLEET_OPENBLAS=0`."""
    env = dict(os.environ if env is None else env)
    if not sys.platform.startswith("linux") or env.get(OFF_SWITCH) == "0" or "LD_PRELOAD" in env \
            or not Path(library).exists():
        return None
    env["LD_PRELOAD"] = library
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env
