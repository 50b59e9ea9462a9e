"""Grafana dashboards as code: builds flashfleet's dashboards with grafana-foundation-sdk and writes
them to grafana/dashboards/*.json (committed; tests/test_observability.py checks they are fresh).

    python grafana/generate.py            # rewrite the JSON files
    python grafana/generate.py --check    # exit 1 if a committed file differs from a fresh build

Needs the `test` extra (pip install -e '.[test]'), which pins grafana-foundation-sdk's Grafana 11.6
build. Every query uses only metrics declared in worker/metrics.py and coordinator/metrics.py plus
Prometheus' own `up`, with the job names of deploy/prometheus/prometheus.yml. Variables:
`$datasource` (any Prometheus), `$model` (regex over the served models), `$instance` (worker
detail: scrape targets of the chosen models).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import bargauge, stat, table, timeseries
from grafana_foundation_sdk.builders.dashboard import (Dashboard, DatasourceVariable,
                                                       QueryVariable, Row)
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh, VariableSort
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

OUT_DIR = Path(__file__).resolve().parent / "dashboards"
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
RI = "$__rate_interval"
M = 'model=~"$model"'
MI = 'model=~"$model", instance=~"$instance"'
WORKER_JOB = "flashfleet-worker"
COORDINATOR_JOB = "flashfleet-coordinator"


# ----- PromQL helpers ---------------------------------------------------------------------------

def rate(metric: str, sel: str = M, by: str = "") -> str:
    """sum [by (...)] (rate(metric{sel}[$__rate_interval]))"""
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({metric}{{{sel}}}[{RI}]))"


def ratio(num: str, den: str, sel: str = M, by: str = "") -> str:
    return f"{rate(num, sel, by)}\n/\n{rate(den, sel, by)}"


def quantile(q: float, histogram: str, sel: str = M, by: str = "") -> str:
    group = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({group}) (rate({histogram}_bucket{{{sel}}}[{RI}])))"


def hist_mean(histogram: str, sel: str = M, by: str = "") -> str:
    return ratio(f"{histogram}_sum", f"{histogram}_count", sel, by)


ACCEPTANCE = ratio("flashfleet_worker_spec_accepted_tokens_total",
                   "flashfleet_worker_spec_draft_tokens_total", by="model, method")
TAU = "1 + " + ratio("flashfleet_worker_spec_accepted_tokens_total",
                     "flashfleet_worker_spec_cycles_total", by="model, method")
PER_POSITION = (rate("flashfleet_worker_spec_accepted_tokens_per_position_total",
                     by="model, method, position")
                + "\n/ on (model, method) group_left ()\n"
                + rate("flashfleet_worker_spec_cycles_total", by="model, method"))
TPS = "flashfleet_worker_decode_tokens_per_second"
SPEEDUP = "({})\n/\n({})".format(hist_mean(TPS, M + ', method!="plain"', "model"),
                                 hist_mean(TPS, M + ', method="plain"', "model"))
BANDWIDTH = ratio("flashfleet_worker_decode_read_bytes_total", "flashfleet_worker_decode_seconds_total",
                  MI, "instance")
PEAK = 'max by (instance) (flashfleet_worker_peak_memory_bandwidth_bytes_per_second{instance=~"$instance"})'
CACHED_RATIO = ratio("flashfleet_worker_prompt_cached_tokens_total", "flashfleet_worker_prompt_tokens_total",
                     by="model")
PREEMPTIONS = rate("flashfleet_worker_preemptions_total", by="model")


# ----- panel helpers ----------------------------------------------------------------------------

def q(expr: str, legend: str = "", ref: str = "A", instant: bool = False, fmt_table: bool = False):
    query = Dataquery().expr(expr).ref_id(ref).datasource(DS)
    if legend:
        query = query.legend_format(legend)
    if instant:
        query = query.instant()
    if fmt_table:
        query = query.format(PromQueryFormat.TABLE)
    return query


def _describe(panel, description: str):
    return panel.description(description) if description else panel


def _targets(panel, queries):
    for i, (expr, legend) in enumerate(queries):
        panel = panel.with_target(q(expr, legend, ref=chr(ord("A") + i)))
    return panel


def ts(title: str, unit: str, queries: list[tuple[str, str]], description: str = "",
       span: int = 12, height: int = 8, min_val: float | None = 0):
    p = _describe(timeseries.Panel().title(title).datasource(DS).unit(unit), description)
    if min_val is not None:
        p = p.min(min_val)
    return _targets(p, queries).span(span).height(height)


def st(title: str, unit: str, expr: str, description: str = "", span: int = 4, decimals=None):
    p = _describe(stat.Panel().title(title).datasource(DS).unit(unit), description)
    p = p.with_target(q(expr)).span(span).height(4)
    return p.decimals(decimals) if decimals is not None else p


def bars(title: str, unit: str, expr: str, legend: str, description: str = "", span: int = 12):
    p = _describe(bargauge.Panel().title(title).datasource(DS).unit(unit), description)
    return p.min(0).max(1).with_target(q(expr, legend)).span(span).height(8)


def info_table(title: str, expr: str, description: str = "", span: int = 12):
    p = _describe(table.Panel().title(title).datasource(DS), description)
    return p.with_target(q(expr, instant=True, fmt_table=True)).span(span).height(6)


def dashboard(uid: str, title: str, description: str, variables: list, rows: list) -> dict:
    """Builds one dashboard: rows of panels, numbered in order."""
    d = (Dashboard(title).uid(uid).description(description).tags(["flashfleet"]).refresh("30s")
         .time("now-1h", "now").timezone("browser").editable())
    for v in variables:
        d = d.with_variable(v)
    next_id = 1
    for row_title, panels in rows:
        d = d.with_row(Row(row_title).id(next_id))
        next_id += 1
        for panel in panels:
            d = d.with_panel(panel.id(next_id))
            next_id += 1
    return json.loads(json.dumps(d.build(), cls=JSONEncoder))


def datasource_var():
    return DatasourceVariable("datasource").label("Data source").type("prometheus")


def model_var():
    return (QueryVariable("model").label("Model").datasource(DS)
            .query("label_values(flashfleet_worker_model_info, model)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
            .multi(True).include_all(True).all_value(".*"))


def instance_var():
    return (QueryVariable("instance").label("Worker").datasource(DS)
            .query('label_values(flashfleet_worker_model_info{model=~"$model"}, instance)')
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
            .multi(True).include_all(True).all_value(".*"))


# ----- the dashboards ---------------------------------------------------------------------------

def fleet() -> dict:
    return dashboard(
        "flashfleet-fleet", "flashfleet / Fleet overview",
        "Traffic, latency, capacity and speculative acceptance of the whole fleet.",
        [datasource_var(), model_var()],
        [("Fleet", [
            st("Workers with a lease", "short", "max(flashfleet_coordinator_workers)",
               "Workers the coordinator routes to."),
            st("Worker targets up", "short", f'sum(up{{job="{WORKER_JOB}"}})',
               "Worker /metrics endpoints Prometheus reaches."),
            st("Requests/s", "reqps", rate("flashfleet_coordinator_requests_total")),
            st("Generated tokens/s", "short", rate("flashfleet_worker_generation_tokens_total")),
            st("Acceptance rate", "percentunit",
               ratio("flashfleet_worker_spec_accepted_tokens_total",
                     "flashfleet_worker_spec_draft_tokens_total"),
               "Accepted / drafted tokens, all speculative methods.", decimals=2),
            st("Sessions / capacity", "percentunit",
               f"sum(flashfleet_worker_sessions{{{M}}}) / sum(flashfleet_worker_capacity_sessions{{{M}}})"),
        ]),
         ("Traffic and latency", [
             ts("Requests by outcome", "reqps",
                [(rate("flashfleet_coordinator_requests_total", by="outcome"), "{{outcome}}")]),
             ts("Tokens/s", "short",
                [(rate("flashfleet_worker_prompt_tokens_total", by="model"), "prompt {{model}}"),
                 (rate("flashfleet_worker_generation_tokens_total", by="model"), "generated {{model}}")]),
             ts("Time to first token", "s",
                [(quantile(0.5, "flashfleet_worker_time_to_first_token_seconds"), "p50"),
                 (quantile(0.95, "flashfleet_worker_time_to_first_token_seconds"), "p95")]),
             ts("Inter-token latency and request latency (p95)", "s",
                [(quantile(0.95, "flashfleet_worker_inter_token_latency_seconds"), "inter-token p95"),
                 (quantile(0.95, "flashfleet_worker_e2e_request_latency_seconds"), "end-to-end p95")]),
         ]),
         ("Capacity", [
             ts("Sessions by worker", "short",
                [(f"sum by (instance) (flashfleet_worker_sessions{{{M}}})", "{{instance}}")]),
             ts("KV cache by worker", "bytes",
                [(f"sum by (instance) (flashfleet_worker_kv_cache_bytes{{{M}}})", "{{instance}} used"),
                 (f"max by (instance) (flashfleet_worker_kv_budget_bytes{{{M}}})", "{{instance}} budget")],
                "Running sessions' KV caches against each worker's KV budget; routing prefers "
                "workers with room for a request."),
             ts("Prompt cache by worker", "bytes",
                [(f"sum by (instance) (flashfleet_worker_prompt_cache_bytes{{{M}}})", "{{instance}}")],
                "Finished turns' KV caches kept for prefix reuse; they give way when sessions "
                "need the memory."),
             ts("Prompt tokens from the prompt cache", "percentunit", [(CACHED_RATIO, "{{model}}")],
                "Cached prompt tokens / all prompt tokens: the share of prefill a session's "
                "earlier turns saved (session affinity keeps a session on the worker holding them)."),
             ts("Preemptions", "short", [(PREEMPTIONS, "{{model}}")],
                "Sessions paused per second to free KV memory, each resumed later by recomputing "
                "its cache (about one prefill of its context)."),
         ])])


def speculative() -> dict:
    return dashboard(
        "flashfleet-spec", "flashfleet / Speculative decoding",
        "Acceptance rate, mean acceptance length (tau), acceptance by block position, cycle "
        "times and speedup. All from counters: any window is exact.",
        [datasource_var(), model_var()],
        [("Acceptance", [
            ts("Acceptance rate", "percentunit", [(ACCEPTANCE, "{{model}} {{method}}")],
               "Accepted draft tokens / drafted tokens."),
            ts("Mean acceptance length (tau)", "short", [(TAU, "{{model}} {{method}}")],
               "Tokens committed per cycle: 1 + accepted / cycles (the bonus token included)."),
            bars("Acceptance by block position", "percentunit", PER_POSITION,
                 "{{model}} {{method}} #{{position}}",
                 "Share of cycles whose draft was accepted at least up to this position."),
            ts("Output from drafts", "percentunit",
               [(ratio("flashfleet_worker_spec_accepted_tokens_total",
                       "flashfleet_worker_generation_tokens_total", by="model"), "{{model}}")],
               "Accepted draft tokens / all generated tokens."),
        ]),
         ("Cost and speed", [
             ts("Mean time per cycle", "s",
                [(ratio("flashfleet_worker_spec_draft_seconds_total",
                        "flashfleet_worker_spec_cycles_total", by="method"), "draft {{method}}"),
                 (ratio("flashfleet_worker_spec_verify_seconds_total",
                        "flashfleet_worker_spec_cycles_total", by="method"), "verify {{method}}"),
                 (ratio("flashfleet_worker_spec_translate_seconds_total",
                        "flashfleet_worker_spec_cycles_total", by="method"),
                  "translate {{method}}")],
                "Exact means from counters, for methods decoded one session at a time (draft, "
                "uag). Drafting runs asynchronously: the draft line is the host time queueing "
                "it and the verify line holds its device time too. Translation time is nonzero "
                "only for cross-tokenizer (uag) drafts."),
             ts("Per-request cycle time (p95)", "s",
                [(quantile(0.95, "flashfleet_worker_spec_cycle_draft_seconds", by="method"),
                  "draft {{method}}"),
                 (quantile(0.95, "flashfleet_worker_spec_cycle_verify_seconds", by="method"),
                  "verify {{method}}")],
                "Distribution of each request's mean cycle time (one observation per request), "
                "for methods decoded one session at a time; as above, the verify line holds the "
                "draft's device time."),
             ts("Decode tokens/s by method", "short",
                [(hist_mean("flashfleet_worker_decode_tokens_per_second", by="model, method"),
                  "{{model}} {{method}}")], "Mean over requests of each request's decode speed."),
             ts("Speedup over plain decoding", "short", [(SPEEDUP, "{{model}}")],
                "Mean decode tokens/s of speculative requests over plain requests of the same "
                "model (needs some plain-mode traffic in the window)."),
             ts("Drafted and accepted tokens/s", "short",
                [(rate("flashfleet_worker_spec_draft_tokens_total", by="method"), "drafted {{method}}"),
                 (rate("flashfleet_worker_spec_accepted_tokens_total", by="method"), "accepted {{method}}")]),
         ])])


def worker() -> dict:
    return dashboard(
        "flashfleet-worker", "flashfleet / Worker detail",
        "One or more workers: estimated memory bandwidth against the chip's peak, KV cache, "
        "latency, the loaded models and the machine.",
        [datasource_var(), model_var(), instance_var()],
        [("Memory", [
            ts("Estimated memory bandwidth", "Bps",
               [(BANDWIDTH, "{{instance}} estimated"), (PEAK, "{{instance}} peak")],
               "Bytes each decode step must read (weights + KV cache of its context) over decode "
               "time; with several sessions interleaved it under-reads. Peak from the chip."),
            ts("Share of peak bandwidth", "percentunit",
               [(f"({BANDWIDTH})\n/ on (instance)\n{PEAK}", "{{instance}}")]),
            ts("KV cache and its budget", "bytes",
               [(f"sum by (instance) (flashfleet_worker_kv_cache_bytes{{{MI}}})", "{{instance}} used"),
                (f"max by (instance) (flashfleet_worker_kv_budget_bytes{{{MI}}})", "{{instance}} budget"),
                (f"sum by (instance) (flashfleet_worker_prompt_cache_bytes{{{MI}}})", "{{instance}} prompt cache")],
               "Running sessions' KV caches (used), the prompt cache (finished turns kept for "
               "reuse, evicted first) and the budget both share."),
            ts("Prompt cache hits and preemptions", "short",
               [(ratio("flashfleet_worker_prompt_cached_tokens_total", "flashfleet_worker_prompt_tokens_total",
                       MI, "instance"), "{{instance}} cached prompt share"),
                (rate("flashfleet_worker_preemptions_total", MI, "instance"), "{{instance}} preemptions/s")],
               "Share of prompt tokens whose KV came from the prompt cache, and sessions paused "
               "per second for memory (each resumed by recomputing its cache)."),
            ts("Decode bytes read per second", "Bps",
               [(rate("flashfleet_worker_decode_read_bytes_total", MI, "instance"), "{{instance}}")],
               "Wall-clock rate of the estimated bytes read (includes idle time)."),
        ]),
         ("Load and latency", [
             ts("Sessions and capacity", "short",
                [(f"sum by (instance) (flashfleet_worker_sessions{{{MI}}})", "{{instance}} sessions"),
                 (f"sum by (instance) (flashfleet_worker_capacity_sessions{{{MI}}})", "{{instance}} capacity")]),
             ts("Requests by outcome", "reqps",
                [(rate("flashfleet_worker_requests_total", MI, "instance, outcome"),
                  "{{instance}} {{outcome}}")]),
             ts("Latency (p95)", "s",
                [(quantile(0.95, "flashfleet_worker_time_to_first_token_seconds", MI, "instance"),
                  "{{instance}} TTFT"),
                 (quantile(0.95, "flashfleet_worker_inter_token_latency_seconds", MI, "instance"),
                  "{{instance}} inter-token"),
                 (quantile(0.95, "flashfleet_worker_e2e_request_latency_seconds", MI, "instance"),
                  "{{instance}} end-to-end")]),
             ts("Decode tokens/s", "short",
                [(hist_mean("flashfleet_worker_decode_tokens_per_second", MI, "instance, method"),
                  "{{instance}} {{method}}")]),
         ]),
         ("Models and machine", [
             info_table("Loaded models", f"flashfleet_worker_model_info{{{MI}}}"),
             info_table("Machine", 'flashfleet_worker_machine_info{instance=~"$instance"}'),
             ts("Weights", "bytes",
                [(f"sum by (instance, role) (flashfleet_worker_model_weights_bytes{{{MI}}})",
                  "{{instance}} {{role}}")]),
             ts("Model load time", "s",
                [(f"max by (instance) (flashfleet_worker_model_load_seconds{{{MI}}})", "{{instance}}")]),
         ])])


def coordinator() -> dict:
    return dashboard(
        "flashfleet-coordinator", "flashfleet / Coordinator",
        "Routing, queueing, retries, worker health, leases, migrations and drains.",
        [datasource_var(), model_var()],
        [("Health", [
            st("Coordinator up", "short", f'max(up{{job="{COORDINATOR_JOB}"}})', span=8),
            st("Workers with a lease", "short", "max(flashfleet_coordinator_workers)", span=8),
            st("Lease expiries (range)", "short",
               "sum(increase(flashfleet_coordinator_lease_expiries_total[$__range]))", span=8),
            ts("Worker lease", "short",
               [("max by (worker) (flashfleet_coordinator_worker_up)", "{{worker}}")],
               "1 while the worker holds a live lease, 0 after it expired.", span=12),
            ts("Heartbeat age", "s",
               [("max by (worker) (flashfleet_coordinator_worker_heartbeat_age_seconds)", "{{worker}}")]),
        ]),
         ("Routing", [
             ts("Routed requests by worker and outcome", "reqps",
                [(rate("flashfleet_coordinator_requests_total", by="worker, outcome"),
                  "{{worker}} {{outcome}}")]),
             ts("Queueing time", "s",
                [(quantile(0.5, "flashfleet_coordinator_queue_seconds"), "p50"),
                 (quantile(0.95, "flashfleet_coordinator_queue_seconds"), "p95"),
                 (quantile(0.99, "flashfleet_coordinator_queue_seconds"), "p99")],
                "Arrival until the call to the serving worker starts: the wait for a slot, "
                "routing and earlier failed attempts; the worker's prefill is not included (see "
                "TTFT on the worker dashboard). Requests refused after a full wait count as "
                "outcome=overloaded under Routed requests, not here."),
             ts("Requests waiting for a slot", "short",
                [("max(flashfleet_coordinator_queued_requests)", "waiting")],
                "Requests queued because every worker serving their model is full (max_queued, "
                "queue_timeout_s in [coordinator]); waiting most of the time means the fleet needs "
                "more capacity."),
             ts("Retries", "reqps", [(rate("flashfleet_coordinator_retries_total", by="model"), "{{model}}")],
                "Requests re-routed to another worker before their first token."),
         ]),
         ("Migration", [
             ts("Migrations by reason and outcome", "short",
                [(f"sum by (reason, outcome) (increase(flashfleet_coordinator_migrations_total{{{M}}}[{RI}]))",
                  "{{reason}} {{outcome}}")],
                "Sessions moved between workers (coordinator/migration.py): speed (a faster worker), load "
                "(a less busy one), memory (its worker's KV budget would run out), drain, manual (flashfleet "
                "move), failure (failover). aborted: the destination refused and the session stayed.",
                span=12),
             ts("Migration pause", "s",
                [(quantile(0.5, "flashfleet_coordinator_migration_pause_seconds", M, "method"), "p50 {{method}}"),
                 (quantile(0.95, "flashfleet_coordinator_migration_pause_seconds", M, "method"), "p95 {{method}}")],
                "Time a moved stream sent its client nothing because of the move.", span=8),
             ts("Migration time", "s",
                [(hist_mean("flashfleet_coordinator_migration_seconds", M, "reason"), "{{reason}}")],
                "Mean time from the decision to move until the destination streamed.", span=8),
             ts("Bytes moved", "Bps",
                [(rate("flashfleet_coordinator_migration_bytes_sum", by="method"), "{{method}}")],
                "Session state sent between workers (0 for a re-prefill, which sends only token ids).", span=8),
             ts("Workers draining", "short",
                [("max by (worker) (flashfleet_coordinator_worker_draining)", "{{worker}}")],
                "1 while an operator drains the worker (flashfleet drain): it gets no new requests and its "
                "sessions move away; it leaves once it runs none."),
         ])])


DASHBOARDS = {"fleet.json": fleet, "speculative.json": speculative, "worker.json": worker,
              "coordinator.json": coordinator}


def render(board: dict) -> str:
    """Canonical JSON text of a dashboard (sorted keys, 2-space indent, final newline)."""
    return json.dumps(board, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def build_all() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {name: render(build()) for name, build in DASHBOARDS.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="fail if the committed JSON is stale")
    p.add_argument("--out", type=Path, default=OUT_DIR)
    a = p.parse_args(argv)
    stale = []
    a.out.mkdir(parents=True, exist_ok=True)
    for name, text in build_all().items():
        path = a.out / name
        if path.exists() and path.read_text(encoding="utf-8") == text:
            continue
        stale.append(name)
        if not a.check:
            path.write_text(text, encoding="utf-8")
    if a.check and stale:
        print(f"stale dashboards: {', '.join(stale)}; run python grafana/generate.py", file=sys.stderr)
        return 1
    print(f"{len(DASHBOARDS)} dashboards {'checked' if a.check else 'written'} in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
