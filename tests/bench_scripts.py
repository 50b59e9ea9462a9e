"""Runs a bench/ script the way a user does (a subprocess from the repository root), for the
tests of the benchmark scripts."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_bench(script: str, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python bench/<script> args...`; returns the finished process (stdout/stderr as text)."""
    return subprocess.run([sys.executable, str(ROOT / "bench" / script), *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, timeout=timeout)
