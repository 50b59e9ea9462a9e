"""Metrics, dashboards and alert rules against a live cluster and a real Prometheus.

The live test starts a coordinator and two workers with real MLX engines on tiny models (one
with a draft model), serves each component's registry over HTTP, starts `prometheus` (Debian
package; .ci/run installs it) with deploy/prometheus/prometheus.yml rewritten to these targets and
a 1 s scrape interval, sends plain and speculative requests, then runs every PromQL expression of
every dashboard and every alert rule through Prometheus' HTTP API. Grafana variables are
substituted as Grafana would with "All" selected ($model, $instance -> ".*"; $__rate_interval and
$__range -> a window covering the whole test). An alert's expression returns data only while it
fires, so each rule is checked twice: as written (it parses and evaluates) and with `bool` added
to its comparisons (the signal it compares exists: at least one series).
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest, start_http_server

from coordinator.config import CoordinatorConfig
from coordinator.metrics import CoordinatorMetrics
from coordinator.server import start_coordinator
from fakes import FakeEngine
from flashfleet import Client
from flashfleet.cli.up import free_port
from harness import LoopThread
from worker.config import EngineConfig
from worker.engine.types import DoneEvent, GenerationStats, ModelDescription
from worker.metrics import (APPLE_PEAK_GBS, MachineInfo, WorkerMetrics,
                            decode_read_bytes_per_token, model_footprint, normalize_chip)
from worker.server import start_worker

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = ROOT / "grafana" / "dashboards"
PROM_DIR = ROOT / "deploy" / "prometheus"
MODEL = "tiny-llama"
WINDOW = "10m"  # longer than the test: rate() over it covers every request
GRAFANA_VARS = {"$__rate_interval": WINDOW, "$__range": WINDOW, "$__interval": "15s",
                "$model": ".*", "$instance": ".*"}


# ----- expressions of the dashboards and rules -------------------------------------------------

def dashboard_queries() -> list[tuple[str, str]]:
    """(where, expr) of every panel target and every query variable of every dashboard."""
    out = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        board = json.loads(path.read_text())
        for var in board["templating"]["list"]:
            if var["type"] == "query":
                out.append((f"{path.name} variable ${var['name']}", var["query"]))
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                out.append((f"{path.name} panel {panel['title']!r} {target['refId']}",
                            target["expr"]))
    return out


def alert_rules() -> list[dict]:
    groups = yaml.safe_load((PROM_DIR / "flashfleet-alerts.yml").read_text())["groups"]
    return [rule for g in groups for rule in g["rules"]]


def substitute(expr: str) -> str:
    for var, value in sorted(GRAFANA_VARS.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unsubstituted Grafana variable in {expr}"
    return expr


def with_bool(expr: str) -> str:
    """Adds `bool` to every comparison outside label matchers and strings, so the expression
    returns 0/1 per series instead of filtering them out."""
    out, depth, quote, i = [], 0, "", 0
    while i < len(expr):
        ch = expr[i]
        if quote:
            quote = "" if ch == quote and expr[i - 1] != "\\" else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif depth == 0 and ch in "<>=!":
            op = expr[i:i + 2] if expr[i:i + 2] in ("==", "!=", "<=", ">=") else ch
            if op in ("==", "!=", "<=", ">=", "<", ">"):
                out.append(op + " bool")
                i += len(op)
                continue
        out.append(ch)
        i += 1
    return "".join(out)


LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$", re.S)


# ----- the live cluster + Prometheus -----------------------------------------------------------

@dataclass
class Live:
    prom_url: str
    stats: list = field(default_factory=list)  # final stats of every request sent
    rules: list = field(default_factory=list)  # /api/v1/rules after the rules were evaluated
    served: list = field(default_factory=list)  # (worker id, final stats) of every request

    def query(self, expr: str) -> dict:
        data = urllib.parse.urlencode({"query": expr, "time": f"{time.time():.3f}"}).encode()
        try:
            with urllib.request.urlopen(f"{self.prom_url}/api/v1/query", data, timeout=10) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:  # 400 with Prometheus' parse error
            return json.load(e)

    def result(self, expr: str) -> list:
        body = self.query(expr)
        assert body["status"] == "success", f"{expr}\n-> {body.get('error')}"
        return body["data"]["result"]

    def scalar(self, expr: str) -> float | None:
        res = self.result(expr)
        return float(res[0]["value"][1]) if res else None

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(f"{self.prom_url}{path}", timeout=10) as r:
            return json.load(r)


def _wait(cond, timeout_s: float, what: str, interval_s: float = 0.25):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def _prometheus_config(tmp: Path, coordinator_port: int, workers: dict[str, int]) -> Path:
    """deploy/prometheus/prometheus.yml with local targets, 1 s intervals and an absolute rule path."""
    cfg = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
    cfg["rule_files"] = [str(PROM_DIR / f) for f in cfg["rule_files"]]
    jobs = {job["job_name"]: job for job in cfg["scrape_configs"]}
    jobs["flashfleet-coordinator"]["static_configs"] = [{"targets": [f"127.0.0.1:{coordinator_port}"]}]
    jobs["flashfleet-worker"]["static_configs"] = [
        {"targets": [f"127.0.0.1:{port}"], "labels": {"worker": wid}} for wid, port in workers.items()]
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def live(tiny_models, tmp_path_factory):
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("the prometheus binary is absent (Debian package `prometheus`; .ci/run "
                    "installs it)")
    from worker.engine.thread import Engine

    tmp = tmp_path_factory.mktemp("prometheus")
    loop = LoopThread()
    servers, workers, proc, coordinator = [], [], None, None
    try:
        coord_registry = CollectorRegistry()
        coordinator = loop.run(start_coordinator(CoordinatorConfig(port=0), coord_registry))
        ports = {"coordinator": free_port()}
        servers.append(start_http_server(ports["coordinator"], "127.0.0.1", coord_registry)[0])
        specs = {"plain-1": {}, "spec-2": {"draft_path": tiny_models.llama_near, "num_draft_tokens": 3}}
        for worker_id, extra in specs.items():
            t0 = time.perf_counter()
            engine = Engine(EngineConfig(model_path=tiny_models.llama, model_name=MODEL, capacity=3,
                                         **extra))
            registry = CollectorRegistry()
            metrics = WorkerMetrics(registry, engine, MachineInfo.detect(chip="M4 Pro"))
            metrics.model_load_seconds.labels(model=MODEL).set(time.perf_counter() - t0)
            w = loop.run(start_worker(engine, worker_id, coordinator=coordinator.address,
                                      metrics=metrics))
            loop.run(asyncio.wait_for(w.registered.wait(), 10))
            workers.append(w)
            ports[worker_id] = free_port()
            servers.append(start_http_server(ports[worker_id], "127.0.0.1", registry)[0])

        config = _prometheus_config(tmp, ports.pop("coordinator"), ports)
        web = free_port()
        log = open(tmp / "prometheus.log", "wb")
        proc = subprocess.Popen([prometheus, f"--config.file={config}",
                                 f"--storage.tsdb.path={tmp / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{web}"],
                                stdout=log, stderr=subprocess.STDOUT)
        lv = Live(f"http://127.0.0.1:{web}")

        def targets_up():
            if proc.poll() is not None:
                raise AssertionError((tmp / "prometheus.log").read_text()[-3000:])
            try:
                active = lv.get("/api/v1/targets")["data"]["activeTargets"]
            except OSError:
                return False
            return len(active) == 3 and all(t["health"] == "up" for t in active)

        # Every series is scraped at zero before the first request, so rate() sees every request.
        _wait(targets_up, 30, "Prometheus to scrape all three targets")
        with Client(coordinator.address) as client:
            prompts = ["The river flows", "Once upon a time", "def fib(n):", "Zażółć gęślą",
                       "A long road", "Metrics matter"]
            for i, prompt in enumerate(prompts):
                for mode in ("plain", "draft"):
                    done = client.complete(MODEL, prompt=prompt, max_tokens=24 + 4 * i, mode=mode)
                    lv.served.append((done.worker_id, done.stats))
            done = client.complete(MODEL, prompt="sampled", max_tokens=20, mode="draft",
                                   temperature=0.8, seed=3)
            lv.served.append((done.worker_id, done.stats))
        lv.stats = [s for _, s in lv.served]
        drafted = sum(s.drafted_tokens for s in lv.stats)
        generated = sum(s.generated_tokens for s in lv.stats)
        _wait(lambda: lv.scalar("sum(flashfleet_worker_spec_draft_tokens_total)") == drafted
              and lv.scalar("sum(flashfleet_worker_generation_tokens_total)") == generated,
              15, "the last requests to be scraped")
        # The coordinator's per-model series appear with the first request; rate() needs two
        # samples of each.
        per_model = ("requests_total", "queue_seconds_bucket", "retries_total", "migrations_total")
        _wait(lambda: all((lv.scalar(f"min(count_over_time(flashfleet_coordinator_{m}[10m]))") or 0) >= 3
                          for m in per_model), 15, "three scrapes of every coordinator series")

        def rules_evaluated():
            groups = lv.get("/api/v1/rules")["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            return rules and all(not r["lastEvaluation"].startswith("0001") for r in rules) and rules

        lv.rules = _wait(rules_evaluated, 15, "the alert rules to be evaluated")
        yield lv
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        for httpd in servers:
            httpd.shutdown()
            httpd.server_close()
        for w in workers:
            loop.run(w.stop(grace_s=0.5))
        if coordinator is not None:
            loop.run(coordinator.stop(grace_s=0.5))
        loop.close()


def test_every_dashboard_query_parses_and_returns_data(live):
    queries = dashboard_queries()
    assert len(queries) > 40
    empty = []
    for where, expr in queries:
        m = LABEL_VALUES.match(expr)
        if m:  # a Grafana variable: the selector must have series carrying the label
            series = live.result(substitute(m["selector"]))
            if not any(m["label"] in s["metric"] for s in series):
                empty.append(where)
            continue
        if not live.result(substitute(expr)):
            empty.append(where)
    assert not empty, f"queries with no data: {empty}"


def test_every_alert_rule_parses_and_its_signal_returns_data(live):
    rules = alert_rules()
    assert {r["alert"] for r in rules} >= {"FlashfleetWorkerDown", "FlashfleetAcceptanceCollapse",
                                          "FlashfleetAcceptanceLengthLow",
                                          "FlashfleetSpeculationSlowerThanPlain",
                                          "FlashfleetKVCacheNearLimit", "FlashfleetKVPreemptions"}
    for rule in rules:
        expr = rule["expr"]
        live.result(expr)  # parses and evaluates (empty while it does not fire)
        assert live.result(with_bool(expr)), f"{rule['alert']}: no series behind {expr}"
    # Prometheus loaded the shipped file and evaluates every rule without error.
    loaded = {r["name"]: r for r in live.rules}
    assert set(loaded) == {r["alert"] for r in rules}
    assert all(r["health"] == "ok" for r in loaded.values()), loaded
    # Nothing is wrong with this cluster: no alert fires.
    assert not [r["name"] for r in live.rules if r["state"] == "firing"]


def test_promql_acceptance_rate_equals_the_requests_final_stats(live):
    spec = [s for s in live.stats if s.cycles]
    assert len(spec) >= 6
    accepted = sum(s.accepted_tokens for s in spec)
    drafted = sum(s.drafted_tokens for s in spec)
    cycles = sum(s.cycles for s in spec)
    assert 0 < accepted < drafted  # the near draft is right on some tokens, not all

    board = json.loads((DASHBOARDS / "speculative.json").read_text())
    exprs = {p["title"]: p["targets"][0]["expr"] for p in board["panels"] if p.get("targets")}
    rate = live.result(substitute(exprs["Acceptance rate"]))
    assert [r["metric"] for r in rate] == [{"model": MODEL, "method": "draft"}]
    assert float(rate[0]["value"][1]) == pytest.approx(accepted / drafted, rel=1e-9)

    tau = live.result(substitute(exprs["Mean acceptance length (tau)"]))
    assert float(tau[0]["value"][1]) == pytest.approx((accepted + cycles) / cycles, rel=1e-9)

    by_position = live.result(substitute(exprs["Acceptance by block position"]))
    per_pos = {int(r["metric"]["position"]): float(r["value"][1]) for r in by_position}
    assert sorted(per_pos) == [1, 2, 3]
    want = [sum(s.accepted_per_position[i] for s in spec if len(s.accepted_per_position) > i)
            for i in range(3)]
    assert [per_pos[p] for p in (1, 2, 3)] == pytest.approx([n / cycles for n in want], rel=1e-9)


def test_bandwidth_and_machine_metrics_are_live(live):
    peak = live.result("flashfleet_worker_peak_memory_bandwidth_bytes_per_second")
    assert {float(r["value"][1]) for r in peak} == {273e9}
    board = json.loads((DASHBOARDS / "worker.json").read_text())
    expr = next(p for p in board["panels"] if p["title"] == "Estimated memory bandwidth")["targets"][0]["expr"]
    values = [float(r["value"][1]) for r in live.result(substitute(expr))]
    assert len(values) == 2 and all(v > 0 or math.isnan(v) for v in values)  # NaN: no decode yet
    by_worker = live.result("sum by (worker) (rate(flashfleet_worker_decode_read_bytes_total[10m]))"
                            " / sum by (worker) (rate(flashfleet_worker_decode_seconds_total[10m]))")
    served = {w for w, s in live.served if s.generated_tokens > 1}
    assert "spec-2" in served
    assert {r["metric"]["worker"] for r in by_worker if float(r["value"][1]) > 0} == served
    info = live.result('flashfleet_worker_model_info{draft_mode="draft"}')
    assert [r["metric"]["num_draft_tokens"] for r in info] == ["3"]


# ----- without Prometheus ----------------------------------------------------------------------

def test_committed_dashboards_equal_a_fresh_generation():
    pytest.importorskip("grafana_foundation_sdk", reason="pip install -e '.[test]'")
    spec = importlib.util.spec_from_file_location("grafana_generate", ROOT / "grafana" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    fresh = generate.build_all()
    assert sorted(fresh) == sorted(p.name for p in DASHBOARDS.glob("*.json"))
    for name, text in fresh.items():
        assert (DASHBOARDS / name).read_text() == text, f"{name} is stale: python grafana/generate.py"


def _exposed_names() -> set[str]:
    """Every sample name the worker and coordinator expose (histogram/counter suffixes included)."""
    engine = FakeEngine(MODEL)
    engine.model = ModelDescription(MODEL, 512, draft="d", draft_mode="draft", num_draft_tokens=2)
    wr, cr = CollectorRegistry(), CollectorRegistry()
    metrics = WorkerMetrics(wr, engine, MachineInfo(chip="M4", peak_memory_bandwidth_bytes_per_s=1e11,
                                                    memory_bytes=2**34))
    metrics.model_load_seconds.labels(model=MODEL).set(1)
    c = CoordinatorMetrics(cr)
    c.observe_queue(MODEL, 0.01)
    for labels in (dict(model=MODEL, worker="w", outcome="ok"),):
        c.routed.labels(**labels).inc()
    c.worker_up.labels(worker="w").set(1)
    c.worker_heartbeat_age.labels(worker="w").set(1)
    c.draining.labels(worker="w").set(0)
    text = (generate_latest(wr) + generate_latest(cr)).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and line[0] != "#"}


def test_dashboards_and_rules_query_only_declared_metrics():
    names = _exposed_names() | {"up"}
    used = set()
    for _, expr in dashboard_queries() + [("rule", r["expr"]) for r in alert_rules()]:
        expr = re.sub(r'"[^"]*"', '""', expr)  # drop label values
        used |= set(re.findall(r"\b(flashfleet_\w+|up)\b", expr))
    assert used <= names, f"not exposed by any metrics.py: {sorted(used - names)}"
    for name in names:  # naming: prefix, counters end in _total
        assert name == "up" or name.startswith(("flashfleet_worker_", "flashfleet_coordinator_"))


def test_worker_metric_names_and_types_follow_prometheus_conventions():
    engine = FakeEngine(MODEL)
    registry = CollectorRegistry()
    WorkerMetrics(registry, engine, MachineInfo())
    CoordinatorMetrics(reg := CollectorRegistry())
    for r in (registry, reg):
        for family in r.collect():
            if family.type == "counter":
                assert all(s.name.endswith(("_total", "_created")) for s in family.samples)
            assert not re.search(r"_(ms|milliseconds|kb|mb|gb|percent)\b", family.name), family.name
            for s in family.samples:
                assert not {"request_id", "session_id"} & set(s.labels)


def test_footprint_matches_the_loaded_model(tiny_models):
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    fp = model_footprint(tiny_models.llama)
    model, _ = load(str(tiny_models.llama))
    params = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    assert params <= fp.weights_bytes <= params * 1.01  # the files' headers are small
    cache = make_prompt_cache(model)
    model(mx.array([[1, 2, 3, 4, 5]]), cache=cache)
    # 2 layers x K and V x (1, 2 heads, 5 tokens, head dim 16) float32
    used = sum(c.keys[..., :c.offset, :].nbytes + c.values[..., :c.offset, :].nbytes for c in cache)
    assert fp.kv_bytes_per_token * 5 == used


def test_decode_read_bytes_estimate():
    m = ModelDescription("m", 4096, weights_bytes=1000, kv_bytes_per_token=10,
                         draft_weights_bytes=100, draft_kv_bytes_per_token=1)
    plain = GenerationStats(prompt_tokens=10, generated_tokens=5, mode="plain")
    # 4 decode steps at contexts 11..14: 4 x 1000 + 10 x (11 + 12 + 13 + 14), over 4 tokens
    assert decode_read_bytes_per_token(m, plain) == pytest.approx((4000 + 10 * 50) / 4)
    spec = GenerationStats(prompt_tokens=10, generated_tokens=8, mode="draft", cycles=2,
                           drafted_tokens=6)
    ctx = 10 + 8 / 2
    want = (2 * (1000 + 10 * ctx) + 6 * (100 + 1 * ctx)) / 8
    assert decode_read_bytes_per_token(m, spec) == pytest.approx(want)
    dflash = GenerationStats(prompt_tokens=10, generated_tokens=8, mode="dflash", cycles=2,
                             drafted_tokens=30)  # one draft forward per block
    assert decode_read_bytes_per_token(m, dflash) == pytest.approx(
        (2 * (1000 + 10 * ctx) + 2 * (100 + ctx)) / 8)
    assert decode_read_bytes_per_token(m, GenerationStats(generated_tokens=1)) == 0


def test_chip_table_and_detection_overrides(caplog):
    assert normalize_chip("Apple M4 Pro") == "M4 Pro" and normalize_chip("m2  max") == "M2 Max"
    assert {f"M{g}{v}" for g in "1234" for v in ("", " Pro", " Max")} <= set(APPLE_PEAK_GBS)
    m = MachineInfo.detect(chip="Apple M2")
    assert m.chip == "M2" and m.peak_memory_bandwidth_bytes_per_s == 100e9 and m.memory_bytes > 0
    caplog.set_level("WARNING", logger="flashfleet.worker")
    assert not caplog.records  # a known chip: no warning
    assert MachineInfo.detect(chip="M9 Pro").peak_memory_bandwidth_bytes_per_s is None
    assert "'M9 Pro' is not in the peak-bandwidth table" in caplog.text  # typo or newer chip: said
    assert "--peak-memory-bandwidth-gbs" in caplog.text
    caplog.clear()
    assert MachineInfo.detect(chip="M4", peak_gbs=410).peak_memory_bandwidth_bytes_per_s == 410e9
    assert MachineInfo.detect(chip="M9 Pro", peak_gbs=410).peak_memory_bandwidth_bytes_per_s == 410e9
    assert not caplog.records  # the peak was given: nothing missing
    with pytest.raises(ValueError):
        MachineInfo.detect(peak_gbs=0)


def test_spec_series_start_at_zero_and_requests_are_counted_once():
    engine = FakeEngine(MODEL)
    engine.model = ModelDescription(MODEL, 512, draft="d", draft_mode="draft", num_draft_tokens=3,
                                    weights_bytes=100, kv_bytes_per_token=1)
    registry = CollectorRegistry()
    m = WorkerMetrics(registry, engine, MachineInfo())
    get = registry.get_sample_value
    lab = {"model": MODEL, "method": "draft"}
    assert get("flashfleet_worker_spec_draft_tokens_total", lab) == 0
    assert get("flashfleet_worker_spec_accepted_tokens_per_position_total", {**lab, "position": "3"}) == 0
    assert get("flashfleet_worker_spec_cycles_total", {"model": MODEL, "method": "plain"}) is None
    stats = GenerationStats(prompt_tokens=4, generated_tokens=9, ttft_s=0.5, tokens_per_s=4.0,
                            total_s=2.5, mode="draft", cycles=3, drafted_tokens=9, accepted_tokens=5,
                            draft_s=0.3, verify_s=0.6, accepted_per_position=[3, 2, 0])
    m.observe_request(MODEL, DoneEvent("r", "stop", stats))
    assert get("flashfleet_worker_spec_accepted_tokens_total", lab) == 5
    assert get("flashfleet_worker_spec_cycle_verify_seconds_sum", lab) == pytest.approx(0.2)
    assert get("flashfleet_worker_decode_seconds_total", lab) == pytest.approx(2.0)
    per_token = decode_read_bytes_per_token(engine.model, stats)
    assert get("flashfleet_worker_decode_read_bytes_total", lab) == pytest.approx(per_token * 4.0 * 2.0)
    assert get("flashfleet_worker_requests_total", {"model": MODEL, "outcome": "stop"}) == 1


def test_kv_budget_prompt_cache_and_preemptions_are_exported():
    engine = FakeEngine(MODEL, kv_budget_bytes=5000)
    registry = CollectorRegistry()
    m = WorkerMetrics(registry, engine, MachineInfo())
    get = registry.get_sample_value
    lab = {"model": MODEL}
    assert get("flashfleet_worker_prompt_cached_tokens_total", lab) == 0  # created at zero
    assert get("flashfleet_worker_preemptions_total", lab) == 0
    assert get("flashfleet_worker_kv_budget_bytes", lab) == 5000
    assert get("flashfleet_worker_prompt_cache_bytes", lab) == 0
    engine.prompt_cache.append((1, 2, 3))  # a finished turn kept by the fake: 1000 bytes
    assert get("flashfleet_worker_prompt_cache_bytes", lab) == engine.load().prompt_cache_bytes == 1000
    for cached, preempted in ((24, 1), (8, 0)):
        stats = GenerationStats(prompt_tokens=32, generated_tokens=4, ttft_s=0.1, tokens_per_s=10.0, total_s=0.4,
                                cached_tokens=cached, preemptions=preempted)
        m.observe_request(MODEL, DoneEvent("r", "stop", stats))
    assert get("flashfleet_worker_prompt_cached_tokens_total", lab) == 32
    assert get("flashfleet_worker_prompt_tokens_total", lab) == 64
    assert get("flashfleet_worker_preemptions_total", lab) == 1
    no_budget = CollectorRegistry()
    WorkerMetrics(no_budget, FakeEngine(MODEL, kv_budget_bytes=0), MachineInfo())
    assert no_budget.get_sample_value("flashfleet_worker_kv_budget_bytes", lab) is None  # unknown: absent


def test_coordinator_creates_model_series_when_first_routed():
    registry = CollectorRegistry()
    c = CoordinatorMetrics(registry)
    assert registry.get_sample_value("flashfleet_coordinator_retries_total", {"model": MODEL}) is None
    c.observe_queue(MODEL, 0.002)
    assert registry.get_sample_value("flashfleet_coordinator_retries_total", {"model": MODEL}) == 0
    assert registry.get_sample_value("flashfleet_coordinator_migrations_total",
                                     {"model": MODEL, "reason": "speed", "outcome": "ok",
                                      "method": "reprefill"}) == 0
    assert registry.get_sample_value("flashfleet_coordinator_migration_pause_seconds_count",
                                     {"model": MODEL, "reason": "drain", "method": "reprefill"}) == 0
    assert registry.get_sample_value("flashfleet_coordinator_lease_expiries_total") == 0
