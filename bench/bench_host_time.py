"""The host's time per decode iteration of the batched engine: plain and DFlash, 1, 8 and 16 rows.

With a tiny random target (`--layers` layers of width 64, `tests/tiny_models.py`) and a random
DFlash draft, a forward costs almost nothing on the device, so what an iteration costs is the
host's: building the forward's graph, scheduling, sampling and the verdict, detokenizing, and
handing each session's tokens to its stream. Per (mode, rows) and per path the table gives the
median milliseconds of one decode iteration with every row decoding (prefills excluded):

  - loop:    one pass of the engine thread's loop (its commands, one scheduler iteration, the
             load it publishes for heartbeats), from one iteration's start to the next's
  - host:    loop - sync: the host's time per iteration (the goal: <= 1 ms at 1 row, <= 2 ms at 16)
  - build:   the batched forward's host part: `plain_step` / `dflash_cycle` less `sync` (the
             graph of the forward, sampling and the verdict, cache bookkeeping)
  - sync:    the forward's `mx.eval`: waiting for the device's work. On a CPU this is MLX's CPU backend running
             the graph, op by op; on a GPU, the device's time not hidden behind the host's
  - emit:    `Session.on_step` of every row (statistics, detokenizing, stop strings, the event to
             the stream); `detok` is its detokenizing part
  - other:   host - build - emit (admission, the KV budget's accounting, bookkeeping, commands,
             publishing, and waits for the interpreter lock held by the gRPC threads)
  - tok/it:  tokens committed per iteration, all rows (DFlash: rows x tau, about 1 with a random draft)
  - msg/it:  stream messages per row and iteration the client received (over gRPC)
  - gap:     the client's mean time between two messages of one stream (over gRPC)

Paths: `engine` (the engine alone, in this process, events to a list), `grpc` (the engine behind a
real worker gRPC server in this process, as a worker runs it; the client streams from a separate
process), `coordinator` (`--coordinator`: the client streams through a real coordinator, a
separate process too). DFlash runs at a fixed block size (`--block`, default 16): the random draft
would make the adaptive policy decode plainly. `--profile N` prints the N functions with the most
own time on the engine thread (cProfile) for every configuration; `--first-request` also compares
the first request after a worker's load with the next ones (shapes met for the first time).

Usage (from the repository root; `--device gpu` on CUDA or Metal):
  python bench/bench_host_time.py                       # plain and DFlash, 1, 8, 16 rows
  python bench/bench_host_time.py --rows 1,16 --paths engine,grpc,coordinator --profile 25
  python bench/bench_host_time.py --device gpu --layers 28 --first-request
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import multiprocessing as mp
import os
import pstats
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "tests"):  # tests/tiny_models.py builds the random models
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"),
                                            *filter(None, [os.environ.get("PYTHONPATH")])])

PATHS = ("engine", "grpc", "coordinator")
MODEL_NAME = "tiny-host-time"


# ---- models -----------------------------------------------------------------------------------

def build_models(root: Path, layers: int, draft_layers: int, block: int) -> tuple[Path, Path]:
    """A random llama target (`layers` layers, width 64, the tests' BPE tokenizer of 512 tokens)
    whose head never prefers a special token (so no row ends early at an EOS), and a random DFlash
    draft of `draft_layers` layers and block size `block` for it. Returns (target dir, draft dir)."""
    import mlx.core as mx
    from mlx_lm import load

    from tiny_models import SPECIAL_TOKENS, EOS_TOKEN, build_bpe_tokenizer, build_model_dir, model_config
    from worker.models.dflash_checkpoint import init_dflash_draft, save_dflash_draft

    tok = root / "tokenizer"
    vocab = build_bpe_tokenizer(tok)
    cfg = model_config("llama", vocab, SPECIAL_TOKENS.index(EOS_TOKEN), layers=layers, max_position_embeddings=4096)
    target = build_model_dir(root / MODEL_NAME, cfg, tok, seed=1)
    weights = mx.load(str(target / "model.safetensors"))
    head = weights["lm_head.weight"]
    # Zero rows give a logit of exactly 0, below the largest of the other random logits.
    weights["lm_head.weight"] = mx.concatenate([mx.zeros_like(head[: len(SPECIAL_TOKENS)]),
                                                head[len(SPECIAL_TOKENS):]])
    mx.save_safetensors(str(target / "model.safetensors"), weights, metadata={"format": "mlx"})
    model, _ = load(str(target))
    draft = root / "dflash"
    save_dflash_draft(init_dflash_draft(model, num_layers=draft_layers, block_size=block), draft)
    return target, draft


# ---- what the engine thread spends ------------------------------------------------------------

@dataclass
class Sample:
    """Seconds of one decode iteration with every row decoding."""

    loop: float
    step: float
    sync: float
    emit: float
    detok: float
    tokens: int


_ACC = {"step": 0.0, "sync": 0.0, "emit": 0.0, "detok": 0.0, "tokens": 0, "in_step": False}
_PATCHED = False


def _patch_engine_functions() -> None:
    """Wraps, once per process, what `Probe` times: the scheduler's batched forwards
    (`plain_step`, `dflash_cycle`), the MLX evaluations inside them (`worker.engine.batch`'s
    `mx.eval`), `Session.on_step` and `TextAssembler.add`; each adds its seconds to `_ACC`."""
    global _PATCHED
    if _PATCHED:
        return
    _PATCHED = True
    import mlx.core as mx

    import worker.engine.batch as batch_mod
    import worker.engine.scheduler as scheduler_mod
    from worker.detokenize import TextAssembler
    from worker.engine.session import Session

    def timed(fn, key, step=False):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            if step:
                _ACC["in_step"] = True
            try:
                return fn(*args, **kwargs)
            finally:
                _ACC[key] += time.perf_counter() - t0
                if step:
                    _ACC["in_step"] = False
        return wrapper

    class TimedMx:
        """`mlx.core` as worker.engine.batch sees it, its `eval` timed inside a forward."""

        def __getattr__(self, name):
            return getattr(mx, name)

        @staticmethod
        def eval(*args):
            t0 = time.perf_counter()
            mx.eval(*args)
            if _ACC["in_step"]:
                _ACC["sync"] += time.perf_counter() - t0

    batch_mod.mx = TimedMx()
    scheduler_mod.plain_step = timed(scheduler_mod.plain_step, "step", step=True)
    scheduler_mod.dflash_cycle = timed(scheduler_mod.dflash_cycle, "step", step=True)
    on_step = Session.on_step

    def timed_on_step(session, step, now_s):
        _ACC["tokens"] += len(step.tokens)
        t0 = time.perf_counter()
        try:
            return on_step(session, step, now_s)
        finally:
            _ACC["emit"] += time.perf_counter() - t0

    Session.on_step = timed_on_step
    TextAssembler.add = timed(TextAssembler.add, "detok")


@dataclass
class Probe:
    """Times the engine thread's work per iteration: wraps a running engine's scheduler
    iteration, and (`_patch_engine_functions`) the functions inside it. Counts an iteration when
    the batch of `mode` has `rows` rows and nothing else runs or waits."""

    engine: object
    mode: str = "plain"
    rows: int = 0
    samples: list[Sample] = field(default_factory=list)
    profiler: cProfile.Profile | None = None
    _open: dict | None = None

    def install(self) -> None:
        _patch_engine_functions()
        sched = self.engine._scheduler
        iterate = sched.iterate

        def timed_iterate():
            now = time.perf_counter()
            if self._open is not None:  # the previous counted iteration ends where this one starts
                o, self._open = self._open, None
                self.samples.append(Sample(now - o["t0"], o["step"], o["sync"], o["emit"], o["detok"], o["tokens"]))
            counted = (self.rows and len(sched.decoding[self.mode]) == self.rows and not sched.prefilling
                       and not sched.waiting and not any(sched.decoding[m] for m in sched.decoding if m != self.mode))
            _ACC.update(step=0.0, sync=0.0, emit=0.0, detok=0.0, tokens=0)
            if self.profiler is not None and counted:
                self.profiler.enable()
            try:
                iterate()
            finally:
                if self.profiler is not None and counted:
                    self.profiler.disable()
            if counted:
                self._open = {"t0": now, **_ACC}

        sched.iterate = timed_iterate

    def start(self, mode: str, rows: int) -> None:
        self.mode, self.rows, self.samples, self._open = mode, rows, [], None

    def stop(self) -> list[Sample]:
        self.rows, self._open = 0, None
        return self.samples


def summarize(samples: list[Sample]) -> dict:
    """Median milliseconds per counted iteration of each part (medians: a 2-core host shared with
    other jobs preempts the engine now and then), the first few iterations dropped as warm-up;
    `other` is host - build - emit of those medians, so the parts add up to `host` only roughly."""
    s = samples[min(len(samples) // 4, 5):] or samples
    if not s:
        return {}
    med = lambda f: statistics.median(f(x) for x in s) * 1e3  # noqa: E731
    out = {"iterations": len(s), "loop": med(lambda x: x.loop), "sync": med(lambda x: x.sync),
           "host": med(lambda x: x.loop - x.sync), "build": med(lambda x: x.step - x.sync),
           "emit": med(lambda x: x.emit), "detok": med(lambda x: x.detok),
           "tok_per_it": statistics.fmean(x.tokens for x in s)}
    out["other"] = out["host"] - out["build"] - out["emit"]
    return out


# ---- the paths --------------------------------------------------------------------------------

def prompts(tokenizer, n: int) -> list[str]:
    """n short distinct prompt texts (English and code from bench/prompts/)."""
    texts = []
    for name in ("enwiki_en.jsonl", "humaneval.jsonl"):
        with (ROOT / "bench" / "prompts" / name).open(encoding="utf-8") as f:
            texts += [json.loads(line)["prompt"][:200] for line in f][:16]
    return [texts[i % len(texts)] for i in range(n)]


def run_engine(engine, probe: Probe, mode: str, rows: int, max_tokens: int) -> dict:
    """`rows` sessions submitted at once straight to the engine; their events go to a list."""
    from worker.engine.types import DoneEvent, ErrorEvent, GenerationRequest

    done = threading.Semaphore(0)
    events: list = []

    def emit(e):
        events.append(e)
        if isinstance(e, (DoneEvent, ErrorEvent)):
            done.release()

    probe.start(mode, rows)
    for i, text in enumerate(prompts(engine._encode_tokenizer, rows)):
        ids = tuple(engine.encode_prompt(text, None))
        engine.submit(GenerationRequest(f"{mode}-{rows}-{i}-{time.monotonic_ns()}", ids, max_tokens, mode=mode), emit)
    for _ in range(rows):
        if not done.acquire(timeout=600):
            raise RuntimeError("a session did not finish")
    bad = [e for e in events if isinstance(e, ErrorEvent)]
    if bad:
        raise RuntimeError(f"a session failed: {bad[0].error!r}")
    return summarize(probe.stop())


def _client(conn, address: str, via_coordinator: bool, texts: list[str], max_tokens: int, mode: str) -> None:
    """Child process: streams one request per text at once; sends back per stream (messages,
    tokens, first message's time, last message's time)."""
    import grpc

    from flashfleet.v1 import common_pb2, coordinator_pb2_grpc, worker_pb2_grpc

    modes = {"plain": common_pb2.DECODE_MODE_PLAIN, "dflash": common_pb2.DECODE_MODE_DFLASH}

    async def one(stub, i, text):
        req = common_pb2.GenerateRequest(model=MODEL_NAME, prompt=text, max_tokens=max_tokens,
                                         request_id=f"c{i}-{time.monotonic_ns()}", mode=modes[mode])
        msgs = toks = 0
        first = last = 0.0
        async for r in stub.Generate(req):
            if r.WhichOneof("kind") == "chunk":
                now = time.perf_counter()
                first = first or now
                last = now
                msgs += 1
                toks += len(r.chunk.token_ids)
        return msgs, toks, first, last

    async def main():
        async with grpc.aio.insecure_channel(address) as ch:
            stub = (coordinator_pb2_grpc.CoordinatorStub if via_coordinator else worker_pb2_grpc.WorkerStub)(ch)
            return await asyncio.gather(*(one(stub, i, t) for i, t in enumerate(texts)))

    try:
        conn.send(("ok", asyncio.run(main())))
    except Exception as e:  # reported by the parent
        conn.send(("error", repr(e)))


def _coordinator(conn) -> None:
    """Child process: a coordinator on a free port; sends its address, serves until terminated."""
    from prometheus_client import CollectorRegistry

    from coordinator.config import CoordinatorConfig
    from coordinator.server import start_coordinator

    async def main():
        c = await start_coordinator(CoordinatorConfig(port=0), CollectorRegistry())
        conn.send(c.address)
        await asyncio.Event().wait()

    asyncio.run(main())


class Server:
    """The engine behind a real worker gRPC server on an event loop thread of this process,
    registered with a coordinator process when `coordinator`."""

    def __init__(self, engine, coordinator: bool):
        from worker.server import start_worker

        self.ctx = mp.get_context("spawn")
        self.coord = None
        coordinator_address = None
        if coordinator:
            parent, child = self.ctx.Pipe()
            self.coord = self.ctx.Process(target=_coordinator, args=(child,), daemon=True)
            self.coord.start()
            coordinator_address = parent.recv()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="bench-grpc", daemon=True)
        self.thread.start()
        self.worker = self._run(start_worker(engine, "bench-worker", coordinator=coordinator_address))
        if coordinator:
            self._run(asyncio.wait_for(self.worker.registered.wait(), 30))
        self.address = coordinator_address or self.worker.advertise_address

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(120)

    def stream(self, texts: list[str], max_tokens: int, mode: str) -> list[tuple]:
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=_client, args=(child, self.address, self.coord is not None, texts,
                                                   max_tokens, mode), daemon=True)
        p.start()
        status, result = parent.recv()
        p.join(30)
        if status != "ok":
            raise RuntimeError(f"the client failed: {result}")
        return result

    def close(self) -> None:
        try:
            self._run(self.worker.stop(grace_s=0.5, close_engine=False))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
            if self.coord is not None:
                self.coord.terminate()
                self.coord.join(5)


def run_server(server: Server, engine, probe: Probe, mode: str, rows: int, max_tokens: int) -> dict:
    """`rows` sessions streamed at once by a client process through `server`."""
    probe.start(mode, rows)
    streams = server.stream(prompts(engine._encode_tokenizer, rows), max_tokens, mode)
    out = summarize(probe.stop())
    msgs = sum(s[0] for s in streams)
    iters = max(1, out.get("iterations", 1))
    gaps = [(s[3] - s[2]) / (s[0] - 1) for s in streams if s[0] > 1]
    out["msg_per_row_it"] = msgs / max(1, sum(s[1] for s in streams)) * (out.get("tok_per_it", 1) / rows)
    out["gap"] = statistics.fmean(gaps) * 1e3 if gaps else 0.0
    out["iterations"] = iters
    return out


def first_request(target: Path, draft: Path, mode: str, rows: int, max_tokens: int, block: int) -> list[dict]:
    """A fresh engine (its warm-up as configured), then the same `rows` sessions three times:
    the first after load, then twice more. Rows of {"run", "loop"}."""
    from worker.config import EngineConfig
    from worker.engine.thread import Engine

    cfg = EngineConfig(model_path=target, draft_path=draft, block_size=block, adaptive_block_size=False,
                       capacity=max(rows, 16), kv_budget_bytes=1 << 30, prompt_cache_entries=0,
                       max_context_tokens=4096)
    t0 = time.perf_counter()
    with Engine(cfg) as engine:
        load_s = time.perf_counter() - t0
        probe = Probe(engine)
        probe.install()
        out = []
        for run in range(3):
            probe.start(mode, rows)
            r = run_engine_all(engine, probe, mode, rows, max_tokens)
            out.append({"run": run + 1, "loop": r, "load_s": load_s})
        return out


def run_engine_all(engine, probe: Probe, mode: str, rows: int, max_tokens: int) -> float:
    """Like run_engine, but the mean loop time over every counted iteration (none dropped)."""
    from worker.engine.types import DoneEvent, ErrorEvent, GenerationRequest

    done = threading.Semaphore(0)
    emit = lambda e: done.release() if isinstance(e, (DoneEvent, ErrorEvent)) else None  # noqa: E731
    for i, text in enumerate(prompts(engine._encode_tokenizer, rows)):
        ids = tuple(engine.encode_prompt(text, None))
        engine.submit(GenerationRequest(f"first-{i}-{time.monotonic_ns()}", ids, max_tokens, mode=mode), emit)
    for _ in range(rows):
        done.acquire(timeout=600)
    s = probe.stop()
    return statistics.fmean(x.loop for x in s) * 1e3 if s else 0.0


# ---- table ------------------------------------------------------------------------------------

def format_table(rows: list[dict]) -> str:
    cols = [("loop", "loop ms"), ("host", "host ms"), ("build", "build ms"), ("sync", "sync ms"),
            ("emit", "emit ms"), ("detok", "detok ms"),
            ("other", "other ms"), ("tok_per_it", "tok/it"), ("msg_per_row_it", "msg/row/it"), ("gap", "gap ms")]
    lines = ["| mode | rows | path | " + " | ".join(c[1] for c in cols) + " | iterations |",
             "|---|---:|---|" + "---:|" * (len(cols) + 1)]
    for r in rows:
        cells = [f"{r[k]:.2f}" if k in r else "-" for k, _ in cols]
        lines.append(f"| {r['mode']} | {r['rows']} | {r['path']} | " + " | ".join(cells) + f" | {r.get('iterations', 0)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,8,16", help="concurrent sessions, comma-separated")
    p.add_argument("--modes", default="plain,dflash", help="plain and/or dflash")
    p.add_argument("--paths", default="engine,grpc", help=f"any of {','.join(PATHS)}")
    p.add_argument("--coordinator", action="store_true", help="add the coordinator path")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens each session generates")
    p.add_argument("--layers", type=int, default=2, help="target layers (width 64)")
    p.add_argument("--draft-layers", type=int, default=1, help="DFlash draft layers")
    p.add_argument("--block", type=int, default=16, help="DFlash block size (fixed)")
    p.add_argument("--device", choices=("default", "cpu", "gpu"), default="default",
                   help="MLX device (default: MLX's default, the GPU where there is one)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="print the N functions with the most own time on the engine thread, per configuration")
    p.add_argument("--first-request", action="store_true",
                   help="also time the first request after a fresh worker's load against the next ones")
    p.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    a = p.parse_args(argv)

    import logging

    import mlx.core as mx

    from flashfleet.blas import restart_with_openblas

    if a.device != "gpu":
        restart_with_openblas()  # on a Linux CPU, the BLAS a worker computes with
    if a.device == "gpu":
        if not mx.is_available(mx.gpu):
            print("no MLX GPU device here (MLX's CUDA or Metal build is needed)", file=sys.stderr)
            return 2
        mx.set_default_device(mx.gpu)
    elif a.device == "cpu":
        mx.set_default_device(mx.cpu)
    logging.basicConfig(level=logging.WARNING)
    paths = [x for x in a.paths.split(",") if x] + (["coordinator"] if a.coordinator else [])
    bad = sorted(set(paths) - set(PATHS))
    if bad:
        p.error(f"unknown paths {bad}; choose from {PATHS}")
    rows_list = [int(x) for x in a.rows.split(",")]
    modes = [m for m in a.modes.split(",") if m]

    from worker.config import EngineConfig
    from worker.engine.thread import Engine

    with tempfile.TemporaryDirectory() as tmp:
        target, draft = build_models(Path(tmp), a.layers, a.draft_layers, a.block)
        print(f"device {mx.default_device()}; mlx {mx.__version__}; target: llama, {a.layers} layers of width 64; "
              f"DFlash draft: {a.draft_layers} layer(s), block {a.block} (fixed); {a.max_tokens} tokens a session",
              flush=True)
        cfg = EngineConfig(model_path=target, draft_path=draft, block_size=a.block, adaptive_block_size=False,
                           capacity=max(16, *rows_list), kv_budget_bytes=1 << 30, prompt_cache_entries=0,
                           max_context_tokens=4096)
        table: list[dict] = []
        profiles: list[tuple[str, str]] = []
        with Engine(cfg) as engine:
            probe = Probe(engine)
            probe.install()
            for path in paths:
                server = Server(engine, path == "coordinator") if path != "engine" else None
                try:
                    for mode in modes:
                        for rows in rows_list:
                            if a.profile:
                                probe.profiler = cProfile.Profile()
                            r = (run_engine(engine, probe, mode, rows, a.max_tokens) if server is None
                                 else run_server(server, engine, probe, mode, rows, a.max_tokens))
                            table.append({"mode": mode, "rows": rows, "path": path, **r})
                            print(format_table(table[-1:]).splitlines()[-1], flush=True)
                            if a.profile:
                                buf = io.StringIO()
                                pstats.Stats(probe.profiler, stream=buf).sort_stats("tottime").print_stats(a.profile)
                                profiles.append((f"{mode}, {rows} rows, {path}", buf.getvalue()))
                                probe.profiler = None
                finally:
                    if server is not None:
                        server.close()
        print()
        print(format_table(table))
        for title, text in profiles:
            print(f"\n## engine thread, {title} (cProfile, own time)\n{text}")
        first = []
        if a.first_request:
            print("\n| mode | rows | run | loop ms | worker load s |\n|---|---:|---:|---:|---:|")
            for mode in modes:
                for rows in rows_list:
                    for r in first_request(target, draft, mode, rows, a.max_tokens, a.block):
                        first.append({"mode": mode, "rows": rows, **r})
                        print(f"| {mode} | {rows} | {r['run']} | {r['loop']:.2f} | {r['load_s']:.1f} |", flush=True)
        if a.json:
            a.json.write_text(json.dumps({"rows": table, "first_request": first}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
