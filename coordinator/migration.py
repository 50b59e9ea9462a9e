"""When to move a running session to another worker, and the request that resumes it there.

A worker's engine runs its sessions in turn on one thread (worker/engine/thread.py): k sessions
on one Mac decode at about 1/k of the speed each, while another Mac serving the same model may
sit idle, because routing placed the session before the load changed (or session affinity kept
a user's requests together). Moving one session from a shared worker to an idle one restores its
full speed and gives the ones left behind a larger share. This is Llumnix's load-balancing
migration (Sun et al., OSDI 2024, "Llumnix: Dynamic Scheduling for Large Language Model
Serving"; shared/research/serving.md §c) reduced to what a fleet of one-model Macs needs:

- **Trigger** (`MigrationPolicy.target`): the session's worker has at least two streams open,
  another live worker serving the model (and mode) has none and room for one, at least
  `min_remaining_tokens` of the budget are left, and the session was not moved in the last
  `cooldown_s` (no ping-pong). Checked at most every `check_interval_s` per stream, off the
  tokens' path (a counter compare per chunk otherwise).
- **Mechanism** (by recomputation): at a chunk boundary the coordinator opens the same request
  on the destination with `resume_token_ids` (every token the client received) and
  `resume_text` (the text it received), and stops forwarding the source; the destination
  prefills prompt + those tokens, which rebuilds its KV cache and a DFlash draft's context from
  the same tokens, and streams on from the next token. Only when its first message arrives is
  the source call cancelled (what it sent meanwhile is dropped); if the destination refuses
  (full, draining, or the request ended meanwhile), the stream stays on the source and nothing
  was lost. So the client loses and repeats nothing: greedy output is the one unmigrated
  decoding gives, after a pause of one prefill. An unseeded sampled session continues as a valid
  sample from the target's distribution; a seeded one is never moved (the same seed must give
  the same output, and its random stream lives on the worker).
  Llumnix copies the KV cache instead, in stages while decoding continues; a 1.5B model's
  cache at 4 K tokens is 117 MB by arithmetic (28 layers x 2 x 256 x 4096 x 2 bytes), about a
  second over 1 GbE, and recomputation needs no cache format shared between workers. Which is
  cheaper on Macs is not measured here (bench/bench_migration.py measures the re-prefill's
  pause).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

from coordinator.registry import WorkerRecord
from flashfleet.requests import WORKER_DEFAULT_MAX_TOKENS
from flashfleet.v1 import common_pb2


@dataclass(frozen=True)
class MigrationPolicy:
    """Attributes:
        enabled: False turns migration off.
        min_remaining_tokens: a session with fewer tokens left of its max_tokens stays (the
            destination's prefill would cost more than what sharing costs it).
        cooldown_s: a session moved this recently stays where it is.
        check_interval_s: a stream looks for a destination at most this often.
    """

    enabled: bool = True
    min_remaining_tokens: int = 64
    cooldown_s: float = 5.0
    check_interval_s: float = 0.25

    def __post_init__(self) -> None:
        if self.min_remaining_tokens < 1 or self.cooldown_s < 0 or self.check_interval_s < 0:
            raise ValueError("MigrationPolicy: min_remaining_tokens >= 1, cooldown_s and check_interval_s >= 0")

    def target(self, request: common_pb2.GenerateRequest, source: WorkerRecord, sent_tokens: int,
               workers: Iterable[WorkerRecord], moved_s: float | None, now_s: float) -> WorkerRecord | None:
        """The idle worker to move a running stream to, or None to stay.

        Args:
            request: the client's request (model, mode, max_tokens: unset counts as the
                worker's default, `WORKER_DEFAULT_MAX_TOKENS`).
            source: the worker streaming it now (its `in_flight` counts this stream).
            sent_tokens: output tokens the client has received.
            workers: live workers.
            moved_s: monotonic time of this stream's last migration (or refused attempt), None if never.
            now_s: monotonic time now.
        """
        if not self.enabled or sent_tokens == 0 or source.in_flight < 2:
            return None
        if request.HasField("seed") and request.temperature > 0:
            return None  # a seeded sample must stay reproducible; its random stream lives on the worker
        if moved_s is not None and now_s - moved_s < self.cooldown_s:
            return None
        budget = request.max_tokens if request.HasField("max_tokens") else WORKER_DEFAULT_MAX_TOKENS
        if budget - sent_tokens < self.min_remaining_tokens:
            return None
        idle = [w for w in workers if w.worker_id != source.worker_id and w.in_flight == 0
                and w.capacity > 0 and not w.unreachable and w.serves(request.model, request.mode)]
        return min(idle, key=lambda w: w.worker_id) if idle else None


class StreamProgress:
    """What a proxied stream has delivered to its client: the resume point of a migration.

    Args:
        clock: monotonic seconds.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self.token_ids: list[int] = []
        self._text: list[str] = []
        self.migrations = 0
        self.moved_s: float | None = None
        self.resumed_tokens = 0
        self._next_check_s = 0.0

    def add(self, chunk: common_pb2.Chunk) -> None:
        """Records a chunk forwarded to the client (its token ids and text)."""
        self.token_ids.extend(chunk.token_ids)
        if chunk.text:
            self._text.append(chunk.text)

    @property
    def text(self) -> str:
        """All text forwarded to the client so far."""
        return "".join(self._text)

    def due(self, interval_s: float) -> bool:
        """True at most once per `interval_s` seconds of the clock (then the policy is asked)."""
        now = self._clock()
        if now < self._next_check_s:
            return False
        self._next_check_s = now + interval_s
        return True

    def resume_request(self, request: common_pb2.GenerateRequest) -> common_pb2.GenerateRequest:
        """A copy of `request` that continues this stream on another worker: `resume_token_ids`
        and `resume_text` set to everything delivered so far (the destination prefills prompt +
        those tokens, see the module docstring)."""
        resumed = common_pb2.GenerateRequest()
        resumed.CopyFrom(request)
        del resumed.resume_token_ids[:]
        resumed.resume_token_ids.extend(self.token_ids)
        resumed.resume_text = self.text
        return resumed

    def moved(self) -> None:
        """Records a migration: the next worker was given every token delivered so far."""
        self.migrations += 1
        self.resumed_tokens = len(self.token_ids)
        self.attempted()

    def attempted(self) -> None:
        """Starts the cooldown (after a migration, or a destination's refusal)."""
        self.moved_s = self._clock()

    def finish_stats(self, stats: common_pb2.GenerationStats) -> None:
        """Makes the last worker's final stats the request's: that worker's prompt counted the
        resumed tokens and its generated count did not."""
        if self.migrations:
            stats.prompt_tokens = max(0, stats.prompt_tokens - self.resumed_tokens)
            stats.generated_tokens += self.resumed_tokens
            stats.migrations = self.migrations
