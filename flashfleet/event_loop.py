"""The event loop and garbage-collector settings of a long-running flashfleet server.

A coordinator relays every token of every stream: per message it awaits one gRPC read and one
gRPC write, each a future completed from grpc's poller thread, so the event loop's own overhead
and the collector's pauses are a visible part of its CPU per token (bench/bench_coordinator.py).
`run` drives the server on uvloop (libuv's event loop, a drop-in asyncio loop) and, once the
server has started, `settle_gc` moves everything built at start-up out of the collector's view.
"""
from __future__ import annotations

import gc
from collections.abc import Coroutine
from typing import Any

import uvloop

# Collections of the youngest generation start after this many new container objects instead of
# 700: each relayed message allocates a few dozen (futures, coroutines, tuples) that refcounting
# frees, and a collection every 700 of them costs about 7 % of a busy coordinator's CPU.
GEN0_THRESHOLD = 20_000


def run(main: Coroutine[Any, Any, Any]) -> Any:
    """Runs `main` to completion on a new uvloop event loop (as `asyncio.run` does) and returns
    its result; exceptions from `main` propagate."""
    return uvloop.run(main)


def settle_gc() -> None:
    """Call once start-up is done: freezes the objects alive now (modules, protobuf descriptors,
    the server's own state) so that no collection scans them again, and collects the youngest
    generation every `GEN0_THRESHOLD` allocations (the older generations' ratios unchanged)."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
