"""What deploy/ ships: Prometheus config and rules pass promtool, the launchd plists and systemd
units name a program and arguments that exist, the cluster config file is read by every entry
point (flags override it) and rejects bad keys, TLS files load as gRPC credentials, and
`flashfleet up --config` starts a cluster from a config file."""
from __future__ import annotations

import asyncio
import os
import plistlib
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from concurrent import futures
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import coordinator.__main__ as coordinator_main
import flashfleet.config as config_mod
import worker.__main__ as worker_main
from flashfleet.cli import COMMANDS
from flashfleet.config import ConfigError, TLSConfig, load_cluster_config

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
CLUSTER = DEPLOY / "cluster.toml"
DOCS = ROOT / "docs" / "operations.md"
VENV_BIN = "/opt/flashfleet/venv/bin/"
PARSERS = {"coordinator": coordinator_main.parse_args, "worker": worker_main.parse_args}


def console_script() -> str:
    """The `flashfleet` console script of this environment (pip install -e . puts it beside
    the interpreter)."""
    found = shutil.which("flashfleet", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        pytest.skip("the flashfleet console script is not installed (pip install -e .)")
    return found


# ----- Prometheus ------------------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool is absent (Debian package `prometheus`; .ci/run installs it)")
def test_promtool_accepts_the_shipped_config_and_rules():
    # The unit tests (flashfleet-alerts.test.yml): a healthy DFlash session (acceptance 9 %,
    # tau 2.4) fires nothing; a wrong draft and an acceptance drop each fire their rule.
    for args in (["check", "config", "prometheus.yml"], ["check", "rules", "flashfleet-alerts.yml"],
                 ["test", "rules", "flashfleet-alerts.test.yml"]):
        proc = subprocess.run(["promtool", *args], cwd=DEPLOY / "prometheus", capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_prometheus_targets_match_the_cluster_config():
    cfg = load_cluster_config(CLUSTER)
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j["static_configs"] for j in prom["scrape_configs"]}
    coordinator_host = cfg.coordinator.dial_address.rsplit(":", 1)[0]
    assert jobs["flashfleet-coordinator"] == [
        {"targets": [f"{coordinator_host}:{cfg.coordinator.metrics_port}"]}]
    assert jobs["flashfleet-worker"] == [
        {"targets": [f"{w.advertise_host}:{w.metrics_port}"], "labels": {"worker": w.id}}
        for w in cfg.workers]


MINIMAL = '[[models]]\nname = "m"\n\n[[workers]]\nid = "w1"\nmodel = "m"\n'


# ----- launchd and systemd ---------------------------------------------------------------------

def _check_command(argv: list[str], monkeypatch) -> str:
    """Checks a service command: the venv's flashfleet console script, a subcommand that exists,
    arguments its parser accepts with the shipped cluster.toml. Returns the subcommand."""
    program, sub, *args = argv
    assert program == VENV_BIN + "flashfleet"
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["flashfleet"] == "flashfleet.cli:main"
    assert COMMANDS[sub][0] == f"{sub}.__main__"
    assert args[0] == "--config" and Path(args[1]).name == "cluster.toml"
    monkeypatch.setattr(config_mod.socket, "gethostname", lambda: "mini-2.local")
    a = PARSERS[sub](["--config", str(CLUSTER), *args[2:]])
    assert a.port == (50051 if sub == "coordinator" else 50052)
    if sub == "worker":
        assert (a.worker_id, a.model, a.coordinator) == ("mini-2", "Qwen2.5-Coder-1.5B-Instruct",
                                                         "coordinator.local:50051")
    return sub


LAUNCHD_KEYS = {"Label", "ProgramArguments", "UserName", "WorkingDirectory", "EnvironmentVariables",
                "RunAtLoad", "KeepAlive", "ThrottleInterval", "ExitTimeOut", "ProcessType",
                "StandardOutPath", "StandardErrorPath"}


@pytest.mark.parametrize("role", ["coordinator", "worker"])
def test_launchd_plist_parses_and_names_a_real_command(role, monkeypatch):
    path = DEPLOY / "launchd" / f"com.flashfleet.{role}.plist"
    plist = plistlib.loads(path.read_bytes())
    assert set(plist) <= LAUNCHD_KEYS, set(plist) - LAUNCHD_KEYS
    assert plist["Label"] == f"com.flashfleet.{role}" and plist["RunAtLoad"] is True
    assert plist["ProcessType"] in ("Standard", "Interactive", "Adaptive", "Background")
    assert _check_command(plist["ProgramArguments"], monkeypatch) == role
    docs = DOCS.read_text()
    for p in (plist["ProgramArguments"][0], plist["ProgramArguments"][3], plist["WorkingDirectory"],
              str(Path(plist["StandardOutPath"]).parent), path.name, plist["UserName"]):
        assert p in docs, f"docs/operations.md never mentions {p} (how does it get created?)"


@pytest.mark.parametrize("role", ["coordinator", "worker"])
def test_systemd_unit_names_a_real_command_and_verifies(role, monkeypatch, tmp_path):
    path = DEPLOY / "systemd" / f"flashfleet-{role}.service"
    text = path.read_text()
    exec_start = next(line.split("=", 1)[1] for line in text.splitlines() if line.startswith("ExecStart="))
    assert _check_command(shlex.split(exec_start), monkeypatch) == role
    assert path.name in DOCS.read_text()
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not available")
    unit = tmp_path / path.name  # the venv of the docs is this environment's
    unit.write_text(text.replace(VENV_BIN + "flashfleet", console_script()))
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_console_script_runs_the_services_with_a_config(tmp_path):
    script = console_script()
    bad = tmp_path / "cluster.toml"
    bad.write_text('[coordinator]\nport = 50051\nmetrics = 9400\n')
    for sub in ("coordinator", "worker"):
        proc = subprocess.run([script, sub, "--config", str(bad)], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert "unknown key 'metrics'" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([script, "worker", "--config", str(CLUSTER), "--worker-id", "mini-9"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no [[workers]] entry for id 'mini-9'" in proc.stderr


# ----- the cluster config ----------------------------------------------------------------------

def test_shipped_cluster_config_loads():
    cfg = load_cluster_config(CLUSTER)
    assert [w.id for w in cfg.workers] == ["mini-1", "mini-2", "mini-3"]
    mini3 = cfg.worker("mini-3")
    assert (mini3.model, mini3.capacity, mini3.port, mini3.chip) == ("SmolLM2-135M-Instruct", 8, 50052, "M4")
    assert cfg.model("Qwen2.5-Coder-1.5B-Instruct").draft == "Qwen2.5-Coder-0.5B-Instruct"
    assert cfg.tls is None


def test_worker_finds_its_entry_by_hostname(monkeypatch):
    cfg = load_cluster_config(CLUSTER)
    for host, want in (("mini-3.local", "mini-3"), ("MINI-1", "mini-1"), ("mini-2.lan", "mini-2")):
        monkeypatch.setattr(config_mod.socket, "gethostname", lambda: host)
        assert cfg.worker().id == want
    monkeypatch.setattr(config_mod.socket, "gethostname", lambda: "laptop.local")
    with pytest.raises(ConfigError, match="no \\[\\[workers\\]\\] entry for this host.*mini-1, mini-2"):
        cfg.worker()


def test_flags_override_the_config_file():
    a = worker_main.parse_args(["--config", str(CLUSTER), "--worker-id", "mini-3"])
    assert (a.model, a.model_name, a.capacity, a.chip, a.metrics_port, a.host) == (
        "SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct", 8, "M4", 9401, "0.0.0.0")
    a = worker_main.parse_args(["--config", str(CLUSTER), "--worker-id", "mini-1", "--capacity", "2",
                                "--host", "127.0.0.1", "--metrics-port", "0"])
    assert (a.capacity, a.host, a.metrics_port, a.draft) == (2, "127.0.0.1", 0, "Qwen2.5-Coder-0.5B-Instruct")
    # Another model than the entry's: the entry's model, name and draft do not apply.
    a = worker_main.parse_args(["--config", str(CLUSTER), "--worker-id", "mini-1", "--model", "/m/x"])
    assert (a.model, a.model_name, a.draft, a.capacity) == ("/m/x", "", None, 8)
    a = worker_main.parse_args(["--model", "m"])  # no config: the built-in defaults
    assert (a.capacity, a.host, a.port, a.num_draft_tokens, a.worker_id) == (
        8, "127.0.0.1", 0, 3, socket.gethostname())
    c = coordinator_main.parse_args(["--config", str(CLUSTER), "--port", "6000"])
    assert (c.host, c.port, c.metrics_port, c.lease_ttl_s, c.http_port) == ("0.0.0.0", 6000, 9400, 10.0, 8000)
    assert coordinator_main.parse_args(["--config", str(CLUSTER), "--http-port", "8100"]).http_port == 8100
    c = coordinator_main.parse_args([])
    assert (c.host, c.port, c.metrics_port, c.http_port) == ("127.0.0.1", 50051, None, None)
    with pytest.raises(SystemExit):
        worker_main.parse_args([])  # no model at all
    # In-flight requests get most of the 30 s systemd allows a stop (the units' TimeoutStopSec).
    assert worker_main.parse_args(["--model", "m"]).drain_timeout_s == 25.0
    assert worker_main.parse_args(["--model", "m", "--drain-timeout", "3"]).drain_timeout_s == 3.0
    with pytest.raises(SystemExit):
        worker_main.parse_args(["--model", "m", "--drain-timeout", "-1"])
    from coordinator.config import CoordinatorConfig
    assert CoordinatorConfig().shutdown_grace_s == 25.0
    for unit in ("coordinator", "worker"):
        text = (ROOT / "deploy" / "systemd" / f"flashfleet-{unit}.service").read_text()
        assert "TimeoutStopSec=30" in text


def test_worker_drain_timeout_comes_from_the_config_then_the_flag(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(MINIMAL + "drain_timeout_s = 4.0\n")
    a = worker_main.parse_args(["--config", str(path), "--worker-id", "w1"])
    assert a.drain_timeout_s == 4.0
    a = worker_main.parse_args(["--config", str(path), "--worker-id", "w1", "--drain-timeout", "9"])
    assert a.drain_timeout_s == 9.0
    assert worker_main.parse_args(["--model", "m"]).drain_timeout_s == 25.0


def test_worker_block_size_flags_reach_the_engine_config(monkeypatch):
    import flashfleet.models as models
    import worker.engine.thread as engine_thread

    built = []
    monkeypatch.setattr(engine_thread, "Engine", built.append)
    monkeypatch.setattr(models, "resolve_model", lambda name: Path("/models") / name)
    for flags, want in (([], (None, True)), (["--fixed-block-size", "--block-size", "8"], (8, False))):
        worker_main.build_engine(worker_main.parse_args(["--model", "m", *flags]))
        assert (built[-1].block_size, built[-1].adaptive_block_size) == want


@pytest.mark.parametrize("text, message", [
    (MINIMAL + "kv_cache_limit_bytes = -1\n", "worker 'w1': kv_cache_limit_bytes must be > 0, got -1"),
    (MINIMAL + "peak_memory_bandwidth_gbs = nan\n", "worker 'w1': peak_memory_bandwidth_gbs must be > 0"),
    (MINIMAL + "drain_timeout_s = -2\n", "worker 'w1': drain_timeout_s must be a finite number"),
    ('[[models]]\nname = "m"\nmax_context_tokens = -5\n', "model 'm': max_context_tokens must be >= 1, got -5"),
])
def test_out_of_range_worker_and_model_values_name_the_file_and_key(tmp_path, text, message):
    # Caught when the file is read, with its path, not as a flag error of the worker command.
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        load_cluster_config(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("flags", [["--max-context-tokens", "-5"], ["--kv-cache-limit-bytes", "0"],
                                   ["--peak-memory-bandwidth-gbs", "inf"], ["--drain-timeout", "nan"]])
def test_out_of_range_worker_flags_are_errors(capsys, flags):
    with pytest.raises(SystemExit):
        worker_main.parse_args(["--model", "m", *flags])
    assert flags[0] in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--port", "99999"), ("--port", "-1"), ("--metrics-port", "70000"),
                                         ("--port", "abc")])
def test_port_flags_outside_the_tcp_range_are_errors(capsys, flag, value):
    """gRPC wraps an out-of-range port around (99999 bound 34463) and the metrics server fails
    with a traceback: every port flag is checked as a config file's ports are."""
    from flashfleet.cli.up import main as up_main

    for parse in (coordinator_main.parse_args, lambda argv: worker_main.parse_args(["--model", "m", *argv]),
                  up_main):
        with pytest.raises(SystemExit) as exit_:
            parse([flag, value])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}:" in err and ("is not a TCP port" in err or "is not a port number" in err)


def test_up_refuses_a_busy_port_before_starting_anything(tmp_path):
    """With a listener already on the port, `LocalCluster.start` says so and spawns nothing (the
    workers would otherwise register with the other process, and the cluster look ready)."""
    from flashfleet.cli.up import LocalCluster, port_is_free

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert not port_is_free("127.0.0.1", port)
        cluster = LocalCluster(port=port, workers=1, log_dir=tmp_path)
        with pytest.raises(RuntimeError, match=f"127.0.0.1:{port} is in use"):
            cluster.start()
        assert cluster.procs == {}
    assert port_is_free("127.0.0.1", port)
    if socket.has_ipv6:  # an IPv6 host is checked as IPv6, not reported busy
        try:
            with socket.socket(socket.AF_INET6) as probe:
                probe.bind(("::1", 0))
                free6 = probe.getsockname()[1]
        except OSError:
            return  # no IPv6 loopback on this machine
        assert port_is_free("::1", free6) and port_is_free("[::1]", free6)


def test_up_stops_when_asked_during_start_up(tiny_models, tmp_path):
    """Ctrl-C while the workers load (`should_stop` true) stops every child at once and raises
    StartupCancelled, instead of waiting for the cluster to be ready or for the timeout."""
    from flashfleet.cli.up import LocalCluster, StartupCancelled

    cluster = LocalCluster(model=str(tiny_models.llama), workers=1, log_dir=tmp_path)
    children, polls = [], []

    def should_stop() -> bool:
        polls.append(time.monotonic())
        children.extend(cluster.procs.values())
        return len(polls) >= 2

    started = time.monotonic()
    with pytest.raises(StartupCancelled, match="before the cluster was ready"):
        cluster.start(timeout_s=120, should_stop=should_stop)
    assert time.monotonic() - started < 30 and cluster.procs == {}
    assert len({id(c) for c in children}) == 2 and all(c.poll() is not None for c in children)


def test_up_refuses_a_config_without_workers(tmp_path, capsys):
    from flashfleet.cli.up import LocalCluster
    from flashfleet.cli.up import main as up_main

    path = tmp_path / "coordinator-only.toml"
    path.write_text("[coordinator]\nport = 50051\n")
    with pytest.raises(ConfigError, match=r"has no \[\[workers\]\] entries"):
        LocalCluster(config=path, workers=0)
    assert up_main(["--config", str(path)]) == 2
    assert "has no [[workers]] entries" in capsys.readouterr().err


def test_a_busy_metrics_port_is_a_one_line_error(tiny_models, capsys):
    """Coordinator and worker alike: exit 1 and a line naming --metrics-port, no traceback, and
    the coordinator's gRPC port is not left bound."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        from flashfleet.cli.up import free_port

        grpc_port = free_port()
        assert coordinator_main.main(["--port", str(grpc_port), "--metrics-port", str(port)]) == 1
        err = capsys.readouterr().err
        assert f"cannot serve metrics on 127.0.0.1:{port}" in err and "--metrics-port" in err
        assert "Traceback" not in err
        with socket.socket() as probe:  # nothing was left listening on the gRPC port
            probe.bind(("127.0.0.1", grpc_port))
        assert worker_main.main(["--model", str(tiny_models.llama), "--port", "0",
                                 "--metrics-port", str(port), "--coordinator", "127.0.0.1:1"]) == 1
        err = capsys.readouterr().err
        assert f"cannot serve metrics on 127.0.0.1:{port}" in err and "Traceback" not in err


@pytest.mark.parametrize("text, message", [
    ("[coordinater]\nport = 1\n", "unknown top-level key 'coordinater'"),
    ("[coordinator]\nport = \"50051\"\n", r"\[coordinator\] port must be int, got '50051'"),
    ("[coordinator]\nlease_ttl_s = 1\nheartbeat_interval_s = 2\n",
     r"lease_ttl_s \(1.0\) must be longer than heartbeat_interval_s \(2.0\)"),
    ("[coordinator]\nheartbeat_interval_s = 0\n", r"\[coordinator\] heartbeat_interval_s must be a "
     "finite number of seconds > 0, got 0.0"),  # 0 would be a busy loop on every worker
    ("[coordinator]\nlease_ttl_s = nan\n", "lease_ttl_s must be a finite number"),  # never expires
    ("[coordinator]\nlease_ttl_s = inf\n", "lease_ttl_s must be a finite number"),
    ("[coordinator]\nshutdown_grace_s = -1\n", "shutdown_grace_s must be a finite number of seconds >= 0"),
    (MINIMAL + "capcity = 3\n", r"\[\[workers\]\] #1: unknown key 'capcity'; expected one of id, model"),
    (MINIMAL + "capacity = 0\n", "capacity must be >= 1"),
    (MINIMAL + "capacity = true\n", "capacity must be int"),
    (MINIMAL + "port = 70000\n", "port = 70000 is not a TCP port"),
    (MINIMAL + '\n[[workers]]\nid = "w1"\nmodel = "m"\n', "duplicate worker id 'w1'"),
    ('[[workers]]\nid = "w1"\nmodel = "nope"\n', "no \\[\\[models\\]\\] entry named 'nope'"),
    ('[[models]]\nname = "m"\n[[workers]]\nmodel = "m"\n', "missing 'id'"),
    ('[worker]\nid = "x"\n', "'id' belongs in each \\[\\[workers\\]\\] entry"),
    ("[tls]\nca_file = \"a\"\n", r"\[tls\]: missing 'cert_file', 'key_file'"),
    ("models = 3\n", "models must be an array of tables"),
    ("[coordinator\n", "is not valid TOML"),
])
def test_bad_config_is_a_clear_error(tmp_path, text, message):
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        load_cluster_config(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("flags, message", [
    (["--heartbeat-interval-s", "0"], "--heartbeat-interval-s must be a finite number of seconds > 0"),
    (["--lease-ttl-s", "nan"], "--lease-ttl-s must be a finite number of seconds > 0, got nan"),
    (["--lease-ttl-s", "1", "--heartbeat-interval-s", "2"], "--lease-ttl-s (1.0) must be longer than"),
    (["--shutdown-grace-s", "-1"], "--shutdown-grace-s must be a finite number of seconds >= 0"),
    (["--route-attempts", "0"], "--route-attempts must be >= 1, got 0"),
])
def test_bad_coordinator_flags_are_named(capsys, flags, message):
    with pytest.raises(SystemExit):
        coordinator_main.parse_args(flags)
    assert message in capsys.readouterr().err


def test_coordinator_shutdown_grace_comes_from_the_config_then_the_flag(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[coordinator]\nshutdown_grace_s = 7.5\n")
    assert coordinator_main.parse_args(["--config", str(path)]).shutdown_grace_s == 7.5
    assert coordinator_main.parse_args(["--config", str(path), "--shutdown-grace-s", "3"]).shutdown_grace_s == 3
    assert coordinator_main.parse_args([]).shutdown_grace_s == 25.0


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read cluster config"):
        load_cluster_config(tmp_path / "nope.toml")


def test_worker_defaults_table_applies_to_every_entry(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[[models]]\nname = "m"\n[worker]\nmodel = "m"\ncapacity = 6\nmetrics_port = 9500\n'
                    '[[workers]]\nid = "a"\n[[workers]]\nid = "b"\ncapacity = 2\n')
    cfg = load_cluster_config(path)
    assert [(w.id, w.model, w.capacity, w.metrics_port) for w in cfg.workers] == [
        ("a", "m", 6, 9500), ("b", "m", 2, 9500)]


# ----- TLS ------------------------------------------------------------------------------------

def _make_certs(d: Path) -> TLSConfig:
    """A CA and a localhost certificate it signs (openssl CLI, else the cryptography package)."""
    if shutil.which("openssl"):
        run = lambda *a: subprocess.run(["openssl", *a], cwd=d, check=True, capture_output=True)
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
            "-subj", "/CN=flashfleet test CA")
        run("req", *ec, "-keyout", "host.key", "-out", "host.csr", "-subj", "/CN=localhost")
        (d / "san.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
        run("x509", "-req", "-in", "host.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "host.pem", "-days", "1", "-extfile", "san.cnf")
    else:
        pytest.importorskip("cryptography", reason="neither openssl nor cryptography available")
        import datetime
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec as ec_
        from cryptography.x509.oid import NameOID

        now = datetime.datetime.now(datetime.timezone.utc)

        def cert(subject, key, issuer, issuer_key, ca, san=None):
            b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
                 .public_key(key.public_key()).serial_number(x509.random_serial_number())
                 .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
                 .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
            if san:
                b = b.add_extension(san, critical=False)
            return b.sign(issuer_key, hashes.SHA256())

        pem = lambda k: k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption())
        ca_key, key = ec_.generate_private_key(ec_.SECP256R1()), ec_.generate_private_key(ec_.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "flashfleet test CA")])
        host = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
        san = x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                           x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
        (d / "ca.pem").write_bytes(cert(ca_name, ca_key, ca_name, ca_key, True).public_bytes(serialization.Encoding.PEM))
        (d / "host.pem").write_bytes(cert(host, key, ca_name, ca_key, False, san).public_bytes(serialization.Encoding.PEM))
        (d / "host.key").write_bytes(pem(key))
    return TLSConfig(ca_file=str(d / "ca.pem"), cert_file=str(d / "host.pem"), key_file=str(d / "host.key"))


def test_tls_files_load_as_mutual_tls_grpc_credentials(tmp_path):
    tls = _make_certs(tmp_path)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", tls.server_credentials())
    server.start()
    try:
        with grpc.secure_channel(f"localhost:{port}", tls.channel_credentials()) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        anonymous = grpc.ssl_channel_credentials(root_certificates=tls.read()[0])
        with grpc.secure_channel(f"localhost:{port}", anonymous) as ch:  # no client certificate
            with pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    finally:
        server.stop(0)


def test_tls_section_is_validated_and_reaches_the_services(tmp_path):
    tls = _make_certs(tmp_path)
    path = tmp_path / "c.toml"
    path.write_text(CLUSTER.read_text() + f'\n[tls]\nca_file = "{tls.ca_file}"\n'
                    f'cert_file = "{tls.cert_file}"\nkey_file = "{tls.key_file}"\n')
    cfg = load_cluster_config(path)
    assert cfg.tls == tls
    assert coordinator_main.parse_args(["--config", str(path)]).tls == tls
    assert worker_main.parse_args(["--config", str(path), "--worker-id", "mini-1"]).tls == tls
    (tmp_path / "host.key").write_text("not a key")
    with pytest.raises(ConfigError, match="key_file .* is not a PEM file"):
        cfg.tls.read()
    with pytest.raises(ConfigError, match="ca_file .* cannot read it"):
        TLSConfig(str(tmp_path / "missing.pem"), tls.cert_file, tls.key_file).server_credentials()


def test_whole_cluster_over_mutual_tls(tmp_path):
    """Client -> coordinator -> worker and worker -> registry all run over mutual TLS; a client
    without a certificate is refused."""
    import asyncio

    from prometheus_client import CollectorRegistry

    from coordinator.config import CoordinatorConfig
    from coordinator.server import start_coordinator
    from fakes import FakeEngine
    from flashfleet import Client
    from flashfleet.errors import Unavailable
    from harness import LoopThread
    from worker.server import start_worker

    tls = _make_certs(tmp_path)
    loop = LoopThread()
    try:
        coord = loop.run(start_coordinator(CoordinatorConfig(host="localhost", port=0),
                                           CollectorRegistry(), tls))
        worker = loop.run(start_worker(FakeEngine(), "w1", host="localhost",
                                       coordinator=f"localhost:{coord.port}", tls=tls))
        loop.run(asyncio.wait_for(worker.registered.wait(), 10))
        with Client(f"localhost:{coord.port}", credentials=tls.channel_credentials()) as client:
            done = client.complete("fake-model", prompt="secure", max_tokens=3)
        assert done.worker_id == "w1" and len(done.token_ids) == 3
        anonymous = grpc.ssl_channel_credentials(root_certificates=tls.read()[0])
        # Each mismatch says which side to fix, not only gRPC's "Socket closed".
        with Client(f"localhost:{coord.port}", credentials=anonymous) as client:
            with pytest.raises(Unavailable, match="client certificate signed by the cluster CA"):
                client.complete("fake-model", prompt="no client cert", max_tokens=1, timeout_s=5)
        with Client(f"localhost:{coord.port}") as client, pytest.raises(
                Unavailable, match=r"if the cluster serves TLS, connect with its \[tls\] files"):
            client.complete("fake-model", prompt="plaintext", max_tokens=1, timeout_s=5)
        plain = loop.run(start_coordinator(CoordinatorConfig(host="localhost", port=0), CollectorRegistry()))
        with Client(f"localhost:{plain.port}", credentials=tls.channel_credentials()) as client:
            with pytest.raises(Unavailable, match="TLS handshake failed: the server may not serve TLS"):
                client.list_models(timeout_s=5)
        loop.run(plain.stop(grace_s=0.2))
        loop.run(worker.stop(grace_s=0.2))
        loop.run(coord.stop(grace_s=0.2))
    finally:
        loop.close()


def test_the_http_api_serves_https_with_mutual_tls_when_the_cluster_does(tmp_path):
    import ssl

    import openai
    from prometheus_client import CollectorRegistry

    from coordinator.config import CoordinatorConfig
    from coordinator.server import start_coordinator
    from fakes import FakeEngine
    from harness import LoopThread
    from worker.server import start_worker

    tls = _make_certs(tmp_path)
    loop = LoopThread()
    try:
        coord = loop.run(start_coordinator(CoordinatorConfig(host="localhost", port=0, http_port=0),
                                           CollectorRegistry(), tls))
        worker = loop.run(start_worker(FakeEngine(), "w1", host="localhost",
                                       coordinator=f"localhost:{coord.port}", tls=tls))
        loop.run(asyncio.wait_for(worker.registered.wait(), 10))
        url = f"https://localhost:{coord.http_port}/v1"
        assert coord.http_url.startswith("https://")
        trusted = ssl.create_default_context(cafile=tls.ca_file)
        trusted.load_cert_chain(tls.cert_file, tls.key_file)
        with openai.DefaultHttpxClient(verify=trusted) as http:
            client = openai.OpenAI(base_url=url, api_key="unused", http_client=http, max_retries=0)
            done = client.completions.create(model="fake-model", prompt="secure", max_tokens=3)
        assert done.usage.completion_tokens == 3 and done.model_extra["flashfleet"]["worker_id"] == "w1"
        anonymous = ssl.create_default_context(cafile=tls.ca_file)  # no client certificate
        with openai.DefaultHttpxClient(verify=anonymous) as http, pytest.raises(openai.APIConnectionError):
            openai.OpenAI(base_url=url, api_key="unused", http_client=http, max_retries=0).models.list()
        loop.run(worker.stop(grace_s=0.2))
        loop.run(coord.stop(grace_s=0.2))
    finally:
        loop.close()


# ----- flashfleet up --config ------------------------------------------------------------------

def test_up_starts_a_cluster_from_a_config_file(tiny_models, tmp_path):
    from flashfleet import Client
    from flashfleet.cli.up import LocalCluster, free_port

    path = tmp_path / "cluster.toml"
    path.write_text(f'''
[coordinator]
port = 1            # flashfleet up picks a free port below (flags override the file)
lease_ttl_s = 6.0

[[models]]
name = "tiny"
path = "{tiny_models.llama}"
draft = "{tiny_models.llama_near}"
num_draft_tokens = 2

[worker]
model = "tiny"
port = 50052        # each local worker gets a free port instead

[[workers]]
id = "alpha"
capacity = 2
chip = "M4"

[[workers]]
id = "beta"
capacity = 3
''')
    metrics = free_port()
    said = []
    cluster = LocalCluster(port=free_port(), metrics_port=metrics, config=path, log_dir=tmp_path / "logs",
                           workers=2)
    cluster.start(progress=said.append)
    try:
        # Processes and logs carry the config's worker ids, as status and the metrics do.
        assert sorted(cluster.procs) == ["alpha", "beta", "coordinator"]
        assert {p.name for p in (tmp_path / "logs").glob("*.log")} == {"alpha.log", "beta.log",
                                                                       "coordinator.log"}
        assert "2 worker(s) loading tiny " in said[0]
        with Client(cluster.address) as client:
            status = client.cluster_status(timeout_s=10)
            assert {(w.worker_id, w.capacity) for w in status.workers} == {("alpha", 2), ("beta", 3)}
            done = client.complete("tiny", prompt="The river flows", max_tokens=8)
            assert done.stats.mode == "draft" and done.stats.cycles > 0
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics + 1}/metrics", timeout=10).read().decode()
        assert 'flashfleet_worker_machine_info{chip="M4"} 1.0' in text
        assert 'num_draft_tokens="2"' in text and "flashfleet_worker_model_load_seconds" in text
        deadline = time.monotonic() + 10  # the coordinator refreshes its gauges every second
        while "flashfleet_coordinator_workers 2.0" not in text and time.monotonic() < deadline:
            time.sleep(0.2)
            text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10).read().decode()
        assert "flashfleet_coordinator_workers 2.0" in text
    finally:
        cluster.stop()


def test_up_names_every_model_of_the_config_and_ignores_the_working_directory(tmp_path, monkeypatch):
    from flashfleet.cli import up

    path = tmp_path / "cluster.toml"
    path.write_text('[[models]]\nname = "a"\n[[models]]\nname = "b"\n'
                    '[[workers]]\nid = "w-a"\nmodel = "a"\n[[workers]]\nid = "w-b"\nmodel = "b"\n')
    spawned, said = [], []
    monkeypatch.setattr(up.LocalCluster, "_wait_ready", lambda self, timeout_s, progress, should_stop: None)
    monkeypatch.setattr(up.subprocess, "Popen", lambda argv, **kw: spawned.append(argv))
    up.LocalCluster(config=path, port=1, log_dir=tmp_path / "logs").start(progress=said.append)
    monkeypatch.undo()  # subprocess.Popen is the real one again
    assert "2 worker(s) loading a, b " in said[0]
    # -P: a folder named `worker` where `flashfleet up` runs must not shadow the package.
    assert sorted(tuple(argv[1:4]) for argv in spawned) == [("-P", "-m", "coordinator"),
                                                            ("-P", "-m", "worker"), ("-P", "-m", "worker")]
    shadow = tmp_path / "cwd"
    (shadow / "worker").mkdir(parents=True)
    (shadow / "worker" / "__main__.py").write_text("raise SystemExit('the shadowing folder ran')\n")
    proc = subprocess.run([sys.executable, "-P", "-m", "worker", "--help"], cwd=shadow,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--model" in proc.stdout, proc.stderr


def test_grafana_provisioning_files():
    prov = ROOT / "grafana" / "provisioning"
    ds = yaml.safe_load((prov / "datasources" / "flashfleet-prometheus.yml").read_text())
    assert ds["apiVersion"] == 1 and [d["type"] for d in ds["datasources"]] == ["prometheus"]
    boards = yaml.safe_load((prov / "dashboards" / "flashfleet.yml").read_text())
    (provider,) = boards["providers"]
    assert provider["type"] == "file" and provider["options"]["path"] in DOCS.read_text()
    assert len(list((ROOT / "grafana" / "dashboards").glob("*.json"))) == 4


def test_a_closed_pipe_ends_the_cli_quietly():
    """`flashfleet --help | head -1`: the reader goes away before the output is flushed; the
    command ends with status 1 and no traceback (Python's SIGPIPE advice), not 120 and a
    BrokenPipeError on stderr."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys, time; from flashfleet.cli import main; "
                             "time.sleep(0.5); sys.exit(main(['--help']))"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the child writes
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err.decode()
    assert b"Traceback" not in err and b"BrokenPipeError" not in err


class _Child:
    """A child process stand-in: exits `exits_after_s` after SIGTERM, records how it was stopped."""

    def __init__(self, exits_after_s: float):
        self.exits_after_s, self.signals, self.killed, self.waits = exits_after_s, [], False, []
        self.returncode = None

    def poll(self):
        return self.returncode

    def send_signal(self, sig):
        self.signals.append(sig)

    def wait(self, timeout=None):
        self.waits.append(timeout)
        if self.killed or (timeout is not None and timeout >= self.exits_after_s):
            self.returncode = -9 if self.killed else 0
            return self.returncode
        raise subprocess.TimeoutExpired("child", timeout)

    def kill(self):
        self.killed = True


def test_up_stop_gives_streams_the_workers_drain_time(tmp_path):
    # Ctrl-C of `up` gives each group of processes its drain time (+5 s) before SIGKILL: workers
    # drain for up to 25 s, and a fixed 10 s would cut answers still streaming.
    import signal

    from flashfleet.cli.up import LocalCluster

    cluster = LocalCluster(workers=1, log_dir=tmp_path)
    assert cluster.drain_s == (30.0, 30.0)
    slow_worker, coordinator = _Child(exits_after_s=20.0), _Child(exits_after_s=0.0)
    cluster.procs = {"worker-1": slow_worker, "coordinator": coordinator}
    cluster.stop()
    assert slow_worker.signals == [signal.SIGTERM] and not slow_worker.killed and slow_worker.returncode == 0
    assert coordinator.signals == [signal.SIGTERM] and cluster.procs == {}
    hung = _Child(exits_after_s=1e9)
    cluster.procs = {"worker-1": hung}
    cluster.stop(grace_s=0.2)  # an explicit grace still bounds the wait
    assert hung.killed
    # The drain time follows the worker flag, and a config file's keys.
    assert LocalCluster(workers=1, log_dir=tmp_path, worker_args=("--drain-timeout", "3")).drain_s[0] == 8.0
    path = tmp_path / "c.toml"
    path.write_text((Path(__file__).parents[1] / "deploy" / "cluster.toml").read_text()
                    .replace("drain_timeout_s = 25.0", "drain_timeout_s = 40.0")
                    .replace("shutdown_grace_s = 25.0", "shutdown_grace_s = 12.0"))
    assert LocalCluster(config=path, workers=1, log_dir=tmp_path).drain_s == (45.0, 17.0)


def test_openblas_hint_only_where_it_applies(tmp_path, monkeypatch):
    import flashfleet.blas as blas

    monkeypatch.setattr(blas.sys, "platform", "linux")
    missing, present = str(tmp_path / "none.so"), tmp_path / "lib.so"
    present.write_bytes(b"")
    hint = blas.openblas_hint({}, missing)
    assert hint and "apt-get install libopenblas0-pthread" in hint and "FLASHFLEET_OPENBLAS=0" in hint
    assert blas.openblas_hint({}, str(present)) is None  # installed
    assert blas.openblas_hint({"FLASHFLEET_OPENBLAS": "0"}, missing) is None  # silenced
    assert blas.openblas_hint({"LD_PRELOAD": "/x.so"}, missing) is None  # the user preloads another
    monkeypatch.setattr(blas.sys, "platform", "darwin")
    assert blas.openblas_hint({}, missing) is None  # a Mac: Accelerate, no preload


def test_up_passes_on_a_workers_bad_model_status(tmp_path, capsys):
    # A worker refusing its model exits 2 (as documented); `up` said 1.
    from flashfleet.cli.up import free_port
    from flashfleet.cli.up import main as up_main

    import signal

    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}  # up installs its own
    try:
        assert up_main(["--model", str(not_a_model), "--workers", "1", "--port", str(free_port()),
                        "--log-dir", str(tmp_path / "logs")]) == 2
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert "not a model directory" in capsys.readouterr().err


def test_launchd_etcd_plist_describes_one_member_of_a_three_node_cluster():
    path = DEPLOY / "launchd" / "com.flashfleet.etcd.plist"
    plist = plistlib.loads(path.read_bytes())
    assert set(plist) <= LAUNCHD_KEYS, set(plist) - LAUNCHD_KEYS
    assert plist["Label"] == "com.flashfleet.etcd" and plist["RunAtLoad"] is True
    argv = plist["ProgramArguments"]
    assert Path(argv[0]).name == "etcd"
    flags = dict(zip(argv[1::2], argv[2::2]))
    members = dict(m.split("=", 1) for m in flags["--initial-cluster"].split(","))
    assert len(members) == 3 and flags["--name"] in members
    assert members[flags["--name"]] == flags["--initial-advertise-peer-urls"] == flags["--listen-peer-urls"]
    assert flags["--advertise-client-urls"] in flags["--listen-client-urls"].split(",")
    docs = DOCS.read_text()
    for p in (path.name, flags["--data-dir"], str(Path(plist["StandardOutPath"]).parent)):
        assert p in docs, f"docs/operations.md never mentions {p}"
    # The coordinators' etcd_endpoints in the docs name the three members' client URLs.
    host = flags["--advertise-client-urls"].removeprefix("http://").split(":")[0]
    assert f"http://{host}:2379" in docs


def test_up_counts_only_its_own_workers_as_ready(tmp_path):
    """A worker from outside (started by hand against the same coordinator) that registers
    before `up`'s own does not make the cluster ready: `_wait_ready` waits for `up`'s worker ids."""
    from fakes import FakeEngine
    from flashfleet.cli.up import LocalCluster
    from harness import start_cluster

    outside = start_cluster({"outside-1": FakeEngine()})
    try:
        port = int(outside.address.rsplit(":", 1)[1])
        cluster = LocalCluster(port=port, workers=1, log_dir=tmp_path)
        cluster.own_ids = ["worker-1"]  # as start() sets them, without spawning processes
        said = []
        with pytest.raises(RuntimeError, match="workers not ready"):
            cluster._wait_ready(3.0, said.append, lambda: False)
        assert said == []
        outside.add_worker(FakeEngine(), "worker-1")
        cluster._wait_ready(10.0, said.append, lambda: False)
        assert said == [f"  1/1 workers ready: worker-1 at {outside.workers[-1].advertise_address}"]
    finally:
        outside.close()


def test_up_passes_etcd_endpoints_to_its_coordinator(tmp_path, monkeypatch):
    from flashfleet.cli import up

    spawned = []

    def ready(self, timeout_s, progress, should_stop):
        raise up.StartupCancelled("test: stop after spawning")

    def popen(argv, **kw):  # a process that has exited: what LocalCluster.stop looks at
        spawned.append(argv)
        return SimpleNamespace(poll=lambda: 0, wait=lambda timeout=None: 0)

    monkeypatch.setattr(up.LocalCluster, "_wait_ready", ready)
    monkeypatch.setattr(up.subprocess, "Popen", popen)
    monkeypatch.setattr(up, "port_is_free", lambda host, port: True)
    monkeypatch.setattr(up.signal, "signal", lambda sig, handler: None)  # up installs its own: not here
    assert up.main(["--workers", "1", "--log-dir", str(tmp_path), "--etcd-endpoints",
                    "http://10.0.0.11:2379,http://10.0.0.12:2379"]) == 0
    coordinator = next(argv for argv in spawned if argv[3] == "coordinator")
    i = coordinator.index("--state")
    assert coordinator[i:i + 4] == ["--state", "etcd", "--etcd-endpoints", "http://10.0.0.11:2379,http://10.0.0.12:2379"]
    spawned.clear()
    assert up.main(["--workers", "1", "--log-dir", str(tmp_path)]) == 0
    assert "--state" not in next(argv for argv in spawned if argv[3] == "coordinator")  # memory by default
