"""Throughput at 1, 2, 4, 8, 16 concurrent sessions: flashfleet against mlx-lm, from the outside.

Every system gets the same N prompts at once (session i gets prompt i mod the prompt count), greedy,
`--max-tokens` each, and the script prints one table row per (system, N):

  - tokens: generated tokens of all N sessions; full: sessions that reached --max-tokens (the rest
    stopped at an EOS; their actual tokens are counted).
  - agg tok/s: tokens / wall time from the first request sent to the last one finished.
  - per-session tok/s mean / min: each session's tokens / (its finish - the common start);
    for mlx-lm-batch every session's time is the call's (the batch returns together).
  - note: ours: the decode mode each request reported and the mean DFlash acceptance length tau.

then, per N, the aggregate ratios of `ours` and `ours-plain` to each mlx-lm baseline.

Systems (`--systems`, comma-separated; default all four):
  ours           a local cluster (coordinator + one worker, `flashfleet up`'s LocalCluster, as
                 processes), N concurrent `AsyncClient` streams, mode "auto": the worker's default
                 path, with the model's shipped DFlash draft when it has one (`--draft`).
  ours-plain     the same cluster, requests with mode="plain".
  mlx-lm-batch   `mlx_lm.generate.batch_generate` on the N prompts in one call, in this process.
  mlx-lm-server  `python -m mlx_lm server` as a process, N concurrent POSTs to /v1/completions
                 (temperature 0, not streamed; tokens from usage.completion_tokens), with
                 --decode-concurrency at least max N and its prompt cache off
                 (--prompt-cache-size 0: the prompts repeat across N, and a cached prompt would
                 skip its prefill; --server-args "--prompt-cache-size 10" restores its default).

Prompts: `bench/prompts/humaneval_heldout.jsonl` (the held-out HumanEval rows), each a user turn in
the target's chat template, rendered to text once here; every system gets that text or its token
ids (`tokenizer.encode(text)`, as the worker and mlx-lm's server encode a raw prompt), so all see the
same tokens. The script checks the prompt token counts the worker and the server report against
its own and prints a warning on a mismatch. Each system answers one short warm-up request first.

Usage (from the repository root):
  python bench/bench_concurrency.py                                   # SmolLM2-135M-Instruct
  python bench/bench_concurrency.py --sessions 1,2,4 --max-tokens 64 --systems ours,mlx-lm-batch
  python bench/bench_concurrency.py --model Qwen2.5-Coder-1.5B-Instruct --draft dflash  # GPU
  python bench/bench_concurrency.py --model DIR --json out.json --worker-args "--fixed-block-size"

`--model` takes a catalog name (fetched with `flashfleet models fetch NAME`) or a model directory.
`--draft auto` (default) loads the shipped DFlash draft when the model has one (`flashfleet models
list`), `none` runs the worker without a draft, anything else is passed to the worker's --draft.
On a GPU host (CUDA or Metal) every system runs on the GPU; the systems run one after another, so
they never share the device. On a Linux CPU the script restarts itself with OpenBLAS
preloaded where it is installed (`flashfleet.blas`), so mlx-lm, its server and the worker use the
same BLAS. mlx-lm computes in the dtype the worker computes in (`worker.loading`: float32 on a
CPU, whatever the stored dtype): batch_generate on the model loaded as a worker loads it, the server
on a copy cast to that dtype in a temporary directory when the stored dtype differs. Exit status: 0, 1 when a system fails, 2 for a bad argument, 130 on Ctrl-C or SIGTERM
(the cluster and the server are stopped first).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/bench_concurrency.py`
    sys.path.insert(0, str(ROOT))
# The cluster's processes import this checkout too, not another installed copy.
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])

DEFAULT_PROMPTS = ROOT / "bench" / "prompts" / "humaneval_heldout.jsonl"
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
SYSTEMS = ("ours", "ours-plain", "mlx-lm-batch", "mlx-lm-server")
BASELINES = ("mlx-lm-batch", "mlx-lm-server")
WARMUP_TOKENS = 8


@dataclass
class Session:
    """One finished session: generated token count, seconds from the common start to its end, and
    whether it reached max_tokens (False: it stopped at an EOS)."""

    tokens: int
    seconds: float
    full: bool


@dataclass
class Level:
    """One system at one concurrency: its sessions and the wall time (seconds) from the first
    request sent to the last one finished. `note`: what the system reported (e.g. decode modes)."""

    system: str
    sessions: list[Session]
    wall_s: float
    note: str = ""
    prompt_tokens: list[int] = field(default_factory=list)

    @property
    def n(self) -> int:
        """Concurrent sessions."""
        return len(self.sessions)

    @property
    def tokens(self) -> int:
        """Generated tokens of all sessions."""
        return sum(s.tokens for s in self.sessions)

    @property
    def aggregate_tps(self) -> float:
        """Generated tokens per second over the wall time."""
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def per_session_tps(self) -> list[float]:
        """Each session's tokens per second from the common start to its own end."""
        return [s.tokens / s.seconds if s.seconds > 0 else 0.0 for s in self.sessions]


# ---- prompts ----------------------------------------------------------------------------------

def read_prompts(path: Path) -> list[str]:
    """Prompt texts of a .jsonl file (field `prompt`, `text` or `content`; `read_prompt_files`).

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file holds no prompt.
    """
    from worker.training.data import read_prompt_files

    texts = [r.text for r in read_prompt_files([path])]
    if not texts:
        raise ValueError(f"{path} holds no prompt")
    return texts


def template_prompts(tokenizer, texts: list[str]) -> tuple[list[str], list[list[int]]]:
    """Each text as a user turn in the tokenizer's chat template (the raw text without one).

    Args:
        tokenizer: an mlx-lm TokenizerWrapper (or a Hugging Face tokenizer).
        texts: user messages.

    Returns:
        (templated texts, their token ids as the worker and mlx-lm's server encode a raw prompt:
        `tokenizer.encode(text)`).
    """
    out = []
    for text in texts:
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 add_generation_prompt=True, tokenize=False)
        out.append(text)
    return out, [[int(i) for i in tokenizer.encode(t)] for t in out]


def session_prompts(items: list, n: int) -> list:
    """The first n items, cycling when n exceeds the count."""
    return [items[i % len(items)] for i in range(n)]


# ---- ours: a local cluster --------------------------------------------------------------------

def start_cluster(model: str, draft: str | None, capacity: int, worker_args: tuple[str, ...] = (),
                  log=print):
    """A coordinator and one worker as processes (`flashfleet.cli.up.LocalCluster`), started and
    registered; the caller stops it (`.stop()`).

    Raises:
        RuntimeError: a process exited during start-up or the worker did not register (its log's
            tail is in the message).
    """
    from flashfleet.cli.up import LocalCluster

    cluster = LocalCluster(model, workers=1, draft=draft, capacity=capacity, worker_args=worker_args)
    cluster.start(progress=log)
    return cluster


async def _ours_level(address: str, model_name: str, prompts: list[str], max_tokens: int,
                      mode: str) -> Level:
    from flashfleet.client import AsyncClient

    async with AsyncClient(address) as client:
        t0 = time.perf_counter()

        async def one(prompt: str):
            done = await client.complete(model_name, prompt=prompt, max_tokens=max_tokens,
                                         temperature=0, mode=mode)
            return done, time.perf_counter() - t0

        results = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t0
    sessions, modes, taus, prompt_tokens = [], {}, [], []
    for done, seconds in results:
        n = len(done.token_ids)
        sessions.append(Session(n, seconds, done.finish_reason == "length" or n >= max_tokens))
        if done.stats is not None:
            modes[done.stats.mode] = modes.get(done.stats.mode, 0) + 1
            prompt_tokens.append(done.stats.prompt_tokens)
            if done.stats.acceptance_length:
                taus.append(done.stats.acceptance_length)
    note = " ".join(f"{m}:{c}" for m, c in modes.items())
    if taus:
        note += f" tau {sum(taus) / len(taus):.2f}"
    return Level("", sessions, wall, note, prompt_tokens)


def run_ours(address: str, model_name: str, prompts: list[str], max_tokens: int,
             mode: str = "auto") -> Level:
    """N concurrent streams (N = len(prompts)) through the coordinator, all sent at once.

    Raises:
        flashfleet.errors.FlashfleetError: a request failed.
    """
    return asyncio.run(_ours_level(address, model_name, prompts, max_tokens, mode))


def run_engine(engine, prompt_ids: list[list[int]], max_tokens: int, mode: str = "auto") -> Level:
    """N requests submitted at once to a worker's engine in this process (`--in-process`: the
    engine alone, without gRPC and the coordinator).

    Raises:
        Exception: the error of a request that failed.
    """
    import threading

    from worker.engine.types import DoneEvent, GenerationRequest, TokenEvent

    n = len(prompt_ids)
    counts, ends, dones, errors = [0] * n, [0.0] * n, [None] * n, []
    finished = threading.Semaphore(0)
    t0 = time.perf_counter()

    def emit_for(i: int):
        def emit(ev) -> None:
            if isinstance(ev, TokenEvent):
                counts[i] += len(ev.token_ids)
                return
            ends[i] = time.perf_counter() - t0
            if isinstance(ev, DoneEvent):
                dones[i] = ev
            else:
                errors.append(ev.error)
            finished.release()
        return emit

    for i, ids in enumerate(prompt_ids):
        engine.submit(GenerationRequest(f"bench-{t0}-{i}", tuple(ids), max_tokens, mode=mode), emit_for(i))
    for _ in range(n):
        finished.acquire()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    sessions = [Session(c, e, c >= max_tokens) for c, e in zip(counts, ends)]
    modes: dict[str, int] = {}
    for d in dones:
        modes[d.stats.mode] = modes.get(d.stats.mode, 0) + 1
    taus = [d.stats.acceptance_length for d in dones if d.stats.acceptance_length]
    note = " ".join(f"{m}:{c}" for m, c in modes.items()) + (f" tau {sum(taus) / len(taus):.2f}" if taus else "")
    return Level("", sessions, wall, note, [d.stats.prompt_tokens for d in dones])


# ---- mlx-lm batch_generate --------------------------------------------------------------------

def run_mlx_batch(model, tokenizer, prompt_ids: list[list[int]], max_tokens: int) -> Level:
    """`batch_generate` on all prompts in one call (greedy: its default sampler). Every session's
    time is the call's: the batch returns together."""
    from mlx_lm.generate import batch_generate

    t0 = time.perf_counter()
    out = batch_generate(model, tokenizer, prompt_ids, max_tokens=max_tokens, return_token_ids=True,
                         completion_batch_size=max(32, len(prompt_ids)))
    wall = time.perf_counter() - t0
    sessions = [Session(len(ids), wall, len(ids) >= max_tokens) for ids in out.token_ids]
    return Level("", sessions, wall, "", [len(p) for p in prompt_ids])


# ---- mlx-lm server ----------------------------------------------------------------------------

def copy_in_worker_dtype(model_dir: Path, out: Path) -> Path:
    """`model_dir` itself when its weights are stored in the dtype a worker computes in
    (`worker.loading.compute_dtype`), else a copy under `out` with its floating weights cast to
    that dtype. mlx-lm's server computes in the stored dtype: a bfloat16 fetch on a CPU, where the
    worker computes in float32, would measure a dtype, not the servers.

    Returns:
        The directory to serve.
    """
    import shutil

    from mlx_lm import load
    from mlx_lm.utils import save_model

    from worker.loading import compute_dtype, stored_dtype

    model, _ = load(str(model_dir))
    stored = stored_dtype(model)
    want = compute_dtype(stored)
    if stored is None or stored == want:
        return model_dir
    model.set_dtype(want)
    save_model(out, model)
    for f in Path(model_dir).iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out / f.name)
    return out


class MlxServer:
    """`python -m mlx_lm server` on a free local port, as a child process; use as a context manager.

    It runs with the environment `flashfleet up` gives its workers (`worker_env`: OpenBLAS
    preloaded on a Linux CPU), so it computes with the workers' BLAS however this script started.

    Args:
        model_dir: the model directory.
        decode_concurrency: its --decode-concurrency.
        extra_args: further server flags (they come last, so they override these).
    """

    def __init__(self, model_dir: Path, decode_concurrency: int, extra_args: tuple[str, ...] = ()):
        from flashfleet.cli.up import free_port, worker_env

        self.port = free_port()
        self.env = worker_env()  # the workers' environment: OpenBLAS preloaded where they get it
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="mlx-lm-server-", suffix=".log", delete=False)
        self.args = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir),
                     "--host", "127.0.0.1", "--port", str(self.port), "--prompt-cache-size", "0",
                     "--decode-concurrency", str(decode_concurrency), "--log-level", "WARNING",
                     *extra_args]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "MlxServer":
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        self.wait_ready()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self) -> str:
        """The last 2000 characters of the server's output."""
        return Path(self.log.name).read_text(errors="replace")[-2000:]

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Waits for /health to answer.

        Raises:
            RuntimeError: the process exited, or no answer within timeout_s (log tail included).
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlx_lm server exited with code {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"mlx_lm server not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGINT (the server's own shutdown), SIGKILL after 10 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def complete(self, prompt: str, max_tokens: int, timeout_s: float = 600.0) -> dict:
        """One POST to /v1/completions (temperature 0); returns the response's JSON.

        Raises:
            urllib.error.HTTPError: the server answered with an error status.
        """
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                           "stream": False}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())


def run_server(server: MlxServer, prompts: list[str], max_tokens: int) -> Level:
    """N concurrent /v1/completions requests (one thread each), all sent at once."""
    start = threading.Barrier(len(prompts) + 1)

    def one(prompt: str):
        start.wait()
        out = server.complete(prompt, max_tokens)
        return out, time.perf_counter()

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(one, p) for p in prompts]
        start.wait()
        t0 = time.perf_counter()
        results = [f.result() for f in futures]
    wall = max(end for _, end in results) - t0
    sessions, prompt_tokens = [], []
    for out, end in results:
        usage = out.get("usage") or {}
        n = int(usage.get("completion_tokens", 0))
        reason = (out.get("choices") or [{}])[0].get("finish_reason")
        sessions.append(Session(n, end - t0, reason == "length" or n >= max_tokens))
        prompt_tokens.append(int(usage.get("prompt_tokens", 0)))
    return Level("", sessions, wall, "", prompt_tokens)


# ---- report -----------------------------------------------------------------------------------

def format_table(levels: list[Level], max_tokens: int) -> str:
    """The results as a Markdown table: one row per (system, sessions)."""
    lines = [f"| system | sessions | tokens | full (={max_tokens}) | wall s | agg tok/s | "
             "per-session tok/s mean | min | note |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for lv in levels:
        per = lv.per_session_tps
        lines.append(f"| {lv.system} | {lv.n} | {lv.tokens} | {sum(s.full for s in lv.sessions)}/{lv.n} "
                     f"| {lv.wall_s:.2f} | {lv.aggregate_tps:.1f} | {sum(per) / len(per):.1f} "
                     f"| {min(per):.1f} | {lv.note} |")
    return "\n".join(lines)


def ratios(levels: list[Level]) -> dict[tuple[str, str, int], float]:
    """Aggregate tok/s of `ours` / `ours-plain` over each baseline at each concurrency:
    {(ours system, baseline, sessions): ratio}; pairs with a missing or zero side are left out."""
    by = {(lv.system, lv.n): lv.aggregate_tps for lv in levels}
    out = {}
    for (system, n), tps in by.items():
        if system not in ("ours", "ours-plain"):
            continue
        for base in BASELINES:
            if by.get((base, n)):
                out[(system, base, n)] = tps / by[(base, n)]
    return out


def format_ratios(levels: list[Level]) -> str:
    """The ratios (`ratios`) as a Markdown table: one row per sessions, one column per pair."""
    r = ratios(levels)
    if not r:
        return ""
    pairs = list(dict.fromkeys((s, b) for s, b, _ in r))
    ns = sorted({n for _, _, n in r})
    lines = ["| sessions | " + " | ".join(f"{s} / {b}" for s, b in pairs) + " |",
             "|---:|" + "---:|" * len(pairs)]
    for n in ns:
        cells = [f"{r[(s, b, n)]:.2f}x" if (s, b, n) in r else "-" for s, b in pairs]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- main -------------------------------------------------------------------------------------

def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _systems(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [n for n in names if n not in SYSTEMS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown system(s) {', '.join(bad) or text!r}; "
                                         f"choose from {', '.join(SYSTEMS)}")
    return list(dict.fromkeys(names))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring); exits 2 on a bad argument."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="catalog name or model directory")
    p.add_argument("--draft", default="auto", help="'auto' (default): the shipped DFlash draft when "
                   "the model has one; 'none'; or the worker's --draft value (e.g. 'dflash', a directory)")
    p.add_argument("--systems", type=_systems, default=list(SYSTEMS),
                   help=f"comma-separated, from {','.join(SYSTEMS)} (default all)")
    p.add_argument("--sessions", type=_int_list, default=[1, 2, 4, 8, 16],
                   help="concurrency levels (default 1,2,4,8,16)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per session (default 256)")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS,
                   help="prompt .jsonl (default bench/prompts/humaneval_heldout.jsonl)")
    p.add_argument("--worker-args", default="", help="extra worker flags, one shell-quoted string")
    p.add_argument("--server-args", default="", help="extra mlx_lm server flags, one string")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--engine-arg", action="append", default=[], metavar="FIELD=VALUE",
                   help="with --in-process: an EngineConfig field (e.g. small_gemm=false); repeatable")
    p.add_argument("--in-process", action="store_true",
                   help="run ours / ours-plain on a worker engine in this process (no gRPC, no coordinator)")
    a = p.parse_args(argv)
    if a.max_tokens < 1:
        p.error(f"--max-tokens must be >= 1, got {a.max_tokens}")
    if not a.prompts.is_file():
        p.error(f"--prompts {a.prompts}: no such file")
    from flashfleet.models import resolve_model

    try:
        a.model_dir = resolve_model(a.model)
    except (FileNotFoundError, NotADirectoryError) as e:
        p.error(f"--model: {e}")
    return a


def _engine_arg(text: str) -> tuple[str, object]:
    """`FIELD=VALUE` -> (FIELD, VALUE as bool, int or str)."""
    field_name, _, value = text.partition("=")
    parsed: object = {"true": True, "false": False}.get(value.lower(), value)
    if isinstance(parsed, str) and parsed.lstrip("-").isdigit():
        parsed = int(parsed)
    return field_name.strip(), parsed


def worker_draft(draft: str, model: str) -> str | None:
    """The worker's --draft for the script's --draft: 'auto' -> 'dflash' when the model has a
    shipped DFlash draft (else None), 'none' -> None, anything else unchanged."""
    from flashfleet.models.drafts import shipped_draft_dir

    if draft.lower() == "none":
        return None
    if draft.lower() == "auto":
        return "dflash" if shipped_draft_dir(model) is not None else None
    return draft


def _check_prompt_tokens(level: Level, want: list[int]) -> None:
    if level.prompt_tokens and level.prompt_tokens != want:
        print(f"warning: {level.system} at {level.n} sessions reports prompt tokens "
              f"{level.prompt_tokens}, this script encoded {want}", file=sys.stderr, flush=True)


def run_all(a: argparse.Namespace, log=print) -> list[Level]:
    """Runs every selected system at every concurrency; returns the levels in run order.

    Raises:
        RuntimeError: a cluster or server failed to start.
        Exception: whatever a failed request raises.
    """
    from mlx_lm.utils import load_tokenizer

    texts = read_prompts(a.prompts)
    tokenizer = load_tokenizer(a.model_dir)
    templated, ids = template_prompts(tokenizer, texts)
    max_n = max(a.sessions)
    log(f"model {a.model_dir}; {len(texts)} prompts ({min(map(len, ids))}-{max(map(len, ids))} "
        f"tokens); sessions {a.sessions}; max_tokens {a.max_tokens}")
    levels: list[Level] = []

    def record(system: str, n: int, level: Level) -> None:
        level.system = system
        _check_prompt_tokens(level, [len(p) for p in session_prompts(ids, n)])
        levels.append(level)
        log(f"  {system} x{n}: {level.tokens} tokens in {level.wall_s:.2f} s = "
            f"{level.aggregate_tps:.1f} tok/s {level.note}")

    ours = [s for s in a.systems if s in ("ours", "ours-plain")]
    if ours and a.in_process:
        from flashfleet.models.drafts import resolve_draft_arg
        from worker.config import EngineConfig
        from worker.engine.thread import Engine

        draft = resolve_draft_arg(worker_draft(a.draft, a.model), a.model)
        draft_dir = None if draft is None else Path(draft)
        log(f"starting an engine in this process: capacity {max_n}, draft {draft_dir}")
        extra = dict(_engine_arg(kv) for kv in a.engine_arg)
        with Engine(EngineConfig(model_path=a.model_dir, draft_path=draft_dir, capacity=max_n, **extra)) as engine:
            for system in ours:
                mode = "plain" if system == "ours-plain" else "auto"
                run_engine(engine, ids[:1], WARMUP_TOKENS, mode)
                for n in a.sessions:
                    record(system, n, run_engine(engine, session_prompts(ids, n), a.max_tokens, mode))
    elif ours:
        from flashfleet.models import served_model_name

        draft = worker_draft(a.draft, a.model)
        log(f"starting a cluster: 1 worker, capacity {max_n}, draft {draft}")
        cluster = start_cluster(a.model, draft, max_n, tuple(shlex.split(a.worker_args)), log)
        try:
            name = served_model_name(a.model)
            for system in ours:
                mode = "plain" if system == "ours-plain" else "auto"
                run_ours(cluster.address, name, templated[:1], WARMUP_TOKENS, mode)
                for n in a.sessions:
                    record(system, n, run_ours(cluster.address, name, session_prompts(templated, n),
                                               a.max_tokens, mode))
        finally:
            cluster.stop()
    if "mlx-lm-batch" in a.systems:
        from worker.loading import load_target

        model, mlx_tokenizer = load_target(a.model_dir)  # in the worker's compute dtype
        run_mlx_batch(model, mlx_tokenizer, ids[:1], WARMUP_TOKENS)
        for n in a.sessions:
            record("mlx-lm-batch", n, run_mlx_batch(model, mlx_tokenizer, session_prompts(ids, n),
                                                    a.max_tokens))
        del model
    if "mlx-lm-server" in a.systems:
        with tempfile.TemporaryDirectory(prefix="mlx-lm-server-model-") as tmp:
            served = copy_in_worker_dtype(a.model_dir, Path(tmp))
            log(f"starting mlx_lm server on {served}")
            with MlxServer(served, max(32, max_n), tuple(shlex.split(a.server_args))) as server:
                server.complete(templated[0], WARMUP_TOKENS)
                for n in a.sessions:
                    record("mlx-lm-server", n, run_server(server, session_prompts(templated, n), a.max_tokens))
    return levels


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark and prints the tables; returns the exit status. SIGTERM stops it as
    Ctrl-C does: the cluster and the server are stopped first."""
    a = parse_args(argv)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        levels = run_all(a, log=lambda m: print(m, flush=True))
    except KeyboardInterrupt:
        print("bench_concurrency: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a system that failed: one line, not a traceback
        print(f"bench_concurrency: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print()
    print(format_table(levels, a.max_tokens))
    table = format_ratios(levels)
    if table:
        print("\nAggregate tok/s ratios:\n" + table)
    if a.json:
        a.json.write_text(json.dumps([{**asdict(lv), "aggregate_tps": lv.aggregate_tps}
                                      for lv in levels], indent=1))
    return 0


if __name__ == "__main__":
    from flashfleet.blas import restart_with_openblas

    restart_with_openblas()
    sys.exit(main())
