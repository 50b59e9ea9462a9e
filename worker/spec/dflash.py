"""DFlash speculative decoding: a block-diffusion draft proposes B-1 tokens in one forward, the
target verifies them in one forward (Chen et al. 2026, "DFlash: Block Diffusion for Flash
Speculative Decoding", arXiv 2602.06036; cycle as in z-lab/dflash `dflash/model_mlx.py`, see
/work/shared/research/dflash.md §3).

State between cycles (P = prompt + generated tokens committed so far; b = the last of them):

    target cache  positions [0, P-1)        every committed token except b
    draft cache   context K/V [0, P-1-S)    plus S pending taps not yet injected
    pending       target taps of positions [P-1-S, P-1), fed to the next draft call

One cycle at block size bs (2 <= bs <= B):
    draft   d = argmax draft([b, MASK x (bs-1)], pending)       bs-1 tokens; injects the pending taps
    verify  logits, taps = target([b] + d)                      one forward, taps captured
            t = sampler(logits)                                 the target's own choice per position
    accept  j = longest prefix with d[i] == t[i]; commit t[:j+1] (j drafts + the bonus t[j])
    rollback target cache trimmed by bs-(j+1); pending = taps[:, :j+1]

So the target keeps j+1 of the bs verified positions, the draft gains exactly those positions one
cycle later, and the new bonus token belongs to neither cache. Every emitted token is the target's
own choice (argmax, or its sample from `sampler`), so the output is the target's at any
temperature: lossless, though not Leviathan-style rejection sampling (at T > 0 acceptance is lower
than it could be, note §3.3). The draft always proposes its argmax: P(target sample == d) = p(d)
is highest at the mode, and drafting uses none of the sampler's random state.

Speed (note §3.4): one host sync per cycle (the accept read-back); the next cycle's draft is
queued with `mx.async_eval` before the Step is yielded, so the device drafts while the host
handles the Step. With the compiled draft it is queued earlier still (`overlap_draft`): the
verdict is computed on the device (`verdict`), and the draft whose first token is the bonus and
whose new context is the chosen row's first j+1 taps goes in right behind the verify, before the
read-back; the host learns j afterwards and only moves offsets. Block K/V of the draft are
written into its cache buffer and trimmed (O(1)) instead of being concatenated with the context
in every layer. Both caches are `PaddedKVCache`s:
multi-token attention keeps one key length per 256 positions, because MLX's CUDA backend compiles
that kernel for every new length (H200: ~65 ms each; a DFlash cycle fell from 116 ms to 13 ms with
draft 1.9 ms + verify 7.1 ms measured alone). Timing a cycle's draft and verify apart costs a
second sync and is done only on cycles chosen by `time_every` or the policy (for metrics); the
policy's cost model gets the untimed cycles' own wall time instead (one sync, the draft queued
ahead, as the cycles it predicts run).
"""
from __future__ import annotations

import time
from typing import Iterable, Iterator, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from worker.capture import HiddenCapture
from worker.compiled_draft import shared_compiled_draft
from worker.compiled_forward import compilable, shared_compiled_target
from worker.models.dflash import Model as DFlashDraft, PaddedKVCache, takes_additive_masks
from worker.sampling import greedy, sample_rows
from worker.spec.base import Sampler, Step, release_buffer_cache
from worker.spec.cost_model import AdaptiveBlockPolicy
from worker.spec.plain import CLEAR_CACHE_EVERY_TOKENS

_FLUSH_PENDING = 32  # plain steps between draft-context flushes while not drafting


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def make_target_cache(target: nn.Module) -> list:
    """The target's prompt cache with every layer trimmable.

    Plain `KVCache`s become `PaddedKVCache`s, so a verify's attention keeps its key length for
    256 positions at a time (on CUDA every new length of a multi-query attention costs a kernel
    compile; see `PaddedKVCache`). Sliding-window layers' `RotatingKVCache`s stop being trimmable
    once they wrap (mlx-lm #1423), so they are replaced too: mlx-lm models pass `window_size`
    when they build the mask of a sliding layer, and `make_mask` honours it, so attention is
    unchanged (memory of those layers grows with the context instead of staying at the window).
    Masks are additive where the architecture takes them (`takes_additive_masks`).

    Raises:
        ValueError: some layer's cache cannot be trimmed (e.g. recurrent GatedDeltaNet state).
    """
    additive_ok = takes_additive_masks(target)
    cache = [PaddedKVCache(additive_ok) if type(c) in (KVCache, RotatingKVCache) else c
             for c in make_prompt_cache(target)]
    bad = {type(c).__name__ for c in cache if not c.is_trimmable()}
    if bad:
        raise ValueError(f"DFlash needs a trimmable target cache; got {sorted(bad)}")
    return cache


def cycle_shapes_seen(target) -> set:
    """(block size, target KV buffer length, draft context buffer length, candidate rows) of
    every cycle this process has run on `target` under a cost policy (kept on the model
    object). A shape's first cycle traces a new compiled graph and, on CUDA, compiles its kernels
    (one attention kernel alone took ~65 ms on the H200, a usual cycle ~10 ms), so
    `dflash_generate` does not feed its time to the policy."""
    store = target.__dict__.get("_flashfleet_cycle_shapes")
    if store is None:
        store = set()
        object.__setattr__(target, "_flashfleet_cycle_shapes", store)
    return store


DEFAULT_CUDA_BRANCHES = 4  # candidate rows per verify on CUDA with cuBLAS's matmuls ("Candidate blocks, warm")
SMALL_GEMM_CUDA_BRANCHES = 1  # ... with worker.small_gemm's ("Small matmuls in one kernel")


def default_branches(small_gemm: bool = False) -> int:
    """Candidate blocks per verify a worker uses unless told (`EngineConfig.branches` None).

    Args:
        small_gemm: whether the target's linears run `worker.small_gemm` (the worker's default on
            CUDA).

    Returns:
        On CUDA: `SMALL_GEMM_CUDA_BRANCHES` (1) with small_gemm, else `DEFAULT_CUDA_BRANCHES` (4);
        elsewhere 1. Measured on the H200 only. With cuBLAS a small target's verify is bound by
        per-operation overhead, so 4 rows of 16 tokens cost 9-12% more cycle time than one and
        add 11-17% to tau (ahead of one block in 10 of 12 comparisons, session 26). With
        small_gemm a one-row verify got 29% cheaper (on 2 of 3 machines) and 4 rows less so
        (their 64-row MLP matmuls stay on cuBLAS, `small_gemm.pays`): under the cost model one
        row ran ahead of 4 rows on cuBLAS in 6 of 6 comparisons (median speedup; 4 of 6 by
        tok/s) and of 4 rows on the small kernel in 2 of 3 (session 28, docs/benchmarks.md). On the CPU a K-row verify computes K times the
        tokens, and no Apple GPU has been measured, so both keep one block (`flashfleet worker
        --branches K` sets it).
    """
    if not mx.cuda.is_available():
        return 1
    return SMALL_GEMM_CUDA_BRANCHES if small_gemm else DEFAULT_CUDA_BRANCHES


def verdict(blocks: mx.array, chosen: mx.array) -> mx.array:
    """The verdict of a verify of candidate rows, computed on the device (no host sync).

    Args:
        blocks: (K, L) integer candidate blocks, per row [first token, d_1 .. d_{L-1}].
        chosen: (K, L) integer, per row the target's token after each of that row's positions.

    Returns:
        (3,) int32 [row, accepted, bonus]: row r accepts d_1..d_j while d_i equals the target's
        choice after d_{i-1}; the row accepted furthest wins, the lowest such row on a tie (the
        draft's own block, row 0, unless another row got further); bonus = chosen[row, j], the
        target's token after the last accepted draft. On the device so that the next cycle's
        draft can be queued behind the verify before the host reads anything (`overlap_draft`).
    """
    L = blocks.shape[1]
    accepted = mx.cumprod((blocks[:, 1:] == chosen[:, :-1]).astype(mx.int32), axis=1).sum(axis=1)
    row = mx.argmax(accepted).astype(mx.int32)
    j = accepted[row]
    return mx.stack([row, j, chosen.reshape(-1)[row * L + j].astype(mx.int32)])


def dflash_generate(
    prompt_tokens: list[int],
    max_tokens: int,
    sampler: Sampler,
    eos_ids: Iterable[int],
    *,
    target: nn.Module,
    draft,
    block_size: Optional[int] = None,
    policy: Optional[AdaptiveBlockPolicy] = None,
    time_every: int = 0,
    target_cache: Optional[list] = None,
    draft_cache: Optional[list] = None,
    prefill_step_tokens: int = 512,
    queue_taps: bool = False,
    compile_target: bool = False,
    compile_draft: bool = False,
    branches: int = 1,
    branch_max_positions: int = 2048,
    overlap_draft: bool = True,
    stream=generation_stream,
) -> Iterator[Step]:
    """Decodes with a DFlash draft; yields one `Step` for the first token, then one per cycle.

    Args:
        prompt_tokens: prompt token ids, non-empty.
        max_tokens: at most this many tokens are yielded in total (> 0).
        sampler: the target's token choice, logits (N, V) -> ids (N,); greedy = argmax.
        eos_ids: generation ends after the first of these (tokens after it are dropped).
        target: an mlx-lm model with a `layers` list.
        draft: a `worker.models.dflash.Model` (bound to `target` here), or an object with the
            same `__call__`, `propose`, `extend_context`, `make_cache`, `bind`,
            `target_layer_ids`, `mask_token_id` and `block_size`.
        block_size: B, tokens per block (last token + B-1 drafts); default the draft's. 1 means
            plain decoding through the same loop.
        policy: optional adaptive block-size policy (`AdaptiveBlockPolicy`); it picks each
            cycle's block size (<= B), including 1 (plain steps) when speculation does not pay,
            from the wall time of plain steps and untimed speculative cycles.
        time_every: without a policy, time draft and verify apart on every n-th cycle
            (0 = never; untimed cycles report draft_s = verify_s = 0). Plain steps (bs = 1) are
            always timed (verify_s), at no extra cost.
        target_cache / draft_cache: empty caches to use (the caller can inspect them between
            Steps); default `make_target_cache(target)` and `draft.make_cache()`.
        prefill_step_tokens: prompt tokens per prefill forward (plain decoding's default, so
            the prefill numerics match it).
        queue_taps: queue each tapped layer's output for evaluation as the verify's graph is
            built (`HiddenCapture` `queue`): the same tokens; whether it is faster is measured
            by `bench/bench_dflash.py --queue-taps`.
        compile_target: run every verify and plain step after the prefill as one compiled graph
            (`worker.compiled_forward.CompiledTarget`, shared by the target's sessions) where
            `compilable` allows it; the prefill's chunks stay uncompiled (their lengths vary).
            `queue_taps` does not apply to compiled forwards (a trace cannot queue).
        compile_draft: run each cycle's draft forward and proposal as one compiled graph
            (`worker.compiled_draft.CompiledDraft`, shared by the draft's sessions) when `draft`
            is a `worker.models.dflash.Model`; the same proposals.
        branches: verify up to this many candidate blocks per cycle in one batched target
            forward (`Model.propose`: the draft's block, and copies of it with its second choice
            at one position each); the cycle keeps the row accepted furthest. Only with the
            compiled verify and the greedy sampler, and while the target's KV buffer stays within
            `branch_max_positions` (the session's caches then hold views of K-row buffers of that
            length until its next cycle, counted in their `nbytes`); otherwise one block. The
            output is unchanged (every committed token is the target's greedy choice after its
            own prefix); tau rises where second choices are right.
        branch_max_positions: see `branches`.
        overlap_draft: with the compiled draft, queue the next cycle's draft on the device right
            behind the verify, before the host reads the verdict (`verdict` on the device gives
            its first token and how many of the verified taps become context;
            `CompiledDraft.queue`): the device drafts while the host reads back, trims and
            builds the next verify, instead of idling while the host launches the draft.
            Untimed cycles only. The next cycle's block size and row count are then chosen
            before this cycle's verdict is known: the policy has not seen this cycle yet, near
            max_tokens the block assumes one token from it, and near `branch_max_positions`
            rows are counted from the untrimmed cache (one row up to bs-1 positions sooner).
            So the block schedule can differ from the serial order's (False); every committed
            token is still the target's own choice, though in bf16 another schedule can
            resolve a near-tie differently, as any change of block size can.
        stream: MLX stream to run on; entered around each piece of work, never across a
            `yield`, so several generators can interleave on one thread.

    Yields:
        Step(tokens, drafted, accepted, draft_s, verify_s). `drafted` = bs-1 and `accepted` = j
        (the target's verdict, bonus not counted; acceptance is a prefix, so position i of the
        block was accepted iff i < accepted). `tokens` has accepted+1 ids unless cut at EOS.

    Raises:
        ValueError: empty prompt, max_tokens < 1, block_size < 1, policy sizes above block_size,
            non-empty or untrimmable caches (raised at the first `next`).
    """
    if not prompt_tokens:
        raise ValueError("empty prompt")
    B = int(block_size if block_size is not None else draft.block_size)
    if B < 1:
        raise ValueError("block_size must be >= 1")
    if policy is not None and max(policy.candidates) > B:
        raise ValueError(f"policy block sizes {policy.candidates} exceed block_size {B}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    eos = frozenset(int(e) for e in eos_ids)
    draft.bind(target)
    tc = make_target_cache(target) if target_cache is None else target_cache
    dc = draft.make_cache() if draft_cache is None else draft_cache
    if any(c.offset for c in tc) or any(c.offset for c in dc):
        raise ValueError("dflash_generate needs empty caches")
    cap = HiddenCapture(target, draft.target_layer_ids, queue=queue_taps)
    masks = [int(draft.mask_token_id)] * (B - 1)
    compiled = (shared_compiled_target(target, draft.target_layer_ids)
                if compile_target and compilable(target, tc) else None)

    def verify(x: mx.array, prefill_chunk: bool = False):
        if compiled is not None and not prefill_chunk and tc[0].keys is not None:
            return compiled(x, tc)
        with cap:
            logits = target(x, cache=tc)
        return logits, cap.hidden()

    compiled_draft = shared_compiled_draft(draft) if compile_draft and isinstance(draft, DFlashDraft) else None
    # Candidate rows need the compiled verify and greedy decoding (a row's tokens are the
    # target's argmax after that row's own prefix; sampled rows would need shared draws).
    max_rows = max(1, int(branches)) if compiled is not None and sampler is greedy else 1

    def rows_for(bs: int) -> int:
        if max_rows == 1 or bs < 2 or tc[0].keys is None or tc[0].key_length(bs) > branch_max_positions:
            return 1
        return min(max_rows, bs) if compiled.branches_fit(tc, bs) else 1

    def launch_draft(b: int, bs: int, pending: list) -> mx.array:
        """Queues the draft; returns the candidate blocks to verify, (rows, bs) uint32 target ids."""
        hidden = None if not pending else pending[0] if len(pending) == 1 else mx.concatenate(pending, axis=1)
        block = mx.array([[b] + masks[: bs - 1]], dtype=mx.uint32)
        rows = rows_for(bs)
        if compiled_draft is not None:
            return compiled_draft(block, hidden, dc, rows)
        return draft.propose(draft(block, hidden, dc)[0], block[0, :1], rows)

    n_seq = len(prompt_tokens)  # committed sequence length; the target cache holds n_seq - 1
    pending: list = []  # target taps not yet injected into the draft context
    next_d = None  # the next cycle's draft tokens, queued before the previous Step is yielded
    cycle_s = None  # wall time of the last cycle as it normally runs (None: not comparable)
    prefetch_s = 0.0  # host time spent queueing the next cycle's draft before the yield
    rows_run = 1  # candidate rows the last cycle verified (a new count is a new compiled shape)

    def buffer_sizes() -> tuple:
        # A cycle that grows a cache buffer (a new 256-position bucket) compiles new attention
        # kernels on CUDA (~65 ms): not a cost the policy should plan with.
        return tuple(c.keys.shape[2] if getattr(c, "keys", None) is not None else 0 for c in (tc[0], dc[0]))

    # So does the first cycle of a block size at a buffer length in this process, without growing
    # anything (another size grew the buffer): a new compiled trace and its kernels. Kept on the
    # target, so the worker's sessions share what has been built.
    seen_shapes = cycle_shapes_seen(target) if policy is not None else None

    def prefill():
        # All but the last prompt token in chunks (as plain decoding does, for identical numerics),
        # injecting each chunk's taps into the draft context so nothing large stays pending. An
        # empty Step after each chunk lets the engine run other sessions (and abort this one).
        prompt = mx.array(prompt_tokens, dtype=mx.uint32)
        for s in range(0, n_seq - 1, prefill_step_tokens):
            with mx.stream(stream):
                _, taps = verify(prompt[None, s: min(s + prefill_step_tokens, n_seq - 1)], prefill_chunk=True)
                draft.extend_context(taps, dc)
                mx.eval([c.state for c in tc], [c.state for c in dc])
            release_buffer_cache(stream)
            if s + prefill_step_tokens < n_seq - 1:  # more chunks to go
                yield Step([])
        with mx.stream(stream):
            logits, taps = verify(prompt[None, -1:])
            tok = sample_rows(sampler, logits[:, -1, :], n_seq)
            mx.eval(tok, taps)
        pending.append(taps)
        return Step(tok.tolist())

    def plain_step(b: int) -> Step:
        nonlocal pending, cycle_s, rows_run
        rows_run = 1
        t0 = time.perf_counter()
        logits, taps = verify(mx.array([[b]], dtype=mx.uint32))
        tok = sample_rows(sampler, logits[0], n_seq)
        mx.eval(tok, taps)
        verify_s = cycle_s = time.perf_counter() - t0
        pending.append(taps)
        if len(pending) >= _FLUSH_PENDING:
            draft.extend_context(mx.concatenate(pending, axis=1), dc)
            pending = []
        return Step(tok.tolist(), verify_s=verify_s)

    early = compiled_draft is not None and overlap_draft
    planned = None  # (block size, timed) of the next cycle, chosen inside this one (overlap)

    def plan(index: int, n_gen_after: int) -> tuple[int, bool]:
        """(block size, timed) of cycle `index`, with n_gen_after tokens generated before it."""
        if policy is not None:
            bs, timed = policy.next_block_size()
        else:
            bs, timed = B, time_every > 0 and index % time_every == 0
        # The block shrinks near max_tokens, to a power of two: on CUDA each new block length
        # compiles new attention kernels, and a few extra verified positions cost nothing
        # there; tokens past max_tokens are cut by the loop.
        return min(bs, _next_pow2(max_tokens - n_gen_after)), timed

    def queue_next(v: mx.array, taps: mx.array, this_bs: int) -> None:
        """Plans the next cycle and queues its draft behind this verify (overlap_draft)."""
        nonlocal planned, next_d
        if n_gen + this_bs >= max_tokens:  # this cycle may end the generation: no draft to waste
            return
        planned = bs, timed = plan(cycle + 1, n_gen + 1)
        if bs > 1 and not timed:  # rows from the untrimmed cache: never more than the serial order's
            next_d = compiled_draft.queue(v[2:3], mx.take(taps, v[:1], axis=0), v[1] + 1, bs, dc, rows_for(bs))

    def spec_cycle(b: int, bs: int, timed: bool) -> Step:
        nonlocal pending, next_d, cycle_s, rows_run
        t0 = time.perf_counter()
        blocks = next_d if next_d is not None else launch_draft(b, bs, pending)
        next_d, pending = None, []
        if timed:
            mx.eval(blocks)
        t1 = time.perf_counter()
        try:
            logits, taps = verify(blocks)
        except ValueError:  # candidate rows could not run compiled after all: the draft's block alone
            if blocks.shape[0] == 1:
                raise
            blocks = blocks[:1]
            logits, taps = verify(blocks)
        rows = rows_run = blocks.shape[0]
        tok = sample_rows(sampler, logits[0], n_seq)[None] if rows == 1 else greedy(logits)
        v = verdict(blocks, tok)
        if early and not timed:
            mx.async_eval(v, tok, taps)  # the verify starts while the next draft is built
            queue_next(v, taps, bs)
            if next_d is not None:
                mx.async_eval(next_d)
        mx.eval(v, tok, taps)  # the one host sync of the cycle
        t2 = time.perf_counter()
        cycle_s = None if timed else t2 - t0 + prefetch_s
        i, j, _ = v.tolist()
        tl = tok.tolist()[i]
        k = bs - 1
        if rows > 1:
            compiled.choose_row(tc, i)
        for c in tc:  # drop the rejected drafts d[j:]; keep b and d[:j]
            c.trim(k - j)
        if next_d is not None:  # the queued draft took the kept positions' taps as context
            for c in dc:
                c.offset += j + 1
        else:
            pending = [taps[i: i + 1, : j + 1]]
        if timed:
            return Step(tl[: j + 1], k, j, t1 - t0, t2 - t1)
        return Step(tl[: j + 1], k, j)

    def prefetch(b: int, bs: int) -> None:
        nonlocal pending, next_d
        next_d = launch_draft(b, bs, pending)
        pending = []
        mx.async_eval(next_d)

    try:
        step = yield from prefill()
        n_gen = 0
        cycle = -1  # the prefill's token is not a cycle
        while True:
            commit = step.tokens
            stop = not eos.isdisjoint(commit)
            if stop:  # end after the first EOS; drop what follows it
                del commit[next(i for i, t in enumerate(commit) if t in eos) + 1:]
            if n_gen + len(commit) > max_tokens:
                del commit[max_tokens - n_gen:]
            context = n_seq - 1  # the target's KV cache while this step ran
            n_seq += len(commit)
            n_gen += len(commit)
            b = commit[-1]
            if policy is not None and cycle >= 0:  # bs: this cycle's, set below on the previous pass
                policy.observe(bs, step.drafted, step.accepted, cycle_s, context)  # noqa: F821
            cycle += 1
            done = stop or n_gen >= max_tokens
            if done:
                next_d = None  # a draft queued for a cycle that will not run
            else:
                if next_d is not None:  # queued inside the last cycle (overlap_draft)
                    bs, timed = next_d.shape[1], False
                elif planned is not None:
                    bs, timed = planned
                    bs = min(bs, _next_pow2(max_tokens - n_gen))
                else:
                    bs, timed = plan(cycle, n_gen)
                planned = None
                prefetch_s = 0.0
                if bs > 1 and not timed and next_d is None:  # the device drafts while the caller handles the Step
                    t_pre = time.perf_counter()
                    with mx.stream(stream):
                        prefetch(b, bs)
                    prefetch_s = time.perf_counter() - t_pre
            yield step
            if done:
                return
            cleared = n_gen // CLEAR_CACHE_EVERY_TOKENS != (n_gen - len(commit)) // CLEAR_CACHE_EVERY_TOKENS
            if cleared:
                release_buffer_cache(stream)
            sizes = buffer_sizes() if policy is not None else None
            with mx.stream(stream):
                step = plain_step(b) if bs == 1 else spec_cycle(b, bs, timed)
            if policy is not None:
                shape = (bs, *buffer_sizes(), rows_run)
                if cleared or shape[1:3] != sizes or shape not in seen_shapes:
                    cycle_s = None  # a kernel compile or a device sync inside it: not a usual cycle
                seen_shapes.add(shape)
    finally:
        # Roll back to the committed sequence: the target keeps n_seq - 1 positions, the draft at
        # most that many (an interrupted cycle may have left rejected or block positions).
        keep = n_seq - 1
        for c in (*tc, *dc):
            if c.offset > keep:
                c.trim(c.offset - keep)
