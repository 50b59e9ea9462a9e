"""Regenerates the gRPC stubs in flashfleet/v1/ (flashfleet's API) and flashfleet/etcd/ (etcd's v3
API, for the coordinator's etcd client) from protos/ (run after editing a .proto).

    python scripts/gen_protos.py            # write stubs into the source tree
    python scripts/gen_protos.py --out DIR  # write them elsewhere (the staleness test does this)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
STUB_DIRS = ("flashfleet/v1", "flashfleet/etcd")  # where stubs land, under the output root


def generate(out_dir: Path) -> list[Path]:
    """Runs grpcio-tools' protoc on every .proto under protos/.

    Args:
        out_dir: root of the output tree; stubs land in out_dir/<one of STUB_DIRS>/.

    Returns:
        The generated files.

    Raises:
        RuntimeError: when protoc fails.
    """
    from grpc_tools import protoc
    import grpc_tools

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted(p for d in STUB_DIRS for p in (out_dir / d).glob("*_pb2*.py*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT)
    for path in generate(parser.parse_args().out):
        print(path)


if __name__ == "__main__":
    sys.exit(main())
