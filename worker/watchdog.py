"""Notices that a worker's engine thread has died while its server still runs.

A dead engine thread (an exception that escaped its loop, a fault in native code that ended the
thread) can serve nothing, yet the gRPC server, health and registration run on the asyncio loop
without it. `watch_engine` polls the engine's `alive` property and calls back once it turns
False; `worker.server` then takes the worker out of the fleet and the process exits with
`ENGINE_DIED_EXIT`, so its supervisor (systemd, launchd, `flashfleet up`) starts it again.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

ENGINE_DIED_EXIT = 70  # EX_SOFTWARE (sysexits.h): an internal error; supervisors restart on it
POLL_S = 0.5  # seconds between looks at `engine.alive`


def engine_alive(engine: object) -> bool:
    """The engine's `alive` property; an engine without one (a test double) counts as alive."""
    return bool(getattr(engine, "alive", True))


async def watch_engine(engine: object, on_death: Callable[[], Awaitable[None]],
                       poll_s: float = POLL_S) -> None:
    """Waits until `engine_alive(engine)` is False (looking every `poll_s` seconds), then awaits
    `on_death()` once and returns. Cancel the task to stop watching (a deliberate shutdown, which
    ends the engine thread itself)."""
    while engine_alive(engine):
        await asyncio.sleep(poll_s)
    await on_death()
