"""bench/soak.py on a tiny random-weight model for 20 s: every kind of request is sent through
both APIs, none is lost, the report's tables match the JSON, every cluster process is sampled,
and the workers hold no session after the drain. The verdict's failure paths are checked on
made-up records (a short run says nothing about memory growth)."""
import json
import statistics
import sys

import pytest

from bench_scripts import ROOT, run_bench

sys.path.insert(0, str(ROOT / "bench"))

from soak_report import format_report, summarize  # noqa: E402
from soak_requests import KINDS, OUTCOMES, Record  # noqa: E402


def _kind_rows(stdout: str) -> dict[str, list[str]]:
    """The first table's rows (kind -> outcome counts and total)."""
    table = stdout.split("| kind | completion |", 1)[1].split("\n\n", 1)[0]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines() if line.startswith("| ")]
    return {r[0]: r[1:] for r in rows if r[0] in KINDS}


def test_a_short_soak_loses_nothing(tmp_path, tiny_models):
    out = tmp_path / "soak.json"
    r = run_bench("soak.py", "--model", tiny_models.llama, "--workers", 2, "--capacity", 2, "--duration", 20,
                  "--short-prompt-tokens", 64, "--long-prompt-tokens", 200, "--long-output-tokens", 64,
                  "--max-growth-pct", 100, "--json", out, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "no request lost: PASS (0 lost)" in r.stdout and "result: PASS" in r.stdout
    data = json.loads(out.read_text())
    records = data["records"]
    assert data["lost"] == 0 and all(rec["outcome"] != "lost" for rec in records)
    rows = _kind_rows(r.stdout)
    assert list(rows) == list(KINDS)
    for kind, cells in rows.items():
        counts = dict(zip(OUTCOMES, map(int, cells[:-1])))
        assert counts == {o: sum(rec["kind"] == kind and rec["outcome"] == o for rec in records) for o in OUTCOMES}
        assert sum(counts.values()) == int(cells[-1]) > 0, kind
    assert rows["bad"][OUTCOMES.index("typed_error")] == rows["bad"][-1]  # every bad request: a typed error
    assert {rec["api"] for rec in records} == {"grpc", "http-chat", "http-completions"}
    assert {rec["stream"] for rec in records if rec["api"] != "grpc"} == {True, False}
    assert data["tokens"] == sum(rec["tokens"] for rec in records) > 0
    labels = [s["label"] for s in data["samples"]]
    assert labels[0] == "start" and labels[-1] == "end" and "warmup" in labels
    assert set(data["memory"]) == {"coordinator", "worker-1", "worker-2"}
    assert all(m["end"] > 0 and m["growth_pct"] is not None for m in data["memory"].values())
    assert data["sessions_left"] == 0
    assert set(data["kv"]) == {"worker-1", "worker-2"} and "| worker | KV MiB start" in r.stdout


def test_bad_arguments_exit_2(tiny_models):
    for bad in (["--mix", "short=1,huge=2"], ["--mix", "short=0"], ["--coordinator", "127.0.0.1:1"],
                ["--duration", "0"], ["--warmup-s", "50", "--duration", "10"], ["--pid", "x=1"],
                ["--model", "no-such-model"]):
        r = run_bench("soak.py", "--model", tiny_models.llama, *bad, timeout=60)
        assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.strip(), (bad, r.stderr)


def _record(kind: str, outcome: str, start_s: float, total_s: float) -> Record:
    return Record(kind, "grpc", True, outcome, "lost:x" if outcome == "lost" else "", start_s, total_s / 2, total_s, 4)


def _samples(warm: int, end: int) -> list[dict]:
    """RSS of one process "w": half of `warm` at the start, `warm` as the highest of the first
    window (1-2 s), a peak above both at 5 s, `end` as the highest of the last window (8-9 s)."""
    rss = [(0.0, "start", warm // 2), (1.0, "warmup", warm - 50), (1.5, "periodic", warm),
           (2.5, "periodic", warm + 500), (5.0, "periodic", max(warm, end) + 1), (8.0, "periodic", end),
           (9.0, "end", end - 30)]
    return [{"t_s": t, "label": label, "rss": {"w": v}} for t, label, v in rss]


def test_the_verdict_fails_on_growth_a_lost_request_or_an_exited_process():
    records = [_record("short", "completion", t, 0.1 * (t + 1)) for t in range(10)]
    ok = summarize(records, _samples(1000, 1040), 10.0, 2.0, 5.0, 1.0)
    m = ok["memory"]["w"]
    assert ok["passed"] and (m["start"], m["warmup"], m["end"], m["peak_after_warmup"]) == (500, 1000, 1040, 1500)
    assert m["growth_pct"] == pytest.approx(4.0)
    assert ok["latency"]["short"]["n"] == 8  # sent after the warm-up
    after = [r.total_s for r in records if r.start_s >= 2.0]
    assert ok["latency"]["short"]["total_p50_s"] == pytest.approx(statistics.median(after))
    assert max(after) >= ok["latency"]["short"]["total_p99_s"] > statistics.median(after)
    grown = summarize(records, _samples(1000, 1060), 10.0, 2.0, 5.0, 1.0)
    assert not grown["passed"] and grown["memory_ok"] is False
    report = format_report(grown, 5.0, 1.0)
    assert "for every process: FAIL" in report and "result: FAIL" in report and "| w | " in report
    lost = summarize(records + [_record("long", "lost", 5.0, 1.0)], _samples(1000, 1000), 10.0, 2.0, 5.0, 1.0)
    assert not lost["passed"] and lost["lost"] == 1 and lost["errors"] == {"lost:x": 1}
    gone = _samples(1000, 1000)
    gone[4]["rss"]["w"] = None  # exited in the middle (a restarted process has another pid)
    exited = summarize(records, gone, 10.0, 2.0, 5.0, 1.0)
    assert not exited["passed"] and exited["memory"]["w"]["growth_pct"] is None
    unmeasured = summarize(records, [], 10.0, 2.0, 5.0, 1.0)
    assert unmeasured["passed"] and unmeasured["memory_ok"] is None
