"""The servers' event loop and collector settings (flashfleet/event_loop.py)."""
import asyncio
import gc
import subprocess
import sys

import uvloop

from flashfleet import event_loop


def test_run_drives_the_coroutine_on_uvloop_and_returns_its_result():
    async def main():
        await asyncio.sleep(0)
        return type(asyncio.get_running_loop())

    assert event_loop.run(main()) is uvloop.Loop


def test_settle_gc_freezes_start_up_objects_and_raises_only_the_youngest_threshold():
    # In a child process: freezing and thresholds are process-wide.
    code = ("import gc; from flashfleet import event_loop; before = gc.get_threshold(); "
            "event_loop.settle_gc(); after = gc.get_threshold(); "
            "print(gc.get_freeze_count() > 1000, after[0] == event_loop.GEN0_THRESHOLD, after[1:] == before[1:])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "True", "True"]
    assert gc.get_freeze_count() == 0  # this process untouched
