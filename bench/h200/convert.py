"""GGUF -> MLX model directory on the GPU machine, for a catalog model (bfloat16 weights).

    python3 bench/h200/convert.py NAME GGUF OUT_DIR

Loads flashfleet.models' converter without the package's __init__ (which imports the gRPC
client and its stubs; that machine's protobuf may be older than the stubs need).
"""
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for pkg in ("flashfleet", "flashfleet.models"):
    m = types.ModuleType(pkg)
    m.__path__ = [str(ROOT / pkg.replace(".", "/"))]
    sys.modules[pkg] = m

from flashfleet.models.catalog import get_spec  # noqa: E402
from flashfleet.models.gguf_convert import convert_gguf  # noqa: E402


def main(name: str, gguf: str, out: str) -> int:
    if (Path(out) / "config.json").is_file():
        print(f"convert: {out} exists")
        return 0
    spec = get_spec(name)
    t0 = time.perf_counter()
    convert_gguf(gguf, out, dtype="bfloat16", chat_template=spec.chat_template,
                 extra_eos_tokens=spec.extra_eos_tokens, progress=False)
    print(f"convert: {name} -> {out} in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
