"""Soak: holds a cluster at saturation through both APIs for a set time and checks that it neither
loses requests nor grows in memory.

The script starts a cluster (`flashfleet up`'s LocalCluster: a coordinator with its HTTP API and
--workers worker processes) or attaches to one (--coordinator ADDR --http URL), then for
--duration seconds keeps --concurrency clients busy (default: twice the cluster's total capacity,
so requests queue), half through gRPC (the SDK's AsyncClient), half through the OpenAI-compatible
HTTP API (aiohttp; /v1/completions and /v1/chat/completions, streamed and not), each sending one
request after another from a weighted mix (--mix) of kinds: short, long, cancelled, bad and
deadline (bench/soak_requests.py says what each is and how its end is classified: completion,
cancelled, typed error or lost). During the warm-up every client sends the mix's largest request
instead (a long prompt with --long-output-tokens, counted as long; --no-fill keeps the mix), so
each worker's KV caches, prompt cache and allocator reach the memory the load can take before the
memory baseline is sampled. When the time is up no new request starts; those in flight run to
their end.

Every cluster process's RSS (psutil) is sampled at the start, after the warm-up (--warmup-s,
default 10 % of the duration), every --sample-s seconds (default duration / 120) and at the end of
the load. A process's RSS "after the warm-up" is the highest sampled in the --window-s seconds
(default 10 % of the duration) from the warm-up on, its RSS "at the end" the highest in the last
--window-s seconds of the load: a worker's RSS follows the KV caches of the sessions it holds at
the moment, which one sample may catch low or high. Printed: requests by kind and outcome, errors
by kind, TTFT and total latency p50/p99 per kind (completions of requests sent after the
warm-up), generated tokens/s (from the first request sent to the last one ended), each process's
RSS with its growth from the warm-up to the end, sessions the workers still hold after the drain,
and a PASS/FAIL line per criterion: every process's RSS at the end at most --max-growth-pct (5)
above its RSS after the warm-up (a process that exited fails); no request lost.

Usage (from the repository root):
  python bench/soak.py --duration 1800                         # SmolLM2-135M-Instruct, 2 workers
  python bench/soak.py --model DIR --workers 2 --capacity 4 --duration 180 --json soak.json
  python bench/soak.py --coordinator 127.0.0.1:50051 --http http://127.0.0.1:8000 \\
      --model SmolLM2-135M-Instruct --pid coordinator=1234 --pid worker-1=1240 --duration 600

With --coordinator, --model names the served model and gives the tokenizer that sizes the prompts;
--pid NAME=PID (repeatable) names the processes to watch (none: memory is not measured).
Prompts: bench/prompts/humaneval.jsonl and enwiki_en.jsonl (raw text), cut to
--short-prompt-tokens; long prompts join them up to --long-prompt-tokens.
Exit status: 0 PASS, 1 FAIL (or the cluster failed), 2 for a bad argument, 130 on Ctrl-C or SIGTERM.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/soak.py`
    sys.path.insert(0, str(ROOT))

from bench_concurrency import read_prompts, worker_draft  # noqa: E402  (sets the workers' PYTHONPATH)
from soak_report import format_report, summarize  # noqa: E402
from soak_requests import KINDS, Budgets, grpc_request, http_request, make_spec  # noqa: E402

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_PROMPTS = (ROOT / "bench" / "prompts" / "humaneval.jsonl", ROOT / "bench" / "prompts" / "enwiki_en.jsonl")
DEFAULT_MIX = "short=45,long=20,cancelled=15,bad=10,deadline=10"
LONG_PROMPTS = 8  # distinct long prompts


# ---- prompts ----------------------------------------------------------------------------------

def build_prompts(tokenizer, texts: list[str], short_tokens: int, long_tokens: int) -> tuple[list[str], list[str]]:
    """(short prompts: each text cut to `short_tokens` tokens; long prompts: LONG_PROMPTS texts of
    about `long_tokens` tokens, each the corpus joined from another starting text)."""
    ids = [tokenizer.encode(t) for t in texts]
    short = [tokenizer.decode(i[:short_tokens]) for i in ids]
    long = []
    for start in range(min(LONG_PROMPTS, len(ids))):
        joined: list[int] = []
        k = start
        while len(joined) < long_tokens:
            joined += ids[k % len(ids)]
            k += 1
        long.append(tokenizer.decode(joined[:long_tokens]))
    return short, long


# ---- memory -----------------------------------------------------------------------------------

def rss_of(pids: dict[str, int]) -> dict[str, int | None]:
    """Each process's resident set size in bytes (None once it has exited)."""
    import psutil

    out = {}
    for name, pid in pids.items():
        try:
            out[name] = psutil.Process(pid).memory_info().rss
        except psutil.Error:
            out[name] = None
    return out


def sample_times(duration_s: float, warmup_s: float, every_s: float) -> list[tuple[float, str]]:
    """(seconds after the start, label) of the RSS samples: start, warm-up, every `every_s`, end."""
    times = [(0.0, "start"), (warmup_s, "warmup"), (duration_s, "end")]
    t = every_s
    while t < duration_s:
        if t > warmup_s:
            times.append((t, "periodic"))
        t += every_s
    return sorted(times)


# ---- load -------------------------------------------------------------------------------------

async def run_load(a, address: str, http_url: str, model: str, pids: dict[str, int], short: list[str],
                   long: list[str], log=print) -> tuple[list, list[dict], float]:
    """Keeps a.concurrency clients busy for a.duration seconds (even-numbered ones through gRPC,
    odd ones through HTTP), waits for the requests in flight, and samples RSS meanwhile.

    Returns:
        (every request's Record, the RSS samples, seconds from the start to the last request's end).
    """
    import aiohttp

    from flashfleet.client import AsyncClient

    kinds, weights = zip(*a.mix.items())
    budgets = Budgets(a.long_output_tokens, a.request_timeout_s, a.grace_s)
    records, samples = [], []
    t0 = time.perf_counter()
    end = t0 + a.duration

    def mib(values: dict) -> str:
        return " ".join(f"{n}={'gone' if v is None else f'{v / 2**20:.0f}'}" for n, v in values.items())

    async def sampler(client):
        for at, label in sample_times(a.duration, a.warmup_s, a.sample_s):
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            rss, kv = rss_of(pids), await kv_bytes(client)
            samples.append({"t_s": round(time.perf_counter() - t0, 3), "label": label, "rss": rss, "kv": kv})
            if label != "periodic" or len(samples) % 5 == 0:
                done = len(records)
                log(f"  {time.perf_counter() - t0:6.0f} s  {label:8s} {done} requests done, "
                    f"{sum(r.outcome == 'lost' for r in records)} lost; RSS MiB {mib(rss)}; KV MiB {mib(kv)}")

    async def client_loop(i: int, client, session):
        rng = random.Random(a.seed * 100_003 + i)
        while time.perf_counter() < end:
            warming = a.fill and time.perf_counter() < t0 + a.warmup_s
            spec = make_spec("fill" if warming else rng.choices(kinds, weights)[0], rng, short, long, budgets)
            start_s = time.perf_counter() - t0
            if i % 2 == 0:
                records.append(await grpc_request(client, model, spec, budgets, start_s))
            else:
                records.append(await http_request(session, http_url, model, spec, budgets, start_s))

    connector = aiohttp.TCPConnector(limit=0)
    async with AsyncClient(address) as client, aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        await asyncio.gather(sampler(client), *(client_loop(i, client, session) for i in range(a.concurrency)))
    wall = time.perf_counter() - t0
    log(f"  {wall:6.0f} s  drained: {len(records)} requests")
    return records, samples, wall


async def kv_bytes(client) -> dict[str, int | None]:
    """Each worker's KV bytes, its sessions' and its prompt cache's, as its latest heartbeat
    reported them (cluster status); {} when the coordinator does not answer."""
    from flashfleet.errors import FlashfleetError

    try:
        status = await client.cluster_status(timeout_s=5)
    except FlashfleetError:
        return {}
    return {w.worker_id: w.kv_cache_bytes + w.prompt_cache_bytes for w in status.workers}


async def sessions_left(address: str, wait_s: float = 10.0) -> int | None:
    """Sessions the workers report running (heartbeats), polled until 0 or `wait_s` seconds pass;
    None when the coordinator does not answer."""
    from flashfleet.client import AsyncClient
    from flashfleet.errors import FlashfleetError

    deadline, left = time.monotonic() + wait_s, None
    async with AsyncClient(address) as client:
        while True:
            try:
                status = await client.cluster_status(timeout_s=5)
                left = sum(w.active_sessions for w in status.workers)
            except FlashfleetError:
                left = None
            if left == 0 or time.monotonic() > deadline:
                return left
            await asyncio.sleep(0.5)


async def total_capacity(address: str) -> int:
    """Sum of the registered workers' capacities (cluster status).

    Raises:
        RuntimeError: no worker is registered.
    """
    from flashfleet.client import AsyncClient

    async with AsyncClient(address) as client:
        status = await client.cluster_status(timeout_s=10)
    if not status.workers:
        raise RuntimeError(f"no worker is registered with the coordinator at {address}")
    return sum(w.capacity for w in status.workers)


# ---- main -------------------------------------------------------------------------------------

def _mix(text: str) -> dict[str, float]:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, _, weight = part.partition("=")
        try:
            w = float(weight)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected KIND=WEIGHT, got {part!r}") from None
        if kind not in KINDS or w < 0:
            raise argparse.ArgumentTypeError(f"{part!r}: kinds are {', '.join(KINDS)}, weights >= 0")
        out[kind] = w
    if not out or sum(out.values()) <= 0:
        raise argparse.ArgumentTypeError(f"no kind with a positive weight in {text!r}")
    return out


def _pid(text: str) -> tuple[str, int]:
    name, _, pid = text.rpartition("=")
    if not pid.isdigit():
        raise argparse.ArgumentTypeError(f"expected NAME=PID or PID, got {text!r}")
    return name or f"pid-{pid}", int(pid)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring); exits 2 on a bad argument."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="catalog name or model directory")
    p.add_argument("--draft", default="auto", help="as bench_concurrency.py: 'auto' (the shipped DFlash "
                   "draft when the model has one), 'none', or the worker's --draft value")
    p.add_argument("--workers", type=int, default=2, help="worker processes to start (default 2)")
    p.add_argument("--capacity", type=int, default=8, help="sessions per worker (default 8)")
    p.add_argument("--worker-args", default="", help="extra worker flags, one shell-quoted string")
    p.add_argument("--coordinator", default=None, help="attach to this coordinator (host:port) instead")
    p.add_argument("--http", default=None, help="with --coordinator: its HTTP API's base URL")
    p.add_argument("--model-name", default=None, help="with --coordinator: the served model's name "
                   "(default: --model's)")
    p.add_argument("--pid", type=_pid, action="append", default=[], metavar="NAME=PID",
                   help="with --coordinator: a process to watch (repeatable)")
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of load (default 1800)")
    p.add_argument("--warmup-s", type=float, default=None, help="default 10 %% of --duration")
    p.add_argument("--sample-s", type=float, default=None, help="RSS sample period (default duration/120, "
                   "at least 1 s)")
    p.add_argument("--window-s", type=float, default=None, help="memory windows after the warm-up and at "
                   "the end (default 10 %% of --duration)")
    p.add_argument("--concurrency", type=int, default=None, help="clients (default 2 x total capacity)")
    p.add_argument("--no-fill", dest="fill", action="store_false",
                   help="send the mix during the warm-up too (default: its largest request only)")
    p.add_argument("--mix", type=_mix, default=_mix(DEFAULT_MIX), help=f"KIND=WEIGHT,... (default {DEFAULT_MIX})")
    p.add_argument("--short-prompt-tokens", type=int, default=128)
    p.add_argument("--long-prompt-tokens", type=int, default=1536)
    p.add_argument("--long-output-tokens", type=int, default=256)
    p.add_argument("--request-timeout-s", type=float, default=300.0, help="deadline of every request "
                   "but the deadline kind's (default 300)")
    p.add_argument("--grace-s", type=float, default=30.0, help="a request with no end this long after "
                   "its deadline is lost (default 30)")
    p.add_argument("--max-growth-pct", type=float, default=5.0)
    p.add_argument("--prompts", type=Path, nargs="+", default=list(DEFAULT_PROMPTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the summary and every request here")
    a = p.parse_args(argv)
    if (a.coordinator is None) != (a.http is None):
        p.error("--coordinator and --http go together")
    if a.pid and a.coordinator is None:
        p.error("--pid needs --coordinator (a started cluster's processes are watched anyway)")
    for flag in ("workers", "capacity", "short_prompt_tokens", "long_prompt_tokens", "long_output_tokens"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(a, flag)}")
    if a.concurrency is not None and a.concurrency < 1:
        p.error(f"--concurrency must be >= 1, got {a.concurrency}")
    if not a.duration > 0 or a.request_timeout_s <= 0 or a.grace_s < 0:
        p.error("--duration and --request-timeout-s must be > 0, --grace-s >= 0")
    a.warmup_s = 0.1 * a.duration if a.warmup_s is None else a.warmup_s
    if not 0 <= a.warmup_s < a.duration:
        p.error(f"--warmup-s must be in [0, --duration), got {a.warmup_s}")
    a.sample_s = max(1.0, a.duration / 120) if a.sample_s is None else a.sample_s
    a.window_s = 0.1 * a.duration if a.window_s is None else a.window_s
    if a.sample_s <= 0 or not 0 <= a.window_s <= (a.duration - a.warmup_s) / 2:
        p.error("--sample-s must be > 0 and --window-s in [0, half the time after the warm-up]")
    for f in a.prompts:
        if not f.is_file():
            p.error(f"--prompts {f}: no such file")
    from flashfleet.models import resolve_model, served_model_name

    try:
        a.model_dir = resolve_model(a.model)
    except (FileNotFoundError, NotADirectoryError) as e:
        p.error(f"--model: {e}")
    a.served = a.model_name or served_model_name(a.model)
    return a


def run(a, log=print) -> dict:
    """Prepares the prompts, starts or attaches to the cluster, runs the load; returns the
    summary with "records", "samples" and "sessions_left" added.

    Raises:
        RuntimeError: the cluster failed to start, or the attached one has no worker.
    """
    from mlx_lm.utils import load_tokenizer

    texts = [t for f in a.prompts for t in read_prompts(f)]
    short, long = build_prompts(load_tokenizer(a.model_dir), texts, a.short_prompt_tokens, a.long_prompt_tokens)
    cluster = None
    if a.coordinator is None:
        from flashfleet.cli.up import LocalCluster, free_port

        draft = worker_draft(a.draft, a.model)
        log(f"starting a cluster: {a.workers} workers x capacity {a.capacity}, draft {draft}")
        cluster = LocalCluster(a.model, workers=a.workers, draft=draft, capacity=a.capacity,
                               worker_args=tuple(shlex.split(a.worker_args)), http_port=free_port())
        cluster.start(progress=log)
        address, http_url = cluster.address, cluster.http_url
        pids = {name: proc.pid for name, proc in cluster.procs.items()}
    else:
        address, http_url, pids = a.coordinator, a.http.rstrip("/"), dict(a.pid)
    try:
        if a.concurrency is None:
            a.concurrency = 2 * asyncio.run(total_capacity(address))
        log(f"soak: {a.duration:.0f} s, warm-up {a.warmup_s:.0f} s, {a.concurrency} clients "
            f"(gRPC {address}, HTTP {http_url}), mix {a.mix}")
        records, samples, wall = asyncio.run(run_load(a, address, http_url, a.served, pids, short, long, log))
        left = asyncio.run(sessions_left(address))
    finally:
        if cluster is not None:
            cluster.stop()
    summary = summarize(records, samples, wall, a.warmup_s, a.max_growth_pct, a.window_s)
    return {**summary, "sessions_left": left, "records": [asdict(r) for r in records], "samples": samples}


def main(argv: list[str] | None = None) -> int:
    """Runs the soak and prints the report; returns the exit status."""
    a = parse_args(argv)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        result = run(a, log=lambda m: print(m, flush=True))
    except KeyboardInterrupt:
        print("soak: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # the cluster failed: one line, not a traceback
        print(f"soak: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print()
    print(format_report(result, a.max_growth_pct, a.window_s))
    left = result["sessions_left"]
    print(f"sessions the workers still hold after the drain: {'unknown' if left is None else left}")
    if a.json:
        a.json.write_text(json.dumps({"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()
                                               if k != "prompts"}, **result}, indent=1, default=str))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
