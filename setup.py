"""The one compiled piece, on Linux only: flashfleet/_cblas_forward.c (see its header and
flashfleet/blas.py). Optional: without a C compiler the install goes on and workers fall back to
Debian's OpenBLAS or MLX's reference BLAS. Everything else is configured in pyproject.toml."""
import sys

from setuptools import Extension, setup

ext_modules = []
if sys.platform.startswith("linux"):
    ext_modules.append(Extension("flashfleet._cblas_forward", ["flashfleet/_cblas_forward.c"], optional=True))

setup(ext_modules=ext_modules)
