"""Prometheus metrics of a worker (prefix flashfleet_worker_, base units, `_total` on counters,
a `model` label, never a per-request or per-session label).

Request-level metrics are recorded once per finished request from its final stats, so the decode
loop never touches prometheus-client. Engine gauges (sessions, KV bytes) are read at scrape time
by a custom collector.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import GaugeMetricFamily

from worker.engine.types import DoneEvent, EngineProtocol

TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS_S = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
STEP_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)
MAX_BLOCK_POSITIONS = 16


class WorkerMetrics:
    """Every worker metric, declared once.

    Args:
        registry: where to register (tests pass a fresh CollectorRegistry).
        engine: read at scrape time for sessions and KV-cache bytes (optional).
    """

    def __init__(self, registry: CollectorRegistry, engine: EngineProtocol | None = None):
        self.requests = Counter("flashfleet_worker_requests", "Finished requests by outcome "
                                "(stop, length, cancelled, error, invalidrequest, overloaded, "
                                "draining).", ["model", "outcome"], registry=registry)
        self.prompt_tokens = Counter("flashfleet_worker_prompt_tokens", "Prompt tokens prefilled.",
                                     ["model"], registry=registry)
        self.generated_tokens = Counter("flashfleet_worker_generation_tokens",
                                        "Tokens generated.", ["model"], registry=registry)
        self.ttft = Histogram("flashfleet_worker_time_to_first_token_seconds", "Time to first "
                              "token.", ["model"], buckets=TTFT_BUCKETS_S, registry=registry)
        self.itl = Histogram("flashfleet_worker_inter_token_latency_seconds", "Mean time per "
                             "output token after the first, one observation per request.",
                             ["model"], buckets=ITL_BUCKETS_S, registry=registry)
        self.e2e = Histogram("flashfleet_worker_e2e_request_latency_seconds", "Whole request on "
                             "the worker.", ["model"], buckets=E2E_BUCKETS_S, registry=registry)
        self.cycles = Counter("flashfleet_worker_spec_cycles", "Speculative draft+verify cycles.",
                              ["model", "method"], registry=registry)
        self.drafted = Counter("flashfleet_worker_spec_draft_tokens", "Draft tokens proposed.",
                               ["model", "method"], registry=registry)
        self.accepted = Counter("flashfleet_worker_spec_accepted_tokens", "Draft tokens accepted "
                                "by the target (bonus tokens excluded).", ["model", "method"],
                                registry=registry)
        self.accepted_pos = Counter("flashfleet_worker_spec_accepted_tokens_per_position",
                                    "Accepted draft tokens by block position (1-based).",
                                    ["model", "method", "position"], registry=registry)
        self.draft_time = Counter("flashfleet_worker_spec_draft_seconds", "Time spent drafting.",
                                  ["model", "method"], registry=registry)
        self.verify_time = Counter("flashfleet_worker_spec_verify_seconds", "Time spent in the "
                                   "target's verify forward.", ["model", "method"],
                                   registry=registry)
        self.tokens_per_s = Gauge("flashfleet_worker_last_request_tokens_per_second",
                                  "Decode tokens/s of the latest finished request.", ["model"],
                                  registry=registry)
        self.model_info = Info("flashfleet_worker_model", "Loaded target and draft.",
                               registry=registry)
        if engine is not None:
            registry.register(_EngineCollector(engine))

    def observe_request(self, model: str, event: DoneEvent) -> None:
        """Records one finished request from its final stats."""
        s = event.stats
        self.requests.labels(model=model, outcome=event.finish_reason).inc()
        self.prompt_tokens.labels(model=model).inc(s.prompt_tokens)
        self.generated_tokens.labels(model=model).inc(s.generated_tokens)
        if s.generated_tokens:
            self.ttft.labels(model=model).observe(s.ttft_s)
            self.e2e.labels(model=model).observe(s.total_s)
        if s.generated_tokens > 1 and s.tokens_per_s > 0:
            self.itl.labels(model=model).observe(1.0 / s.tokens_per_s)
            self.tokens_per_s.labels(model=model).set(s.tokens_per_s)
        if s.cycles:
            m = s.mode
            self.cycles.labels(model=model, method=m).inc(s.cycles)
            self.drafted.labels(model=model, method=m).inc(s.drafted_tokens)
            self.accepted.labels(model=model, method=m).inc(s.accepted_tokens)
            self.draft_time.labels(model=model, method=m).inc(s.draft_s)
            self.verify_time.labels(model=model, method=m).inc(s.verify_s)
            for i, n in enumerate(s.accepted_per_position[:MAX_BLOCK_POSITIONS]):
                if n:
                    self.accepted_pos.labels(model=model, method=m, position=str(i + 1)).inc(n)


class _EngineCollector:
    """Reads the engine's load at scrape time (no per-token metric calls)."""

    def __init__(self, engine: EngineProtocol):
        self.engine = engine

    def collect(self):
        load = self.engine.load()
        name = self.engine.model.name
        for metric, help_, value in (
                ("flashfleet_worker_sessions", "Sessions resident (running).", load.active_sessions),
                ("flashfleet_worker_capacity_sessions", "Configured session capacity.", load.capacity),
                ("flashfleet_worker_kv_cache_bytes", "Bytes held by KV caches.", load.kv_cache_bytes)):
            g = GaugeMetricFamily(metric, help_, labels=["model"])
            g.add_metric([name], value)
            yield g
