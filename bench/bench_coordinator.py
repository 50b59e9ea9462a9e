"""What one coordinator relays: streams held, tokens/s, requests/s admitted, CPU per 1,000 tokens
and the heartbeat load, with simulated workers (bench/sim_worker.py: no model, tokens at a set rate,
each worker's streams all given their chunk at the same tick of its clock, as a real engine's
batched iteration gives them).

Per row (coordinators x workers), this script starts the coordinator processes (`python -m
coordinator`, each alone on a core of its own where the host has enough), the simulated workers (in
`--sim-procs` processes per coordinator) and load clients (`--client-procs` processes of this
script, grpc.aio), then measures three phases:

1. idle: the workers only heartbeat (every 2 s, the coordinator's default): the coordinator's CPU
   share then is the heartbeat load (with its keepalive pings to every worker);
2. stream: `--streams` streams per coordinator, each a request of `--max-tokens` tokens that the
   clients open again as soon as it completes; after `--warmup-s`, `--duration-s` seconds are
   measured: tokens the clients received per second (relayed), Chunk messages per second,
   requests completed per second, streams held (receiving tokens: past their first message and
   not complete; the clients' mean over the window),
   the share of the set rate each stream got ("rate kept": 100 % when the coordinator keeps up),
   and the coordinators' CPU seconds (psutil) per 1,000 tokens;
3. admit: `--admit-concurrency` clients per coordinator send one-token requests back to back for
   `--admit-s` seconds: requests admitted and completed per second.

In the stream window the bench samples each coordinator's own measure of how late it answers an
RPC (`flashfleet_coordinator_rpc_lag_seconds` on its `--metrics-port`: median and maximum) and
reads its count of expired leases after it. Through all three the simulated workers time every
heartbeat from send to answer: the table gives
the round trip's median, 99th percentile and maximum over heartbeats sent in the stream window
(how late a loaded coordinator answers them; the simulated workers' own loops are loaded too, so
"sender late" says how late they sent them) and the heartbeats refused for an expired lease.

Several coordinators run independently, each with its own workers and clients, so their rows
show how the relay adds up across processes; with `--etcd` they share the fleet's state in etcd
(`--state etcd`, a member this script starts): each worker registers with one coordinator and
every coordinator routes its clients to all of them.

    python bench/bench_coordinator.py --workers 50 200 1000 --coordinators 1 2 3 \\
        --streams 2000 --tokens-per-s 25 --max-tokens 200 [--json-out F]

Pinning plan (`make_plan`, printed above the table): from the cores this process may run on
(os.sched_getaffinity, or `--cores`), coordinator i gets the i-th one; every simulated-worker and
client process gets one of the cores left, in turn (all cores when every core has a coordinator),
and by default there are as many of them as cores left. A client process counts a message's tokens
into running totals and nothing per token, so a few of them take tens of thousands of tokens a
second. The coordinator and simulated-worker path needs grpcio, protobuf, grpcio-health-checking,
grpcio-reflection, prometheus-client, tenacity and psutil (no MLX). `--tokens-per-chunk` sets the
tokens an engine iteration (a simulated worker's tick, every tokens-per-chunk / tokens-per-s
seconds) yields a stream (1: plain decoding; several: speculative decoding); `--coalesce` has a
call that fell behind send every chunk queued while it wrote as one message. The simulated workers
serve Subscribe as real ones do, so a coordinator that opens one per worker gets a tick's chunks
for all of a worker's streams as one batch.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flashfleet.transport import CHANNEL_OPTIONS  # noqa: E402
from flashfleet.v1 import common_pb2, coordinator_pb2_grpc  # noqa: E402

HEARTBEAT_INTERVAL_S = 2.0  # the coordinator's default
# How often the stream window reads each coordinator's /metrics (its RPC lag): a fast Prometheus
# scrape interval. One exposition at 200 workers costs the coordinator about 50 ms of CPU (py-spy),
# so a 1 s interval would itself take 5 % of the core being measured.
SCRAPE_S = 5.0
START_TIMEOUT_S = 120.0


# --- load client (a subprocess of this script) ---------------------------------------------------

async def _client(args) -> dict:
    """Runs one client process's streams (or one-token requests) against one coordinator and
    counts what arrives inside [measure_from, measure_to] (wall-clock seconds), and how many
    streams were receiving tokens (past their first message, not yet complete), sampled twice a
    second inside it.

    Cheap per message, so that a few processes offer tens of thousands of tokens a second: a
    message adds its token count to running totals (no clock read, no per-token work), and the
    window's counts are the totals' difference between its two ends, read by one task."""
    channels = [grpc.aio.insecure_channel(args.target, options=[*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)])
                for _ in range(max(1, math.ceil(args.streams / 250)))]
    stubs = [coordinator_pb2_grpc.CoordinatorStub(c) for c in channels]
    total = [0, 0, 0]  # tokens, chunk messages, requests completed: since the start
    errors: dict[str, int] = {}
    streaming = [0]
    inside, stop = [False], [False]  # in the measured window; past it (the streams end)

    async def one_stream(i: int) -> None:
        stub = stubs[i % len(stubs)]
        if args.ramp_s > 0:
            await asyncio.sleep(random.uniform(0, args.ramp_s))
        while not stop[0]:
            req = common_pb2.GenerateRequest(model=args.model, prompt="simulated", max_tokens=args.max_tokens,
                                             request_id=uuid.uuid4().hex)
            started = False
            try:
                async for resp in stub.Generate(req, timeout=args.timeout_s):
                    if resp.HasField("chunk"):
                        total[0] += len(resp.chunk.token_ids)
                        total[1] += 1
                        if not started:
                            started = True
                            streaming[0] += 1
                    else:
                        total[2] += 1
                    if stop[0]:
                        break
            except grpc.aio.AioRpcError as e:
                if inside[0]:
                    name = e.code().name
                    errors[name] = errors.get(name, 0) + 1
                await asyncio.sleep(0.05)
            finally:
                if started:
                    streaming[0] -= 1

    tasks = [asyncio.ensure_future(one_stream(i)) for i in range(args.streams)]
    await asyncio.sleep(max(0.0, args.measure_from - time.time()))
    inside[0] = True
    at_from = list(total)
    samples = []
    while time.time() < args.measure_to:
        samples.append(streaming[0])
        await asyncio.sleep(min(0.5, max(0.0, args.measure_to - time.time())))
    at_to = list(total)
    inside[0] = False
    await asyncio.sleep(max(0.0, args.measure_to + 0.5 - time.time()))
    stop[0] = True
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for c in channels:
        await c.close()
    tokens, messages, requests = (b - a for a, b in zip(at_from, at_to))
    return {"tokens": tokens, "messages": messages, "requests": requests, "errors": sum(errors.values()),
            "error_codes": errors, "held": sum(samples) / len(samples) if samples else 0.0}


def run_client(argv) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--target")
    p.add_argument("--model")
    p.add_argument("--streams", type=int)
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--measure-from", type=float)
    p.add_argument("--measure-to", type=float)
    p.add_argument("--ramp-s", type=float)
    p.add_argument("--timeout-s", type=float)
    args = p.parse_args(argv)
    print(json.dumps(asyncio.run(_client(args))), flush=True)
    return 0


# --- processes -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """Where one row's processes run (`make_plan`).

    Attributes:
        coordinator_cores: the core of each coordinator, in order.
        load_cores: the cores of the load generators (simulated workers, clients, etcd): those no
            coordinator has, or all of them when every core has one.
        sim_procs: simulated-worker processes per coordinator.
        client_procs: client processes per coordinator.
    """

    coordinator_cores: list[int]
    load_cores: list[int]
    sim_procs: int
    client_procs: int

    def describe(self) -> str:
        n = len(self.coordinator_cores)
        return (f"coordinator cores {self.coordinator_cores}; {n * self.sim_procs} simulated-worker and "
                f"{n * self.client_procs} client processes, one core each, over cores {self.load_cores}")


def parse_cores(text: str) -> list[int]:
    """Core ids of a list such as "0-3,6" (taskset's syntax), sorted.

    Raises:
        ValueError: not such a list.
    """
    cores: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    if not cores or min(cores) < 0:
        raise ValueError(f"not a core list: {text!r} (e.g. 0-3,6)")
    return sorted(cores)


def usable_cores(cores: list[int] | None = None) -> list[int]:
    """The cores this process may run on (os.sched_getaffinity; all of os.cpu_count() where the
    platform has no affinity), or those of `cores` among them."""
    if hasattr(os, "sched_getaffinity"):
        avail = sorted(os.sched_getaffinity(0))
    else:
        avail = list(range(os.cpu_count() or 1))
    if cores is None:
        return avail
    return [c for c in cores if c in set(avail)]


def make_plan(args, coordinators: int) -> Plan:
    """The row's pinning plan: coordinator i gets the i-th usable core (from `--coordinator-core`
    on, wrapping around), and every simulated-worker and client process one of the cores left,
    in turn. `--sim-procs` / `--client-procs` 0 (the default) split the cores left evenly between
    the two kinds and over the coordinators, at least one process each."""
    cores = usable_cores(args.cores)
    first = cores.index(args.coordinator_core) if args.coordinator_core is not None else 0
    coordinator_cores = [cores[(first + i) % len(cores)] for i in range(coordinators)]
    load = [c for c in cores if c not in coordinator_cores] or cores
    auto = max(1, len(load) // (2 * coordinators))
    return Plan(coordinator_cores, load, args.sim_procs or auto, args.client_procs or auto)


def _pinned(cmd: list[str], cores: list[int] | None) -> list[str]:
    """`cmd` under `taskset -c CORES` where taskset exists and cores are given."""
    if cores and _has_taskset():
        return ["taskset", "-c", ",".join(map(str, cores)), *cmd]
    return cmd


def _has_taskset() -> bool:
    return subprocess.run(["sh", "-c", "command -v taskset"], capture_output=True).returncode == 0


def _wait_line(proc: subprocess.Popen, prefix: str, what: str) -> str:
    """The first stdout line of `proc` starting with `prefix` (raises if it exits first)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{what} exited ({proc.wait()}): {_err_tail(proc)}")
        if line.startswith(prefix):
            return line.strip()
    raise RuntimeError(f"{what} did not start within {START_TIMEOUT_S:.0f} s")


def _start(cmd: list[str], cores, src: Path = ROOT) -> subprocess.Popen:
    """Starts `cmd` (pinned to `cores`) with `src` as its working directory and import root. Its
    stderr goes to a temporary file (`_err_tail`): a pipe nobody reads would fill and stall it."""
    env = {**os.environ, "PYTHONPATH": str(src), "PYTHONUNBUFFERED": "1"}
    err = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(_pinned(cmd, cores), stdout=subprocess.PIPE, stderr=err, text=True, cwd=src, env=env)
    proc.err_file = err
    return proc


def _err_tail(proc: subprocess.Popen, n: int = 2000) -> str:
    """The last `n` characters `proc` wrote to stderr."""
    proc.err_file.seek(0)
    return proc.err_file.read()[-n:]


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class EtcdMember:
    """One etcd member (the `etcd` binary) on free loopback ports in a temporary directory,
    pinned to `cores`; `stop()` kills it and removes its data."""

    def __init__(self, cores):
        self.dir = tempfile.mkdtemp(prefix="bench-etcd-")
        client, peer = _free_port(), _free_port()
        self.endpoint = f"127.0.0.1:{client}"
        self.proc = subprocess.Popen(_pinned([
            shutil.which("etcd"), "--name", "bench", "--data-dir", os.path.join(self.dir, "data"),
            "--listen-client-urls", f"http://{self.endpoint}", "--advertise-client-urls", f"http://{self.endpoint}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"bench=http://127.0.0.1:{peer}", "--logger", "zap", "--log-level", "warn"], cores),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", client), timeout=0.2):
                    return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("etcd did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_s(pids: list[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def _coordinator_pid(proc: subprocess.Popen) -> int:
    """The coordinator's own pid (taskset execs it, so the Popen's pid is the coordinator's)."""
    return proc.pid


def _sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.time()))


def _clients(targets, args, plan: "Plan", streams_per_coordinator: int, max_tokens: int, t_from: float,
             t_to: float, ramp_s: float) -> list[subprocess.Popen]:
    """Starts `plan.client_procs` client processes per coordinator, each on one load core."""
    procs = []
    k = plan.sim_procs * len(targets)  # the load cores after the simulated workers'
    for target in targets:
        per = [streams_per_coordinator // plan.client_procs + (i < streams_per_coordinator % plan.client_procs)
               for i in range(plan.client_procs)]
        for n in per:
            if n == 0:
                continue
            cores = [plan.load_cores[k % len(plan.load_cores)]]
            k += 1
            procs.append(_start([sys.executable, str(Path(__file__).resolve()), "--client", "--target", target,
                                 "--model", args.model, "--streams", str(n), "--max-tokens", str(max_tokens),
                                 "--measure-from", repr(t_from), "--measure-to", repr(t_to),
                                 "--ramp-s", repr(ramp_s), "--timeout-s", repr(args.timeout_s)], cores))
    return procs


def _collect(procs: list[subprocess.Popen], timeout_s: float) -> dict:
    total = {"tokens": 0, "messages": 0, "requests": 0, "errors": 0, "error_codes": {}, "held": 0.0}
    for p in procs:
        out, _ = p.communicate(timeout=timeout_s)
        if p.returncode != 0:
            raise RuntimeError(f"a load client failed ({p.returncode}): {_err_tail(p)}")
        c = json.loads(out.strip().splitlines()[-1])
        for k in ("tokens", "messages", "requests", "errors", "held"):
            total[k] += c[k]
        for k, v in c["error_codes"].items():
            total["error_codes"][k] = total["error_codes"].get(k, 0) + v
    return total


def run_row(args, coordinators: int, workers: int, src: Path = ROOT, label: str = "this") -> dict:
    """Starts `coordinators` coordinators (the code of the repository at `src`) with `workers`
    simulated workers in all, runs the three phases and returns the row's measurements."""
    plan = make_plan(args, coordinators)
    load_cores = plan.load_cores
    procs: list[subprocess.Popen] = []
    sims: list[subprocess.Popen] = []
    rpc_lags: list[float] = []
    expiries = float("nan")
    beats = {"rtts": [], "lease_losses": []}
    etcd = None
    t_from = t_to = math.inf
    load_avg = float("nan")
    try:
        state = []
        if args.etcd:  # one etcd member holds the fleet's state for every coordinator of the row
            etcd = EtcdMember(load_cores)
            state = ["--state", "etcd", "--etcd-endpoints", etcd.endpoint]
        targets, pids = [], []
        metrics_ports = []
        for c in range(coordinators):
            metrics_ports.append(_free_port())
            proc = _start([sys.executable, "-m", "coordinator", "--port", "0", "--log-level", "WARNING",
                           "--metrics-port", str(metrics_ports[-1]),
                           "--max-queued", str(max(64, args.streams)),
                           "--heartbeat-interval-s", repr(HEARTBEAT_INTERVAL_S), *state],
                          [plan.coordinator_cores[c]], src)
            procs.append(proc)
            line = _wait_line(proc, "coordinator ready on", "the coordinator")
            targets.append(line.rsplit(" ", 1)[1].replace("0.0.0.0", "127.0.0.1"))
            pids.append(_coordinator_pid(proc))
        per_coord = [workers // coordinators + (i < workers % coordinators) for i in range(coordinators)]
        capacity = max(2, math.ceil(args.streams * 1.25 / max(1, min(per_coord))))
        for c, (target, n) in enumerate(zip(targets, per_coord)):
            nprocs = max(1, min(plan.sim_procs, n))
            for i in range(nprocs):
                k = n // nprocs + (i < n % nprocs)
                sims.append(_start([sys.executable, str(ROOT / "bench" / "sim_worker.py"), "--coordinator", target,
                                    "--workers", str(k), "--capacity", str(capacity),
                                    "--tokens-per-s", repr(args.tokens_per_s),
                                    "--tokens-per-chunk", str(args.tokens_per_chunk), "--model", args.model,
                                    "--prefix", f"sim{c}.{i}", *(["--coalesce"] if args.coalesce else [])],
                                   [load_cores[(c * plan.sim_procs + i) % len(load_cores)]]))
        procs.extend(sims)
        for s in sims:
            _wait_line(s, "ready", "a simulated worker process")

        # 1. idle: heartbeats only
        time.sleep(HEARTBEAT_INTERVAL_S)  # every worker's heartbeat cycle has begun
        c0, t0 = _cpu_s(pids), time.time()
        time.sleep(args.idle_s)
        idle_cpu = (_cpu_s(pids) - c0) / (time.time() - t0)

        # 2. stream
        start = time.time() + 1.0
        t_from = start + args.warmup_s
        t_to = t_from + args.duration_s
        clients = _clients(targets, args, plan, args.streams, args.max_tokens, t_from, t_to,
                           min(args.warmup_s, args.max_tokens / args.tokens_per_s))
        procs.extend(clients)
        _sleep_until(t_from)
        c0 = _cpu_s(pids)
        spy = None
        if args.py_spy:  # samples the first coordinator through the measured window
            spy = subprocess.Popen(["py-spy", "record", "--pid", str(pids[0]), "--duration", str(int(args.duration_s)),
                                    "--format", "raw", "--rate", "200", "--nonblocking", "--output",
                                    f"{args.py_spy}-{label}-c{coordinators}-w{workers}.txt"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rpc_lags = []  # the coordinators' own measure of how late they answer an RPC, sampled
        while time.time() < t_to:
            rpc_lags += [v for port in metrics_ports
                         if not math.isnan(v := _scrape(port, "flashfleet_coordinator_rpc_lag_seconds"))]
            time.sleep(min(SCRAPE_S, max(0.0, t_to - time.time())))
        stream_cpu = _cpu_s(pids) - c0
        load_avg = os.getloadavg()[0]  # the host's 1-minute load average at the window's end
        expiries = sum(_scrape(port, "flashfleet_coordinator_lease_expiries_total") for port in metrics_ports)
        # workers each coordinator gets tokens from on an open subscription (nan: a version without them)
        subscribed = [_scrape(port, "flashfleet_coordinator_worker_subscriptions") for port in metrics_ports]
        counts = _collect(clients, args.timeout_s + 60)
        if spy is not None:
            spy.wait(60)

        # 3. admit: one-token requests back to back
        a_from = time.time() + 2.0
        a_to = a_from + args.admit_s
        admitters = _clients(targets, args, plan, args.admit_concurrency, 1, a_from, a_to, 0.0)
        procs.extend(admitters)
        _sleep_until(a_from)
        a0 = _cpu_s(pids)
        _sleep_until(a_to)
        admit_cpu = _cpu_s(pids) - a0
        admit = _collect(admitters, args.timeout_s + 60)
        if counts["errors"] or admit["errors"]:  # what the coordinators logged about them
            for p in procs[:coordinators]:
                print(f"coordinator log (end):\n{_err_tail(p, 3000)}", file=sys.stderr, flush=True)
    finally:
        for sim in sims:  # their last line reports every heartbeat's round trip
            if sim.poll() is None:
                sim.terminate()
            try:
                out, _ = sim.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                continue
            for line in out.splitlines():
                if line.startswith("heartbeats "):
                    got = json.loads(line[len("heartbeats "):])
                    beats["rtts"] += got["rtts"]
                    beats["lease_losses"] += got["lease_losses"]
        _stop(procs)
        if etcd is not None:
            etcd.stop()
    rtts = sorted(r for t, r, _ in beats["rtts"] if t_from <= t <= t_to)
    rpc_lags.sort()
    sender_late = sorted(late for t, _, late in beats["rtts"] if t_from <= t <= t_to)
    d = args.duration_s
    offered = coordinators * args.streams
    tokens_s = counts["tokens"] / d
    return {
        "code": label, "coordinators": coordinators, "workers": workers, "capacity": capacity, "streams": offered,
        "held": round(counts["held"]), "tokens_per_s": tokens_s, "messages_per_s": counts["messages"] / d,
        "tokens_per_message": counts["tokens"] / counts["messages"] if counts["messages"] else float("nan"),
        "rate_kept": tokens_s / (offered * args.tokens_per_s), "requests_per_s": counts["requests"] / d,
        "cpu_s_per_1k_tokens": 1000 * stream_cpu / counts["tokens"] if counts["tokens"] else float("nan"),
        "coordinator_cpu": stream_cpu / d / coordinators, "errors": counts["errors"],
        "error_codes": counts["error_codes"], "admitted_per_s": admit["requests"] / args.admit_s,
        "admit_cpu": admit_cpu / args.admit_s / coordinators, "admit_errors": admit["errors"],
        "heartbeats_per_s": workers / HEARTBEAT_INTERVAL_S, "idle_cpu": idle_cpu / coordinators,
        "heartbeat_rtt_p50_s": _quantile(rtts, 0.5), "heartbeat_rtt_p99_s": _quantile(rtts, 0.99),
        "heartbeat_rtt_max_s": rtts[-1] if rtts else float("nan"), "leases_lost": len(beats["lease_losses"]),
        "heartbeat_sender_late_p99_s": _quantile(sender_late, 0.99),
        "rpc_lag_p50_s": _quantile(rpc_lags, 0.5), "rpc_lag_max_s": rpc_lags[-1] if rpc_lags else float("nan"),
        "lease_expiries": expiries, "subscribed": min(subscribed), "load_avg": load_avg, "plan": plan.describe(),
    }


def _scrape(port: int, name: str) -> float:
    """The value of the sample `name` (no labels) on a coordinator's /metrics; nan when absent
    (a version without it) or unreachable."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
    except OSError:
        pass
    return float("nan")


def _quantile(xs: list[float], q: float) -> float:
    """The q-quantile of sorted `xs` (nearest rank); nan when empty."""
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def print_table(rows: list[dict], args) -> None:
    print(f"\n{args.tokens_per_s:g} tokens/s per stream, {args.tokens_per_chunk} token(s) per chunk"
          f"{' (chunks due together sent as one message)' if args.coalesce else ''}, "
          f"{args.max_tokens} tokens per request; {args.duration_s:g} s measured per row; "
          f"host: {os.cpu_count()} cores, load generators on the same host")
    for plan in dict.fromkeys(r["plan"] for r in rows):
        print(f"plan: {plan}")
    print()
    head = ("code", "coord", "workers", "streams", "held", "tokens/s", "rate kept", "msgs/s", "tok/msg", "req/s",
            "CPU s/1k tok", "coord CPU", "subscribed", "admitted req/s", "heartbeats/s", "idle CPU", "RPC lag p50/max s",
            "lease expiries", "heartbeat RTT p50/p99/max s", "sender late p99 s", "leases lost", "load avg",
            "errors")
    print("| " + " | ".join(head) + " |")
    print("|" + "---:|" * len(head))
    for r in rows:
        errs = r["errors"] + r["admit_errors"]
        subscribed = "-" if math.isnan(r.get("subscribed", math.nan)) else f"{r['subscribed']:.0f}"
        print(f"| {r['code']} | {r['coordinators']} | {r['workers']} | {r['streams']} | {r['held']} | {r['tokens_per_s']:,.0f} | "
              f"{100 * r['rate_kept']:.0f} % | {r['messages_per_s']:,.0f} | {r['tokens_per_message']:.1f} | "
              f"{r['requests_per_s']:,.0f} | "
              f"{r['cpu_s_per_1k_tokens']:.3f} | {100 * r['coordinator_cpu']:.0f} % | "
              f"{subscribed} | "
              f"{r['admitted_per_s']:,.0f} | "
              f"{r['heartbeats_per_s']:,.0f} | {100 * r['idle_cpu']:.1f} % | {r['rpc_lag_p50_s']:.3f} / "
              f"{r['rpc_lag_max_s']:.3f} | {r['lease_expiries']:.0f} | {r['heartbeat_rtt_p50_s']:.3f} / "
              f"{r['heartbeat_rtt_p99_s']:.3f} / {r['heartbeat_rtt_max_s']:.3f} | "
              f"{r['heartbeat_sender_late_p99_s']:.3f} | {r['leases_lost']} | {r['load_avg']:.1f} | {errs} |")
    print("\ncoord CPU and idle CPU: per coordinator, 100 % = one core; idle: heartbeats only; subscribed: the "
          "workers whose tokens reached the coordinator on a subscription at the window's end (the least over "
          "coordinators; - : a coordinator without them); RPC lag: the "
          "coordinator's own measure of how late it answers an RPC (its rpc_lag_seconds gauge, sampled every 5 s "
          "in the stream window); load avg: the host's 1-minute load average at the stream window's end; lease expiries: counted by the coordinators; heartbeat RTT: send to answer, heartbeats sent in the stream window; sender late: how much later than due the "
          "simulated worker's own loop sent them; leases lost: heartbeats refused for an expired "
          "lease in the whole row")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--client"]:
        return run_client(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[50, 200, 1000], help="simulated workers in all")
    p.add_argument("--coordinators", type=int, nargs="+", default=[1], help="coordinator processes")
    p.add_argument("--streams", type=int, default=2000, help="concurrent streams per coordinator")
    p.add_argument("--tokens-per-s", type=float, default=25.0, help="tokens per second of each stream")
    p.add_argument("--tokens-per-chunk", type=int, default=1,
                   help="token ids per chunk of a simulated worker (an engine iteration's tokens: 1 for plain decoding, "
                   "several for speculative decoding)")
    p.add_argument("--max-tokens", type=int, default=200, help="tokens per request")
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument("--duration-s", type=float, default=20.0, help="measured seconds of the stream phase")
    p.add_argument("--idle-s", type=float, default=4.0, help="measured seconds of the heartbeat-only phase")
    p.add_argument("--admit-s", type=float, default=5.0, help="measured seconds of the admission phase")
    p.add_argument("--admit-concurrency", type=int, default=64, help="one-token clients per coordinator")
    p.add_argument("--coalesce", action="store_true",
                   help="the simulated workers send every chunk already due as one message when a stream falls "
                   "behind its rate, as the real worker does (default: one message per chunk)")
    p.add_argument("--cores", type=parse_cores, default=None, metavar="LIST",
                   help="cores the row may use, e.g. 0-15 (default: all this process may run on, "
                   "os.sched_getaffinity). Pinning plan: coordinator i runs alone on the i-th of them (from "
                   "--coordinator-core on); the simulated workers and clients run one process a core over the "
                   "cores left (all of them when every core has a coordinator), as does etcd")
    p.add_argument("--sim-procs", type=int, default=0,
                   help="simulated-worker processes per coordinator (default 0: the cores left / (2 x coordinators), "
                   "at least 1)")
    p.add_argument("--client-procs", type=int, default=0,
                   help="client processes per coordinator (default 0: as --sim-procs)")
    p.add_argument("--coordinator-core", type=int, default=None,
                   help="core of the first coordinator (default: the first of --cores); the next ones take the "
                   "following cores")
    p.add_argument("--timeout-s", type=float, default=120.0, help="deadline of each request")
    p.add_argument("--model", default="sim")
    p.add_argument("--json-out", type=Path, default=None)
    p.add_argument("--etcd", action="store_true",
                   help="the coordinators share the fleet's state in etcd (`--state etcd`; the bench starts one etcd "
                   "member, the `etcd` binary): each worker registers with one coordinator and serves all; without "
                   "it every coordinator has its own workers")
    p.add_argument("--baseline-src", type=Path, default=None, metavar="DIR",
                   help="a checkout of another version (e.g. `git worktree add DIR COMMIT`): each row runs its "
                   "coordinator first (code \"baseline\"), then this one's (\"this\"), side by side")
    p.add_argument("--py-spy", default=None, metavar="PREFIX",
                   help="profile the first coordinator through each row's measured stream window with py-spy "
                   "(pip install py-spy): collapsed stacks in PREFIX-c<coordinators>-w<workers>.txt")
    args = p.parse_args(argv)
    bad = [n for n in (*args.workers, *args.coordinators, args.streams, args.max_tokens, args.tokens_per_chunk,
                       args.admit_concurrency) if n < 1]
    if bad or args.tokens_per_s <= 0 or args.duration_s <= 0 or min(args.sim_procs, args.client_procs) < 0:
        p.error("counts must be >= 1 (--sim-procs, --client-procs >= 0) and --tokens-per-s, --duration-s > 0")
    cores = usable_cores(args.cores)
    if not cores:
        p.error(f"none of --cores {args.cores} is usable here (this process may run on {usable_cores()})")
    if args.coordinator_core is not None and args.coordinator_core not in cores:
        p.error(f"--coordinator-core {args.coordinator_core} is not among the usable cores {cores}")
    if min(args.duration_s, args.admit_s) <= 0:
        p.error("--duration-s and --admit-s must be above 0: each row measures a stream window and an admission window")
    if args.etcd and not shutil.which("etcd"):
        p.error("--etcd needs the etcd binary (apt-get install etcd-server)")
    if args.etcd and args.baseline_src is not None:
        p.error("--etcd and --baseline-src cannot go together: the baseline's coordinator may have no --state")
    if args.baseline_src is not None and not (args.baseline_src / "coordinator" / "__main__.py").is_file():
        p.error(f"--baseline-src {args.baseline_src}: no coordinator/__main__.py there")
    try:
        import psutil  # noqa: F401
    except ImportError:
        p.error("psutil is needed (pip install psutil; it is in the test extra)")
    rows = []
    failed = 0
    for c in args.coordinators:
        for w in args.workers:
            if w < c:
                p.error(f"{w} workers cannot be split over {c} coordinators")
            for src, label in ([(args.baseline_src.resolve(), "baseline")] if args.baseline_src else []) + [(ROOT, "this")]:
                try:
                    rows.append(run_row(args, c, w, src, label))
                except (RuntimeError, subprocess.TimeoutExpired) as e:  # the row is lost, not the run
                    print(f"row {label} {c} coordinator(s) x {w} workers failed: {e}", file=sys.stderr, flush=True)
                    failed += 1
                    continue
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print_table(rows, args)
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
