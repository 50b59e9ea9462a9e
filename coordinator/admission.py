"""A bounded wait for a free worker slot, in front of routing.

When every worker that serves a request's model is at capacity, the request waits here instead
of failing at once, as Ray Serve's `max_queued_requests` and Ollama's `OLLAMA_MAX_QUEUE` do: a
burst larger than the fleet's capacity is served as slots free up, and only a queue that is full
or a wait that is too long is RESOURCE_EXHAUSTED.
"""
from __future__ import annotations

import asyncio
from typing import Callable

from coordinator.routing import AllBusy


class AdmissionQueue:
    """Requests wait for a slot in arrival order (asyncio.Condition wakes waiters FIFO).

    Args:
        max_queued: requests that may wait at once; one more is refused at once (0: none wait,
            every request that finds the fleet full is refused).
        timeout_s: longest wait of one request, seconds (the client's deadline may end it
            sooner: the gRPC call is then cancelled, and so is the wait).

    One queue serves every model: `max_queued` bounds the coordinator's waiting requests in
    all, so a burst for one model can fill it and a request for another model that finds its
    own workers full is then refused too. A request whose model has a free slot never waits
    behind another model's waiters (it takes the lock only to check, and the waiters release it).

    Call `notify()` whenever a slot may have freed: a stream ended, a worker registered or sent
    a heartbeat with a new capacity. It is cheap when nobody waits, and while `held` says that
    nobody may go (then the caller notifies once that ends).

    Attributes:
        held: returns True while no waiter may go whatever the workers free (the coordinator
            itself is overloaded, coordinator/overload.py): `notify()` then wakes nobody, since
            each wake-up of every waiter costs the loop that is already late. None: never.

    Raises:
        ValueError: max_queued or timeout_s < 0.
    """

    def __init__(self, max_queued: int, timeout_s: float):
        if max_queued < 0 or timeout_s < 0:
            raise ValueError(f"max_queued and timeout_s must be >= 0, got {max_queued}, {timeout_s}")
        self.max_queued = max_queued
        self.timeout_s = timeout_s
        self.waiting = 0
        self._cond = asyncio.Condition()
        self._wakers: set[asyncio.Task] = set()  # held so they are not garbage-collected mid-run
        self.held: Callable[[], bool] | None = None

    def notify(self) -> None:
        """Wakes the waiters to re-check for room (from the event loop's thread)."""
        if self.waiting and not (self.held is not None and self.held()):
            task = asyncio.get_running_loop().create_task(self._wake())
            self._wakers.add(task)
            task.add_done_callback(self._wakers.discard)

    async def _wake(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    async def wait_for_room(self, has_room: Callable[[], bool], what: str) -> float:
        """Returns once `has_room()` is true; the caller must take the slot before its next await
        (so no other waiter sees the same slot free).

        Args:
            has_room: true when a worker that can serve the request has a free slot.
            what: the request's model, for error messages.

        Returns:
            Seconds waited (0.0 when there was room at once).

        Raises:
            AllBusy: the queue is full, or no slot freed within `timeout_s`.
        """
        room = has_room()
        if room and not self.waiting:
            return 0.0
        # With others waiting, even a request that sees room takes its turn at the lock, so a
        # slot a stream just freed goes to the waiters first and not to whoever arrives next.
        if not room and self.waiting >= self.max_queued:
            raise AllBusy(f"every worker serving {what!r} is at capacity and {self.waiting} request(s) "
                          f"already wait (max_queued {self.max_queued}); retry later or add workers")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        self.waiting += 1
        try:
            async with asyncio.timeout(self.timeout_s), self._cond:
                await self._cond.wait_for(has_room)
        except TimeoutError:
            raise AllBusy(f"every worker serving {what!r} stayed at capacity for {self.timeout_s:g} s "
                          "(queue_timeout_s); retry later or add workers") from None
        finally:
            self.waiting -= 1
        return loop.time() - t0
