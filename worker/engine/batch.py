"""Decoding as functions over a batch of sessions: one plain step, or one DFlash cycle, for all rows.

A `Batch` holds the rows of one decoding method: each row's caches live in shared `RowKVCache`s
(one per layer) with their own lengths, so rows join after their prefill, leave when done, and roll
back independently. Per row the state between iterations is (n = committed tokens, b = the last):

    target cache   positions [0, n-1)             every committed token but b
    draft cache    context [0, n-1-S)             DFlash only
    pending        taps of positions [n-1-S, n-1) DFlash only: not yet in the draft's context

`plain_step` runs one target forward of the B last tokens. `dflash_cycle` (DFlash, Chen et al.
2026, arXiv 2602.06036; the cycle of z-lab/dflash) runs one draft forward proposing L-1 tokens
for every row (injecting each row's pending taps), one target forward verifying all B x L
tokens, and computes each row's verdict on the device: row r accepts its drafts while they equal
the target's own choice, commits them and the target's bonus token, and keeps j_r + 1 of its L
verified positions (its cache length moves; nothing is copied). One host synchronisation per
iteration reads every row's tokens. Output is the target's own choice at every position
(greedy: its argmax; sampled: its draw keyed by sequence position, `worker.sampling.sample_rows`),
so each row's output does not depend on the rows beside it. A row with a grammar (structured
output, worker/engine/grammar.py) chooses among the tokens its grammar allows at each position,
and its draft proposes only such tokens. A row with penalties or a logit bias
(worker/engine/penalties.py) chooses from its penalised logits, each verified position under the
penalty state after the drafts before it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import mlx.core as mx
import numpy as np

from worker.caches.rows import RowKVCache, as_attention_mask, share_lengths
from worker.engine.grammar import RowGrammar, allowed
from worker.engine.penalties import RowPenalties
from worker.engine.types import TokenLogprob
from worker.sampling import greedy, sample_rows
from worker.decoding.base import Sampler

FLUSH_PENDING = 32  # pending taps a row may hold while the batch decodes plainly
GRAMMAR_CANDIDATES = 16  # a constrained row's draft candidates a position, walked along its grammar


@dataclass
class Row:
    """What a batch needs of one session each iteration.

    Attributes:
        sampler: the session's sampler (greedy: `worker.sampling.greedy`).
        n: committed sequence length (prompt + generated), tokens.
        last: the last committed token id (b).
        request_id: the session's request (for logs and tests).
        grammar: the row's grammar matcher (structured output, worker/engine/grammar.py), or None.
        top_logprobs: -1, or the alternatives each of its tokens' `TokenLogprob` lists.
        penalties: the row's penalties and logit bias (worker/engine/penalties.py), or None.
    """

    sampler: Sampler
    n: int
    last: int
    request_id: str = ""
    grammar: Optional[RowGrammar] = None
    top_logprobs: int = -1
    penalties: Optional[RowPenalties] = None

    def commit(self, tokens: list[int], eos_ids, remaining: int) -> tuple[list[int], bool]:
        """A forward's new tokens for this row, cut after the first EOS and to `remaining`;
        advances n, last, the grammar and the penalty counts. Returns (the tokens kept, whether an
        EOS ended the row).

        Raises:
            RuntimeError: the grammar refused a token (`RowGrammar.advance`)."""
        stop = next((i for i, t in enumerate(tokens) if t in eos_ids), None)
        kept = tokens[: (len(tokens) if stop is None else stop + 1)][:remaining]
        self.n += len(kept)
        self.last = kept[-1]
        if self.grammar is not None:
            self.grammar.advance(kept)
        if self.penalties is not None:
            self.penalties.advance(kept)
        return kept, stop is not None and stop < remaining


@dataclass
class Batch:
    """The rows of one decoding method and their caches.

    Attributes:
        target: one `RowKVCache` per target layer, B rows.
        draft: one `RowKVCache` per draft layer (DFlash), or None.
        pending: (B, P, n_taps * D) target taps not yet in the draft's context, or None (P = 0).
        pending_len: real taps per row (<= P); the rest of a row is padding.
        rows: per row, `Row`.
        logprobs: the last forward's `TokenLogprob`s of each row that asks for them, by row index,
            one per verified position (the committed ones are its first).
    """

    target: list[RowKVCache]
    draft: Optional[list[RowKVCache]] = None
    pending: Optional[mx.array] = None
    pending_len: list[int] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def caches(self) -> list[RowKVCache]:
        return self.target + (self.draft or [])

    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches) + (0 if self.pending is None else self.pending.nbytes)

    def join(self, row: Row, target: list[RowKVCache], draft: Optional[list[RowKVCache]]) -> None:
        """Appends a prefilled session (one-row caches holding n-1 positions; no pending taps).

        Each layer's buffers are copied and evaluated in turn, so the copy's transient memory is
        one layer's buffer, not the whole cache's."""
        for mine, theirs in zip(self.caches, target + (draft or [])):
            mine.extend(theirs)
            mx.eval(mine.state)
        share_lengths(self.target)
        share_lengths(self.draft or [])
        if self.draft is not None:
            if self.pending is not None:
                pad = mx.zeros((1, *self.pending.shape[1:]), self.pending.dtype)
                self.pending = mx.concatenate([self.pending, pad])
            self.pending_len.append(0)
        self.rows.append(row)

    def keep(self, indices: Sequence[int]) -> None:
        """Keeps these rows, in this order (the others leave)."""
        indices = list(indices)
        for c in self.caches:  # layer by layer: one layer's buffer of transient memory
            c.keep_rows(indices)
            mx.eval(c.state)
        share_lengths(self.target)
        share_lengths(self.draft or [])
        if self.draft is not None:
            self.pending_len = [self.pending_len[i] for i in indices]
            if self.pending is not None:
                self.pending = self.pending[mx.array(indices, dtype=mx.int32)] if indices else None
        self.rows = [self.rows[i] for i in indices]

    def reserve(self, L: int) -> None:
        """Grows every buffer, layer by layer, for an iteration of block size L."""
        P = 0 if self.pending is None else self.pending.shape[1]
        for c in self.target:
            c.reserve(L)
        for c in self.draft or []:
            c.reserve(P + L)

    def positions_after(self, new_tokens: int) -> int:
        """Buffer positions a row after a forward of `new_tokens` a row (for the memory budget)."""
        return max((c.buffer_length(new_tokens) for c in self.target[:1]), default=0)


def prefill_chunk(target: Any, tokens: Sequence[int], cache: list[RowKVCache], draft: Any = None,
                  draft_cache: Optional[list[RowKVCache]] = None, capture: Any = None,
                  following: Optional[Sequence[int]] = None, top: int = 0) -> list[TokenLogprob]:
    """Feeds `tokens` (a prompt chunk) through the target into a one-row cache; with a DFlash
    draft, their target taps go into the draft's context too. Grows the buffers first, layer by
    layer, then evaluates the caches.

    Scoring (prompt log-probabilities): with `following`, the token after each of `tokens`
    (len(tokens) ids), returns each following token's `TokenLogprob` under the target's logits
    at the position before it, with `top` alternatives (evaluated with the caches); else [].
    """
    for c in cache + (draft_cache or []):
        c.reserve(len(tokens))
    x = mx.array(list(tokens), dtype=mx.uint32)[None]
    if draft is None:
        logits = target(x, cache=cache)
    else:
        with capture:
            logits = target(x, cache=cache)
        draft.extend_context(capture.hidden(), draft_cache)
    parts = None
    if following is not None:
        parts = _logprob_parts(logits, mx.array([list(following)], dtype=mx.int32), top)
    mx.eval([c.state for c in cache + (draft_cache or [])], *(parts or ()))
    if parts is None:
        return []
    return _host_logprobs((([0],) + parts), [list(following)], [top])[0]


def choose(logits: mx.array, rows: Sequence[Row], masks: Optional[dict[int, np.ndarray]] = None,
           blocks: Optional[mx.array] = None) -> mx.array:
    """Each row's tokens at its L positions: (B, L, V) logits -> (B, L) uint32. Greedy rows take
    the argmax; sampled rows draw keyed by the sequence position of each token. A row with
    penalties chooses from its penalised logits, position j under the penalty state after the
    first j drafted tokens of its block (`blocks` (B, L): [b, d_1 .. d_{L-1}]; None when L = 1).
    A row with `masks[i]` ((L, W) int32 bit masks, worker/engine/grammar.py) chooses among the
    tokens its mask allows at each position; the other rows' choices are computed as without it."""
    masks = masks or {}
    chosen = greedy(logits).astype(mx.uint32)
    special = [i for i, r in enumerate(rows)
               if r.sampler is not greedy or i in masks or r.penalties is not None]
    if not special:
        return chosen
    parts = []
    for i, r in enumerate(rows):
        if i not in special:
            parts.append(chosen[i])
            continue
        lg = logits[i]
        if r.penalties is not None:
            lg = r.penalties.apply(lg, None if blocks is None or blocks.shape[1] < 2 else blocks[i, 1:])
        if i in masks:
            lg = mx.where(allowed(masks[i], lg.shape[-1]), lg, -mx.inf)
        parts.append((greedy(lg) if r.sampler is greedy else sample_rows(r.sampler, lg, r.n)).astype(mx.uint32))
    return mx.stack(parts)


def logprobs_of(logits: mx.array, chosen: mx.array, rows: Sequence[Row]) -> Optional[tuple]:
    """Log-probabilities of the chosen tokens, and the most likely tokens, of the rows that ask
    for them (`Row.top_logprobs` >= 0), from the target's raw logits (B, L, V) and choices
    (B, L): (row indices, chosen logprobs (b, L), top ids (b, L, k), top logprobs (b, L, k)) as
    lazy arrays, k the largest number asked (at least 1); None when no row asks."""
    want = [i for i, r in enumerate(rows) if r.top_logprobs >= 0]
    if not want:
        return None
    index = mx.array(want, dtype=mx.int32)
    return (want, *_logprob_parts(logits[index], chosen[index], max(rows[i].top_logprobs for i in want)))


def _logprob_parts(logits: mx.array, tokens: mx.array, k: int) -> tuple[mx.array, mx.array, mx.array]:
    """Log-softmax in float32 of logits (b, L, V): (the logprobs of `tokens` (b, L), the ids
    (b, L, max(1, k)) of the most likely tokens, unordered, and their logprobs), lazy."""
    lg = logits.astype(mx.float32)
    lp = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
    picked = mx.take_along_axis(lp, tokens.astype(mx.int32)[..., None], axis=-1)[..., 0]
    k = max(1, k)
    top = mx.argpartition(-lp, kth=k - 1, axis=-1)[..., :k]
    return picked, top, mx.take_along_axis(lp, top, axis=-1)


def _host_logprobs(parts: Optional[tuple], chosen: list[list[int]], rows: Sequence[Row | int]
                   ) -> dict[int, list[TokenLogprob]]:
    """`logprobs_of`'s arrays (evaluated) as `TokenLogprob`s by row index, per position; `rows`
    gives each row's number of alternatives (a `Row`'s top_logprobs, or the number)."""
    if parts is None:
        return {}
    want, picked, top, top_lp = parts
    picked, top, top_lp = picked.tolist(), top.tolist(), top_lp.tolist()
    out = {}
    for k, i in enumerate(want):
        n = rows[i] if isinstance(rows[i], int) else rows[i].top_logprobs
        out[i] = [TokenLogprob(chosen[i][j], picked[k][j],
                               tuple(sorted(zip(top[k][j], top_lp[k][j]), key=lambda p: -p[1])[:n]))
                  for j in range(len(picked[k]))]
    return out


def grammar_masks(rows: Sequence[Row]) -> dict[int, np.ndarray]:
    """The next token's (1, W) mask of every constrained row, by row index."""
    return {i: r.grammar.masks() for i, r in enumerate(rows) if r.grammar is not None}


def penalty_state(rows: Sequence[Row]) -> list[mx.array]:
    """The penalised rows' device state (evaluated with the iteration's read-back)."""
    return [a for r in rows if r.penalties is not None for a in r.penalties.state()]


def read_rows(out: mx.array, *also: mx.array) -> list[list[int]]:
    """The iteration's one host synchronisation: evaluates `out` (B, N) and `also` (device state
    the next iteration reads, evaluated with it so its graph does not grow), and reads `out` back
    with one `tolist`."""
    mx.eval(out, *also)
    return out.tolist()


def plain_step(target: Any, batch: Batch) -> list[list[int]]:
    """One decode step of every row: (B, 1) last tokens through the target; returns each row's
    one new token (a constrained row's among the tokens its grammar allows). The caches gain the
    last tokens' positions."""
    batch.reserve(1)
    x = mx.array([[r.last] for r in batch.rows], dtype=mx.uint32)
    logits = target(x, cache=batch.target)
    tokens = choose(logits[:, -1:, :], batch.rows, grammar_masks(batch.rows))
    parts = logprobs_of(logits[:, -1:, :], tokens, batch.rows)
    out = read_rows(tokens, *(parts[1:] if parts else ()), *penalty_state(batch.rows))
    batch.logprobs = _host_logprobs(parts, out, batch.rows)
    return out


def _concat_pending(batch: Batch, taps: mx.array, kept: Sequence[int]) -> None:
    """Appends `kept[r]` taps of row r (taps (B, L, F)) to its pending taps."""
    B, L, F = taps.shape
    if batch.pending is None or not any(batch.pending_len):
        batch.pending, batch.pending_len = taps, list(kept)
        return
    # Row r's new taps go right after its own pending ones: a scatter into a buffer of P + L.
    buf = mx.concatenate([batch.pending, mx.zeros((B, L, F), taps.dtype)], axis=1)
    pos = mx.array(batch.pending_len, dtype=mx.int32)[:, None] + mx.arange(L, dtype=mx.int32)[None]
    buf = mx.put_along_axis(buf, mx.broadcast_to(pos[:, :, None], taps.shape), taps, axis=1)
    batch.pending = buf
    batch.pending_len = [p + k for p, k in zip(batch.pending_len, kept)]


def _draft_layer_mask(attn: Any, qpos: mx.array, end: mx.array, S: int, dtype) -> mx.array:
    """(B, 1, L, S) mask of a draft layer: block queries (positions qpos (B, L)) see keys below
    `end` (B,) (bidirectional inside the block unless the layer is causal; windowed if it is)."""
    kpos = mx.arange(S, dtype=mx.int32)[None, None]
    q = qpos[:, :, None]
    visible = kpos < end[:, None, None]
    if attn.causal:
        visible = visible & (kpos <= q)
    if attn.window:
        visible = visible & (q - kpos < attn.window)
        if not attn.causal:
            visible = visible & (kpos - q < attn.window)
    return as_attention_mask(visible[:, None], dtype)


def draft_block(draft: Any, batch: Batch, L: int) -> mx.array:
    """The draft's proposals for every row: (B, L) uint32 blocks [b, d_1 .. d_{L-1}].

    Injects each row's pending taps into its draft context (written at [T_r, T_r + S_r); padding
    taps land past the block, beyond every mask) and attends the block [b, MASK x (L-1)] to the
    row's context; the block's K/V are dropped afterwards (lengths move to T_r + S_r). A
    constrained row drafts along its grammar (`RowGrammar.draft`): its logits come to the host.
    """
    cache = batch.draft
    rows = batch.rows
    B = len(rows)
    first = mx.array([[r.last] for r in rows], dtype=mx.uint32)
    block = mx.concatenate([first, mx.full((B, L - 1), draft.mask_token_id, mx.uint32)], axis=1)
    h = draft.block_embeddings(block)
    T = cache[0].lengths
    S = mx.array(batch.pending_len, dtype=mx.int32)
    P = 0 if batch.pending is None else batch.pending.shape[1]
    ctx = draft.context(batch.pending) if P else None
    arangeP = mx.arange(P, dtype=mx.int32)[None]
    arangeL = mx.arange(L, dtype=mx.int32)[None]
    start = T + S  # block position of b in each row
    ctx_pos = mx.where(arangeP < S[:, None], T[:, None] + arangeP, start[:, None] + L + arangeP - S[:, None])
    positions = mx.concatenate([ctx_pos, start[:, None] + arangeL], axis=1) if P else start[:, None] + arangeL
    extent = P + L
    masks: dict = {}
    for layer, c in zip(draft.layers, cache):
        a = layer.self_attn
        x = layer.input_layernorm(h)
        kb, vb = a.keys_values(x, start)
        if P:
            kc, vc = a.keys_values(ctx, T)
            kb, vb = mx.concatenate([kc, kb], axis=2), mx.concatenate([vc, vb], axis=2)
        c.write(kb, vb, positions, extent)
        kind = (a.window, a.causal)
        if kind not in masks:
            masks[kind] = _draft_layer_mask(a, start[:, None] + arangeL, start + L, c.keys.shape[2], None)
        q = a.queries(x, start)
        h = h + a.attend(q, c.keys, c.values, masks[kind])
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    new_T = [t + s for t, s in zip(cache[0].host_lengths, batch.pending_len)]
    for c in cache:
        c.set_lengths(new_T, start)
    batch.pending, batch.pending_len = None, [0] * B
    logits = draft.head(draft.norm(h)[:, 1:])
    penalised = [i for i, r in enumerate(rows) if r.penalties is not None]
    if penalised:  # with the committed tokens' penalty state (the block's own drafts not counted)
        logits = _replace_rows(logits, penalised,
                               mx.stack([rows[i].penalties.apply(logits[i], ids=draft.vocab) for i in penalised]
                                        ).astype(logits.dtype))
    drafted = draft.draft_tokens(logits).astype(mx.uint32)
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
    if constrained:  # only their C best candidates a position come to the host
        sub = logits[mx.array(constrained)]
        C = min(GRAMMAR_CANDIDATES, sub.shape[-1])
        top = mx.argpartition(-sub, kth=C - 1, axis=-1)[..., :C]
        scores = mx.take_along_axis(sub, top, axis=-1).astype(mx.float32)
        if draft.vocab is not None:
            top = draft.vocab[top]
        top, scores = np.array(top), np.array(scores)
        legal = [rows[i].grammar.draft(top[k], scores[k]) for k, i in enumerate(constrained)]
        drafted = _replace_rows(drafted, constrained, mx.array(legal, dtype=mx.uint32))
    return mx.concatenate([first, drafted], axis=1)


def _replace_rows(x: mx.array, indices: list[int], values: mx.array) -> mx.array:
    """x (B, ...) with rows `indices` replaced by `values` (len(indices), ...)."""
    index = mx.array(indices, dtype=mx.int32)
    out = mx.array(x)
    out[index] = values
    return out


def flush_pending(draft: Any, batch: Batch) -> None:
    """Injects every row's pending taps into its draft context without drafting."""
    if batch.pending is None or not any(batch.pending_len):
        batch.pending, batch.pending_len = None, [0] * batch.size
        return
    cache = batch.draft
    T = cache[0].lengths
    S = mx.array(batch.pending_len, dtype=mx.int32)
    P = batch.pending.shape[1]
    # Row r's taps at T_r + p; its padding (p >= S_r) lands past its new end, T_r + S_r, where the
    # next write overwrites it.
    positions = T[:, None] + mx.arange(P, dtype=mx.int32)[None]
    ctx = draft.context(batch.pending)
    for layer, c in zip(draft.layers, cache):
        a = layer.self_attn
        k, v = a.keys_values(ctx, T)
        c.write(k, v, positions, P)
    new_T = [t + s for t, s in zip(cache[0].host_lengths, batch.pending_len)]
    for c in cache:
        c.set_lengths(new_T, T + S)
    batch.pending, batch.pending_len = None, [0] * batch.size


@dataclass(frozen=True)
class CycleResult:
    """One DFlash iteration's outcome per row: committed tokens (accepted drafts + the bonus) and
    accepted draft count (bonus not counted); L is the block size run (1 = a plain step)."""

    tokens: list[list[int]]
    accepted: list[int]
    block_size: int


def dflash_cycle(target: Any, draft: Any, capture: Any, batch: Batch, L: int) -> CycleResult:
    """One iteration of batched DFlash at block size L for every row (L = 1: a plain step that
    still records the taps the draft will need).

    Args:
        target: the mlx-lm target.
        draft: a bound `worker.models.dflash.Model`.
        capture: a `worker.capture.HiddenCapture` of the target at the draft's tapped layers.
        batch: the DFlash batch (`Batch` with draft caches), B >= 1 rows.
        L: block size, 1 <= L <= the draft's trained block size.

    Returns:
        Per row its committed tokens (1 .. L) and accepted draft tokens; the caches hold the
        committed positions, the batch's pending taps those of the committed tokens but the last.
    """
    rows = batch.rows
    batch.reserve(L)
    if L == 1:
        if batch.pending is not None and (batch.pending.shape[1] >= FLUSH_PENDING
                                          or len(set(batch.pending_len)) > 1):
            flush_pending(draft, batch)
        blocks = mx.array([[r.last] for r in rows], dtype=mx.uint32)
        masks = grammar_masks(rows)
    else:
        blocks = draft_block(draft, batch, L)
        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        drafts = np.array(blocks[mx.array(constrained), 1:]).tolist() if constrained else []
        masks = {i: rows[i].grammar.verify_masks(d) for i, d in zip(constrained, drafts)}
    with capture:
        logits = target(blocks, cache=batch.target)
    taps = capture.hidden()
    chosen = choose(logits, rows, masks, blocks)
    parts = logprobs_of(logits, chosen, rows)
    if L > 1:
        accepted = mx.cumprod((blocks[:, 1:] == chosen[:, :-1]).astype(mx.int32), axis=1).sum(axis=1)
    else:
        accepted = mx.zeros((len(rows),), mx.int32)
    # One read-back: each row's L chosen tokens, then its accepted count (and the log-probabilities
    # of the rows that ask for them, evaluated with it).
    out = read_rows(mx.concatenate([chosen, accepted.astype(mx.uint32)[:, None]], axis=1), taps,
                    *(parts[1:] if parts else ()), *penalty_state(rows))
    acc = [r[L] for r in out]
    batch.logprobs = _host_logprobs(parts, [r[:L] for r in out], rows)
    kept = [j + 1 for j in acc]
    new_len = [n - L + k for n, k in zip(batch.target[0].host_lengths, kept)]
    device_len = batch.target[0].lengths - L + accepted + 1
    for c in batch.target:
        c.set_lengths(new_len, device_len)
    _concat_pending(batch, taps, kept)
    return CycleResult([r[:k] for r, k in zip(out, kept)], acc, L)
