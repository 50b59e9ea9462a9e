"""bench/bench_coordinator.py end to end at a tiny size: one coordinator, three simulated workers
(bench/sim_worker.py), a few streams; its table row and JSON carry measured tokens, streams held
and admitted requests with no error, and bad arguments are one line (exit 2)."""
import json

from bench_scripts import run_bench


def test_table_json_and_bad_arguments(tmp_path):
    out = tmp_path / "c.json"
    r = run_bench("bench_coordinator.py", "--workers", 3, "--streams", 8, "--max-tokens", 20, "--tokens-per-s", 40,
                  "--warmup-s", 1, "--duration-s", 3, "--idle-s", 0.5, "--admit-s", 1, "--admit-concurrency", 2,
                  "--sim-procs", 1, "--client-procs", 1, "--json-out", out, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| this |")]
    assert len(rows) == 1, r.stdout
    (row,) = json.loads(out.read_text())
    assert row["coordinators"] == 1 and row["workers"] == 3 and row["streams"] == 8
    assert row["tokens_per_s"] > 0 and row["messages_per_s"] > 0 and row["rate_kept"] > 0.25, row
    assert 1 <= row["held"] <= 8 and row["errors"] == 0 and row["admit_errors"] == 0, row
    assert row["admitted_per_s"] > 0 and row["cpu_s_per_1k_tokens"] > 0 and row["heartbeats_per_s"] == 1.5
    # every simulated worker heartbeats inside the window, answered well within the lease
    assert 0 < row["heartbeat_rtt_p50_s"] <= row["heartbeat_rtt_max_s"] < 5 and row["leases_lost"] == 0, row
    # the coordinator's own measure of its RPC lateness, sampled from its /metrics
    assert 0 < row["rpc_lag_p50_s"] <= row["rpc_lag_max_s"] < 5 and row["lease_expiries"] == 0, row
    bad = run_bench("bench_coordinator.py", "--workers", 0)
    assert bad.returncode == 2 and "must be >= 1" in bad.stderr and "Traceback" not in bad.stderr
    bad = run_bench("bench_coordinator.py", "--baseline-src", tmp_path)
    assert bad.returncode == 2 and "no coordinator/__main__.py there" in bad.stderr


def test_two_coordinators_sharing_the_fleet_state_in_etcd(tmp_path):
    import shutil

    import pytest
    if not shutil.which("etcd"):
        pytest.skip("the etcd binary is not installed (apt-get install etcd-server; .ci/run installs it)")
    out = tmp_path / "e.json"
    r = run_bench("bench_coordinator.py", "--etcd", "--coordinators", 2, "--workers", 4, "--streams", 6,
                  "--max-tokens", 20, "--tokens-per-s", 40, "--warmup-s", 1, "--duration-s", 3, "--idle-s", 0.5,
                  "--admit-s", 1, "--admit-concurrency", 2, "--sim-procs", 1, "--client-procs", 1, "--json-out", out,
                  timeout=300)
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(out.read_text())
    assert row["coordinators"] == 2 and row["streams"] == 12 and row["tokens_per_s"] > 0 and row["errors"] == 0, row


def test_the_coordinator_and_simulated_worker_path_imports_no_mlx():
    import subprocess
    import sys

    from bench_scripts import ROOT
    code = ("import sys; sys.path.insert(0, 'bench'); import coordinator.__main__, coordinator.server, sim_worker, "
            "bench_coordinator; print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'worker')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr)
