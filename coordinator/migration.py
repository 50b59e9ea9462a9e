"""When and where a running session moves to another worker, and the request that resumes it there.

Workers serving one model differ: another Mac may be faster (more memory bandwidth), less loaded
(a smaller batch), or have more KV memory free, and routing placed each session before the load
changed (or session affinity kept a user's requests together). This is Llumnix's migration
(Sun et al., OSDI 2024, "Llumnix: Dynamic Scheduling for Large Language Model Serving"): load
balancing, de-fragmenting memory before a session runs out of it, and draining a worker, all as
one rule over what each worker measured.

**Inputs** (every heartbeat, worker.proto WorkerLoad): per running session its context tokens,
KV bytes, remaining tokens and speculative speedup s (the engine's cost-model estimate of its
tokens/s over plain decoding; 1.0 plain); per worker its KV budget and free bytes, chip and peak
memory bandwidth, seconds per prefilled token, and its measured decode profile t_w(B, C): seconds
per decode iteration at batch size B and context C (worker/engine/profile.py).

**Prediction**: a session of context C decodes at s / t_w(B, C) tokens/s on worker w, with B the
streams w runs (the source's count includes the session; a destination's is its count + 1).
t_w between and beyond measured buckets is interpolated linearly in C, then in B (flat below
the smallest bucket, extended along the last slope above the largest). A worker with no
measurement is predicted from another worker's profile times the ratio of their peak
bandwidths (decode reads the weights and the cache once a step: Leviathan et al. 2023's
memory-bound regime); without either it is no candidate. On a destination without the source's
draft kind, s counts as 1.

**Rule** (`MigrationPolicy.decide`, at most every `check_interval_s` per stream, and once per load
report of its worker: between two heartbeats a check would weigh the same sessions):

- *drain*: the source is being drained: move to the candidate predicting the most tokens/s
  (the least busy when none can be predicted);
- otherwise nothing while the session moved less than `cooldown_s` ago;
- *memory*: the source's sessions will need sum (C + remaining) x bytes/token > its KV budget
  before they finish: its session with the most growth left moves, to the fastest candidate
  with room for all of its growth, before the worker must preempt;
- *speed* / *load*: with R tokens left (R >= `min_remaining_tokens`), a candidate d is worth it
  when tps_d >= `min_speedup` x tps_src and the time saved R / tps_src - R / tps_d exceeds
  `hysteresis` x the move's cost, min(KV bytes / `link_bandwidth_bytes_per_s`, C x d's seconds
  per prefilled token), and at least `min_saving_s` (measured profiles carry noise: on equally
  fast workers a cheap move could otherwise win on it now and then); the one saving the most net of the cost wins. "speed" when d would be
  that much faster even at the source's batch size (a faster machine), "load" otherwise (the
  gain comes from a smaller batch: a shared worker to an idle one). A speed or load move back to
  the worker the session left also needs tps_d >= `min_speedup` x g x tps_src, g the tokens/s
  ratio its move away predicted: going back must beat the evidence that made it leave, by the
  same margin; and it needs timings that worker took after the session left (its profile's
  sample count grew since its first load report without the session): an idle worker's profile is as old as its last session, and weighed
  against the fresh timings of the session's worker on a busy host (workers sharing one machine,
  as `flashfleet up` runs them) it reads faster by however much the host's load rose since.
  Without both, two equally fast workers would trade a session back and forth once `cooldown_s`
  has passed.

Candidates: live, reachable, not draining, serving the model and mode, with a free slot and KV
room for the session's growth (when budgets are known), and not the worker the session left less
than `cooldown_s` ago (no ping-pong). A memory, speed or load check weighs at most
`max_candidates` of them, drawn at random when the fleet has more (power of k choices, as
routing's power of two): every stream asks every `check_interval_s`, so a check that weighed the
whole fleet would cost streams x workers per interval, which made the check most of a busy
coordinator's work (bench/bench_coordinator.py). A drain weighs every worker. A seeded sampled session moves only between workers whose
decoding draws each token with a key of its sequence position (plain and DFlash batches,
worker/sampling.py `sample_rows`), so the continuation is the one it would have had; a classic
draft or cross-tokenizer draft advances one random stream per call and is never moved seeded.

**Mechanism** (coordinator/kv_transfer.py, docs/migration.md): by default the session's KV state
is copied to the destination while the stream goes on, then the destination gets the request with
`resume_token_ids` (every token the client received), `resume_text` and the staged state's
`import_id`, and prefills only the tokens generated during the copy; re-prefill of prompt + those
tokens is the fallback (and `migrate_method = "reprefill"`). Only when the destination's first
message arrives is the source call cancelled; if the destination refuses, the stream stays on the
source and nothing was lost. Greedy output is the one unmigrated decoding gives.
"""
from __future__ import annotations

import bisect
import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Iterable, Sequence

from coordinator.registry import WorkerRecord
from flashfleet import kv_need  # the one KV formula, shared with the engine
from flashfleet.requests import WORKER_DEFAULT_MAX_TOKENS
from flashfleet.v1 import common_pb2, worker_pb2

# Why a session moved (metric label `reason`): the policy's rules, an operator's MoveSession, and
# failover after its worker failed.
REASONS = ("speed", "load", "memory", "drain", "manual", "failure")
POSITION_KEYED_MODES = (common_pb2.DECODE_MODE_AUTO, common_pb2.DECODE_MODE_PLAIN, common_pb2.DECODE_MODE_DFLASH)


@dataclass(frozen=True)
class Decision:
    """Where a session moves and why.

    Attributes:
        dest: the destination worker.
        reason: one of REASONS.
        saved_s: predicted seconds saved over the remaining tokens (speed/load; 0 otherwise).
        cost_s: predicted pause of the move, seconds (inf when unknown).
        gain: predicted tokens/s on `dest` over the source's (speed/load; 0 otherwise).
    """

    dest: WorkerRecord
    reason: str
    saved_s: float = 0.0
    cost_s: float = math.inf
    gain: float = 0.0


def _interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    """y at x over points sorted by x: linear between neighbours, flat below the first, along the
    last segment's slope (if rising) above the last."""
    if len(points) == 1 or x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return y1 + max(0.0, (y1 - y0) / (x1 - x0)) * (x - x1)


class ProfileTable:
    """A worker's measured decode profile, parsed once for many predictions (`profile_seconds`).

    Args:
        profile: DecodeCost entries (worker.proto WorkerLoad.decode_profile); entries with no
            seconds are skipped.
    """

    def __init__(self, profile: Iterable[worker_pb2.DecodeCost]):
        by_batch: dict[int, list[tuple[float, float]]] = {}
        for c in profile:
            if c.seconds > 0:
                by_batch.setdefault(c.batch_size, []).append((c.context_tokens, c.seconds))
        self._by_batch = sorted((b, sorted(pts)) for b, pts in by_batch.items())
        self._batches = [b for b, _ in self._by_batch]

    def __bool__(self) -> bool:
        return bool(self._by_batch)

    def seconds(self, batch: int, context: int) -> float | None:
        """Predicted seconds per decode iteration at `batch` rows and `context` tokens (module
        docstring); None when the profile is empty."""
        rows = self._by_batch
        if not rows:
            return None
        # Only the batch buckets around `batch` count (the one below `batch`'s segment, or the
        # last two above the largest): their contexts are interpolated, not every bucket's.
        i = bisect.bisect_left(self._batches, batch)
        near = rows[:1] if i == 0 else rows[i - 1:i + 1] if i < len(rows) else rows[-2:]
        return _interpolate([(b, _interpolate(pts, context)) for b, pts in near], batch)


def profile_seconds(profile: Iterable[worker_pb2.DecodeCost], batch: int, context: int) -> float | None:
    """Predicted seconds per decode iteration at `batch` rows and `context` tokens from a measured
    profile (module docstring); None when the profile is empty."""
    return ProfileTable(profile).seconds(batch, context)


def profile_timings(worker: WorkerRecord) -> int:
    """How many decode timings the worker's reported profile holds in all (its entries'
    `samples`): it grows only while the worker decodes."""
    return sum(c.samples for c in worker.load.decode_profile)


def _profile_table(worker: WorkerRecord) -> ProfileTable:
    """`worker`'s decode profile, parsed once per load report (each heartbeat brings a new one)."""
    load, table = worker.profile_cache
    if load is not worker.load:
        table = ProfileTable(worker.load.decode_profile)
        worker.profile_cache = (worker.load, table)
    return table


def _remaining(request: common_pb2.GenerateRequest, session: worker_pb2.SessionLoad, sent_tokens: int) -> int:
    """Tokens the session has left to generate: its worker's count, else the request's budget
    less what the client got."""
    budget = request.max_tokens if request.HasField("max_tokens") else WORKER_DEFAULT_MAX_TOKENS
    return session.remaining_tokens or max(0, budget - sent_tokens)


def _kv_need_now(worker: WorkerRecord, model: str) -> int:
    """`MigrationPolicy.kv_need_bytes(worker, model)`, worked out once per load report (each of the
    worker's streams asks it)."""
    load, cached_model, need = worker.need_cache
    if load is not worker.load or cached_model != model:
        need = MigrationPolicy.kv_need_bytes(worker, model)
        worker.need_cache = (worker.load, model, need)
    return need


class _Peers:
    """The workers of `workers` serving `model`, filtered as they are iterated: a prediction
    borrows the first peer profile it finds, so most never look past the first few."""

    def __init__(self, workers: Sequence[WorkerRecord], model: str):
        self._workers, self._model = workers, model

    def __iter__(self):
        return (w for w in self._workers if w.serves(self._model))


def session_load(worker: WorkerRecord, request_id: str) -> worker_pb2.SessionLoad | None:
    """The session `request_id` in the worker's latest heartbeat, or None (not reported yet)."""
    return next((s for s in worker.load.sessions if s.request_id == request_id), None)


def _bytes_per_position(worker: WorkerRecord, s: worker_pb2.SessionLoad, model: str) -> int:
    """KV bytes one position of this session takes, as its worker reports it, else the model's
    registered bytes per token on that worker."""
    return s.kv_bytes_per_position or worker.kv_bytes_per_token(model)


def _final_rows(worker: WorkerRecord, sessions: Iterable[worker_pb2.SessionLoad], model: str) -> list[tuple[int, int]]:
    return [(s.context_tokens + s.remaining_tokens, _bytes_per_position(worker, s, model)) for s in sessions]


def _draft_mode(worker: WorkerRecord, model: str) -> int:
    return next((m.draft_mode for m in worker.models if m.name == model), common_pb2.DECODE_MODE_AUTO)


def position_keyed(request: common_pb2.GenerateRequest, worker: WorkerRecord) -> bool:
    """Whether `worker` reproduces the request's tokens wherever it continues them: greedy and
    unseeded requests always; a seeded sampled one where its decoding keys each draw by sequence
    position (plain and DFlash batches; AUTO resolves to the worker's draft kind)."""
    if not (request.HasField("seed") and request.temperature > 0):
        return True
    mode = request.mode
    if mode == common_pb2.DECODE_MODE_AUTO:
        mode = _draft_mode(worker, request.model)
    return mode in POSITION_KEYED_MODES


@dataclass(frozen=True)
class MigrationPolicy:
    """When and where a running session moves (module docstring). Pure: the clock is the caller's.

    Attributes:
        enabled: False turns off the automatic moves (speed, load, memory); drains and an
            operator's MoveSession still move sessions.
        min_remaining_tokens: a session with fewer tokens left stays (speed and load moves).
        cooldown_s: a session moved this recently stays where it is, and does not go back to the
            worker it left within this time.
        check_interval_s: a stream asks the policy at most this often (and at most once per load
            report of its worker, drains excepted).
        link_bandwidth_bytes_per_s: the network between workers (default 1 Gb/s): moving a KV
            cache of b bytes costs b / this.
        hysteresis: a speed or load move needs a predicted saving of this many times its cost.
        min_saving_s: ... and of at least this many seconds.
        min_speedup: ... and a destination predicting at least this many times the source's tokens/s.
        max_candidates: a memory, speed or load check weighs at most this many destinations,
            drawn at random from the fleet when it has more (a drain weighs every worker).
        rng: the random source of those draws.
    """

    # What it weighs changes only with the workers' load reports: a stream asks again only after
    # its worker's next one (ProxiedStream); a policy without this attribute is asked every check.
    once_per_load_report: ClassVar[bool] = True

    enabled: bool = True
    min_remaining_tokens: int = 64
    cooldown_s: float = 5.0
    check_interval_s: float = 0.25
    link_bandwidth_bytes_per_s: float = 125e6
    hysteresis: float = 1.5
    min_saving_s: float = 1.0
    min_speedup: float = 1.1
    max_candidates: int = 8
    rng: random.Random = field(default_factory=random.Random, repr=False, compare=False)

    def __post_init__(self) -> None:
        if (self.min_remaining_tokens < 1 or self.cooldown_s < 0 or self.check_interval_s < 0
                or not self.link_bandwidth_bytes_per_s > 0 or not self.hysteresis >= 0 or not self.min_speedup >= 1
                or not self.min_saving_s >= 0 or self.max_candidates < 1):
            raise ValueError("MigrationPolicy: min_remaining_tokens >= 1, cooldown_s and check_interval_s >= 0, "
                             "link_bandwidth_bytes_per_s > 0, hysteresis >= 0, min_speedup >= 1, min_saving_s >= 0, "
                             "max_candidates >= 1")

    # ----- predictions ---------------------------------------------------------------------------

    def seconds_per_iteration(self, worker: WorkerRecord, batch: int, context: int,
                              peers: Iterable[WorkerRecord] = ()) -> float | None:
        """Predicted seconds per decode iteration on `worker` at `batch` rows and `context`
        tokens: from its own profile, else from a peer's profile times the peers' peak-bandwidth
        ratio (both known), else None."""
        own = _profile_table(worker).seconds(batch, context)
        if own is not None:
            return own
        bw = worker.load.peak_memory_bandwidth_bytes_per_s
        if bw <= 0:
            return None
        for peer in peers:
            peer_bw = peer.load.peak_memory_bandwidth_bytes_per_s
            t = _profile_table(peer).seconds(batch, context) if peer_bw > 0 else None
            if t is not None:
                return t * peer_bw / bw
        return None

    def move_cost_s(self, session: worker_pb2.SessionLoad, dest: WorkerRecord) -> float:
        """Predicted pause of moving `session` to `dest`: min(KV bytes over the link, `dest`'s
        re-prefill of its context); inf when neither is known."""
        costs = []
        moved = session.context_tokens * session.kv_bytes_per_position or session.kv_bytes
        if moved:
            costs.append(moved / self.link_bandwidth_bytes_per_s)
        if dest.load.prefill_seconds_per_token > 0:
            costs.append(session.context_tokens * dest.load.prefill_seconds_per_token)
        return min(costs, default=math.inf)

    @staticmethod
    def kv_need_bytes(worker: WorkerRecord, model: str, extra: worker_pb2.SessionLoad | None = None,
                      without: str = "") -> int:
        """KV bytes the worker's sessions (plus `extra`, less request `without`) will need when
        each reaches its context + remaining tokens: the engine's own arithmetic (batches padded
        to their longest row in whole buffer buckets, attention's working memory;
        flashfleet/kv_need.py)."""
        sessions = [s for s in worker.load.sessions if s.request_id != without]
        sessions += [extra] if extra is not None else []
        return kv_need.final_need_bytes(_final_rows(worker, sessions, model), worker.load.kv_layers)

    def _has_room(self, dest: WorkerRecord, session: worker_pb2.SessionLoad | None, model: str) -> bool:
        if session is None or dest.load.kv_budget_bytes <= 0:
            return True
        return self.kv_need_bytes(dest, model, session) <= dest.load.kv_budget_bytes

    # ----- the rule --------------------------------------------------------------------------------

    def candidates(self, request: common_pb2.GenerateRequest, source: WorkerRecord, workers: Iterable[WorkerRecord],
                   left_worker: str | None = None, left_s: float | None = None,
                   now_s: float = 0.0, limit: int | None = None) -> list[WorkerRecord]:
        """Workers the stream may move to (module docstring), without the KV-room check: the
        first `limit` of them in `workers`' order (all with None)."""
        if not position_keyed(request, source):
            return []
        out = []
        for w in workers:
            if (w.worker_id == source.worker_id or w.unreachable or w.draining or w.busy >= w.capacity
                    or not w.serves(request.model, request.mode) or not position_keyed(request, w)):
                continue
            if w.worker_id == left_worker and left_s is not None and now_s - left_s < self.cooldown_s:
                continue
            out.append(w)
            if len(out) == limit:
                break
        return out

    def _tps(self, w: WorkerRecord, batch: int, context: int, speedup: float, peers) -> float | None:
        t = self.seconds_per_iteration(w, batch, context, peers)
        return None if t is None or t <= 0 else speedup / t

    def fastest(self, request: common_pb2.GenerateRequest, source: WorkerRecord, session: worker_pb2.SessionLoad | None,
                candidates: Sequence[WorkerRecord], peers: Sequence[WorkerRecord]) -> WorkerRecord | None:
        """Of `candidates` with KV room for the session, the one predicting the most tokens/s for
        it (the least busy, then the lowest id, among those that cannot be predicted); None when
        none has room."""
        roomy = [w for w in candidates if self._has_room(w, session, request.model)]
        if not roomy:
            return None
        context = session.context_tokens if session is not None else 1
        speedup = session.speculative_speedup if session is not None and session.speculative_speedup > 0 else 1.0

        def key(w: WorkerRecord):
            s = speedup if _draft_mode(w, request.model) == _draft_mode(source, request.model) else 1.0
            tps = self._tps(w, w.busy + 1, context, s, peers)
            return (tps is None, -(tps or 0.0), w.busy, w.worker_id)

        return min(roomy, key=key)

    def decide(self, request: common_pb2.GenerateRequest, source: WorkerRecord, sent_tokens: int,
               workers: Iterable[WorkerRecord], moved_s: float | None, now_s: float,
               left_worker: str | None = None, left_s: float | None = None,
               left_gain: float = 0.0, left_timings: int | None = None) -> Decision | None:
        """Whether and where a running stream moves now (module docstring).

        Args:
            request: the client's request (model, mode, max_tokens: unset counts as
                `WORKER_DEFAULT_MAX_TOKENS`, seed, temperature).
            source: the worker streaming it (its `in_flight` counts this stream).
            sent_tokens: output tokens the client has received (0: nothing to resume yet).
            workers: live workers.
            moved_s: clock time of its last move or refused attempt, None if never.
            now_s: clock time now (seconds, the same clock).
            left_worker, left_s: the worker it last moved away from, and when.
            left_gain: the `Decision.gain` of that move (0: not a speed or load move).
            left_timings: `profile_timings` of that worker in its first load report without
                the stream (None: none yet, and no speed or load move back to it).

        Returns:
            A Decision, or None to stay.
        """
        if sent_tokens == 0:
            return None
        workers = list(workers)
        peers = _Peers(workers, request.model)
        session = session_load(source, request.request_id)
        if source.draining:
            cands = self.candidates(request, source, workers, left_worker, left_s, now_s)
            dest = self.fastest(request, source, session, cands, peers) if cands else None
            return Decision(dest, "drain") if dest is not None else None
        if not self.enabled or (moved_s is not None and now_s - moved_s < self.cooldown_s) or session is None:
            return None
        budget = source.load.kv_budget_bytes
        need = _kv_need_now(source, request.model) if budget > 0 else 0
        if need <= budget and _remaining(request, session, sent_tokens) < self.min_remaining_tokens:
            return None  # no memory move, and too little left for a speed or load move to pay
        cands = self.candidates(request, source, self._sample(workers, source), left_worker, left_s, now_s,
                                self.max_candidates)
        if not cands:
            return None
        if need > budget:  # the session whose leaving frees the most moves (a long row pads its whole batch)
            victim = max(source.load.sessions,
                         key=lambda s: (need - self.kv_need_bytes(source, request.model, without=s.request_id),
                                        s.request_id))
            if victim.request_id == request.request_id and session.remaining_tokens > 0:
                dest = self.fastest(request, source, session, cands, peers)
                if dest is not None:
                    return Decision(dest, "memory", cost_s=self.move_cost_s(session, dest))
        return self._speed(request, source, session, sent_tokens, cands, peers, left_worker, left_gain, left_timings)

    def _sample(self, workers: list[WorkerRecord], source: WorkerRecord) -> list[WorkerRecord]:
        """The workers a memory, speed or load check looks at: all of them in a fleet of up to
        `max_candidates` others, else up to 4 x `max_candidates` drawn at random (of which the
        first `max_candidates` eligible ones count), so a check costs the same in a fleet of any
        size (power of k choices, as routing's power of two)."""
        if len(workers) <= self.max_candidates + 1:
            return workers
        draws = min(len(workers), 4 * self.max_candidates)
        return [w for w in self.rng.sample(workers, draws) if w is not source]

    def _speed(self, request, source: WorkerRecord, session: worker_pb2.SessionLoad, sent_tokens: int,
               cands: Sequence[WorkerRecord], peers: Sequence[WorkerRecord], left_worker: str | None = None,
               left_gain: float = 0.0, left_timings: int | None = None) -> Decision | None:
        remaining = _remaining(request, session, sent_tokens)
        if remaining < self.min_remaining_tokens:
            return None
        speedup = session.speculative_speedup if session.speculative_speedup > 0 else 1.0
        context = session.context_tokens
        tps_src = self._tps(source, max(1, source.busy), context, speedup, peers)
        if tps_src is None:
            return None
        best = None
        source_mode = _draft_mode(source, request.model)
        for d in cands:  # the KV-room check (a sum over d's sessions) last: few get that far
            s = speedup if _draft_mode(d, request.model) == source_mode else 1.0
            tps = self._tps(d, d.busy + 1, context, s, peers)
            back = 1.0
            if d.worker_id == left_worker:  # going back: new timings of it, and beat the move away
                if left_timings is None or profile_timings(d) <= left_timings:
                    continue
                back = max(1.0, left_gain)
            if tps is None or tps < self.min_speedup * back * tps_src:
                continue
            saved = remaining / tps_src - remaining / tps
            cost = self.move_cost_s(session, d)
            if (saved > max(self.hysteresis * cost, self.min_saving_s)
                    and (best is None or saved - cost > best.saved_s - best.cost_s)
                    and self._has_room(d, session, request.model)):
                # "speed": faster at the source's own batch size (a faster machine); else "load"
                same = self._tps(d, max(1, source.busy), context, s, peers)
                best = Decision(d, "speed" if same is not None and same >= self.min_speedup * tps_src else "load",
                                saved, cost, tps / tps_src)
        return best


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
        self.left_worker: str | None = None  # the worker it last moved away from
        self.left_s: float | None = None
        self.left_gain = 0.0  # the tokens/s ratio that move predicted (0: not a speed or load move)
        self.left_timings: int | None = None  # that worker's `profile_timings` once it dropped the stream
        self._next_check_s = 0.0

    def resume_from(self, token_ids: list[int], text: str) -> None:
        """Starts from what a client already received from an earlier stream of the request
        (it resumes after its coordinator died): the next worker is given these tokens."""
        self.token_ids = list(token_ids)
        self._text = [text] if text else []
        self.resumed_tokens = len(self.token_ids)

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

    def left(self, worker_id: str, gain: float = 0.0) -> None:
        """Records that the stream moved away from `worker_id` now, by a move that predicted
        `gain` times the tokens/s there (`Decision.gain`): it does not go back within the policy's
        cooldown, nor for speed or load unless that worker has timed steps since it dropped the
        stream (`left_timings`, set by the caller from the worker's load reports) and the way
        back predicts more than that gain."""
        self.left_worker, self.left_s, self.left_gain = worker_id, self._clock(), gain
        self.left_timings = None

    def attempted(self) -> None:
        """Starts the cooldown (after a migration, or a destination's refusal)."""
        self.moved_s = self._clock()

    def finish_stats(self, stats: common_pb2.GenerationStats) -> None:
        """Makes the last worker's final stats the request's: that worker's prompt counted the
        resumed tokens and its generated count did not. Its cached and transferred positions
        (a prefix of prompt + resumed tokens) keep their share of the request's prompt, so each
        stays at most `prompt_tokens` as for a request that never moved."""
        if self.migrations or self.resumed_tokens:
            stats.prompt_tokens = max(0, stats.prompt_tokens - self.resumed_tokens)
            stats.generated_tokens += self.resumed_tokens
            stats.migrations = self.migrations
            stats.cached_tokens = min(stats.cached_tokens, stats.prompt_tokens)
            stats.transferred_tokens = min(stats.transferred_tokens, stats.prompt_tokens)
