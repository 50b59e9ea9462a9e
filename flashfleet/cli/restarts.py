"""Which exited workers `flashfleet up` starts again, and how long it waits first."""
from __future__ import annotations

from dataclasses import dataclass, field

# Exit statuses a restart would not mend: 0 (the worker was stopped on purpose, e.g. SIGTERM by
# hand) and 2 (a bad config or model: it would fail the same way again).
NOT_RESTARTED = (0, 2)


def should_restart(code: int) -> bool:
    """Whether a worker that exited with `code` (Popen.returncode: negative = killed by that
    signal) is started again: every failure but a bad config or model, as systemd's
    Restart=on-failure and launchd's KeepAlive/SuccessfulExit=false do (e.g. 70, the engine
    thread died: `worker.watchdog.ENGINE_DIED_EXIT`; -9, killed)."""
    return code not in NOT_RESTARTED


@dataclass
class RestartBackoff:
    """Capped, doubling waits before a failed worker is started again.

    A worker's first restart waits `first_s` seconds; each further failure within `stable_s`
    seconds of its last start doubles the wait, up to `max_s`; a worker that ran for `stable_s`
    or longer before it failed waits `first_s` again.
    """

    first_s: float = 1.0
    max_s: float = 30.0
    stable_s: float = 60.0
    _streak: dict[str, int] = field(default_factory=dict)

    def delay(self, name: str, ran_s: float, first_at_once: bool = False) -> float:
        """Seconds to wait before starting `name` again, which ran `ran_s` seconds this time;
        with `first_at_once`, the first restart of a run of failures waits none (the next
        `first_s`, then doubling)."""
        n = 0 if ran_s >= self.stable_s else self._streak.get(name, -1) + 1
        self._streak[name] = n
        if first_at_once:
            return 0.0 if n == 0 else min(self.first_s * 2.0 ** min(n - 1, 32), self.max_s)
        return min(self.first_s * 2.0 ** min(n, 32), self.max_s)
