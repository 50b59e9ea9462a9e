"""`python tests/engine_death_worker.py WORKER_FLAGS...`: `python -m worker` for
`test_worker_engine_death.py`, with SIGUSR1 bound to killing the engine thread: `EngineKilled`
is raised on that thread, as a bug in the engine's loop would raise an exception there. Only this
test script binds the signal: a production worker offers no way to crash its engine.

The exception is raised when the thread next runs Python code; an idle engine waits in its
command queue, so send a request after the signal.
"""
from __future__ import annotations

import ctypes
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from worker import __main__ as worker_main  # noqa: E402

_build_engine = worker_main.build_engine


class EngineKilled(BaseException):
    """Raised on the engine thread by SIGUSR1 (a BaseException: no `except Exception` keeps the
    thread alive)."""


def kill_thread(thread: threading.Thread) -> None:
    """Schedules `EngineKilled` in `thread` (CPython's PyThreadState_SetAsyncExc).

    Raises:
        RuntimeError: the thread was not found (it has ended already).
    """
    found = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                       ctypes.py_object(EngineKilled))
    if found != 1:
        raise RuntimeError(f"thread {thread.name} not found ({found})")


def build_engine_with_kill_switch(a):
    """`worker.__main__.build_engine`, then SIGUSR1 kills the thread the engine started.

    Raises:
        RuntimeError: building the engine started no thread, or several unnamed ones.
    """
    before = set(threading.enumerate())
    engine = _build_engine(a)
    started = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    if len(started) > 1:
        started = [t for t in started if "engine" in t.name]
    if len(started) != 1:
        raise RuntimeError(f"cannot tell the engine thread among {[t.name for t in started]}")
    signal.signal(signal.SIGUSR1, lambda signum, frame: kill_thread(started[0]))
    return engine


if __name__ == "__main__":
    worker_main.build_engine = build_engine_with_kill_switch
    sys.exit(worker_main.main(sys.argv[1:]))
