"""The report of `bench/soak.py`: counts, latency percentiles, memory growth and the verdict, as a
dict (`summarize`) and as Markdown tables (`format_report`)."""
from __future__ import annotations

from collections import Counter

import numpy as np

from soak_requests import KINDS, OUTCOMES, Record

MiB = 1024 * 1024


def percentiles(values: list[float]) -> tuple[float | None, float | None]:
    """(p50, p99) of `values` (linear interpolation), or (None, None) for no values."""
    if not values:
        return None, None
    p50, p99 = np.percentile(np.asarray(values, dtype=float), [50, 99])
    return float(p50), float(p99)


def memory_growth(samples: list[dict], window_s: float, key: str = "rss") -> dict[str, dict]:
    """Per process: RSS bytes at the start, the highest RSS sampled in the window of `window_s`
    seconds that begins at the warm-up's sample ("warmup") and in the one that ends at the load's
    end ("end"), the peak after the warm-up, and the end's growth over the warm-up in percent.
    Maxima over windows, not single samples: a worker's RSS follows the KV caches of the sessions
    it runs at that moment, so one sample may catch it low or high.

    Args:
        samples: [{"t_s": seconds since the start, "label": "start" | "warmup" | "periodic" | "end",
            "rss": {process name: bytes, or None once it has exited}}], in time order, with one
            "start", one "warmup" and one "end".
        window_s: the windows' length, seconds (0: the warm-up's and the end's samples alone).
        key: the samples' field to read ("rss"; "kv": the workers' KV bytes, same shape).

    Returns:
        {name: {"start", "warmup", "end", "peak_after_warmup": bytes, or None where the process
        had exited; "growth_pct": float, or None once the process has exited}}.
    """
    at = {s["label"]: s["t_s"] for s in samples if s["label"] != "periodic"}
    names = list(dict.fromkeys(n for s in samples for n in s.get(key, {})))

    def highest(name: str, lo: float, hi: float) -> int | None:
        values = [s.get(key, {}).get(name) for s in samples if lo <= s["t_s"] <= hi]
        return None if not values or None in values else max(values)

    out = {}
    for name in names:
        start = next(s.get(key, {}).get(name) for s in samples if s["label"] == "start")
        warm = highest(name, at["warmup"], at["warmup"] + window_s)
        end = highest(name, at["end"] - window_s, at["end"])
        peak = highest(name, at["warmup"], float("inf"))
        growth = 100.0 * (end - warm) / warm if warm and end is not None and peak is not None else None
        out[name] = {"start": start, "warmup": warm, "end": end, "peak_after_warmup": peak, "growth_pct": growth}
    return out


def summarize(records: list[Record], samples: list[dict], wall_s: float, warmup_s: float,
              max_growth_pct: float, window_s: float) -> dict:
    """The soak's results.

    Args:
        records: every request's end.
        samples: RSS samples (`memory_growth`); empty when no process was watched.
        window_s: `memory_growth`'s windows, seconds.
        wall_s: seconds from the first request sent to the last one ended (tokens/s is over
            this time).
        warmup_s: latencies count requests sent after this many seconds.
        max_growth_pct: the memory criterion: no process's RSS at the end more than this percent
            above its RSS after the warm-up (each the highest in its window, `memory_growth`).

    Returns:
        {"requests", "by_kind": {kind: {outcome: n}}, "errors": {error: n}, "latency": {kind:
        {"n", "ttft_p50_s", "ttft_p99_s", "total_p50_s", "total_p99_s"}}, "tokens",
        "tokens_per_s", "memory": memory_growth(samples), "kv": memory_growth(samples, key="kv")
        (information: the KV bytes each worker reported), "lost", "memory_ok" (None: not
        measured), "passed"}.
    """
    by_kind = {k: {o: 0 for o in OUTCOMES} for k in KINDS}
    for r in records:
        by_kind[r.kind][r.outcome] += 1
    errors = Counter(r.error for r in records if r.error)
    latency = {}
    for kind in KINDS:
        after = [r for r in records if r.kind == kind and r.start_s >= warmup_s]
        ttft = percentiles([r.ttft_s for r in after if r.ttft_s is not None and r.outcome == "completion"])
        total = percentiles([r.total_s for r in after if r.outcome == "completion"])
        latency[kind] = {"n": sum(r.outcome == "completion" for r in after), "ttft_p50_s": ttft[0],
                         "ttft_p99_s": ttft[1], "total_p50_s": total[0], "total_p99_s": total[1]}
    tokens = sum(r.tokens for r in records)
    memory = memory_growth(samples, window_s) if samples else {}
    lost = sum(r.outcome == "lost" for r in records)
    memory_ok = None
    if memory:
        memory_ok = all(m["growth_pct"] is not None and m["growth_pct"] <= max_growth_pct for m in memory.values())
    return {"requests": len(records), "by_kind": by_kind, "errors": dict(errors.most_common()), "latency": latency,
            "tokens": tokens, "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
            "memory": memory, "kv": memory_growth(samples, window_s, "kv") if samples else {}, "lost": lost, "memory_ok": memory_ok,
            "passed": lost == 0 and memory_ok is not False}


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _mib(value: int | None) -> str:
    return "gone" if value is None else f"{value / MiB:.1f}"


def format_report(s: dict, max_growth_pct: float, window_s: float) -> str:
    """`summarize`'s result as Markdown tables and the verdict lines (PASS/FAIL); `window_s`:
    the memory windows' length, seconds (named in the memory table's header)."""
    lines = ["| kind | " + " | ".join(OUTCOMES) + " | total |", "|---|" + "---:|" * (len(OUTCOMES) + 1)]
    for kind, row in s["by_kind"].items():
        lines.append(f"| {kind} | " + " | ".join(str(row[o]) for o in OUTCOMES) + f" | {sum(row.values())} |")
    lines += ["", "| error | requests |", "|---|---:|"]
    lines += [f"| {e} | {n} |" for e, n in s["errors"].items()] or ["| (none) | 0 |"]
    lines += ["", "| kind | completions after warm-up | TTFT p50 ms | TTFT p99 ms | total p50 ms | total p99 ms |",
              "|---|---:|---:|---:|---:|---:|"]
    for kind, row in s["latency"].items():
        lines.append(f"| {kind} | {row['n']} | {_ms(row['ttft_p50_s'])} | {_ms(row['ttft_p99_s'])} "
                     f"| {_ms(row['total_p50_s'])} | {_ms(row['total_p99_s'])} |")
    lines += ["", f"requests: {s['requests']}; generated tokens: {s['tokens']} = {s['tokens_per_s']:.1f} tok/s "
              "(from the first request sent to the last one ended)"]
    if s["memory"]:
        lines += ["", f"| process | RSS MiB start | after warm-up (max of {window_s:.0f} s) | end (max of last "
                  f"{window_s:.0f} s) | peak after warm-up | growth % |",
                  "|---|---:|---:|---:|---:|---:|"]
        for name, m in s["memory"].items():
            growth = "-" if m["growth_pct"] is None else f"{m['growth_pct']:+.1f}"
            lines.append(f"| {name} | {_mib(m['start'])} | {_mib(m['warmup'])} | {_mib(m['end'])} "
                         f"| {_mib(m['peak_after_warmup'])} | {growth} |")
    if s.get("kv"):
        lines += ["", "| worker | KV MiB start (sessions + prompt cache, heartbeat) | after warm-up | end | "
                  "peak after warm-up |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {name} | {_mib(m['start'])} | {_mib(m['warmup'])} | {_mib(m['end'])} "
                  f"| {_mib(m['peak_after_warmup'])} |" for name, m in s["kv"].items()]
    verdict = {None: "NOT MEASURED (no process to watch)", True: "PASS", False: "FAIL"}[s["memory_ok"]]
    lines += ["", f"memory growth after warm-up <= {max_growth_pct:g} % for every process: {verdict}",
              f"no request lost: {'PASS' if s['lost'] == 0 else 'FAIL'} ({s['lost']} lost)",
              f"result: {'PASS' if s['passed'] else 'FAIL'}"]
    return "\n".join(lines)
