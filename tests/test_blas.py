"""flashfleet.blas: which OpenBLAS a worker preloads, and that MLX's matmuls then run in it."""
from __future__ import annotations

import subprocess
import sys

import pytest

import flashfleet.blas as blas

CHILD = """
import mlx.core as mx, numpy as np
a = mx.random.normal((96, 80)); b = mx.random.normal((80, 64))
got, want = np.array(a @ b), np.array(a) @ np.array(b)
assert np.allclose(got, want, rtol=1e-4, atol=1e-4), abs(got - want).max()
print("ok")
"""


def test_mlx_matmul_binds_to_the_pip_openblas_through_the_forwarder(tmp_path):
    """In a process started with `openblas_env()`'s pip preload, MLX's cblas_sgemm resolves to
    flashfleet's forwarder and the forwarder's scipy_cblas_sgemm to scipy-openblas32's library
    (the dynamic loader's own account, LD_DEBUG=bindings), and the product is right."""
    preload = blas.pip_openblas()
    if preload is None:
        pytest.skip("no pip OpenBLAS here: not Linux, scipy-openblas32 absent, or the forwarder "
                    "was not built (no C compiler at install time)")
    lib, forwarder = preload.split(":")
    env = blas.openblas_env({"PATH": "/usr/bin:/bin"}, preload)
    env.update(LD_DEBUG="bindings", LD_DEBUG_OUTPUT=str(tmp_path / "ld"))
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    lines = [line for f in tmp_path.glob("ld.*") for line in f.read_text(errors="replace").splitlines()]
    mlx_to_forwarder = [line for line in lines if "libmlx" in line and f"to {forwarder}" in line
                        and "`cblas_sgemm'" in line]
    forwarder_to_lib = [line for line in lines if f"file {forwarder}" in line and f"to {lib}" in line
                        and "`scipy_cblas_sgemm'" in line]
    assert mlx_to_forwarder and forwarder_to_lib, "\n".join(line for line in lines if "gemm" in line)


def test_find_openblas_prefers_pip_then_debian(tmp_path, monkeypatch):
    debian = tmp_path / "libopenblas.so.0"
    monkeypatch.setattr(blas.sys, "platform", "linux")
    monkeypatch.setattr(blas, "DEBIAN_OPENBLAS", str(debian))
    monkeypatch.setattr(blas, "pip_openblas", lambda: "/pip/lib.so:/pip/forward.so")
    assert blas.find_openblas() == "/pip/lib.so:/pip/forward.so"
    monkeypatch.setattr(blas, "pip_openblas", lambda: None)
    assert blas.find_openblas() is None  # neither
    debian.write_bytes(b"")
    assert blas.find_openblas() == str(debian)
    monkeypatch.setattr(blas.sys, "platform", "darwin")
    assert blas.find_openblas() is None


def test_pip_openblas_needs_the_wheel_and_the_forwarder(tmp_path, monkeypatch):
    """None without the compiled forwarder beside flashfleet/blas.py; "LIB:FORWARDER" with it."""
    pytest.importorskip("scipy_openblas32", reason="scipy-openblas32 is a Linux dependency")
    import scipy_openblas32

    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "libscipy_openblas.so").write_bytes(b"")
    monkeypatch.setattr(scipy_openblas32, "get_lib_dir", lambda: str(lib))
    package = tmp_path / "flashfleet"
    package.mkdir()
    monkeypatch.setattr(blas, "__file__", str(package / "blas.py"))
    assert blas.pip_openblas() is None  # no forwarder built
    forwarder = package / "_cblas_forward.cpython-311-x86_64-linux-gnu.so"
    forwarder.write_bytes(b"")
    assert blas.pip_openblas() == f"{lib / 'libscipy_openblas.so'}:{forwarder}"


def test_openblas_env_preloads_every_library_or_none(tmp_path, monkeypatch):
    a, b = tmp_path / "a.so", tmp_path / "b.so"
    a.write_bytes(b"")
    monkeypatch.setattr(blas.sys, "platform", "linux")
    assert blas.openblas_env({}, f"{a}:{b}") is None  # b absent
    b.write_bytes(b"")
    assert blas.openblas_env({}, f"{a}:{b}")["LD_PRELOAD"] == f"{a}:{b}"
    assert blas.openblas_hint({}, f"{a}:{b}") is None
    assert "apt-get install libopenblas0-pthread" in blas.openblas_hint({}, str(tmp_path / "absent.so"))
