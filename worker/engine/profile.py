"""What a worker measures of its own speed, for the coordinator's migration policy.

`DecodeProfile` keeps the engine's own timings: seconds per decode iteration (one plain step of
the whole batch, or a DFlash iteration at block size 1) by (batch-size bucket, context bucket),
buckets being powers of two as in worker/engine/block_policy.py, each the least of its recent
timings (worker/engine/timings.py: time a busy host adds to some steps is not the worker's speed,
and two equally fast workers whose means followed the host's load at different moments would
each look faster in turn), and an exponential mean of seconds per prefilled prompt token. The engine thread writes
it; heartbeats read `snapshot()` from another thread (whole-dict replacement: a reader never sees
a half-updated table).

`SessionRates` keeps each running session's recent generated tokens per second (exponential mean
over its steps), and `speculative_speedup` is the engine cost model's estimate of a speculating
row's tokens/s over plain decoding's.

The engine takes its `DecodeProfile` as an argument (`worker.engine.thread.Engine(profile=...)`),
so tests of a heterogeneous fleet on one machine can inject one that makes a worker slower.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from worker.engine.block_policy import Acceptance, BatchBlockPolicy
from worker.engine.timings import RecentTimings


@dataclass(frozen=True)
class DecodeCostEntry:
    """One bucket of the profile: batch sizes in (batch_size/2, batch_size], contexts in
    (context_tokens/2, context_tokens]; `seconds` per decode iteration (the least of its recent
    timings) after `samples` timings in all."""

    batch_size: int
    context_tokens: int
    seconds: float
    samples: int


class DecodeProfile:
    """Decode-iteration costs (the least of recent timings) and an exponential mean of prefill
    times; engine thread writes, any reads.

    Args:
        decay: weight of the old mean in each prefill update, [0, 1).
        window: a bucket's cost is the least of its last `window` timings ...
        horizon: ... taken within `horizon` decode iterations (of any bucket) of its newest.

    Raises:
        ValueError: decay outside [0, 1), window < 1, horizon < 0.
    """

    def __init__(self, decay: float = 0.8, window: int = 64, horizon: int = 256):
        if not 0 <= decay < 1:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        if window < 1 or horizon < 0:
            raise ValueError(f"window must be >= 1 and horizon >= 0, got {window} / {horizon}")
        self.decay, self.window, self.horizon = decay, window, horizon
        self._decode: dict[tuple[int, int], tuple[float, int]] = {}
        self._timings: dict[tuple[int, int], RecentTimings] = {}
        self._ticks = 0
        self._seen: set[tuple[int, int]] = set()
        self.prefill_seconds_per_token = 0.0

    def decode(self, batch_size: int, context: int, block: int, seconds: float) -> None:
        """Records one decode iteration of `batch_size` rows whose longest holds `context` tokens,
        run at block size `block` (1: a plain step) in `seconds`; only plain steps enter the
        table (a DFlash iteration's cost depends on its block size: the block policy keeps it),
        and the first one of each bucket is dropped as warm-up."""
        if block != 1 or batch_size < 1 or seconds <= 0:
            return
        key = BatchBlockPolicy.key(batch_size, context)  # the block policy's buckets
        self._ticks += 1
        if key not in self._seen:  # the first iteration of a bucket is warm-up (graph set-up, compiles)
            self._seen.add(key)
            return
        timings = self._timings.setdefault(key, RecentTimings(self.window, self.horizon))
        timings.add(self._ticks, seconds)
        table = dict(self._decode)
        table[key] = (timings.estimate(), table.get(key, (0.0, 0))[1] + 1)
        self._decode = table

    def prefill(self, tokens: int, seconds: float) -> None:
        """Records one prefill chunk of `tokens` prompt tokens that took `seconds`."""
        if tokens < 1 or seconds <= 0:
            return
        per_token = seconds / tokens
        old = self.prefill_seconds_per_token
        self.prefill_seconds_per_token = per_token if old == 0 else self.decay * old + (1 - self.decay) * per_token

    def snapshot(self) -> list[DecodeCostEntry]:
        """The decode table, sorted by (batch_size, context_tokens); safe from any thread."""
        return [DecodeCostEntry(b, c, s, n) for (b, c), (s, n) in sorted(self._decode.items())]

    def reset(self) -> None:
        """Forgets every measurement (after warm-up: dummy prompts' costs are no request's)."""
        self._decode = {}
        self._timings = {}
        self._seen = set()
        self.prefill_seconds_per_token = 0.0


@dataclass(frozen=True)
class SessionSnapshot:
    """One session as heartbeats report it (see SessionLoad in protos/flashfleet/v1/worker.proto).

    Attributes:
        request_id: its id.
        context_tokens: prompt + generated tokens it holds.
        kv_bytes: bytes its KV cache holds (or will once admitted).
        tokens_per_s: recent generated tokens per second (0 before two steps).
        speculative_speedup: estimated tokens/s over plain decoding's (1.0 plain).
        remaining_tokens: tokens of max_tokens still to generate.
        kv_bytes_per_position: KV bytes one position of it takes (its method's caches; 0 unknown).
    """

    request_id: str
    context_tokens: int
    kv_bytes: int
    tokens_per_s: float
    speculative_speedup: float
    remaining_tokens: int
    kv_bytes_per_position: int = 0


class SessionRates:
    """Each session's recent tokens/s: an exponential mean of tokens / seconds between its steps.

    Args:
        decay: weight of the old mean in each update, [0, 1).
    """

    def __init__(self, decay: float = 0.8):
        self.decay = decay
        self._last: dict[str, tuple[float, int]] = {}
        self._rate: dict[str, float] = {}

    def observe(self, request_id: str, generated: int, now_s: float) -> None:
        """The session has generated `generated` tokens in all at clock time `now_s` (seconds)."""
        last = self._last.get(request_id)
        self._last[request_id] = (now_s, generated)
        if last is None or generated <= last[1] or now_s <= last[0]:
            return
        rate = (generated - last[1]) / (now_s - last[0])
        old = self._rate.get(request_id)
        self._rate[request_id] = rate if old is None else self.decay * old + (1 - self.decay) * rate

    def rate(self, request_id: str) -> float:
        """Recent tokens/s of a session (0.0 before two steps)."""
        return self._rate.get(request_id, 0.0)

    def keep(self, request_ids: set[str]) -> None:
        """Forgets sessions not in `request_ids` (they ended)."""
        for rid in [r for r in self._last if r not in request_ids]:
            self._last.pop(rid, None)
            self._rate.pop(rid, None)


def speculative_speedup(acceptance: Sequence[Acceptance], costs: Mapping[int, float]) -> list[float]:
    """Each row's estimated speculative tokens/s over plain decoding's in one batch.

    The block policy's model (worker/engine/block_policy.py): at block size L the batch commits
    sum_r E_r(L) tokens per iteration of c(L) seconds, and it runs the L* that maximises that
    rate; row r then gains E_r(L*) x c(1) / c(L*) over a plain step (1.0 when L* = 1).

    Args:
        acceptance: each row's `Acceptance` (its E_r(L)).
        costs: measured seconds per iteration by block size L in the batch's bucket; without
            c(1) nothing is known and every row gets 1.0.
    """
    if 1 not in costs or not acceptance:
        return [1.0] * len(acceptance)
    best, best_rate = 1, len(acceptance) / costs[1]
    for L, c in costs.items():
        if L > 1 and c > 0:
            r = sum(a.expected(L) for a in acceptance) / c
            if r > best_rate:
                best, best_rate = L, r
    if best == 1:
        return [1.0] * len(acceptance)
    return [a.expected(best) * costs[1] / costs[best] for a in acceptance]


class LoadBoard:
    """The engine thread's latest session snapshots, published for other threads (heartbeats).

    Args:
        min_interval_s: the engine publishes at most this often (building snapshots costs a
            little Python per session; heartbeats come every few seconds).
    """

    def __init__(self, min_interval_s: float = 0.2):
        self.min_interval_s = min_interval_s
        self.sessions: tuple[SessionSnapshot, ...] = ()
        self.kv_layers = 0  # the target's attention layers, once the engine has loaded it
        self._next_s = 0.0

    def due(self, now_s: float) -> bool:
        """True at most once per `min_interval_s` (then the engine publishes)."""
        if now_s < self._next_s:
            return False
        self._next_s = now_s + self.min_interval_s
        return True

    def publish(self, sessions: Sequence[SessionSnapshot]) -> None:
        """Replaces the published sessions (one reference swap: readers see the old or the new)."""
        self.sessions = tuple(sessions)


def scheduler_sessions(sched, rates: SessionRates, now_s: float) -> list[SessionSnapshot]:
    """Snapshots of every session a `worker.engine.scheduler.Scheduler` holds (engine thread):
    batched ones with their row bytes and, for DFlash rows, `speculative_speedup` over the block
    policy's costs in their batch's bucket; generator-driven ones with their caches' bytes and
    speedup 1.0 (no cost model). Updates `rates` and forgets ended sessions there."""
    out: list[SessionSnapshot] = []
    speedups: dict[str, float] = {}
    dflash = sched.decoding.get("dflash", [])
    if dflash and sched.policy is not None:
        B, ctx = len(dflash), max(len(s.tokens) for s in dflash)
        costs = {L: c for L in sched.policy.candidates if (c := sched.policy.cost(B, ctx, L)) is not None}
        for s, x in zip(dflash, speculative_speedup([s.acceptance for s in dflash], costs)):
            speedups[s.request_id] = x
    seqs = [*sched.waiting, *sched.prefilling, *(s for m in sched.decoding for s in sched.decoding[m])]
    for s in seqs:
        st = s.session.stats
        rates.observe(s.request_id, st.generated_tokens, now_s)
        out.append(SessionSnapshot(s.request_id, len(s.tokens), sched.row_bytes(s.mode, len(s.tokens)),
                                   rates.rate(s.request_id), speedups.get(s.request_id, 1.0), max(0, s.remaining),
                                   sched.bytes_per_position.get(s.mode, 0)))
    for rid, g in sched.generators.items():
        st = g.stats
        rates.observe(rid, st.generated_tokens, now_s)
        out.append(SessionSnapshot(rid, st.prompt_tokens + st.generated_tokens, g.kv_cache_bytes, rates.rate(rid),
                                   1.0, max(0, g.request.max_tokens - st.generated_tokens)))
    rates.keep({x.request_id for x in out})
    return out
