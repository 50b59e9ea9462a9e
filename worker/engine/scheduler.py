"""The engine thread's scheduler: continuous batching within a KV memory budget.

Each iteration (`iterate`) does, in order:
  1. admit waiting sessions while the KV budget has room (a prompt-cache hit skips their cached
     prefix);
  2. one prefill chunk (`prefill_step_tokens` tokens) of the prefilling session with the fewest
     tokens left, so a long prompt delays decoding sessions by one chunk per iteration and a short
     prompt's first token waits for at most one chunk of a long one (chunked prefill, as
     Sarathi-Serve and vLLM interleave it with decoding); a session whose prompt shares a prefix
     with a decoding row of its method (the choices of one request with n > 1, a turn sent twice)
     copies that row's caches of the prefix instead of prefilling it; a session whose prefill is
     done joins its method's batch;
  3. if the next iteration's caches would exceed the budget, evict prompt-cache entries, then
     preempt the newest sessions (their caches are dropped; they wait at the front of the queue
     and resume by recomputing their prompt and output, as vLLM's recompute preemption does);
  4. one batched forward per decoding method: a plain step for every plain session, one DFlash
     iteration (draft + verify of every speculating session) at the block size the policy picks;
     sessions of methods without a batched path (classic draft models, cross-tokenizer drafts)
     advance one step each;
  5. emits each session's tokens; finished sessions leave their batch, and their caches go to the
     prompt cache.
A running session's state can be exported (`export`; worker/engine/kv_transfer.py) and imported
on another worker (`reserve_import`, then `imports`, a `StagedImports` of worker/engine/imports.py):
a request that claims an imported state starts as a prompt-cache hit on it. Staged imports count
against the KV budget until claimed, dropped, or expired.
Everything here runs on the engine thread, the only thread that touches MLX.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import mlx.core as mx

from worker.capture import HiddenCapture
from worker.engine.batch import Batch, Row, dflash_cycle, plain_step, prefill_chunk
from worker.engine.block_policy import Acceptance, BatchBlockPolicy
from worker.engine.grammar import RowGrammar
from worker.engine.penalties import RowPenalties
from worker.engine.profile import DecodeProfile
from worker.engine.imports import StagedImport, StagedImports
from worker.engine import kv_layout
from worker.engine.kv_transfer import CacheBytes, Layout, snapshot
from worker.engine.prompt_cache import PromptCache
from flashfleet import kv_need  # the one KV formula, shared with the coordinator
from worker.caches.rows import STEP, RowKVCache, make_row_caches
from worker.engine.session import Session
from worker.engine.types import ErrorEvent, NotExportable, Overloaded, TokenLogprob, UnknownSession
from worker.decoding.base import Sampler, Step

log = logging.getLogger(__name__)

BATCHED_MODES = ("plain", "dflash")
# Shortest prefix (tokens) a prefill copies from a decoding row rather than computing (the whole
# prompt when it is shorter): a copy of a few positions is not worth the row's full copy.
SHARED_PREFIX_MIN_TOKENS = 16
CLEAR_CACHE_EVERY = 256  # iterations between returning freed buffers to the allocator
# Most prompt tokens a scored prefill chunk (prompt_logprobs) feeds: its logits and their float32
# log-softmax stay until it is evaluated, 2 x 128 x 151,936 x 4 bytes = 0.16 GB with Qwen2.5.
SCORED_PREFILL_TOKENS = 128


@dataclass
class Sequence:
    """One admitted request of a batched mode, as data.

    Attributes:
        session: its output side (text assembly, stop strings, statistics, the emit callback).
        mode: "plain" or "dflash".
        sampler: its sampler.
        tokens: committed token ids, prompt then generated.
        order: admission order; the newest session is preempted first.
        acceptance: its DFlash acceptance by draft position (the block-size policy's E_r(L)).
        phase: "waiting", "prefill" or "decode".
        target / draft: its one-row caches while it prefills (None otherwise).
        prefilled: positions of tokens[:-1] in those caches.
        row: its `Row` while it decodes.
        import_id: an imported state it claims at admission ("" for none).
        grammar: its grammar matcher (structured output, worker/engine/grammar.py), or None.
        penalties: its penalties and logit bias (worker/engine/penalties.py), or None.
        error: what ended it, when something did (a grammar that refused a token).
        share_tried: whether its prefill looked for a decoding row to copy a shared prefix from.
        scored: the prompt's log-probabilities gathered while it prefills (a request with
            prompt_logprobs), None once they are sent or when not asked for.
    """

    session: Session
    mode: str
    sampler: Sampler
    tokens: list[int]
    order: int
    acceptance: Acceptance = field(default_factory=Acceptance)
    phase: str = "waiting"
    target: Optional[list[RowKVCache]] = None
    draft: Optional[list[RowKVCache]] = None
    prefilled: int = 0
    row: Optional[Row] = None
    import_id: str = ""
    grammar: Optional[RowGrammar] = None
    penalties: Optional[RowPenalties] = None
    error: Optional[Exception] = None
    share_tried: bool = False
    scored: Optional[list[TokenLogprob]] = None

    @property
    def request_id(self) -> str:
        return self.session.request.request_id

    @property
    def remaining(self) -> int:
        return self.session.request.max_tokens - self.session.stats.generated_tokens


class Scheduler:
    """Runs every admitted session of one worker; engine thread only.

    Args:
        models: the loaded models (`worker.engine.modes.LoadedModels`).
        block_size: DFlash's largest block (the draft's trained size unless configured).
        adaptive: choose each iteration's block size (`BatchBlockPolicy`); else always block_size.
        prefill_step_tokens: prompt tokens per prefill chunk.
        kv_budget_bytes: most bytes the KV caches (batches, prefills, the prompt cache) may hold.
        prompt_cache_entries: finished turns kept for prefix reuse (0: none).
        release: called with a request id when it stops counting against capacity.
        clock: monotonic seconds.
        profile: where each plain decode iteration's and prefill chunk's time is recorded
            (worker/engine/profile.py; the coordinator's migration policy reads it); None: none.

    Raises:
        ValueError: the target has non-attention layers (`make_row_caches`), or the budget holds
            less than one session's smallest cache.
    """

    def __init__(self, models, *, block_size: int, adaptive: bool, prefill_step_tokens: int,
                 kv_budget_bytes: int, prompt_cache_entries: int, release: Callable[[str], None],
                 clock: Callable[[], float] = time.perf_counter, profile: Optional[DecodeProfile] = None):
        self.m = models
        self.profile = profile
        self.block_size = block_size
        self.prefill_step_tokens = prefill_step_tokens
        self.budget = kv_budget_bytes
        self.release = release
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []
        self.decoding: dict[str, list[Sequence]] = {mode: [] for mode in BATCHED_MODES}
        self.generators: dict[str, Session] = {}
        self.batches = {"plain": Batch(make_row_caches(models.target, 0))}
        self.capture = None
        if models.draft_kind == "dflash":
            self.batches["dflash"] = Batch(make_row_caches(models.target, 0), self._draft_caches(0))
            self.capture = HiddenCapture(models.target, models.draft.target_layer_ids)
        self.policy = BatchBlockPolicy(block_size) if adaptive and models.draft_kind == "dflash" else None
        self.prompt_cache = PromptCache(prompt_cache_entries, kv_budget_bytes)
        self.pooled = Acceptance(decay=0.98)  # every session's cycles: new sessions' prior
        # Per mode: KV bytes of one row position; `Layout.per_position` of each cache.
        self.bytes_per_position, self.layouts = kv_layout.measure(models, self.capture)
        self.imports = StagedImports(self.layouts, clock)  # imported states until claimed
        smallest = self.row_bytes("plain", 1)
        if kv_budget_bytes < smallest:
            raise ValueError(f"the KV budget of {kv_budget_bytes:,} bytes holds less than one session of "
                             f"{STEP} positions ({smallest:,} bytes for this model): raise --kv-cache-limit-bytes")
        self._order = 0
        self._iterations = 0
        self.preemptions = 0
        self.peak_kv_bytes = 0
        self.peak_projected_bytes = 0

    def reset_measurements(self) -> None:
        """Forgets costs, peaks and counts (after warm-up: a dummy prompt's costs are no request's)."""
        if self.policy is not None:
            self.policy = BatchBlockPolicy(self.block_size)
        self.pooled = Acceptance(decay=0.98)
        self.peak_kv_bytes = self.peak_projected_bytes = self.preemptions = 0
        self.prompt_cache.trim_to(0)

    # ----- sizes ---------------------------------------------------------------------------------

    def _draft_caches(self, batch: int) -> list[RowKVCache]:
        return [RowKVCache(batch) for _ in self.m.draft.layers]

    def row_bytes(self, mode: str, positions: int) -> int:
        """Bytes of one row holding `positions` positions (in whole buffer buckets;
        `flashfleet.kv_need.batch_bytes` of one row)."""
        return kv_need.batch_bytes(1, positions, self.bytes_per_position.get(mode, self.bytes_per_position["plain"]))

    def max_block(self, mode: str) -> int:
        return self.block_size if mode == "dflash" else 1

    def kv_bytes(self) -> int:
        """Bytes the sessions' KV caches hold now (the prompt cache's not included)."""
        total = sum(b.nbytes() for b in self.batches.values())
        total += sum(c.nbytes for s in self.prefilling for c in (s.target or []) + (s.draft or []))
        total += self.imports.nbytes()
        return total + sum(c.nbytes for s in self.generators.values() for c in s.caches)

    def projected_bytes(self, extra: Optional[Sequence] = None) -> int:
        """Bytes the caches may hold by the end of the next iteration: each batch at its buffer
        length after a forward of its largest block, with every prefilling session (and `extra`,
        one not yet admitted) counted as already joined (a joining row's length can raise the
        whole batch's buffer length) and its prefill caches besides; generators as they are;
        plus attention's working memory. Batches and working memory by flashfleet/kv_need.py,
        the formula the coordinator's migration policy uses."""
        total = self.prompt_cache.nbytes
        largest = 0
        joining = self.prefilling + ([extra] if extra is not None else [])
        for mode, batch in self.batches.items():
            L = self.max_block(mode)
            rows = [s for s in joining if s.mode == mode]
            if not (batch.size or rows):
                continue
            positions = max([batch.positions_after(L) if batch.size else 0]
                            + [len(s.tokens) + L for s in rows])
            b = kv_need.batch_bytes(batch.size + len(rows), positions, self.bytes_per_position[mode])
            total += b + sum(self.row_bytes(mode, len(s.tokens)) for s in rows)
            largest = max(largest, b)
        total += kv_need.working_bytes(largest, self.kv_layers)
        claimed = extra.import_id if extra is not None else ""
        total += self.imports.nbytes(excluding=claimed)
        return total + sum(c.nbytes for s in self.generators.values() for c in s.caches)

    @property
    def kv_layers(self) -> int:
        """The target's attention layers (the working memory's divisor, flashfleet/kv_need.py)."""
        return len(self.batches["plain"].caches)

    def fits_alone(self, mode: str, positions: int) -> bool:
        """Whether one session of `positions` positions fits the budget with nothing else."""
        row = self.row_bytes(mode, positions)
        return row + kv_need.working_bytes(row, self.kv_layers) <= self.budget

    # ----- sessions in and out -----------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.prefilling or self.generators
                    or any(self.decoding[m] for m in BATCHED_MODES))

    def add(self, session: Session, mode: str, sampler: Sampler, grammar: Optional[RowGrammar] = None,
            penalties: Optional[RowPenalties] = None) -> None:
        """Queues a batched-mode session (its request already validated), with its grammar
        matcher when its output is constrained and its penalty state when it has penalties."""
        self._order += 1
        req = session.request
        prior = self.pooled.as_prior(self.max_block(mode) - 1)  # the worker's recent acceptance
        self.waiting.append(Sequence(session, mode, sampler, list(req.prompt_tokens), self._order,
                                     prior, import_id=req.import_id, grammar=grammar, penalties=penalties,
                                     scored=[] if req.prompt_logprobs >= 0 else None))

    def add_generator(self, session: Session) -> None:
        """Adds a session decoded by its own generator (modes without a batched path)."""
        self.generators[session.request.request_id] = session

    def cancel(self, request_id: str) -> Optional[Session]:
        """Removes a session wherever it is; returns it (None when unknown)."""
        if request_id in self.generators:
            s = self.generators.pop(request_id)
            _close(s)
            return s
        for s in list(self.waiting):
            if s.request_id == request_id:
                self.waiting.remove(s)
                self.imports.drop(s.import_id)
                return s.session
        for s in self.prefilling:
            if s.request_id == request_id:
                self.prefilling.remove(s)
                return s.session
        for mode, seqs in self.decoding.items():
            for i, s in enumerate(seqs):
                if s.request_id == request_id:
                    self._leave(mode, [i])
                    return s.session
        return None

    def sessions(self) -> list[Session]:
        """Every admitted session."""
        out = [s.session for s in (*self.waiting, *self.prefilling)]
        out += [s.session for m in BATCHED_MODES for s in self.decoding[m]]
        return out + list(self.generators.values())

    # ----- one iteration -------------------------------------------------------------------------

    def iterate(self) -> None:
        """One scheduler iteration (module docstring)."""
        self._iterations += 1
        if self.imports:
            self.imports.expire()
        self._admit()
        self._prefill_chunk()
        self._fit_budget()
        self.peak_projected_bytes = max(self.peak_projected_bytes, self.projected_bytes())
        for mode in BATCHED_MODES:
            if self.decoding[mode]:
                self._decode(mode)
        for s in list(self.generators.values()):
            self._advance_generator(s)
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.kv_bytes() + self.prompt_cache.nbytes)

        if self._iterations % CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()

    def _admit(self) -> None:
        while self.waiting:
            seq = self.waiting[0]
            over = self.projected_bytes(seq) - self.budget
            if over > 0:
                self.prompt_cache.trim_to(self.prompt_cache.nbytes - over)
                if self.projected_bytes(seq) > self.budget and not self.idle_but_waiting():
                    return
            self.waiting.popleft()
            try:
                self._start_prefill(seq)
            except Exception as e:
                log.exception("request %s failed to start its prefill", seq.request_id)
                self._finish(seq.session, error=e)

    def idle_but_waiting(self) -> bool:
        return not (self.prefilling or self.generators or any(self.decoding[m] for m in BATCHED_MODES))

    def _start_prefill(self, seq: Sequence) -> None:
        head = seq.tokens[:-1]
        if seq.scored is not None:  # every prompt position is scored: no cached state is reused
            self.imports.drop(seq.import_id)
            seq.import_id, seq.scored, cached = "", [], None
        else:
            cached, k = self.imports.claim(seq.import_id, seq.request_id, seq.mode, seq.tokens)
            seq.import_id = ""
        if cached is not None:
            seq.session.stats.transferred_tokens = k
        elif seq.scored is None:
            cached, k = self.prompt_cache.fetch(seq.mode, head) if not seq.prefilled else (None, 0)
            if cached is not None:
                seq.session.stats.cached_tokens = k
        n_target = len(self.batches["plain"].target)
        if cached is not None:
            seq.target, seq.draft = cached[:n_target], (cached[n_target:] or None)
        else:
            seq.target = make_row_caches(self.m.target, 1)
            seq.draft = self._draft_caches(1) if seq.mode == "dflash" else None
            k = 0
        seq.prefilled, seq.phase = k, "prefill"
        self.prefilling.append(seq)

    def _prefill_chunk(self) -> None:
        if not self.prefilling:
            return
        # Fewest tokens left first: a short prompt waits for at most the chunk in flight.
        seq = min(self.prefilling, key=lambda s: (len(s.tokens) - 1 - s.prefilled, s.order))
        end = len(seq.tokens) - 1
        try:
            if not seq.share_tried and seq.scored is None:  # a scored prompt is prefilled in full
                seq.share_tried = True
                self._share_prefix(seq)
            if seq.prefilled < end:
                scoring = seq.scored is not None
                step = min(self.prefill_step_tokens, SCORED_PREFILL_TOKENS) if scoring else self.prefill_step_tokens
                stop = min(end, seq.prefilled + step)
                dflash = seq.mode == "dflash"
                t0 = self.clock()
                scored = prefill_chunk(self.m.target, seq.tokens[seq.prefilled: stop], seq.target,
                                       self.m.draft if dflash else None, seq.draft, self.capture,
                                       seq.tokens[seq.prefilled + 1: stop + 1] if scoring else None,
                                       seq.session.request.prompt_logprobs)
                if self.profile is not None:
                    self.profile.prefill(stop - seq.prefilled, self.clock() - t0)
                if scoring:
                    seq.scored.extend(scored)
                seq.prefilled = stop
                mx.clear_cache()
            if seq.prefilled >= end and seq.scored is not None:
                seq.session.emit_prompt_logprobs(seq.tokens[0], seq.scored)
                seq.scored = None
        except Exception as e:
            log.exception("request %s failed in prefill", seq.request_id)
            self.prefilling.remove(seq)
            self._finish(seq.session, error=e)
            return
        if seq.prefilled >= end and seq.remaining <= 0:  # max_tokens 0: the prompt was only scored
            self.prefilling.remove(seq)
            self._finish(seq.session)
        elif seq.prefilled >= end:
            self.prefilling.remove(seq)
            seq.row = Row(seq.sampler, len(seq.tokens), seq.tokens[-1], seq.request_id, seq.grammar,
                          seq.session.request.top_logprobs, seq.penalties)
            self.batches[seq.mode].join(seq.row, seq.target, seq.draft)
            seq.target = seq.draft = None
            seq.phase = "decode"
            self.decoding[seq.mode].append(seq)

    def _share_prefix(self, seq: Sequence) -> None:
        """Starts `seq`'s prefill from the caches of the decoding row of its mode whose tokens
        share the longest prefix with its prompt, when that covers at least
        `SHARED_PREFIX_MIN_TOKENS` more positions than it holds (a prompt-cache hit's), or the
        rest of its prompt: a copy of that row's positions, trimmed to the shared prefix, replaces
        computing them; counted as cached prompt tokens."""
        head = seq.tokens[:-1]
        best, best_k = None, 0
        for i, other in enumerate(self.decoding[seq.mode]):
            k = _common_prefix(head, other.tokens[: other.row.n - 1])
            if k > best_k:
                best, best_k = i, k
        gain = best_k - seq.prefilled
        if best is None or gain <= 0 or gain < min(SHARED_PREFIX_MIN_TOKENS, len(head) - seq.prefilled):
            return
        caches = self._row_caches(seq.mode, best)
        if caches is None:
            return
        for c in caches:
            c.trim(c.host_lengths[0] - best_k)
        n_target = len(self.batches[seq.mode].target)
        seq.target, seq.draft = caches[:n_target], (caches[n_target:] or None)
        seq.prefilled = best_k
        seq.session.stats.cached_tokens = min(best_k, len(seq.session.request.prompt_tokens))

    def _fit_budget(self) -> None:
        over = self.projected_bytes() - self.budget
        if over > 0:
            self.prompt_cache.trim_to(self.prompt_cache.nbytes - over)
        while self.projected_bytes() > self.budget:
            running = [s for m in BATCHED_MODES for s in self.decoding[m]] + self.prefilling
            if len(running) <= 1:
                return
            self._preempt(max(running, key=lambda s: s.order))

    def _preempt(self, seq: Sequence) -> None:
        """Drops a session's caches; it waits at the front of the queue and resumes by recomputing."""
        if seq.phase == "decode":
            seqs = self.decoding[seq.mode]
            self._leave(seq.mode, [seqs.index(seq)])
        else:
            self.prefilling.remove(seq)
        seq.target = seq.draft = seq.row = None
        seq.prefilled, seq.phase, seq.share_tried = 0, "waiting", False
        seq.session.stats.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)
        log.info("preempted request %s at %d tokens (KV budget %d bytes)", seq.request_id,
                 len(seq.tokens), self.budget)

    def _leave(self, mode: str, indices: list[int]) -> None:
        seqs = self.decoding[mode]
        gone = set(indices)
        keep = [i for i in range(len(seqs)) if i not in gone]
        self.batches[mode].keep(keep)
        self.decoding[mode] = [seqs[i] for i in keep]

    # ----- decoding ------------------------------------------------------------------------------

    def _decode(self, mode: str) -> None:
        seqs = self.decoding[mode]
        batch = self.batches[mode]
        t0 = self.clock()
        try:
            L = 1
            if mode == "plain":
                results = [(t, 0, 0) for t in plain_step(self.m.target, batch)]
            else:
                L = self._block_for(seqs)
                res = dflash_cycle(self.m.target, self.m.draft, self.capture, batch, L)
                results = [(t, L - 1, a) for t, a in zip(res.tokens, res.accepted)]
            elapsed, context = self.clock() - t0, max(s.row.n for s in seqs)
            if mode != "plain" and self.policy is not None:
                self.policy.observe(len(seqs), context, L, elapsed)
            if self.profile is not None:
                self.profile.decode(len(seqs), context, L, elapsed)
        except Exception as e:
            log.exception("a batched %s iteration failed; ending its %d sessions", mode, len(seqs))
            self._leave(mode, list(range(len(seqs))))
            for s in seqs:
                self._finish(s.session, error=e)
            return
        done: list[int] = []
        for i, (seq, (tokens, drafted, accepted)) in enumerate(zip(seqs, results)):
            if drafted:
                seq.acceptance.observe(drafted, accepted)
                self.pooled.observe(drafted, accepted)
            if not self._commit(seq, tokens, drafted, accepted, batch.logprobs.get(i, ())):
                done.append(i)
        if done:
            for i in done:
                if seqs[i].error is not None:  # its row's length and tokens disagree: nothing to keep
                    continue
                try:
                    self._keep_prompt_cache(mode, i)
                except Exception:  # the cache is an optimisation: never lose the session for it
                    log.exception("request %s: keeping its prompt cache failed", seqs[i].request_id)
            self._leave(mode, done)
            for i in done:
                self._finish(seqs[i].session, error=seqs[i].error)

    def _block_for(self, seqs: list[Sequence]) -> int:
        useful = max(s.remaining for s in seqs)
        if self.policy is None:
            return max(1, min(self.block_size, 1 << max(0, useful - 1).bit_length()))
        return self.policy.choose([s.acceptance for s in seqs], max(s.row.n for s in seqs), useful)

    def _commit(self, seq: Sequence, tokens: list[int], drafted: int, accepted: int, logprobs=()) -> bool:
        """Emits a row's new tokens (cut after an EOS and at max_tokens), with their
        log-probabilities when it asked for them; False when it is done."""
        try:
            tokens, _ = seq.row.commit(tokens, self.m.eos_ids, seq.remaining)
        except RuntimeError as e:  # its grammar refused a token: the session ends with the error
            log.exception("request %s: committing its tokens failed", seq.request_id)
            seq.error = e
            return False
        s = seq.session
        try:
            s.on_step(Step(tokens, drafted, accepted, logprobs=tuple(logprobs[: len(tokens)])), self.clock())
        except Exception:
            log.exception("request %s: emitting its tokens failed", seq.request_id)
            s.done_reason = s.done_reason or "cancelled"
        seq.tokens.extend(tokens)
        return not s.done_reason

    def _keep_prompt_cache(self, mode: str, index: int) -> None:
        """Copies a finished row's caches into the prompt cache: positions [0, n-1) of its n
        committed tokens (a row cut at an EOS or max_tokens inside a block holds more: trimmed)."""
        if not self.prompt_cache.max_entries:
            return
        seq = self.decoding[mode][index]
        n = seq.row.n - 1
        entry = self.row_bytes(mode, n)
        self.prompt_cache.trim_to(self.budget - self.kv_bytes() - entry)
        if self.kv_bytes() + self.prompt_cache.nbytes + entry > self.budget:
            return
        caches = self._row_caches(mode, index)
        if caches is not None:
            self.prompt_cache.insert(mode, seq.tokens[:n], caches)

    def _row_caches(self, mode: str, index: int) -> Optional[list[RowKVCache]]:
        """One-row copies of a decoding row's caches, target then draft, holding positions
        [0, n-1) of its n committed tokens (a DFlash row's pending taps folded into its draft
        cache), evaluated; None when the row holds fewer."""
        batch, seq = self.batches[mode], self.decoding[mode][index]
        n = seq.row.n - 1
        caches = [c.row(index) for c in batch.target]
        if batch.draft is not None:
            draft = [c.row(index) for c in batch.draft]
            S = batch.pending_len[index]
            if S:
                self.m.draft.extend_context(batch.pending[index: index + 1, :S], draft)
            caches += draft
        if n < 1 or any(c.host_lengths[0] < n for c in caches):
            return None
        for c in caches:
            c.trim(c.host_lengths[0] - n)
        mx.eval([c.state for c in caches])
        return caches

    # ----- session state out and in (KV transfer) ------------------------------------------------

    def export(self, request_id: str) -> tuple[str, tuple[int, ...], list[CacheBytes]]:
        """A host copy of a decoding session's state (the session goes on decoding).

        Returns:
            (mode, its n0 committed token ids, its caches' bytes holding positions [0, n0-1):
            target layers, then the draft's).

        Raises:
            UnknownSession: no such session, or it is not decoding yet (waiting or prefilling).
            NotExportable: it decodes with its own generator (classic or cross-tokenizer draft).
        """
        for mode in BATCHED_MODES:
            for i, seq in enumerate(self.decoding[mode]):
                if seq.request_id != request_id:
                    continue
                caches = self._row_caches(mode, i)
                if caches is None:
                    raise UnknownSession(f"request {request_id!r} has no state to export yet")
                n = seq.row.n - 1
                parts = ["target"] * len(self.batches[mode].target)
                parts += ["draft"] * (len(caches) - len(parts))
                return mode, tuple(seq.tokens[: n + 1]), snapshot(caches, parts, n)
        if request_id in self.generators:
            raise NotExportable(f"request {request_id!r} decodes in mode "
                                f"{self.generators[request_id].stats.mode!r}, which has no exportable state")
        if any(s.request_id == request_id for s in (*self.waiting, *self.prefilling)):
            raise UnknownSession(f"request {request_id!r} is not decoding yet")
        raise UnknownSession(f"no running request {request_id!r}")

    def reserve_import(self, import_id: str, request_id: str, mode: str, positions: int,
                       layouts: list[Layout], expires_s: float) -> StagedImport:
        """Reserves KV budget for a state about to arrive (its data is not here yet).

        Args:
            import_id: its name, unique on this worker.
            request_id: its session's request (an earlier import of the same request is dropped).
            mode: "plain" or "dflash".
            positions: positions its caches hold, >= 1.
            layouts: its caches' layouts (target then draft), checked against this worker's.
            expires_s: clock time when it is dropped unless claimed.

        Raises:
            StateMismatch: positions < 1, a mode this worker cannot decode, or layouts (count,
                dtype, heads, head sizes) other than this worker's (`StagedImports.check`).
            Overloaded: its bytes do not fit the KV budget now (the message has the numbers).
        """
        self.imports.check(mode, positions, layouts)
        self.imports.drop_request(request_id)
        need = self.row_bytes(mode, positions)
        over = self.projected_bytes() + need - self.budget
        if over > 0:
            self.prompt_cache.trim_to(self.prompt_cache.nbytes - over)
        have = self.budget - self.projected_bytes()
        if need > have:
            raise Overloaded(f"the state needs {need:,} bytes of KV cache; {max(0, have):,} of this worker's "
                             f"{self.budget:,} are free")
        return self.imports.reserve(StagedImport(import_id, request_id, mode, positions, need, expires_s))

    def _advance_generator(self, s: Session) -> None:
        rid = s.request.request_id
        try:
            step = next(s.steps, None)
            if step is None:
                s.flush()
                s.done_reason = "length"
            else:
                s.on_step(step, self.clock())
        except Exception as e:
            log.exception("request %s failed", rid)
            self.generators.pop(rid, None)
            _close(s)
            self._finish(s, error=e)
            return
        if s.done_reason:
            self.generators.pop(rid, None)
            _close(s)
            self._finish(s)

    def _finish(self, s: Session, error: Optional[Exception] = None) -> None:
        """Releases a session's capacity, then emits its final event."""
        rid = s.request.request_id
        self.release(rid)
        event = ErrorEvent(rid, error) if error is not None else s.done_event(s.done_reason or "length", self.clock())
        try:
            s.emit(event)
        except Exception:
            log.exception("emit failed for %s", rid)


def _common_prefix(a, b) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _close(s: Session) -> None:
    try:
        s.steps.close()
    except Exception:
        log.exception("request %s: closing its generator failed", s.request.request_id)
