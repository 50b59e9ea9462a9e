"""bench/chaos.py for 60 s on a tiny random-weight model with a kill -9 every 12 s (coordinator A,
worker 1, coordinator A, worker 2, each started again): every SDK stream equals its unfaulted
greedy reference, every HTTP request ends cleanly, every worker ends at 0 sessions for both
coordinators and for itself. The verdict's failure paths are checked on made-up outcomes (a
short run says nothing about memory growth: its RSS bound is loose)."""
import json
import shutil
import sys
from types import SimpleNamespace

import pytest

from bench_scripts import ROOT, run_bench

sys.path.insert(0, str(ROOT / "bench"))

from chaos import Outcome, Run, report  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="the etcd binary is not installed "
                                "(apt-get install etcd-server; .ci/run installs it)")


def test_a_short_chaos_run_loses_no_stream_and_leaks_no_slot(tmp_path, tiny_models):
    out = tmp_path / "chaos.json"
    r = run_bench("chaos.py", "--model", tiny_models.llama, "--model-name", "tiny", "--duration", 60,
                  "--period", 12, "--max-growth-pct", 100, "--log-dir", tmp_path / "logs", "--json", out,
                  timeout=420)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    assert "chaos: PASS" in r.stdout and r.stdout.count("| PASS ") == 4
    data = json.loads(out.read_text())
    assert [k[0] for k in data["kills"]] == ["coord-a", "w1", "coord-a", "w2"]
    sdk = [o for o in data["outcomes"] if o["api"] == "sdk"]
    http = [o for o in data["outcomes"] if o["api"] == "http"]
    assert len(sdk) > 20 and all(o["outcome"] == "ok" for o in sdk)
    # streams ran across every kill: some began before and ended after it
    assert all(any(o["start_s"] < t < o["end_s"] for o in sdk) for _, t in data["kills"])
    assert len(http) > 10 and {o["outcome"] for o in http} <= {"ok", "clean_error", "connection"}
    assert any(o["outcome"] == "ok" for o in http)
    final = data["final_sessions"]
    assert set(final) == {"coord-a", "coord-b", "workers"}
    assert all(v == {"w1": 0, "w2": 0, "w3": 0} for v in final.values())


def _args(**kw):
    return SimpleNamespace(**{"duration": 60.0, "period": 12.0, "restart_delay": 0.5, "sdk_clients": 1,
                              "http_clients": 1, "max_tokens": 8, "warmup_s": 6.0, "window_s": 6.0,
                              "max_growth_pct": 5.0, **kw})


def _clear():
    zero = {"w1": 0, "w2": 0, "w3": 0}
    return {"coord-a": dict(zero), "coord-b": dict(zero), "workers": dict(zero)}


def _run(*outcomes, kills=(("coord-a", 12.0),), rss_end=100):
    run = Run(list(outcomes), list(kills))
    run.rss = {"coord-b": [(-3.0, 100), (58.0, rss_end)], "w3": [(5.0, 100), (58.0, 100)]}
    run.fill_s = 4.0
    return run


def test_the_verdict_fails_on_each_kind_of_fault():
    ok = [Outcome("sdk", "ok", "", 1.0, 2.0), Outcome("http", "ok", "", 1.0, 2.0, "coord-a")]
    text, passed, _ = report(_args(), _run(*ok), _clear())
    assert passed and "chaos: PASS" in text
    # a broken connection while its coordinator died is clean; with no kill near it, it is not
    cut = Outcome("http", "connection", "ServerDisconnectedError", 10.0, 12.1, "coord-a")
    assert report(_args(), _run(*ok, cut), _clear())[1]
    stray = Outcome("http", "connection", "ServerDisconnectedError", 30.0, 31.0, "coord-a")
    text, passed, _ = report(_args(), _run(*ok, stray), _clear())
    assert not passed and "unclean 1" in text
    for bad in (Outcome("sdk", "mismatch", "", 1.0, 2.0), Outcome("sdk", "lost", "UNAVAILABLE", 1.0, 2.0),
                Outcome("http", "hang", "", 1.0, 2.0, "coord-b"), Outcome("http", "unclean", "", 1.0, 2.0, "coord-b")):
        assert not report(_args(), _run(*ok, bad), _clear())[1], bad
    leaked = _clear()
    leaked["coord-b"]["w2"] = 1
    assert not report(_args(), _run(*ok), leaked)[1]
    assert not report(_args(), _run(*ok, rss_end=106), _clear())[1]  # +6 % on a survivor
