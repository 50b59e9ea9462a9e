"""Prometheus metrics of a worker: prefix `flashfleet_worker_`, base units (seconds, bytes),
`_total` on counters, a bounded `model` label (plus `method`, `outcome`, `position`, `role`),
never a per-request or per-session label.

How values get here, so the decode loop never touches prometheus-client:
  - Request metrics are recorded once per finished request from its final `GenerationStats`
    (`WorkerMetrics.observe_request`, called by the servicer on the asyncio loop).
  - Engine state (sessions, KV-cache bytes, the KV budget, the prompt cache), the loaded models
    and the machine are read at scrape time by a custom collector (`_EngineCollector`).

Speculative decoding is exported as counters (cycles, drafted, accepted, accepted per block
position), so acceptance rate, mean acceptance length (tau) and per-position acceptance are
computed in PromQL over any window:

    acceptance rate  rate(..._spec_accepted_tokens_total) / rate(..._spec_draft_tokens_total)
    tau              1 + rate(..._spec_accepted_tokens_total) / rate(..._spec_cycles_total)

Draft and verify time come two ways: `..._spec_{draft,verify}_seconds_total` counters (exact
totals: divide by the cycles' rate for the mean per cycle) and `..._spec_cycle_{draft,verify}_seconds`
histograms with ONE observation per request, the request's mean time per cycle (final stats carry
totals, not per-cycle times). The split is approximate: drafting is
queued asynchronously, so its compute lands in the verify time; batched methods (plain, DFlash)
report neither.

Memory bandwidth is an estimate, not a measurement: each decode step must read the weights it
runs plus the KV cache of its context (`model_footprint`). Per request, the bytes read per
committed token (`decode_read_bytes_per_token`) times the tokens decoded is added to
`..._decode_read_bytes_total`, and the decode time to `..._decode_seconds_total`; their rate ratio
is the bandwidth a request's steps achieved (with N sessions interleaved on one worker, each
request's decode time includes the others' steps, so the ratio then under-reads by about N).
Compare it with `..._peak_memory_bandwidth_bytes_per_second`, known for Apple chips
(`APPLE_PEAK_GBS`).
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily

from worker.engine.types import DoneEvent, EngineProtocol, GenerationStats, ModelDescription

log = logging.getLogger("flashfleet.worker")

# LLM buckets (research notes (b), after vLLM): a TTFT from 1 ms (tiny models) to minutes (long
# prompts on a big model); inter-token gaps from 2 ms (small models on an M4 Pro) up.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                  7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS_S = (0.002, 0.005, 0.01, 0.02, 0.025, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS_S = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0,
                 120.0, 240.0, 480.0, 960.0)
CYCLE_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0,
                   2.5)
TOKENS_PER_S_BUCKETS = (1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 75.0, 100.0, 150.0,
                        200.0, 300.0, 500.0, 1000.0, 2000.0)
MAX_BLOCK_POSITIONS = 16
OUTCOMES = ("stop", "length", "cancelled", "error")  # created at 0; servicer adds refusals

# Peak unified-memory bandwidth of Apple Silicon, GB/s (10^9 bytes/s), from Apple's specs. Max
# chips: the full-GPU variant (the binned M3 Max has 300, the binned M4 Max 410: pass
# --peak-memory-bandwidth-gbs).
APPLE_PEAK_GBS = {
    "M1": 68.25, "M1 Pro": 200.0, "M1 Max": 400.0, "M1 Ultra": 800.0,
    "M2": 100.0, "M2 Pro": 200.0, "M2 Max": 400.0, "M2 Ultra": 800.0,
    "M3": 100.0, "M3 Pro": 150.0, "M3 Max": 400.0, "M3 Ultra": 819.0,
    "M4": 120.0, "M4 Pro": 273.0, "M4 Max": 546.0,
    "M5": 153.0,
}

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


# ----- what the engine loaded ------------------------------------------------------------------

@dataclass(frozen=True)
class ModelFootprint:
    """Bytes a model occupies: weights, and KV cache per token of context (0 = unknown)."""

    weights_bytes: int = 0
    kv_bytes_per_token: int = 0


def model_footprint(model_dir: Path, kv_element_bytes: int = 0) -> ModelFootprint:
    """Estimates a model directory's footprint from its files, without loading it.

    Weights: the size of its *.safetensors files. KV per token: 2 (K and V) x layers x KV heads x
    head dim x bytes per element. Sliding-window layers are counted as full attention (an
    overestimate for e.g. Gemma 3). A loaded engine reports the bytes its caches take instead
    (`worker.engine.kv_layout`), for its target and a DFlash draft.

    Args:
        model_dir: the model directory (config.json, *.safetensors).
        kv_element_bytes: bytes of one cached element: those of the dtype the worker computes in
            (`worker.loading.compute_dtype`: float32 on a CPU, whatever the stored dtype);
            0: the config's torch_dtype (float32: 4, otherwise 2).

    Returns:
        The footprint; fields it cannot tell are 0 (never raises on odd configs).
    """
    model_dir = Path(model_dir)
    weights = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
        cfg = {**cfg.get("text_config", {}), **cfg}  # multimodal configs nest these
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float16")
        kv = 2 * layers * kv_heads * head_dim * (kv_element_bytes or _DTYPE_BYTES.get(dtype, 2))
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        kv = 0
    return ModelFootprint(weights_bytes=weights, kv_bytes_per_token=kv)


def decode_read_bytes_per_token(m: ModelDescription, s: GenerationStats) -> float:
    """Estimated bytes read from memory per token decoded after the first, for one request.

    Every forward reads its model's weights once plus the KV cache of its context; the context is
    taken at its mean over the decode (prompt + half the generated tokens), exact for plain
    decoding. Plain decoding runs one target forward per token. A speculative cycle runs one
    target (verify) forward, and the draft once per drafted token ("draft") or once per block
    ("dflash": the whole block in one forward).

    Returns:
        Bytes per token; 0 when fewer than two tokens were generated.
    """
    if s.generated_tokens < 2:
        return 0.0
    ctx = s.prompt_tokens + s.generated_tokens / 2
    if s.cycles:
        target_passes = s.cycles
        draft_passes = s.cycles if s.mode == "dflash" else s.drafted_tokens
        tokens = s.generated_tokens
    else:
        target_passes, draft_passes, tokens = s.generated_tokens - 1, 0, s.generated_tokens - 1
    read = (target_passes * (m.weights_bytes + m.kv_bytes_per_token * ctx)
            + draft_passes * (m.draft_weights_bytes + m.draft_kv_bytes_per_token * ctx))
    return read / tokens


# ----- the machine -----------------------------------------------------------------------------

@dataclass(frozen=True)
class MachineInfo:
    """The host a worker runs on.

    Attributes:
        chip: e.g. "M4 Pro" ("" when unknown).
        peak_memory_bandwidth_bytes_per_s: None when unknown (not exported then).
        memory_bytes: physical memory (0 when unknown).
    """

    chip: str = ""
    peak_memory_bandwidth_bytes_per_s: float | None = None
    memory_bytes: int = 0

    @classmethod
    def detect(cls, chip: str | None = None, peak_gbs: float | None = None) -> "MachineInfo":
        """Detects the chip (macOS: sysctl machdep.cpu.brand_string) and memory; explicit
        arguments win. The peak comes from `peak_gbs`, else from APPLE_PEAK_GBS by chip.

        Raises:
            ValueError: a non-positive peak_gbs.
        """
        if peak_gbs is not None and peak_gbs <= 0:
            raise ValueError(f"peak memory bandwidth must be > 0 GB/s, got {peak_gbs}")
        chip = normalize_chip(chip if chip is not None else detect_chip())
        gbs = peak_gbs if peak_gbs is not None else APPLE_PEAK_GBS.get(chip)
        if gbs is None and chip:  # a typo or a chip newer than the table: say so, keep serving
            log.warning("chip %r is not in the peak-bandwidth table (%s): the peak memory bandwidth "
                        "metric stays absent; set --peak-memory-bandwidth-gbs "
                        "(peak_memory_bandwidth_gbs in cluster.toml)", chip, ", ".join(APPLE_PEAK_GBS))
        return cls(chip=chip, peak_memory_bandwidth_bytes_per_s=gbs * 1e9 if gbs else None,
                   memory_bytes=physical_memory_bytes())


def normalize_chip(name: str) -> str:
    """"Apple M4 Pro" / "m4 pro" -> "M4 Pro" (a key of APPLE_PEAK_GBS when known)."""
    name = " ".join(name.split())
    if name.lower().startswith("apple "):
        name = name[6:]
    for known in APPLE_PEAK_GBS:
        if known.lower() == name.lower():
            return known
    return name


def detect_chip() -> str:
    """The Apple chip's name on macOS ("Apple M4 Pro"), "" elsewhere or on failure."""
    if sys.platform != "darwin":
        return ""
    try:
        out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip()


def physical_memory_bytes() -> int:
    """Physical memory in bytes (Linux and macOS), 0 when unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


# ----- the metrics -----------------------------------------------------------------------------

@dataclass(frozen=True)
class _Decode:
    """Decode children of one (model, method), bound once (labels() takes a lock per call)."""

    tokens_per_s: Histogram
    seconds: Counter
    read_bytes: Counter


@dataclass(frozen=True)
class _Spec:
    """Speculative-decoding children of one (model, method), bound once."""

    cycles: Counter
    drafted: Counter
    accepted: Counter
    draft_s: Counter
    verify_s: Counter
    cycle_draft_s: Histogram
    cycle_verify_s: Histogram
    translate_s: Counter


class WorkerMetrics:
    """Every worker metric, declared once.

    Args:
        registry: where to register (tests pass a fresh CollectorRegistry).
        engine: read at scrape time for sessions, KV bytes and the loaded models (optional). With
            an engine, the series of its model (and draft method, block positions, outcomes) are
            created at zero, so rate() counts the first requests too.
        machine: the host (chip, peak bandwidth, memory); None detects it.

    Usage: the servicer calls `observe_request(model, done_event)` once per finished request;
    `model_load_seconds` is set by whoever loads the engine.
    """

    def __init__(self, registry: CollectorRegistry, engine: EngineProtocol | None = None,
                 machine: MachineInfo | None = None):
        self.registry = registry
        self.machine = machine if machine is not None else MachineInfo.detect()
        r, m, mm = registry, ["model"], ["model", "method"]
        self.requests = Counter("flashfleet_worker_requests", "Finished requests by outcome "
                                "(stop, length, cancelled, error, invalidrequest, overloaded, "
                                "draining).", ["model", "outcome"], registry=r)
        self.prompt_tokens = Counter("flashfleet_worker_prompt_tokens", "Prompt tokens prefilled.",
                                     m, registry=r)
        self.generated_tokens = Counter("flashfleet_worker_generation_tokens",
                                        "Tokens generated.", m, registry=r)
        self.cached_tokens = Counter("flashfleet_worker_prompt_cached_tokens", "Prompt tokens whose KV "
                                     "cache came from the prompt cache instead of a prefill (part of "
                                     "prompt_tokens).", m, registry=r)
        self.preemptions = Counter("flashfleet_worker_preemptions", "Times a session was paused to "
                                   "free KV memory and later resumed by recomputing its cache.", m,
                                   registry=r)
        self.ttft = Histogram("flashfleet_worker_time_to_first_token_seconds", "Time from "
                              "admission to the first token.", m, buckets=TTFT_BUCKETS_S, registry=r)
        self.itl = Histogram("flashfleet_worker_inter_token_latency_seconds", "Mean time per "
                             "output token after the first; one observation per request.", m,
                             buckets=ITL_BUCKETS_S, registry=r)
        self.e2e = Histogram("flashfleet_worker_e2e_request_latency_seconds", "Whole request on "
                             "the worker, from admission to its last token.", m,
                             buckets=E2E_BUCKETS_S, registry=r)
        self.tokens_per_s = Histogram("flashfleet_worker_decode_tokens_per_second", "Decode "
                                      "speed of a request (tokens after the first step over their "
                                      "time); one observation per request.", mm,
                                      buckets=TOKENS_PER_S_BUCKETS, registry=r)
        self.decode_s = Counter("flashfleet_worker_decode_seconds", "Time requests spent "
                                "decoding after their first token.", mm, registry=r)
        self.read_bytes = Counter("flashfleet_worker_decode_read_bytes", "Estimated bytes the "
                                  "decode steps read (weights + KV cache); rate over "
                                  "decode_seconds' rate = memory bandwidth.", mm, registry=r)
        self.cycles = Counter("flashfleet_worker_spec_cycles", "Speculative draft+verify cycles.",
                              mm, registry=r)
        self.drafted = Counter("flashfleet_worker_spec_draft_tokens", "Draft tokens proposed.",
                               mm, registry=r)
        self.accepted = Counter("flashfleet_worker_spec_accepted_tokens", "Draft tokens accepted "
                                "by the target (bonus tokens excluded).", mm, registry=r)
        self.accepted_pos = Counter("flashfleet_worker_spec_accepted_tokens_per_position",
                                    "Accepted draft tokens by block position (1-based): "
                                    "position p counts cycles that accepted at least p tokens.",
                                    ["model", "method", "position"], registry=r)
        self.draft_time = Counter("flashfleet_worker_spec_draft_seconds", "Time spent drafting.",
                                  mm, registry=r)
        self.verify_time = Counter("flashfleet_worker_spec_verify_seconds", "Time spent in the "
                                   "target's verify forward.", mm, registry=r)
        self.translate_time = Counter("flashfleet_worker_spec_translate_seconds", "Time spent "
                                      "translating tokens between the draft's and the target's "
                                      "vocabularies (cross-tokenizer drafts).", mm, registry=r)
        self.cycle_draft = Histogram("flashfleet_worker_spec_cycle_draft_seconds", "Drafting time "
                                     "per cycle, the request's mean; one observation per request.",
                                     mm, buckets=CYCLE_BUCKETS_S, registry=r)
        self.cycle_verify = Histogram("flashfleet_worker_spec_cycle_verify_seconds", "Verify time "
                                      "per cycle, the request's mean; one observation per "
                                      "request.", mm, buckets=CYCLE_BUCKETS_S, registry=r)
        self.model_load_seconds = Gauge("flashfleet_worker_model_load_seconds", "Time to load "
                                        "and warm up the models.", m, registry=r)
        self._decode: dict[tuple[str, str], _Decode] = {}
        self._spec: dict[tuple[str, str], _Spec] = {}
        self._engine = engine
        if engine is not None:
            self._create_series(engine.model)
            registry.register(_EngineCollector(engine, self))

    def _create_series(self, model: ModelDescription) -> None:
        name = model.name
        for outcome in OUTCOMES:
            self.requests.labels(model=name, outcome=outcome)
        for metric in (self.prompt_tokens, self.generated_tokens, self.cached_tokens, self.preemptions,
                       self.ttft, self.itl, self.e2e):
            metric.labels(model=name)
        self._decode_children(name, "plain")
        if model.draft_mode:
            self._decode_children(name, model.draft_mode)
            self._spec_children(name, model.draft_mode)
            for pos in range(1, min(model.num_draft_tokens, MAX_BLOCK_POSITIONS) + 1):
                self.accepted_pos.labels(model=name, method=model.draft_mode, position=str(pos))

    def _decode_children(self, model: str, method: str) -> _Decode:
        c = self._decode.get((model, method))
        if c is None:
            lab = {"model": model, "method": method}
            c = self._decode[(model, method)] = _Decode(
                self.tokens_per_s.labels(**lab), self.decode_s.labels(**lab),
                self.read_bytes.labels(**lab))
        return c

    def _spec_children(self, model: str, method: str) -> _Spec:
        c = self._spec.get((model, method))
        if c is None:
            lab = {"model": model, "method": method}
            c = self._spec[(model, method)] = _Spec(*(m.labels(**lab) for m in (
                self.cycles, self.drafted, self.accepted, self.draft_time, self.verify_time,
                self.cycle_draft, self.cycle_verify, self.translate_time)))
        return c

    def observe_request(self, model: str, event: DoneEvent) -> None:
        """Records one finished request from its final stats."""
        s = event.stats
        self.requests.labels(model=model, outcome=event.finish_reason).inc()
        self.prompt_tokens.labels(model=model).inc(s.prompt_tokens)
        self.generated_tokens.labels(model=model).inc(s.generated_tokens)
        self.cached_tokens.labels(model=model).inc(s.cached_tokens)
        self.preemptions.labels(model=model).inc(s.preemptions)
        if s.generated_tokens:
            self.ttft.labels(model=model).observe(s.ttft_s)
            self.e2e.labels(model=model).observe(s.total_s)
        decode_s = s.total_s - s.ttft_s
        if s.generated_tokens > 1 and s.tokens_per_s > 0 and decode_s > 0:
            d = self._decode_children(model, s.mode)
            self.itl.labels(model=model).observe(1.0 / s.tokens_per_s)
            d.tokens_per_s.observe(s.tokens_per_s)
            d.seconds.inc(decode_s)
            if self._engine is not None:
                per_token = decode_read_bytes_per_token(self._engine.model, s)
                d.read_bytes.inc(per_token * s.tokens_per_s * decode_s)
        if s.cycles:
            c = self._spec_children(model, s.mode)
            c.cycles.inc(s.cycles)
            c.drafted.inc(s.drafted_tokens)
            c.accepted.inc(s.accepted_tokens)
            c.draft_s.inc(s.draft_s)
            c.verify_s.inc(s.verify_s)
            c.translate_s.inc(s.translate_s)
            c.cycle_draft_s.observe(s.draft_s / s.cycles)
            c.cycle_verify_s.observe(s.verify_s / s.cycles)
            for i, n in enumerate(s.accepted_per_position[:MAX_BLOCK_POSITIONS]):
                self.accepted_pos.labels(model=model, method=s.mode, position=str(i + 1)).inc(n)


class _EngineCollector:
    """Yields engine, model and machine gauges at scrape time (no per-token metric calls)."""

    def __init__(self, engine: EngineProtocol, metrics: WorkerMetrics):
        self.engine = engine
        self.metrics = metrics

    def collect(self):
        load = self.engine.load()
        model = self.engine.model
        machine = self.metrics.machine
        name = model.name

        def gauge(metric: str, help_: str, value: float, labels: dict | None = None):
            labels = {"model": name, **(labels or {})}
            g = GaugeMetricFamily(metric, help_, labels=list(labels))
            g.add_metric(list(labels.values()), value)
            return g

        yield gauge("flashfleet_worker_sessions", "Sessions admitted (running or queued).",
                    load.active_sessions)
        yield gauge("flashfleet_worker_capacity_sessions", "Configured session capacity.",
                    load.capacity)
        yield gauge("flashfleet_worker_kv_cache_bytes", "Bytes held by running sessions' KV "
                    "caches (the prompt cache not included).", load.kv_cache_bytes)
        if load.kv_budget_bytes:
            yield gauge("flashfleet_worker_kv_budget_bytes", "Most bytes the KV caches may hold "
                        "(running sessions and the prompt cache): kv_cache_limit_bytes when set, "
                        "else the device's usable memory less a margin and the weights.",
                        load.kv_budget_bytes)
        yield gauge("flashfleet_worker_prompt_cache_bytes", "Bytes held by finished turns' KV caches "
                    "kept for prefix reuse (evicted first when sessions need room).",
                    load.prompt_cache_bytes)
        w = GaugeMetricFamily("flashfleet_worker_model_weights_bytes", "Bytes of weights loaded.",
                              labels=["model", "role"])
        kv = GaugeMetricFamily("flashfleet_worker_model_kv_bytes_per_token", "KV-cache bytes per "
                               "token of context.", labels=["model", "role"])
        w.add_metric([name, "target"], model.weights_bytes)
        kv.add_metric([name, "target"], model.kv_bytes_per_token)
        if model.draft:
            w.add_metric([name, "draft"], model.draft_weights_bytes)
            kv.add_metric([name, "draft"], model.draft_kv_bytes_per_token)
        yield w
        yield kv
        info = InfoMetricFamily("flashfleet_worker_model", "Served model, its draft and limits.",
                                labels=["model"])
        info.add_metric([name], {"draft": model.draft, "draft_mode": model.draft_mode,
                                 "max_context_tokens": str(model.max_context_tokens),
                                 "num_draft_tokens": str(model.num_draft_tokens)})
        yield info
        yield InfoMetricFamily("flashfleet_worker_machine", "The host's chip.",
                               value={"chip": machine.chip or "unknown"})
        if machine.memory_bytes:
            yield GaugeMetricFamily("flashfleet_worker_memory_bytes", "Physical memory of the "
                                    "host.", value=machine.memory_bytes)
        if machine.peak_memory_bandwidth_bytes_per_s:
            yield GaugeMetricFamily("flashfleet_worker_peak_memory_bandwidth_bytes_per_second",
                                    "Peak memory bandwidth of the host's chip.",
                                    value=machine.peak_memory_bandwidth_bytes_per_s)
