"""Large buffers go back to the OS when freed (glibc), so a long-running process's memory follows
its load instead of its highest burst.

glibc's malloc serves a request of at least M_MMAP_THRESHOLD bytes with its own mmap and unmaps
it on free, but it raises that threshold to the size of every such block freed (up to 32 MiB):
after the first free of a 2 MiB buffer, 2 MiB buffers come from the heap, whose top is not given
back while anything above it lives. Session migration streams KV state in 2 MiB messages
(worker/kv_wire.py) from one worker to another, and the coordinator takes HTTP bodies of up to
8 MiB, so without a fixed threshold their resident memory keeps the high-water mark of the
busiest moment (a soak shows it as growth).
Setting the threshold (mallopt) fixes it and turns the dynamic adjustment off; elsewhere (macOS's
allocator returns large blocks itself) nothing is done.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc <malloc.h>
MMAP_THRESHOLD_BYTES = 256 * 1024  # blocks of this size and more are mmapped and unmapped on free


def return_large_buffers(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Pins glibc's mmap threshold at `threshold` bytes for this process (module docstring).

    Returns:
        True when glibc took the setting; False on other platforms or C libraries.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, threshold) == 1
    if not ok:
        log.debug("mallopt(M_MMAP_THRESHOLD, %d) refused", threshold)
    return ok
