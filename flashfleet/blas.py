"""Debian's OpenBLAS under MLX's CPU wheel, for worker processes on Linux.

MLX's `mlx[cpu]` wheel links a reference BLAS; preloading Debian's OpenBLAS
(`apt-get install libopenblas0-pthread`) makes a CPU worker's float32 matmuls much faster
(SmolLM2 in float32 decodes at 10.2 against 6.7 tokens/s on two cores). A library must be preloaded when the process starts, so `flashfleet up`
sets it in its workers' environment and a worker started by hand re-executes itself with it
(`worker/__main__.py`). One BLAS thread per worker: small matrix-vector products get slower with
more.
"""
from __future__ import annotations

import os
import platform
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


def openblas_hint(env: Mapping[str, str] | None = None, library: str = OPENBLAS) -> Optional[str]:
    """A one-line hint when a Linux x86_64 CPU worker would run without OpenBLAS (the library is
    not installed, nothing else preloaded, `FLASHFLEET_OPENBLAS` not "0"), else None. Without it
    MLX's CPU wheel uses its reference BLAS: a prompt's prefill runs at about the speed of
    decoding (`flashfleet demo` on a 2-core CPU without it: 20-31 s to the first token, about 85 ms a
    prompt token)."""
    env = os.environ if env is None else env
    if not sys.platform.startswith("linux") or platform.machine() != "x86_64" or env.get(OFF_SWITCH) == "0" \
            or "LD_PRELOAD" in env or Path(library).exists():
        return None
    return (f"OpenBLAS not found ({library}): CPU workers use MLX's reference BLAS and run several "
            "times slower; install it with `apt-get install libopenblas0-pthread` "
            f"({OFF_SWITCH}=0 silences this)")
