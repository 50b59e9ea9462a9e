"""Access control over real gRPC and HTTP on loopback, fake engines: API keys on the coordinator's
public API, the join token on its registry and on the workers' Worker service."""
from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request

import grpc
import pytest

from coordinator.config import CoordinatorConfig
from coordinator.server import start_coordinator
from fakes import FakeEngine
from flashfleet import Client
from flashfleet.auth import load_api_keys, load_join_token
from flashfleet.errors import Unauthenticated
from flashfleet.requests import build_request
from flashfleet.v1 import coordinator_pb2, coordinator_pb2_grpc, worker_pb2, worker_pb2_grpc
from harness import LoopThread, start_cluster

KEY = "sk-test-right-key"
TOKEN = "join-test-token"


@pytest.fixture
def secured():
    engine = FakeEngine()
    cluster = start_cluster({"w1": engine}, http_port=0, api_keys=(KEY, "sk-other"), join_token=TOKEN)
    yield cluster, engine
    cluster.close()


def http(cluster, path: str, body: dict | None = None, key: str | None = None):
    """(status, parsed JSON body) of a GET (body None) or POST to the HTTP API."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(cluster.coordinator.http_url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_grpc_call_without_the_right_key_is_unauthenticated_and_reaches_no_worker(secured, key, monkeypatch):
    cluster, engine = secured
    monkeypatch.delenv("FLASHFLEET_API_KEY", raising=False)
    with Client(cluster.address, api_key=key) as client:
        with pytest.raises(Unauthenticated, match="missing or wrong API key"):
            client.complete("fake-model", "hello", max_tokens=3)
        with pytest.raises(Unauthenticated):
            client.list_models()
    assert engine.submitted == []


def test_grpc_call_with_a_right_key_works(secured, monkeypatch):
    cluster, engine = secured
    monkeypatch.delenv("FLASHFLEET_API_KEY", raising=False)
    with Client(cluster.address, api_key=KEY) as client:
        assert client.complete("fake-model", "hello", max_tokens=3).text
    assert len(engine.submitted) == 1
    monkeypatch.setenv("FLASHFLEET_API_KEY", "sk-other")  # the second key, from the environment
    with Client(cluster.address) as client:
        assert [m.info.name for m in client.list_models()] == ["fake-model"]


def test_health_stays_open_with_keys(secured):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    cluster, _ = secured
    with grpc.insecure_channel(cluster.address) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_http_request_without_the_right_key_is_401_and_reaches_no_worker(secured, key):
    cluster, engine = secured
    status, body = http(cluster, "/v1/completions", {"model": "fake-model", "prompt": "hi", "max_tokens": 3}, key)
    assert status == 401
    assert body["error"]["code"] == "invalid_api_key"
    assert body["error"]["message"] == "missing or wrong API key"
    assert http(cluster, "/v1/models", key=key)[0] == 401
    assert engine.submitted == []


def test_http_request_with_a_right_key_works(secured):
    cluster, engine = secured
    status, body = http(cluster, "/v1/completions", {"model": "fake-model", "prompt": "hi", "max_tokens": 3}, KEY)
    assert status == 200, body
    assert body["choices"][0]["text"]
    assert len(engine.submitted) == 1


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_a_worker_without_the_join_token_cannot_register(secured, token):
    cluster, _ = secured
    metadata = () if token is None else (("x-flashfleet-join-token", token),)
    with grpc.insecure_channel(cluster.address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            worker_pb2_grpc.RegistryStub(ch).Register(
                worker_pb2.RegisterRequest(worker_id="intruder", address="127.0.0.1:1"), metadata=metadata, timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # a whole worker with the wrong token keeps retrying and never joins
    cluster.add_worker(FakeEngine(), "w-bad", wait=False, join_token="wrong-token")
    time.sleep(1.0)
    assert sorted(w.worker_id for w in cluster.coordinator.registry.live()) == ["w1"]


def test_a_direct_worker_call_needs_the_join_token(secured):
    cluster, engine = secured
    worker = cluster.workers[0]
    request = build_request("fake-model", "hello", max_tokens=3)
    with grpc.insecure_channel(f"127.0.0.1:{worker.port}") as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request, timeout=5))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert engine.submitted == []
        answers = list(stub.Generate(request, timeout=5, metadata=(("x-flashfleet-join-token", TOKEN),)))
    assert answers[-1].WhichOneof("kind") == "complete"
    assert len(engine.submitted) == 1


def test_nothing_configured_everything_works_as_before(monkeypatch):
    monkeypatch.delenv("FLASHFLEET_API_KEY", raising=False)
    engine = FakeEngine()
    cluster = start_cluster({"w1": engine}, http_port=0)
    try:
        with Client(cluster.address) as client:
            assert client.complete("fake-model", "hello", max_tokens=3).text
        assert http(cluster, "/v1/models")[0] == 200
        with grpc.insecure_channel(f"127.0.0.1:{cluster.workers[0].port}") as ch:
            answers = list(worker_pb2_grpc.WorkerStub(ch).Generate(build_request("fake-model", "hi", max_tokens=2),
                                                                   timeout=5))
        assert answers[-1].WhichOneof("kind") == "complete"
        with grpc.insecure_channel(cluster.address) as ch:
            status = coordinator_pb2_grpc.CoordinatorStub(ch).GetClusterStatus(
                coordinator_pb2.GetClusterStatusRequest(), timeout=5)
        assert [w.worker_id for w in status.workers] == ["w1"]
    finally:
        cluster.close()


def test_secrets_files_and_environment(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# clients\nsk-a\n\nsk-b  # the batch jobs\nsk-ops admin  # the operators\n")
    assert load_api_keys(keys, env={"FLASHFLEET_COORDINATOR_API_KEYS": "sk-c, sk-a"}) == {
        "sk-a": "client", "sk-b": "client", "sk-ops": "admin", "sk-c": "client"}
    assert load_api_keys(None, env={"FLASHFLEET_COORDINATOR_API_KEYS": "sk-d admin"}) == {"sk-d": "admin"}
    assert load_api_keys(None, env={}) == {}
    assert load_api_keys(None, env={"FLASHFLEET_API_KEY": "sk-client"}) == {}  # the client's variable
    for bad in ("sk-e root", "sk-e admin extra"):
        (tmp_path / "bad").write_text(bad + "\n")
        with pytest.raises(ValueError) as e:
            load_api_keys(tmp_path / "bad", env={})
        assert "sk-e" not in str(e.value)  # a key never appears in a message
    token = tmp_path / "token"
    token.write_text("# join token\ns3cret\n")
    assert load_join_token(token, env={"FLASHFLEET_JOIN_TOKEN": "other"}) == "s3cret"
    assert load_join_token(None, env={"FLASHFLEET_JOIN_TOKEN": "other"}) == "other"
    assert load_join_token(None, env={}) is None
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ValueError):
        load_join_token(tmp_path / "empty")


@pytest.mark.parametrize("host, keys, token, warned", [
    ("0.0.0.0", (), None, {"neither API keys nor TLS", "no join token"}),
    ("0.0.0.0", (KEY,), None, {"no join token"}),
    ("0.0.0.0", (KEY,), TOKEN, set()),
    ("127.0.0.1", (), None, set())])
def test_warnings_when_listening_beyond_loopback_unprotected(host, keys, token, warned, caplog):
    """A coordinator says at start which protections are on, and warns on a non-loopback host
    about missing keys (with no TLS) and a missing join token; no secret is ever logged."""
    loop = LoopThread()
    try:
        with caplog.at_level(logging.INFO, logger="flashfleet.coordinator"):
            running = loop.run(start_coordinator(CoordinatorConfig(host=host, port=0, api_keys=keys,
                                                                   join_token=token)))
            loop.run(running.stop(grace_s=0.1))
    finally:
        loop.close()
    messages = [r.getMessage() for r in caplog.records]
    assert {w for w in ("neither API keys nor TLS", "no join token") if any(w in m for m in messages)} == warned
    summary = [m for m in messages if m.startswith("access control:")]
    assert summary == [f"access control: API keys {'on (1 key)' if keys else 'off'}, "
                       f"join token {'on' if token else 'off'}, TLS off"]
    assert not any(KEY in m or TOKEN in m for m in messages)


def test_cluster_config_passes_the_secrets_files_to_coordinator_and_workers(tmp_path, monkeypatch):
    from coordinator.__main__ import parse_args
    from flashfleet.cli.up import LocalCluster
    from flashfleet.config import load_cluster_config

    monkeypatch.delenv("FLASHFLEET_API_KEY", raising=False)
    monkeypatch.delenv("FLASHFLEET_COORDINATOR_API_KEYS", raising=False)
    (tmp_path / "keys").write_text("# keys\nsk-first\nsk-second\n")
    (tmp_path / "token").write_text("tok\n")
    cfg_path = tmp_path / "cluster.toml"
    cfg_path.write_text(f'[coordinator]\napi_keys_file = "{tmp_path / "keys"}"\n'
                        f'join_token_file = "{tmp_path / "token"}"\n\n'
                        '[[models]]\nname = "m"\npath = "/nonexistent"\n\n[[workers]]\nid = "w1"\nmodel = "m"\n')
    a = parse_args(["--config", str(cfg_path)])
    assert (a.api_keys_file, a.join_token_file) == (str(tmp_path / "keys"), str(tmp_path / "token"))
    assert parse_args(["--config", str(cfg_path), "--api-keys-file", "other"]).api_keys_file == "other"
    cfg = load_cluster_config(cfg_path)
    assert cfg.worker_settings(cfg.worker("w1"))["join_token_file"] == str(tmp_path / "token")
    local = LocalCluster(config=cfg_path, workers=1, port=1, log_dir=tmp_path / "logs")
    assert local.readiness_key() == "sk-first"  # what `flashfleet up` checks readiness with
    monkeypatch.setenv("FLASHFLEET_API_KEY", "sk-env")  # the shell's key: maybe another cluster's
    assert local.readiness_key() == "sk-first"


def test_up_passes_the_secrets_files_to_the_coordinator_and_its_workers(tmp_path, monkeypatch):
    """`flashfleet up --api-keys-file K --join-token-file T`: the coordinator gets both, every
    worker the join token, and the readiness check sends the first key of K."""
    from flashfleet.cli import up

    monkeypatch.delenv("FLASHFLEET_API_KEY", raising=False)
    (tmp_path / "keys").write_text("sk-up\n")
    (tmp_path / "token").write_text("tok\n")
    spawned, keys_sent = [], []
    monkeypatch.setattr(up.subprocess, "Popen", lambda argv, **kw: spawned.append(argv))

    def wait_ready(self, timeout_s, progress, should_stop):
        keys_sent.append(self.readiness_key())

    monkeypatch.setattr(up.LocalCluster, "_wait_ready", wait_ready)
    up.LocalCluster(workers=2, port=1, log_dir=tmp_path / "logs", api_keys_file=tmp_path / "keys",
                    join_token_file=tmp_path / "token").start(progress=lambda line: None)
    monkeypatch.undo()
    coordinator = next(a for a in spawned if a[3] == "coordinator")
    workers = [a for a in spawned if a[3] == "worker"]
    flag = lambda argv, name: argv[argv.index(name) + 1]  # noqa: E731
    assert flag(coordinator, "--api-keys-file") == str(tmp_path / "keys")
    assert flag(coordinator, "--join-token-file") == str(tmp_path / "token")
    assert len(workers) == 2 and all(flag(w, "--join-token-file") == str(tmp_path / "token") for w in workers)
    assert not any("--api-keys-file" in w for w in workers)
    assert keys_sent == ["sk-up"]


def test_up_help_names_the_access_control_flags(capsys):
    from flashfleet.cli.up import main as up_main

    with pytest.raises(SystemExit):
        up_main(["--help"])
    out = capsys.readouterr().out
    assert "--api-keys-file" in out and "--join-token-file" in out and "FLASHFLEET_API_KEY" in out


ADMIN = "sk-test-admin-key"


@pytest.fixture
def with_admin():
    engine = FakeEngine()
    cluster = start_cluster({"w1": engine}, http_port=0, api_keys=(KEY, ADMIN), admin_keys=(ADMIN,))
    yield cluster, engine
    cluster.close()


def test_drain_and_move_need_an_admin_key(with_admin, monkeypatch):
    from flashfleet.errors import FailedPrecondition, ModelNotFound, PermissionDenied

    cluster, _ = with_admin
    monkeypatch.delenv("FLASHFLEET_API_KEY", raising=False)
    with Client(cluster.address, api_key=KEY) as client:
        assert client.complete("fake-model", "hello", max_tokens=3).text  # a client key serves requests
        with pytest.raises(PermissionDenied, match="DrainWorker needs an API key with the admin role"):
            list(client.drain_worker("w1", timeout_s=5))
        with pytest.raises(PermissionDenied, match="MoveSession needs an API key with the admin role"):
            client.move_session("no-such-request", timeout_s=5)
    assert cluster.coordinator.registry.get("w1").draining is False
    with Client(cluster.address, api_key=ADMIN) as client:
        # Past the key check, the servicer answers: the last worker of its model cannot drain.
        with pytest.raises(FailedPrecondition, match="last live worker"):
            list(client.drain_worker("w1", timeout_s=5))
        with pytest.raises(ModelNotFound, match="no request 'no-such-request' is streaming"):
            client.move_session("no-such-request", timeout_s=5)
        assert client.complete("fake-model", "hello", max_tokens=3).text  # an admin key serves requests too


@pytest.mark.parametrize("variant", [KEY[:-1], KEY + "x", "x" + KEY, KEY[1:], KEY.upper(), f" {KEY}x",
                                     ADMIN[:-1], ADMIN + "!"])
def test_a_keys_prefix_or_suffix_is_never_accepted(with_admin, variant, monkeypatch):
    from flashfleet.auth import matches

    cluster, engine = with_admin
    monkeypatch.delenv("FLASHFLEET_API_KEY", raising=False)
    assert not matches(variant, (KEY, ADMIN))
    with Client(cluster.address, api_key=variant) as client:
        with pytest.raises(Unauthenticated):
            client.complete("fake-model", "hello", max_tokens=3)
        with pytest.raises(Unauthenticated):
            list(client.drain_worker("w1", timeout_s=5))
    assert http(cluster, "/v1/models", key=variant)[0] == 401
    assert engine.submitted == []


def test_up_reports_access_control_and_warns_beyond_loopback(tmp_path, monkeypatch):
    """`flashfleet up` prints what the coordinator's access control is (from its flags, config or
    environment) and, on a non-loopback host, a warning for each missing protection."""
    from flashfleet.cli.up import LocalCluster

    for name in ("FLASHFLEET_COORDINATOR_API_KEYS", "FLASHFLEET_JOIN_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "keys").write_text(f"{KEY}\nsk-second\n")
    (tmp_path / "token").write_text(f"{TOKEN}\n")
    local = LocalCluster(workers=1, port=1, log_dir=tmp_path / "logs")
    assert local.access_lines() == ["access control: API keys off, join token off, TLS off"]
    open_ = LocalCluster(workers=1, port=1, host="0.0.0.0", log_dir=tmp_path / "logs",
                         api_keys_file=tmp_path / "keys")
    lines = open_.access_lines()
    assert lines[0] == "access control: API keys on (2 keys), join token off, TLS off"
    assert len(lines) == 2 and lines[1].startswith("warning: no join token")
    monkeypatch.setenv("FLASHFLEET_JOIN_TOKEN", TOKEN)
    secured = open_.access_lines()
    assert secured == ["access control: API keys on (2 keys), join token on, TLS off"]
    assert not any(KEY in line or TOKEN in line for line in lines + secured)


def test_a_keys_file_with_no_key_or_a_bad_line_is_refused_by_name(tmp_path):
    """A file given for API keys that holds none would leave the coordinator open: refused. A bad
    entry is named by its file and line (or the variable and entry), never by the key."""
    (tmp_path / "empty").write_text("# keys: none yet\n\n")
    with pytest.raises(ValueError, match="empty holds no API key"):
        load_api_keys(tmp_path / "empty", env={})
    (tmp_path / "keys").write_text("# clients\nsk-good\nsk-bad superuser\n")
    with pytest.raises(ValueError) as e:
        load_api_keys(tmp_path / "keys", env={})
    assert str(e.value).startswith(f"{tmp_path / 'keys'}, line 3: unknown API key role 'superuser'")
    with pytest.raises(ValueError) as e:
        load_api_keys(None, env={"FLASHFLEET_COORDINATOR_API_KEYS": "sk-ok,sk-x y z"})
    assert str(e.value).startswith("FLASHFLEET_COORDINATOR_API_KEYS, entry 2: an API key entry is")
    assert "sk-bad" not in str(e.value) and "sk-x" not in str(e.value)


@pytest.mark.parametrize("content, error", [("", "holds no API key"), ("sk-a b c\n", "line 1: an API key entry")])
def test_up_refuses_a_bad_keys_file_before_starting_anything(tmp_path, monkeypatch, capsys, content, error):
    from flashfleet.cli import up

    monkeypatch.setattr(up.subprocess, "Popen", lambda *a, **k: pytest.fail("started a process"))
    (tmp_path / "keys").write_text(content)
    assert up.main(["--workers", "1", "--port", "0", "--log-dir", str(tmp_path / "logs"),
                    "--api-keys-file", str(tmp_path / "keys")]) == 2
    err = capsys.readouterr().err
    assert f"flashfleet up: cannot read a secrets file: {tmp_path / 'keys'}" in err and error in err


def test_up_says_how_a_client_sends_its_key(tmp_path, monkeypatch):
    """Once keys are on, `flashfleet up`'s suggested `generate` needs a key: it says which variable
    takes it and which file holds the keys, never a key; nothing to say once the shell has one."""
    from flashfleet.cli.up import LocalCluster

    for name in ("FLASHFLEET_API_KEY", "FLASHFLEET_COORDINATOR_API_KEYS"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "keys").write_text(f"{KEY}\n")
    assert LocalCluster(workers=1, port=1, log_dir=tmp_path / "logs").api_key_hint() is None
    secured = LocalCluster(workers=1, port=1, log_dir=tmp_path / "logs", api_keys_file=tmp_path / "keys")
    hint = secured.api_key_hint()
    assert f"export FLASHFLEET_API_KEY=<a key in {tmp_path / 'keys'}>" in hint and KEY not in hint
    monkeypatch.setenv("FLASHFLEET_API_KEY", KEY)
    assert secured.api_key_hint() is None


def test_client_commands_say_how_to_send_a_key(secured, monkeypatch, capsys):
    from flashfleet.cli import generate, status

    cluster, engine = secured
    monkeypatch.delenv("FLASHFLEET_API_KEY", raising=False)
    assert status.main(["--address", cluster.address]) == 1
    assert "UNAUTHENTICATED" in (err := capsys.readouterr().err) and "export FLASHFLEET_API_KEY=KEY" in err
    assert generate.main(["hi", "--address", cluster.address, "--model", "fake-model"]) == 1
    assert "export FLASHFLEET_API_KEY=KEY" in capsys.readouterr().err
    assert engine.submitted == []


def test_a_worker_refused_for_its_join_token_is_told_to_fix_the_token(caplog):
    """The registration retries say what to fix: a join token refusal names the token's flag,
    not the coordinator's address."""
    from types import SimpleNamespace

    from worker.server import _warn_while_unreachable

    refused = grpc.aio.AioRpcError(grpc.StatusCode.UNAUTHENTICATED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   details="missing or wrong join token")
    state = SimpleNamespace(seconds_since_start=0.5, outcome=SimpleNamespace(exception=lambda: refused))
    with caplog.at_level(logging.WARNING, logger="flashfleet.worker"):
        _warn_while_unreachable("10.0.0.2:50051")(state)
    [message] = [r.getMessage() for r in caplog.records]
    assert "UNAUTHENTICATED: missing or wrong join token" in message and "--join-token-file" in message
    assert "check --coordinator" not in message


def test_up_checks_readiness_with_its_coordinators_key_not_the_shells(tmp_path, monkeypatch):
    """A shell's FLASHFLEET_API_KEY left from another cluster (or an old keys file) is not one this
    coordinator accepts: `flashfleet up` asks for readiness with a key of its own keys file, so
    it is ready when its workers are, not stuck "still loading" until its timeout."""
    from flashfleet.cli.up import LocalCluster

    monkeypatch.setenv("FLASHFLEET_API_KEY", "sk-from-another-cluster")
    monkeypatch.delenv("FLASHFLEET_COORDINATOR_API_KEYS", raising=False)
    (tmp_path / "keys").write_text(f"{KEY}\n")
    cluster = start_cluster({"worker-1": FakeEngine()}, api_keys=(KEY,))
    try:
        port = int(cluster.address.rsplit(":", 1)[1])
        local = LocalCluster(port=port, workers=1, log_dir=tmp_path / "logs", api_keys_file=tmp_path / "keys")
        local.own_ids = ["worker-1"]  # as start() sets them, without spawning processes
        said = []
        local._wait_ready(10.0, said.append, lambda: False)
        assert said == [f"  1/1 workers ready: worker-1 at {cluster.workers[0].advertise_address}"]
    finally:
        cluster.close()
