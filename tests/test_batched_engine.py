"""The batched engine: sessions decoded together give each session its output when run alone.

Float32 on the CPU (tiny random llama). Covers plain and DFlash batches with sessions of different
prompt lengths joining and leaving mid-stream, per-row acceptance and rollback (an oracle draft
that is right up to a different position in every row), preemption under a KV budget, seeded
sampling beside other sessions, chunked-prefill time to first token, and the prompt cache.
"""
from __future__ import annotations

import queue
import threading
import time

import mlx.core as mx
import pytest

import worker.engine.batch as batch_mod
from harness import run_request
from worker.config import EngineConfig
from worker.engine.thread import Engine
from worker.engine.types import DoneEvent, GenerationRequest, InvalidRequest, SamplingParams, TokenEvent

PROMPTS = ["The river", "Once upon a time in a small village by the sea, there lived",
           "def add(a, b):", "Zażółć gęślą jaźń, said the", "1, 2, 3, 4,", "Speculative decoding is"]


class Collector:
    """Submits requests (optionally once another request has produced k tokens) and gathers
    every request's tokens and final event."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.tokens: dict[str, list[int]] = {}
        self.done: dict[str, DoneEvent] = {}
        self.first_token_s: dict[str, float] = {}
        self.submitted_s: dict[str, float] = {}
        self.after: dict[str, list[tuple[int, GenerationRequest]]] = {}
        self.errors: queue.Queue = queue.Queue()
        self.all_done = threading.Event()
        self.expected = 0

    def submit(self, req: GenerationRequest, after: tuple[str, int] | None = None) -> None:
        self.expected += 1
        self.tokens[req.request_id] = []
        if after is None:
            self.submitted_s[req.request_id] = time.perf_counter()
            self.engine.submit(req, self._emit_for(req.request_id))
        else:
            self.after.setdefault(after[0], []).append((after[1], req))

    def _emit_for(self, rid: str):
        def emit(ev):
            if isinstance(ev, TokenEvent):
                if ev.token_ids and rid not in self.first_token_s:
                    self.first_token_s[rid] = time.perf_counter()
                self.tokens[rid].extend(ev.token_ids)
                pending = self.after.get(rid, [])
                for k, req in list(pending):
                    if len(self.tokens[rid]) >= k:
                        pending.remove((k, req))
                        self.submitted_s[req.request_id] = time.perf_counter()
                        self.engine.submit(req, self._emit_for(req.request_id))
            elif isinstance(ev, DoneEvent):
                self.done[rid] = ev
                for _, req in self.after.pop(rid, []):  # ended before k tokens: start them now
                    self.submitted_s[req.request_id] = time.perf_counter()
                    self.engine.submit(req, self._emit_for(req.request_id))
                if len(self.done) == self.expected:
                    self.all_done.set()
            else:
                self.errors.put(ev.error)
                self.all_done.set()
        return emit

    def wait(self, timeout_s: float = 300.0) -> None:
        assert self.all_done.wait(timeout_s), f"only {len(self.done)} of {self.expected} finished"
        assert self.errors.empty(), self.errors.get()


def encode_all(engine: Engine) -> list[tuple[int, ...]]:
    return [tuple(engine.encode_prompt(p, None)) for p in PROMPTS]


def alone(engine: Engine, prompts, max_tokens, mode="plain", **kw) -> list[list[int]]:
    return [run_request(engine, GenerationRequest(f"alone-{mode}-{i}-{time.time()}", p, max_tokens,
                                                  mode=mode, **kw))[0] for i, p in enumerate(prompts)]


def run_staggered(engine: Engine, prompts, max_tokens, mode: str, **kw) -> Collector:
    """Starts half the sessions at once and each other one after an earlier one's k-th token, so
    rows join and leave a running batch."""
    c = Collector(engine)
    lengths = [max_tokens - 3 * (i % 3) for i in range(len(prompts))]  # leave at different steps
    for i, p in enumerate(prompts):
        req = GenerationRequest(f"{mode}-{i}", p, lengths[i], mode=mode, **kw)
        c.submit(req, None if i < len(prompts) // 2 else (f"{mode}-{i - len(prompts) // 2}", 2 + 3 * i))
    c.wait()
    return c


def test_plain_batch_equals_each_session_alone(tiny_models):
    with Engine(EngineConfig(model_path=tiny_models.llama, capacity=8)) as engine:
        prompts = encode_all(engine)
        c = run_staggered(engine, prompts, 24, "plain")
        solo = alone(engine, prompts, 24)
        for i in range(len(prompts)):
            n = len(c.tokens[f"plain-{i}"])
            assert n > 0 and c.tokens[f"plain-{i}"] == solo[i][:n]
            assert c.done[f"plain-{i}"].stats.generated_tokens == n


def test_dflash_batch_equals_plain_greedy(tiny_models, dflash_dir):
    cfg = EngineConfig(model_path=tiny_models.llama, draft_path=dflash_dir, capacity=8,
                       adaptive_block_size=False)
    with Engine(cfg) as engine:
        prompts = encode_all(engine)
        plain = alone(engine, prompts, 24)
        c = run_staggered(engine, prompts, 24, "dflash")
        for i in range(len(prompts)):
            got = c.tokens[f"dflash-{i}"]
            assert got and got == plain[i][: len(got)]
            assert c.done[f"dflash-{i}"].stats.cycles > 0


def test_dflash_rows_accept_and_roll_back_independently(tiny_models, dflash_dir, monkeypatch):
    """An oracle draft proposes each row's true continuation, wrong from a row-specific position
    on: rows accept different numbers of tokens in the same iteration and still give plain
    greedy output; acceptance counts follow the oracle."""
    cfg = EngineConfig(model_path=tiny_models.llama, draft_path=dflash_dir, capacity=8,
                       adaptive_block_size=False)
    with Engine(cfg) as engine:
        prompts = encode_all(engine)[:4]
        plain = alone(engine, prompts, 30)
        truth = {f"oracle-{i}": list(p) + plain[i] for i, p in enumerate(prompts)}
        real = batch_mod.draft_block
        wrong_at = {f"oracle-{i}": i % 4 for i in range(4)}  # drafts right before this position

        def oracle(draft, batch, L):
            blocks = real(draft, batch, L).tolist()
            for r, row in enumerate(batch.rows):
                seq = truth[row.request_id]
                for i in range(1, L):
                    pos = row.n - 1 + i
                    right = seq[pos] if pos < len(seq) else 0
                    blocks[r][i] = right if i <= wrong_at[row.request_id] else (right + 1) % 512
            return mx.array(blocks, dtype=mx.uint32)

        monkeypatch.setattr(batch_mod, "draft_block", oracle)
        c = Collector(engine)
        for i, p in enumerate(prompts):
            c.submit(GenerationRequest(f"oracle-{i}", p, 30, mode="dflash"))
        c.wait()
        for i in range(4):
            rid = f"oracle-{i}"
            assert c.tokens[rid] == plain[i]
            st = c.done[rid].stats
            if i == 3:  # right at every drafted position (the oracle knows no token past the end)
                assert st.accepted_tokens >= st.drafted_tokens - 3
            else:
                assert st.accepted_tokens <= i * st.cycles
            if 0 < i < 3 and st.cycles > 1:
                assert st.accepted_tokens >= i * (st.cycles - 1)


def test_seeded_sampling_is_per_session(tiny_models, dflash_dir):
    cfg = EngineConfig(model_path=tiny_models.llama, draft_path=dflash_dir, capacity=8)
    with Engine(cfg) as engine:
        prompts = encode_all(engine)
        sampling = SamplingParams(temperature=0.8, seed=7)
        solo = alone(engine, prompts[:1], 20, sampling=sampling)[0]
        c = Collector(engine)
        c.submit(GenerationRequest("seeded", prompts[0], 20, sampling=sampling))
        for i, p in enumerate(prompts[1:]):
            c.submit(GenerationRequest(f"other-{i}", p, 20, sampling=SamplingParams(temperature=1.0, seed=i)))
        c.wait()
        assert c.tokens["seeded"] == solo
        in_plain = alone(engine, prompts[:1], 20, mode="plain", sampling=sampling)[0]
        assert in_plain == solo


def _run_long_sessions(tiny_models, budget):
    """Five 200-token prompts, 150 tokens each, all at once: (tokens, done events, MLX peak over the
    loaded engine's memory, the scheduler's peak accounted bytes, each prompt's output alone)."""
    cfg = EngineConfig(model_path=tiny_models.llama, capacity=8, kv_budget_bytes=budget,
                       prompt_cache_entries=0, prefill_step_tokens=64)
    with Engine(cfg) as engine:
        prompts = [tuple(engine.encode_prompt(p * 12, None))[:200] for p in PROMPTS[:5]]
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        c = Collector(engine)
        for i, p in enumerate(prompts):
            c.submit(GenerationRequest(f"long-{i}", p, 150))
        c.wait()
        peak = mx.get_peak_memory() - base
        sched = engine._scheduler
        accounted = sched.peak_projected_bytes
        assert sched.peak_kv_bytes <= accounted
        solo = alone(engine, prompts, 150)
        return [c.tokens[f"long-{i}"] for i in range(5)], c.done, peak, accounted, solo


def test_preempted_sessions_resume_with_the_same_output(tiny_models):
    """A budget under what five long sessions take: the newest are preempted and resumed by
    recomputation; every output equals its run alone, and MLX's peak memory stays in the budget."""
    free_tokens, _, free_peak, free_accounted, _ = _run_long_sessions(tiny_models, None)
    budget = int(0.7 * free_accounted)
    tokens, done, peak, accounted, solo = _run_long_sessions(tiny_models, budget)
    assert sum(done[f"long-{i}"].stats.preemptions for i in range(5)) > 0
    assert tokens == solo == free_tokens
    assert accounted <= budget
    # MLX's own counter. What the accounting leaves out (logits, MLP activations, masks) is what
    # the unconstrained run's peak shows above its accounted bytes.
    unaccounted = max(0, free_peak - free_accounted)
    assert peak <= budget + unaccounted, f"peak {peak} bytes, budget {budget} + {unaccounted} unaccounted"
    assert unaccounted < budget / 4


def test_request_that_never_fits_is_refused_with_numbers(tiny_models):
    cfg = EngineConfig(model_path=tiny_models.llama, kv_budget_bytes=300_000, max_context_tokens=4096)
    with Engine(cfg) as engine:
        prompt = tuple(engine.encode_prompt("hello " * 50, None))
        with pytest.raises(InvalidRequest, match=r"needs [\d.]+ MB of KV cache, more than .* KV budget of 0\.3 MB"):
            engine.submit(GenerationRequest("big", prompt, 1000), lambda e: None)
        toks, done = run_request(engine, GenerationRequest("small", prompt[:8], 4))
        assert done.finish_reason in ("stop", "length") and toks


def test_short_request_waits_at_most_one_long_chunk(tiny_models):
    """While a 4K-token prompt prefills in chunks, a short request's first token comes within two
    chunks' time (the chunk in flight, then its own prefill and first step)."""
    cfg = EngineConfig(model_path=tiny_models.llama, capacity=4, max_context_tokens=8192,
                       prefill_step_tokens=512, prompt_cache_entries=0)
    with Engine(cfg) as engine:
        long_prompt = tuple((list(engine.encode_prompt("The quick brown fox. " * 400, None)) * 2)[:4096])
        short = tuple(engine.encode_prompt("Hi", None))
        # The chunk time, measured: a long prompt alone, timed to its first token; the fastest of
        # two runs, so that the first run's one-time costs do not stretch the wait below.
        chunk_s = float("inf")
        for i in range(2):
            t0 = time.perf_counter()
            run_request(engine, GenerationRequest(f"measure-{i}", long_prompt, 1))
            chunk_s = min(chunk_s, (time.perf_counter() - t0) / (len(long_prompt) / 512))
        c = Collector(engine)
        c.submit(GenerationRequest("long", long_prompt, 2))
        time.sleep(2.5 * chunk_s)  # the long prefill is under way
        c.submit(GenerationRequest("short", short, 2))
        c.wait()
        ttft = c.first_token_s["short"] - c.submitted_s["short"]
        assert c.first_token_s["short"] < c.first_token_s["long"]
        assert ttft <= 2 * chunk_s, f"short TTFT {ttft:.3f} s, chunk {chunk_s:.3f} s"


@pytest.mark.parametrize("mode", ["plain", "dflash"])
def test_second_turn_prefills_only_new_tokens(tiny_models, dflash_dir, mode):
    cfg = EngineConfig(model_path=tiny_models.llama, draft_path=dflash_dir, capacity=4,
                       adaptive_block_size=False)
    with Engine(cfg) as engine:
        turn1 = tuple(engine.encode_prompt(None, [{"role": "user", "content": "Name a river."}]))
        out1, done1 = run_request(engine, GenerationRequest("t1", turn1, 12, mode=mode))
        assert done1.stats.cached_tokens == 0
        follow = turn1 + tuple(out1) + tuple(engine.encode_prompt("And a mountain?", None))
        warm, done2 = run_request(engine, GenerationRequest("t2", follow, 12, mode=mode))
        assert done2.stats.cached_tokens >= len(turn1) + len(out1) - 1
    with Engine(cfg) as cold_engine:
        cold, done3 = run_request(cold_engine, GenerationRequest("t2c", follow, 12, mode=mode))
        assert done3.stats.cached_tokens == 0
    assert warm == cold


@pytest.mark.parametrize("mode", ["plain", "dflash"])
def test_sessions_sharing_a_prompt_copy_the_first_ones_prefill(tiny_models, dflash_dir, mode):
    """Three sessions of one prompt submitted together (a request's n choices): the first one
    prefills it, the others copy its caches of the prompt; every output is the prompt's alone."""
    cfg = EngineConfig(model_path=tiny_models.llama, draft_path=dflash_dir, capacity=4,
                       adaptive_block_size=False, prefill_step_tokens=8)
    with Engine(cfg) as engine:
        prompt = tuple(engine.encode_prompt(PROMPTS[1], None))
        assert len(prompt) > 8  # prefilled in several chunks
        c = Collector(engine)
        for i in range(3):
            c.submit(GenerationRequest(f"share-{i}", prompt, 16, mode=mode))
        c.wait()
        cached = sorted(c.done[f"share-{i}"].stats.cached_tokens for i in range(3))
        assert cached == [0, len(prompt) - 1, len(prompt) - 1]
    with Engine(cfg) as cold:
        want = run_request(cold, GenerationRequest("alone", prompt, 16, mode=mode))[0]
    assert all(c.tokens[f"share-{i}"] == want for i in range(3))


def test_a_draft_that_does_not_pay_is_mostly_not_run(tiny_models, dflash_dir):
    """The tiny random draft is almost never right: under the cost policy (the default) the worker's
    DFlash sessions decode with plain steps after a few probes, and their output is plain greedy."""
    cfg = EngineConfig(model_path=tiny_models.llama, draft_path=dflash_dir, capacity=4)
    with Engine(cfg) as engine:
        prompt = encode_all(engine)[1]
        plain = alone(engine, [prompt], 120)[0]
        out, done = run_request(engine, GenerationRequest("auto", prompt, 120, mode="auto"))
        assert out == plain and done.stats.mode == "dflash"
        assert done.stats.cycles <= 0.25 * done.stats.generated_tokens


def test_prompt_text_beyond_the_context_is_refused_before_tokenizing(tiny_models):
    """A prompt of more bytes than the context can hold gets a clear error without being tokenized
    (the worker's tokenizer would otherwise spend seconds and memory on it)."""
    from worker.engine.intake import MAX_PROMPT_BYTES_PER_TOKEN

    with Engine(EngineConfig(model_path=tiny_models.llama, warmup=False)) as engine:
        limit = MAX_PROMPT_BYTES_PER_TOKEN * engine.model.max_context_tokens
        calls = []
        real = engine._encode_tokenizer.encode
        engine._encode_tokenizer.encode = lambda *a, **k: calls.append(1) or real(*a, **k)
        with pytest.raises(InvalidRequest, match=r"the prompt is [\d,]+ bytes; .* shorten the prompt"):
            engine.encode_prompt("x" * (limit + 1), None)
        with pytest.raises(InvalidRequest, match="shorten the prompt"):
            engine.encode_prompt(None, [{"role": "user", "content": "y" * (limit + 1)}])
        assert not calls
        assert engine.encode_prompt("hello", None)


@pytest.mark.parametrize("temperature", [100.5, 1e30, float("nan"), -0.1])
def test_temperature_out_of_range_is_refused(temperature):
    from worker.sampling import validate_sampling

    with pytest.raises(InvalidRequest, match=r"temperature must be a number in \[0, 100\]"):
        validate_sampling(temperature, 1.0, None)


def test_a_budget_smaller_than_one_session_is_refused_at_start(tiny_models):
    with pytest.raises(RuntimeError, match=r"KV budget of 1,000 bytes holds less than one session"):
        Engine(EngineConfig(model_path=tiny_models.llama, kv_budget_bytes=1000, warmup=False))


def test_admission_keeps_sessions_waiting_rather_than_preempting_them(tiny_models):
    """Five 200-token prompts with almost no output under a budget that holds about two: the
    scheduler admits only what fits and the rest wait their turn; nobody is preempted (an
    admission that let everyone in would have to preempt to get back under the budget)."""
    def run(budget):
        cfg = EngineConfig(model_path=tiny_models.llama, capacity=8, kv_budget_bytes=budget,
                           prompt_cache_entries=0, prefill_step_tokens=64)
        with Engine(cfg) as engine:
            prompts = [tuple(engine.encode_prompt(p * 12, None))[:200] for p in PROMPTS[:5]]
            c = Collector(engine)
            for i, p in enumerate(prompts):
                c.submit(GenerationRequest(f"short-{i}", p, 2))
            c.wait()
            sched = engine._scheduler
            return [c.tokens[f"short-{i}"] for i in range(5)], c.done, sched.peak_projected_bytes, sched.preemptions

    free_tokens, _, free_accounted, _ = run(None)
    budget = int(0.45 * free_accounted)
    tokens, done, accounted, preemptions = run(budget)
    assert tokens == free_tokens
    assert preemptions == 0 and all(done[f"short-{i}"].stats.preemptions == 0 for i in range(5))
    assert accounted <= budget


def test_a_batchs_layers_share_their_lengths_through_joins_leaves_and_forwards(tiny_models, dflash_dir):
    """Every layer of a batch holds one lengths array (the next forward's layers then build their
    positions once), and sharing changes no token: the batch's rows decode as they do alone."""
    from mlx_lm import load

    from worker.capture import HiddenCapture
    from worker.engine.batch import Batch, Row, dflash_cycle, plain_step
    from worker.engine.warm import dummy_batch
    from worker.sampling import greedy
    from worker.models.dflash_checkpoint import load_dflash_draft

    target, _ = load(str(tiny_models.llama))
    draft = load_dflash_draft(dflash_dir, target)
    capture = HiddenCapture(target, draft.target_layer_ids)

    def shared(caches):
        return all(c.lengths is caches[0].lengths for c in caches)

    plain = dummy_batch(target, 3, 9)
    spec = dummy_batch(target, 2, 9, draft, capture)
    alone = [Batch([c.row(i) for c in plain.target], rows=[Row(greedy, r.n, r.last)])
             for i, r in enumerate(plain.rows)]
    out = [plain_step(target, plain) for _ in range(2)]
    assert shared(plain.target) and shared(spec.target) and shared(spec.draft)
    for i, a in enumerate(alone):
        assert [plain_step(target, a)[0] for _ in range(2)] == [o[i] for o in out]
    plain.keep([2, 0])
    assert shared(plain.target)
    plain.join(alone[1].rows[0], alone[1].target, None)
    assert shared(plain.target) and plain.size == 3
    plain_step(target, plain)
    assert shared(plain.target)
    for L in (4, 1, 2):
        dflash_cycle(target, draft, capture, spec, L)
        assert shared(spec.target) and shared(spec.draft)
    assert mx.array_equal(spec.target[0].lengths, mx.array(spec.target[-1].host_lengths))


def test_engine_and_coordinator_count_kv_with_one_formula(tiny_models, dflash_dir):
    """A session's KV need as the engine admits it (`fits_alone`, `projected_bytes`'s parts) and
    as the coordinator's migration policy computes it from the heartbeat (`final_need_bytes` with
    the reported `kv_layers`) is the same number, in plain and DFlash modes."""
    from flashfleet.kv_need import final_need_bytes, working_bytes

    cfg = EngineConfig(model_path=tiny_models.llama, draft_path=dflash_dir, capacity=2)
    with Engine(cfg) as engine:
        sched = engine._scheduler  # idle: read only
        layers = engine.load().kv_layers
        assert layers == sched.kv_layers > 0
        assert sched.bytes_per_position["dflash"] > sched.bytes_per_position["plain"]
        for mode in ("plain", "dflash"):
            for n in (1, 256, 257, 1000):
                row = sched.row_bytes(mode, n)
                need = final_need_bytes([(n, sched.bytes_per_position[mode])], layers)
                assert row + working_bytes(row, sched.kv_layers) == need, (mode, n)
                assert sched.fits_alone(mode, n) == (need <= sched.budget)


def test_engine_and_coordinator_call_the_same_kv_functions(tiny_models, monkeypatch):
    """The engine's admission (`fits_alone`, `projected_bytes`) and the coordinator's migration
    policy (`kv_need_bytes`) compute through the functions of flashfleet/kv_need.py, not copies of
    them: with each function replaced by a recording one, both sides' calls show up, and the
    coordinator's number is the engine's."""
    import sys

    from coordinator.migration import MigrationPolicy
    from coordinator.registry import WorkerRecord
    from flashfleet import kv_need
    from flashfleet.v1 import common_pb2, worker_pb2

    calls = []
    for name in ("bucket", "batch_bytes", "working_bytes", "final_need_bytes"):
        def recording(*args, _real=getattr(kv_need, name), _name=name):
            calls.append((sys._getframe(1).f_globals["__name__"], _name))
            return _real(*args)
        monkeypatch.setattr(kv_need, name, recording)
    with Engine(EngineConfig(model_path=tiny_models.llama, capacity=2)) as engine:
        sched = engine._scheduler  # idle: read only
        calls.clear()
        fits = sched.fits_alone("plain", 300)
        sched.projected_bytes()
        engine_side = set(calls)
        row = sched.row_bytes("plain", 310)
        want = row + kv_need.working_bytes(row, sched.kv_layers)
        per_position, layers = sched.bytes_per_position["plain"], sched.kv_layers
    assert {("worker.engine.scheduler", "batch_bytes"), ("worker.engine.scheduler", "working_bytes")} <= engine_side
    load = worker_pb2.WorkerLoad(capacity=2, kv_budget_bytes=10**9, kv_layers=layers, sessions=[worker_pb2.SessionLoad(
        request_id="r", context_tokens=300, remaining_tokens=10, kv_bytes_per_position=per_position)])
    record = WorkerRecord("w", "w:1", "lease", [common_pb2.ModelInfo(name="m", kv_bytes_per_token=per_position)],
                          load, 0.0, model_names=frozenset({"m"}))
    calls.clear()
    assert MigrationPolicy.kv_need_bytes(record, "m") == want and fits
    assert {("coordinator.migration", "final_need_bytes"), ("flashfleet.kv_need", "batch_bytes"),
            ("flashfleet.kv_need", "working_bytes")} <= set(calls)


def _draft_logits(target, draft, prompts, joins, sizes, eos) -> list[list[mx.array]]:
    """Drives a DFlash `Batch` by hand: prompt i joins before iteration joins[i], and iteration k
    runs block size sizes[k] for every row. Returns each row's draft logits (L - 1, V), one per
    iteration of block size > 1 it took part in."""
    from worker.caches.rows import RowKVCache, make_row_caches
    from worker.capture import HiddenCapture
    from worker.engine.batch import Batch, Row, dflash_cycle, prefill_chunk
    from worker.sampling import greedy

    capture = HiddenCapture(target, draft.target_layer_ids)
    batch = Batch(make_row_caches(target, 0), [RowKVCache(0) for _ in draft.layers])
    head = draft._head
    seen: list[mx.array] = []
    draft._head = lambda h: seen.append(head(h)) or seen[-1]
    rows: list = []
    logits: list[list[mx.array]] = [[] for _ in prompts]
    try:
        for k, L in enumerate(sizes):
            for i, p in enumerate(prompts):
                if joins[i] == k:
                    cache, dcache = make_row_caches(target, 1), [RowKVCache(1) for _ in draft.layers]
                    prefill_chunk(target, p[:-1], cache, draft, dcache, capture)
                    rows.append(Row(greedy, len(p), p[-1], str(i)))
                    batch.join(rows[-1], cache, dcache)
            seen.clear()
            res = dflash_cycle(target, draft, capture, batch, L)
            for r, toks in zip(batch.rows, res.tokens):
                r.commit(toks, eos, 10 ** 6)
            for j, r in enumerate(batch.rows if seen else ()):
                logits[int(r.request_id)].append(seen[0][j])
    finally:
        draft._head = head
    return logits


def test_a_rows_drafts_in_a_batch_are_its_drafts_alone(tiny_models, dflash_dir):
    """The draft's conditioning inside a batch: rows of different prompt lengths, one joining
    mid-stream, plain iterations (L = 1) leaving rows with pending taps of different lengths, then
    DFlash iterations. Each row's draft logits, iteration by iteration, are those it gets decoded
    alone with the same block sizes (its target taps, positions and draft cache do not depend on
    the rows beside it, so neither does its acceptance). Compared on the draft's logits: a random
    draft's argmax is blind to much of its input."""
    from mlx_lm import load

    from worker.models.dflash_checkpoint import load_dflash_draft

    target, tok = load(str(tiny_models.llama))
    target.set_dtype(mx.float32)
    draft = load_dflash_draft(dflash_dir, target)
    prompts = [tok.encode(p) for p in PROMPTS[:3]]
    sizes = [4, 4, 1, 4, 1, 1, 4, 2, 4, 4, 1, 4]
    joins = [0, 0, 3]
    together = _draft_logits(target, draft, prompts, joins, sizes, set())
    for i, p in enumerate(prompts):
        alone_logits = _draft_logits(target, draft, [p], [0], sizes[joins[i]:], set())[0]
        assert len(together[i]) == len(alone_logits) >= 5
        for k, (a, b) in enumerate(zip(together[i], alone_logits)):
            assert mx.allclose(a, b, atol=1e-4).item(), f"row {i}, iteration {k}"
