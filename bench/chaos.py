"""Chaos: a fleet under load with a process `kill -9`ed every period, checked for lost streams,
unclean HTTP errors, leaked slots and memory growth.

The script starts one etcd member, two coordinators sharing the fleet's state in it (each with its
OpenAI-compatible HTTP API) and three workers given both coordinators (`--orphan-grace`
shortened so that sessions a dead coordinator left behind end within the run). It streams each
prompt once, unfaulted, as the greedy reference, then for --duration seconds keeps --sdk-clients
SDK clients (AsyncClient, both coordinators) streaming greedy requests and --http-clients HTTP
clients sending /v1/completions, streamed and not, to either coordinator's HTTP API. Every
--period seconds one process is killed with SIGKILL, in turn: coordinator A, worker 1,
coordinator A, worker 2, ... (a coordinator is started again --restart-delay seconds later on the
same ports, as `flashfleet up` does; a worker at once, on a new port under the same id).
Coordinator B and worker 3 are never killed: their memory is the one that must not grow.

Checks, each PASS or FAIL:
- SDK streams: every one completed with the reference's token ids and finish reason (none
  raised, none differed).
- HTTP: every request ended cleanly: a 200 with a whole JSON body or an SSE stream ending in
  `[DONE]`, or an error status (or SSE error event) with an OpenAI-shaped JSON error; a broken
  connection counts as clean only when the coordinator it was sent to was killed while it ran
  (an HTTP stream cannot resume); a request with no end within --http-timeout-s is a hang.
- slots: once the load stopped, within --orphan-grace + 20 s every coordinator's status shows
  every worker at 0 sessions (the streams it proxies) and every worker's own load
  (Worker.GetLoad) shows 0 sessions.
- RSS: the survivors' (coordinator B, worker 3) RSS at the end (the highest sample of the last
  --window-s seconds of the load) at most --max-growth-pct above their baseline: the highest sample
  from a fill before the load (3 x --capacity streams at once: every worker full, as a survivor
  is while the others are down) to --warmup-s into the load.

Usage (from the repository root; the etcd binary on PATH: apt-get install etcd-server):
  python bench/chaos.py --duration 600 --period 60                   # SmolLM2-135M-Instruct
  python bench/chaos.py --model DIR --model-name tiny --duration 60 --period 12 --json chaos.json

Exit status: 0 PASS, 1 FAIL (or the cluster failed to start), 2 for a bad argument.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/chaos.py`
    sys.path.insert(0, str(ROOT))

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The river flows through the old town and", "Once upon a time a small robot",
           "In the middle of the night the", "The recipe calls for two cups of",
           "def fibonacci(n):", "The capital of France is", "Write a haiku about autumn:",
           "The three laws of motion are"]
# Kill order: (process, kind). Coordinator B and worker 3 are the survivors.
KILL_CYCLE = ("coord-a", "w1", "coord-a", "w2")
SURVIVORS = ("coord-b", "w3")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- processes --------------------------------------------------------------------------------

class Fleet:
    """The etcd member, coordinators and workers of one run, as child processes with logs.

    Args:
        log_dir: where each process logs (NAME.log, appended to across restarts).
        model, model_name: the workers' model directory (or fetched name) and the name it is served as.
        capacity: sessions each worker admits.
        orphan_grace_s: the workers' --orphan-grace.
    """

    def __init__(self, log_dir: Path, model: str, model_name: str, capacity: int, orphan_grace_s: float):
        from flashfleet.cli.up import worker_env

        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.argv: dict[str, list[str]] = {}
        self.env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.worker_env = {**worker_env(), "PYTHONPATH": str(ROOT), "FLASHFLEET_DEVICE_SHARE": "3"}
        etcd_port, peer_port = free_port(), free_port()
        self.etcd_endpoint = f"127.0.0.1:{etcd_port}"
        self.argv["etcd"] = [
            shutil.which("etcd"), "--name", "chaos", "--data-dir", str(log_dir / "etcd-data"),
            "--listen-client-urls", f"http://{self.etcd_endpoint}", "--advertise-client-urls",
            f"http://{self.etcd_endpoint}", "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"chaos=http://127.0.0.1:{peer_port}", "--log-level", "warn"]
        self.grpc: dict[str, str] = {}
        self.http: dict[str, str] = {}
        for name in ("coord-a", "coord-b"):
            port, http_port = free_port(), free_port()
            self.grpc[name], self.http[name] = f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}"
            self.argv[name] = [sys.executable, "-m", "coordinator", "--port", str(port), "--http-port", str(http_port),
                               "--state", "etcd", "--etcd-endpoints", self.etcd_endpoint, "--log-level", "INFO"]
        a, b = self.grpc["coord-a"], self.grpc["coord-b"]
        for i, name in enumerate(("w1", "w2", "w3")):
            order = f"{a},{b}" if i % 2 == 0 else f"{b},{a}"  # heartbeats spread over both
            self.argv[name] = [sys.executable, "-m", "worker", "--model", model, "--model-name", model_name,
                               "--coordinator", order, "--worker-id", name, "--capacity", str(capacity),
                               "--orphan-grace", str(orphan_grace_s), "--host", "127.0.0.1", "--port", "0",
                               "--log-level", "INFO"]

    def start(self, name: str) -> None:
        """Starts (or starts again) one process."""
        with open(self.log_dir / f"{name}.log", "ab") as log:
            env = self.worker_env if name.startswith("w") else self.env
            self.procs[name] = subprocess.Popen(self.argv[name], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                                env=env, start_new_session=True)

    def kill(self, name: str) -> None:
        """SIGKILL, and reaps it."""
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def exited(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is not None]

    def stop(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM if name != "etcd" else signal.SIGKILL)
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def tail(self, name: str, chars: int = 2000) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")[-chars:]


# ---- load -------------------------------------------------------------------------------------

@dataclass
class Outcome:
    """One request's end: api "sdk" or "http"; outcome "ok", "clean_error", "connection" (cut while
    its coordinator died), or a failure: "lost", "mismatch", "hang", "unclean"."""

    api: str
    outcome: str
    detail: str
    start_s: float
    end_s: float
    coordinator: str = ""


@dataclass
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    kills: list[tuple[str, float]] = field(default_factory=list)  # (process, seconds after the load began)
    rss: dict[str, list[tuple[float, int]]] = field(default_factory=dict)  # process -> (t, bytes)
    fill_s: float = 0.0  # seconds the fill before the load took (its RSS samples have t < 0)


async def sdk_client(i: int, addresses: list[str], model: str, reference: dict, stop: asyncio.Event, t0: float,
                     run: Run, max_tokens: int, timeout_s: float) -> None:
    """Streams greedy requests one after another until `stop`; each must equal its reference."""
    from flashfleet import AsyncClient
    from flashfleet.errors import FlashfleetError

    order = addresses if i % 2 == 0 else addresses[::-1]
    n = 0
    async with AsyncClient(order, timeout_s=timeout_s) as client:
        while not stop.is_set():
            prompt = PROMPTS[(i + n) % len(PROMPTS)]
            n += 1
            start = time.monotonic() - t0
            ids, finish = [], None
            try:
                async with asyncio.timeout(timeout_s + 10):
                    async for chunk in client.generate(model, prompt, max_tokens=max_tokens,
                                                       request_id=f"sdk{i}-{n}"):
                        ids.extend(chunk.token_ids)
                        finish = chunk.finish_reason or finish
                want_ids, want_finish = reference[prompt]
                if ids == want_ids and finish == want_finish:
                    out = ("ok", "")
                else:
                    at = next((k for k, (x, y) in enumerate(zip(ids, want_ids)) if x != y), min(len(ids), len(want_ids)))
                    out = ("mismatch", f"{len(ids)} tokens ({finish}), reference {len(want_ids)} ({want_finish}); "
                                       f"first difference at {at}")
            except TimeoutError:
                out = ("hang", f"no end within {timeout_s + 10:.0f} s")
            except FlashfleetError as e:
                out = ("lost", f"{e.code.name}: {e.details}"[:300])
            except Exception as e:  # neither an end nor a typed error
                out = ("lost", f"{type(e).__name__}: {e}"[:300])
            run.outcomes.append(Outcome("sdk", *out, start, time.monotonic() - t0))


def _openai_error(body) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return isinstance(err, dict) and "message" in err


async def http_once(session, url: str, model: str, prompt: str, stream: bool, max_tokens: int,
                    timeout_s: float) -> tuple[str, str]:
    """One /v1/completions request: ("ok" | "clean_error" | "connection" | "hang" | "unclean", detail)."""
    import aiohttp

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url + "/v1/completions", json=body) as resp:
                if resp.status != 200:
                    raw = await resp.read()
                    try:
                        ok = _openai_error(json.loads(raw))
                    except ValueError:
                        ok = False
                    return ("clean_error", f"HTTP {resp.status}") if ok else \
                        ("unclean", f"HTTP {resp.status} without a JSON error: {raw[:200]!r}")
                if not stream:
                    raw = await resp.read()
                    try:
                        answer = json.loads(raw)
                    except ValueError:
                        return "unclean", f"a 200 whose body is not whole JSON ({len(raw)} bytes)"
                    return ("ok", "") if answer.get("choices") else ("unclean", f"a 200 without choices: {raw[:200]!r}")
                async for line in resp.content:
                    if not line.startswith(b"data: "):
                        continue
                    payload = line[6:].strip()
                    if payload == b"[DONE]":
                        return "ok", ""
                    try:
                        event = json.loads(payload)
                    except ValueError:
                        return "unclean", f"an SSE event that is not JSON: {payload[:200]!r}"
                    if _openai_error(event):
                        return "clean_error", f"SSE error: {event['error'].get('message', '')[:200]}"
                return "unclean", "the stream ended without [DONE] or an error event, the connection still whole"
    except TimeoutError:
        return "hang", f"no end within {timeout_s:.0f} s"
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
        return "connection", f"{type(e).__name__}: {e}"[:300]


async def http_client(i: int, urls: dict[str, str], model: str, stop: asyncio.Event, t0: float, run: Run,
                      max_tokens: int, timeout_s: float) -> None:
    """Sends /v1/completions one after another until `stop`, alternating coordinators and
    streamed / not."""
    import aiohttp

    names = sorted(urls)
    n = 0
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            name = names[(i + n) % len(names)]
            prompt = PROMPTS[(i + n) % len(PROMPTS)]
            stream = (n // len(names)) % 2 == 0
            n += 1
            start = time.monotonic() - t0
            outcome, detail = await http_once(session, urls[name], model, prompt, stream, max_tokens, timeout_s)
            run.outcomes.append(Outcome("http", outcome, detail, start, time.monotonic() - t0, name))
            if outcome == "connection":
                await asyncio.sleep(0.2)  # its coordinator is starting again


def explained(o: Outcome, kills: list[tuple[str, float]], restart_s: float) -> bool:
    """A broken HTTP connection is clean when the coordinator it was sent to was killed while the
    request ran (or was being started again when it was sent)."""
    return any(name == o.coordinator and o.start_s - restart_s - 5.0 <= t <= o.end_s + 0.5 for name, t in kills)


# ---- checks -----------------------------------------------------------------------------------

def sessions_now(fleet: Fleet) -> dict[str, dict[str, int]]:
    """{"coord-a": {worker: sessions it proxies}, ..., "workers": {worker: its own active sessions}}."""
    import grpc

    from flashfleet import Client
    from flashfleet.v1 import worker_pb2, worker_pb2_grpc

    out: dict[str, dict[str, int]] = {"workers": {}}
    addresses = {}
    for name, addr in fleet.grpc.items():
        try:
            with Client(addr) as c:
                status = c.cluster_status(timeout_s=3)
            out[name] = {w.worker_id: w.active_sessions for w in status.workers}
            addresses.update({w.worker_id: w.address for w in status.workers})
        except Exception as e:
            out[name] = {"error": str(e)[:100]}
    for worker_id, addr in sorted(addresses.items()):
        try:
            with grpc.insecure_channel(addr) as ch:
                load = worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest(), timeout=3)
            out["workers"][worker_id] = load.active_sessions
        except grpc.RpcError as e:
            out["workers"][worker_id] = -1
            print(f"  GetLoad of {worker_id}: {e.code().name}", flush=True)
    return out


def slots_clear(s: dict, workers: int) -> bool:
    return (all(len(v) == workers and all(isinstance(n, int) and n == 0 for n in v.values())
                for k, v in s.items() if k != "workers")
            and len(s["workers"]) == workers and all(n == 0 for n in s["workers"].values()))


def window_max(samples: list[tuple[float, int]], lo: float, hi: float) -> int | None:
    vals = [b for t, b in samples if lo <= t <= hi]
    return max(vals) if vals else None


# ---- the run ----------------------------------------------------------------------------------

async def wait_ready(fleet: Fleet, workers: int, timeout_s: float) -> None:
    from flashfleet import AsyncClient

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if fleet.exited():
            raise RuntimeError(f"{fleet.exited()[0]} exited during start-up:\n{fleet.tail(fleet.exited()[0])}")
        counts = []
        for addr in fleet.grpc.values():
            try:
                async with AsyncClient(addr) as c:
                    counts.append(len((await c.cluster_status(timeout_s=2)).workers))
            except Exception:
                counts.append(0)
        if all(n == workers for n in counts):
            return
        await asyncio.sleep(0.5)
    raise RuntimeError(f"the fleet was not ready within {timeout_s:.0f} s; logs in {fleet.log_dir}")


async def chaos(a, fleet: Fleet, log=print) -> tuple[Run, dict]:
    """Reference, load with faults, drain, slot check. Returns the run and the final sessions."""
    from flashfleet import AsyncClient

    addresses = [fleet.grpc["coord-a"], fleet.grpc["coord-b"]]
    reference = {}
    async with AsyncClient(addresses, timeout_s=a.sdk_timeout_s) as client:
        for p in PROMPTS:
            ids, finish = [], None
            async for chunk in client.generate(a.model_name, p, max_tokens=a.max_tokens):
                ids.extend(chunk.token_ids)
                finish = chunk.finish_reason or finish
            reference[p] = (ids, finish)
    log(f"reference: {len(PROMPTS)} prompts, {sum(len(v[0]) for v in reference.values())} tokens")

    run, stop = Run(), asyncio.Event()
    pids = {n: fleet.procs[n].pid for n in SURVIVORS}
    import psutil

    samples: list[tuple[float, str, int]] = []

    async def sample_rss():
        while not stop.is_set():
            for name, pid in pids.items():
                try:
                    samples.append((time.monotonic(), name, psutil.Process(pid).memory_info().rss))
                except psutil.Error:
                    pass
            await asyncio.sleep(a.sample_s)

    # The fill: every worker at capacity once, so that the survivors' memory baseline holds as many
    # sessions' KV caches as a worker ever does (later, a survivor carries the load of the workers
    # that are down).
    sampler = asyncio.create_task(sample_rss())
    fill_t = time.monotonic()
    async with AsyncClient(addresses, timeout_s=a.sdk_timeout_s) as client:
        async def one(i):
            async for _ in client.generate(a.model_name, PROMPTS[i % len(PROMPTS)], max_tokens=a.max_tokens):
                pass
        await asyncio.gather(*(one(i) for i in range(3 * a.capacity)))
    t0 = time.monotonic()
    run.fill_s = t0 - fill_t
    log(f"fill: {3 * a.capacity} streams at once in {run.fill_s:.1f} s")

    async def faults():
        k = 0
        while True:
            await asyncio.sleep(max(0.0, (k + 1) * a.period - (time.monotonic() - t0)))
            if time.monotonic() - t0 > a.duration - 1:
                return
            name = KILL_CYCLE[k % len(KILL_CYCLE)]
            k += 1
            fleet.kill(name)
            run.kills.append((name, time.monotonic() - t0))
            log(f"  {time.monotonic() - t0:6.1f} s  kill -9 {name}")
            if name.startswith("coord"):
                await asyncio.sleep(a.restart_delay)
            fleet.start(name)

    tasks = [asyncio.create_task(sdk_client(i, addresses, a.model_name, reference, stop, t0, run, a.max_tokens,
                                            a.sdk_timeout_s)) for i in range(a.sdk_clients)]
    tasks += [asyncio.create_task(http_client(i, fleet.http, a.model_name, stop, t0, run, a.max_tokens,
                                              a.http_timeout_s)) for i in range(a.http_clients)]
    faulter = asyncio.create_task(faults())
    await asyncio.sleep(a.duration)
    stop.set()
    await faulter
    await asyncio.gather(*tasks)
    await sampler
    for t, name, rss in samples:
        run.rss.setdefault(name, []).append((t - t0, rss))
    log(f"load stopped after {time.monotonic() - t0:.0f} s; {len(run.outcomes)} requests; waiting for every slot to free")
    # every process runs again (the last one killed may still be loading), then every slot frees
    await wait_ready(fleet, 3, 300)
    deadline = time.monotonic() + a.orphan_grace_s + 20
    final = sessions_now(fleet)
    while not slots_clear(final, 3) and time.monotonic() < deadline:
        await asyncio.sleep(1.0)
        final = sessions_now(fleet)
    return run, final


def report(a, run: Run, final: dict) -> tuple[str, bool, dict]:
    """The table and the verdict."""
    restart_s = a.restart_delay + 3.0
    sdk = [o for o in run.outcomes if o.api == "sdk"]
    http = [o for o in run.outcomes if o.api == "http"]
    for o in http:
        if o.outcome == "connection" and not explained(o, run.kills, restart_s):
            o.outcome, o.detail = "unclean", "connection broken with no coordinator killed: " + o.detail
    count = lambda xs, k: sum(1 for o in xs if o.outcome == k)  # noqa: E731
    sdk_bad = [o for o in sdk if o.outcome != "ok"]
    http_bad = [o for o in http if o.outcome in ("hang", "unclean")]
    end_s = max((o.end_s for o in run.outcomes), default=a.duration)
    warm, win = a.warmup_s, a.window_s
    growth = {}
    for name, samples in run.rss.items():
        base, last = window_max(samples, -run.fill_s, warm), window_max(samples, a.duration - win, a.duration)
        growth[name] = (base, last, None if not base or not last else 100.0 * (last - base) / base)
    rss_ok = bool(growth) and all(g[2] is not None and g[2] <= a.max_growth_pct for g in growth.values())
    slots_ok = slots_clear(final, 3)
    checks = [
        ("SDK streams: none lost, tokens = reference", not sdk_bad and bool(sdk),
         f"{count(sdk, 'ok')} ok of {len(sdk)}; lost {count(sdk, 'lost')}, mismatch {count(sdk, 'mismatch')}, "
         f"hang {count(sdk, 'hang')}"),
        ("HTTP: every failure a clean error", not http_bad and bool(http),
         f"{len(http)} requests: ok {count(http, 'ok')}, clean error {count(http, 'clean_error')}, connection cut "
         f"by a killed coordinator {count(http, 'connection')}, hang {count(http, 'hang')}, unclean "
         f"{count(http, 'unclean')}"),
        ("no slot leaked (every worker at 0 sessions)", slots_ok,
         "; ".join(f"{k}: {v}" for k, v in final.items())),
        (f"survivors' RSS growth <= {a.max_growth_pct:g} %", rss_ok,
         ", ".join(f"{n} {b / 2**20:.0f} -> {e / 2**20:.0f} MiB ({p:+.1f} %)" if p is not None else f"{n}: no sample"
                   for n, (b, e, p) in sorted(growth.items()))),
    ]
    lines = [f"chaos: {a.duration:.0f} s, a kill -9 every {a.period:g} s ({len(run.kills)} kills: "
             + ", ".join(f"{n}@{t:.0f}s" for n, t in run.kills) + f"); load ended at {end_s:.0f} s",
             f"load: {a.sdk_clients} SDK clients, {a.http_clients} HTTP clients, max_tokens {a.max_tokens}; "
             f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}", "",
             f"| {'check':<46} | {'result':<6} | detail", f"|{'-' * 48}|{'-' * 8}|{'-' * 60}"]
    for name, ok, detail in checks:
        lines.append(f"| {name:<46} | {'PASS' if ok else 'FAIL':<6} | {detail}")
    for o in (sdk_bad + http_bad)[:20]:
        lines.append(f"  {o.api} {o.outcome} at {o.start_s:.1f}-{o.end_s:.1f} s {o.coordinator}: {o.detail}")
    passed = all(ok for _, ok, _ in checks)
    lines.append(f"\nchaos: {'PASS' if passed else 'FAIL'}")
    summary = {"passed": passed, "checks": [{"check": n, "pass": ok, "detail": d} for n, ok, d in checks],
               "kills": run.kills, "final_sessions": final, "outcomes": [asdict(o) for o in run.outcomes],
               "rss_growth_pct": {n: g[2] for n, g in growth.items()}, "load_average": os.getloadavg()}
    return "\n".join(lines), passed, summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="model directory or fetched name (default %(default)s)")
    p.add_argument("--model-name", default=None, help="the name it is served as (default: --model's)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default %(default)s)")
    p.add_argument("--period", type=float, default=60.0, help="seconds between kills (default %(default)s)")
    p.add_argument("--restart-delay", type=float, default=0.5, help="a killed coordinator starts again after this")
    p.add_argument("--sdk-clients", type=int, default=4)
    p.add_argument("--http-clients", type=int, default=2)
    p.add_argument("--capacity", type=int, default=4, help="sessions per worker (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--orphan-grace-s", type=float, default=10.0, help="the workers' --orphan-grace")
    p.add_argument("--sdk-timeout-s", type=float, default=120.0, help="an SDK stream's deadline")
    p.add_argument("--http-timeout-s", type=float, default=120.0, help="an HTTP request with no end by then hangs")
    p.add_argument("--warmup-s", type=float, default=None, help="RSS baseline window's end, seconds into the load "
                   "(default 10 %% of --duration)")
    p.add_argument("--window-s", type=float, default=None, help="RSS windows' length (default 10 %% of --duration)")
    p.add_argument("--sample-s", type=float, default=2.0)
    p.add_argument("--max-growth-pct", type=float, default=5.0)
    p.add_argument("--log-dir", default=None, help="process logs (default: a new temporary directory)")
    p.add_argument("--json", default=None, help="write the summary here")
    a = p.parse_args(argv)
    if shutil.which("etcd") is None:
        p.error("the etcd binary is not on PATH (apt-get install etcd-server)")
    if a.period <= 0 or a.duration < a.period:
        p.error("--period must be > 0 and --duration at least one --period")
    if a.model_name is None:
        from flashfleet.models.cache import served_model_name

        a.model_name = served_model_name(a.model)
    a.warmup_s = a.duration * 0.1 if a.warmup_s is None else a.warmup_s
    a.window_s = a.duration * 0.1 if a.window_s is None else a.window_s
    log_dir = Path(a.log_dir or tempfile.mkdtemp(prefix="flashfleet-chaos-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(log_dir, a.model, a.model_name, a.capacity, a.orphan_grace_s)
    print(f"logs in {log_dir}", flush=True)
    try:
        for name in ("etcd", "coord-a", "coord-b", "w1", "w2", "w3"):
            fleet.start(name)
        asyncio.run(wait_ready(fleet, 3, 600))
        run, final = asyncio.run(chaos(a, fleet, log=lambda line: print(line, flush=True)))
    except RuntimeError as e:
        print(f"chaos: {e}", file=sys.stderr)
        return 1
    finally:
        fleet.stop()
    text, passed, summary = report(a, run, final)
    print(text, flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
