"""Cut several files into equal pieces of one byte stream, for the `device` tool's 64 MiB runs.

    python3 bench/h200/pieces.py split DEST PIECE_MIB FILE...   (here)
    python3 join.py                                             (there, after any batch of runs)

`split` writes DEST/NN/blob.NNNN (one folder per run, every piece PIECE_MIB except the last),
and DEST/join/{join.py,manifest.json}. Files follow each other in the stream with no gaps, so
no run carries a half-empty piece. `join.py` (a copy of this file) rebuilds every file whose
pieces have all arrived in /root/stage, checks its sha256, writes /root/stage/files/NAME and
marks it NAME.ok; pieces are deleted once no incomplete file needs them. Run it as often as
you like: finished files are skipped.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

STAGE = Path("/root/stage")


def split(dest: Path, piece_mib: int, files: list[str]) -> None:
    piece = piece_mib * 2**20
    shutil.rmtree(dest, ignore_errors=True)
    (dest / "join").mkdir(parents=True)
    manifest, offset = {"piece": piece, "files": []}, 0
    for f in map(Path, files):
        h = hashlib.sha256()
        with f.open("rb") as r:
            for chunk in iter(lambda: r.read(2**24), b""):
                h.update(chunk)
        size = f.stat().st_size
        manifest["files"].append({"name": f.name, "offset": offset, "size": size, "sha256": h.hexdigest()})
        offset += size
    total, k = offset, 0
    for entry, f in zip(manifest["files"], map(Path, files)):
        with f.open("rb") as r:
            pos = entry["offset"]
            while pos < entry["offset"] + entry["size"]:
                k = pos // piece
                room = (k + 1) * piece - pos
                data = r.read(min(room, entry["offset"] + entry["size"] - pos))
                run = dest / f"{k + 1:02d}"
                run.mkdir(exist_ok=True)
                with (run / f"blob.{k:04d}").open("ab") as w:
                    w.write(data)
                pos += len(data)
    (dest / "join" / "manifest.json").write_text(json.dumps(manifest, indent=1))
    shutil.copy(__file__, dest / "join" / "join.py")
    for e in manifest["files"]:
        last = (e["offset"] + e["size"] - 1) // piece + 1
        print(f"{e['name']}: {e['size'] / 2**20:.1f} MiB, complete after run {last:02d}")
    print(f"{(total - 1) // piece + 1} runs of {piece_mib} MiB")


def join() -> int:
    manifest = json.loads((Path(__file__).parent / "manifest.json").read_text())
    piece = manifest["piece"]
    out_dir = STAGE / "files"
    out_dir.mkdir(parents=True, exist_ok=True)
    pending = 0
    needed: set[int] = set()
    for e in manifest["files"]:
        ks = range(e["offset"] // piece, (e["offset"] + e["size"] - 1) // piece + 1)
        target = out_dir / e["name"]
        if (out_dir / (e["name"] + ".ok")).exists():
            continue
        if not all((STAGE / f"blob.{k:04d}").exists() for k in ks):
            pending += 1
            needed.update(ks)
            print(f"join: {e['name']} waits for pieces {ks.start}-{ks.stop - 1}")
            continue
        h = hashlib.sha256()
        with target.open("wb") as w:
            for k in ks:
                lo = max(e["offset"], k * piece) - k * piece
                hi = min(e["offset"] + e["size"], (k + 1) * piece) - k * piece
                with (STAGE / f"blob.{k:04d}").open("rb") as r:
                    r.seek(lo)
                    data = r.read(hi - lo)
                h.update(data)
                w.write(data)
        if h.hexdigest() != e["sha256"]:
            target.unlink()
            print(f"join: {e['name']} DAMAGED (sha256 mismatch)")
            return 1
        (out_dir / (e["name"] + ".ok")).touch()
        print(f"join: {e['name']} ok")
    for p in STAGE.glob("blob.*"):
        if int(p.suffix[1:]) not in needed:
            p.unlink()
    return 0 if pending == 0 else 3


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "split":
        split(Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
    else:
        sys.exit(join())
