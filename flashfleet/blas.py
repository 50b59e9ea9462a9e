"""OpenBLAS under MLX's CPU wheel, for worker processes on Linux.

MLX's `mlx[cpu]` wheel links a reference BLAS; preloading OpenBLAS makes a CPU worker's float32
matmuls many times faster. Two sources, the first found wins:

1. pip: the `scipy-openblas32` wheel (a dependency on Linux) with `flashfleet/_cblas_forward.c`,
   which the install compiles (setup.py). The wheel exports its functions with a `scipy_` prefix
   only, so it is preloaded together with that forwarder, which gives MLX the usual
   `cblas_sgemm` / `cblas_dgemm` / `cblas_cgemm` names.
2. Debian's `libopenblas0-pthread` (`apt-get install libopenblas0-pthread`).

A library must be preloaded when the process starts, so `flashfleet up` sets it in its workers'
environment and a worker started by hand re-executes itself with it (`worker/__main__.py`). One
BLAS thread per worker: small matrix-vector products get slower with more.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Mapping, Optional

DEBIAN_OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
OFF_SWITCH = "FLASHFLEET_OPENBLAS"  # "0": leave the process's BLAS alone


def pip_openblas() -> Optional[str]:
    """The `LD_PRELOAD` value for the pip OpenBLAS: scipy-openblas32's library, then the compiled
    `flashfleet._cblas_forward` ("LIB:FORWARDER", absolute paths), or None when either is absent
    (the wheel not installed, or flashfleet installed without a C compiler)."""
    try:
        import scipy_openblas32
    except ImportError:
        return None
    forwarder = next(Path(__file__).parent.glob("_cblas_forward*.so"), None)
    try:
        lib = Path(scipy_openblas32.get_lib_dir()) / scipy_openblas32.get_library(fullname=True)
    except (OSError, IndexError):  # a broken install: no library in its lib directory
        return None
    if forwarder is None or not lib.exists():
        return None
    return f"{lib}:{forwarder}"


def find_openblas() -> Optional[str]:
    """What to preload on Linux: `pip_openblas()`, else Debian's OpenBLAS where installed, else
    None (also on any other platform)."""
    if not sys.platform.startswith("linux"):
        return None
    return pip_openblas() or (DEBIAN_OPENBLAS if Path(DEBIAN_OPENBLAS).exists() else None)


def _all_exist(library: Optional[str]) -> bool:
    return bool(library) and all(Path(p).exists() for p in library.split(":"))


def openblas_env(env: Mapping[str, str] | None = None, library: str | None = None) -> Optional[dict[str, str]]:
    """`env` (default os.environ) with OpenBLAS preloaded, or None where that does not apply: not
    Linux, no OpenBLAS found, `LD_PRELOAD` already set (the user chose), or `FLASHFLEET_OPENBLAS=0`.

    Args:
        env: the environment to extend (not modified).
        library: what to preload, one path or several joined by ":" (every one must exist);
            None finds it (`find_openblas`).
    """
    env = dict(os.environ if env is None else env)
    if not sys.platform.startswith("linux") or env.get(OFF_SWITCH) == "0" or "LD_PRELOAD" in env:
        return None
    library = find_openblas() if library is None else library
    if not _all_exist(library):
        return None
    env["LD_PRELOAD"] = library
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env


def openblas_hint(env: Mapping[str, str] | None = None, library: str | None = None) -> Optional[str]:
    """A one-line hint when a Linux CPU worker would run without OpenBLAS (none found, nothing else
    preloaded, `FLASHFLEET_OPENBLAS` not "0"), else None. Without it MLX's CPU wheel uses its
    reference BLAS: a prompt's prefill runs at about the speed of decoding.

    Args:
        env: the environment to judge (default os.environ).
        library: as `openblas_env`'s; None finds it.
    """
    env = os.environ if env is None else env
    if not sys.platform.startswith("linux") or env.get(OFF_SWITCH) == "0" or "LD_PRELOAD" in env:
        return None
    if _all_exist(find_openblas() if library is None else library):
        return None
    return ("OpenBLAS not found: CPU workers use MLX's reference BLAS and run several times slower; "
            "reinstall flashfleet where a C compiler is present (pip builds its OpenBLAS forwarder), "
            f"or `apt-get install libopenblas0-pthread` ({OFF_SWITCH}=0 silences this)")


def restart_with_openblas() -> None:
    """Replaces this process by the same command with OpenBLAS preloaded where `openblas_env`
    says it applies, as a worker does (for benchmarks: mlx-lm then computes with the BLAS the
    worker uses, and child processes inherit it). A restarted process has LD_PRELOAD set, so it
    never restarts again."""
    env = openblas_env()
    if env is not None:
        os.execve(sys.executable, list(sys.orig_argv), env)
