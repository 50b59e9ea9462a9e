"""How many bytes a worker's KV caches may use, by default derived from the device.

vLLM sizes its KV cache from the memory left after the weights (`gpu_memory_utilization`); mlx-lm's
server has no such bound and can run a Mac out of memory as caches grow (mlx-lm #1390). Here the
default budget is the device's usable memory, minus what the loaded models hold (MLX's active
memory after loading), minus a margin for activations and the rest of the process:

    Apple GPU   Metal's recommended working set (`max_recommended_working_set_size`)
    CUDA        the device's memory (`memory_size` in `mx.device_info()`)
    CPU         the machine's physical memory
"""
from __future__ import annotations

import logging
import os

import mlx.core as mx

log = logging.getLogger(__name__)

MARGIN_FRACTION = 0.2  # of usable memory, left for activations, MLX's buffer cache and the process
MIN_BUDGET_BYTES = 64 << 20


def usable_memory_bytes() -> int:
    """Memory the device can give MLX, bytes (see the module docstring)."""
    info = {}
    try:
        info = mx.device_info()
    except Exception:  # an MLX without device_info
        pass
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        if info.get(key):
            return int(info[key])
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


SHARE_ENV = "FLASHFLEET_DEVICE_SHARE"  # workers sharing this device (`flashfleet up` sets it)


def default_kv_budget_bytes() -> int:
    """The KV budget when none is configured: usable memory x (1 - MARGIN_FRACTION), divided among
    the workers sharing the device (`FLASHFLEET_DEVICE_SHARE`, default 1), minus MLX's active
    memory (this worker's loaded weights), at least MIN_BUDGET_BYTES. Call after loading the
    models."""
    try:
        share = max(1, int(os.environ.get(SHARE_ENV, "1")))
    except ValueError:
        share = 1
    usable = usable_memory_bytes() // share
    budget = int(usable * (1 - MARGIN_FRACTION)) - mx.get_active_memory()
    return max(MIN_BUDGET_BYTES, budget)
