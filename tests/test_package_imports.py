"""The flashfleet package loads its SDK names on first use, so the model fetcher and `draft train`
run where grpcio is missing or older than the generated stubs need (e.g. a GPU image with an older grpcio)."""
from __future__ import annotations

import subprocess
import sys

import pytest


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout


def test_importing_the_package_and_its_fetcher_leaves_grpc_unloaded():
    out = _run("import sys, flashfleet, flashfleet.models.catalog, flashfleet.cli.draft_cmd; "
               "print(sorted(m for m in sys.modules if m == 'grpc' or m.startswith('flashfleet.v1')))")
    assert out.strip() == "[]"


def test_sdk_names_load_on_first_use():
    out = _run("import sys, flashfleet; c = flashfleet.Client; e = flashfleet.Overloaded; "
               "print(c.__module__, e.__module__, 'grpc' in sys.modules, 'Client' in dir(flashfleet))")
    assert out.split() == ["flashfleet.client", "flashfleet.errors", "True", "True"]


def test_an_unknown_name_is_an_attribute_error():
    import flashfleet

    with pytest.raises(AttributeError, match="no attribute 'Clinet'"):
        flashfleet.Clinet  # noqa: B018
    from flashfleet import Client, InvalidArgument  # the documented import still works

    assert issubclass(InvalidArgument, flashfleet.FlashfleetError) and Client is flashfleet.Client
