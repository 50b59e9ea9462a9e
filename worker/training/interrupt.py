"""Ctrl-C during training: stop at a step boundary (`sigint_as_flag`), say so (`TrainingInterrupted`)."""
from __future__ import annotations

import contextlib
import signal
import threading


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) during `Trainer.run`: the step in flight finished, a checkpoint was saved
    (when the run has one), and training stopped; the same command resumes from `step`."""

    def __init__(self, step: int, saved: bool):
        super().__init__(f"interrupted at step {step}")
        self.step, self.saved = step, saved


@contextlib.contextmanager
def sigint_as_flag(flag: list):
    """While active (main thread of a single process only), the first Ctrl-C sets flag[0] so the
    training loop stops at a step boundary, where the state is consistent; a second one
    interrupts at once as usual."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        flag[0] = True
        signal.signal(signal.SIGINT, previous)  # the next Ctrl-C is the default KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
