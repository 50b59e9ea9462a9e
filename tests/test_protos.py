"""The committed stubs in flashfleet/v1/ and flashfleet/etcd/ must match what grpcio-tools generates
from protos/."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_stubs_are_current(tmp_path):
    generator = _load_generator()
    fresh = generator.generate(tmp_path)
    assert fresh, "protoc generated nothing"
    fresh_rel = {str(p.relative_to(tmp_path)) for p in fresh}
    assert {rel.rsplit("/", 1)[0] for rel in fresh_rel} == set(generator.STUB_DIRS)
    for path in fresh:
        rel = str(path.relative_to(tmp_path))
        committed = ROOT / rel
        assert committed.exists(), f"{rel} missing: run python scripts/gen_protos.py"
        assert committed.read_text() == path.read_text(), (
            f"{rel} is stale against protos/: run python scripts/gen_protos.py")
    committed_rel = {str(p.relative_to(ROOT)) for d in generator.STUB_DIRS for p in (ROOT / d).glob("*_pb2*.py*")}
    stale = committed_rel - fresh_rel
    assert not stale, f"stubs without a .proto: {stale}"


def test_declared_grpcio_is_new_enough_for_the_stubs():
    # The generated *_pb2_grpc.py raise at import under a grpcio older than the grpcio-tools that
    # wrote them (seen on a machine with grpcio 1.84): the declared minimum must cover that.
    import re
    import tomllib

    from packaging.version import Version

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + project["optional-dependencies"]["server"]
    floor = {m["name"]: Version(m["v"]) for d in deps
             if (m := re.fullmatch(r"(?P<name>grpcio[a-z-]*)(>=|==)(?P<v>[0-9.]+)", d))}
    generated = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'",
                          (ROOT / "flashfleet" / "v1" / "coordinator_pb2_grpc.py").read_text())
    assert generated, "coordinator_pb2_grpc.py no longer states the grpcio it needs"
    for name in ("grpcio", "grpcio-health-checking", "grpcio-reflection"):
        assert floor[name] >= Version(generated[1]), f"pyproject.toml: {name} must be >= {generated[1]}"


def test_package_is_versioned():
    from flashfleet.v1 import common_pb2
    assert common_pb2.DESCRIPTOR.package == "flashfleet.v1"
