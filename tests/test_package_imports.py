"""The flashfleet package loads its SDK names on first use, so the model fetcher and `draft train`
run where grpcio is missing or older than the generated stubs need (e.g. a GPU image with an older grpcio)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

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


SERVER_ONLY = ("mlx", "mlx_lm", "numpy", "transformers", "aiohttp", "prometheus_client", "coordinator", "worker")


def test_the_sdk_and_the_cli_load_no_server_code():
    """The SDK (`flashfleet`, `flashfleet.client`, its names), the CLI's entry point and its
    client commands, `flashfleet draft`'s and the cluster config's modules import none of the
    server's packages (tests/test_client_install.py checks the same in a venv without them)."""
    out = _run("import sys, flashfleet, flashfleet.client, flashfleet.cli, "
               "flashfleet.cli.generate, flashfleet.cli.status, flashfleet.cli.drain, flashfleet.cli.move, "
               "flashfleet.cli.up, flashfleet.cli.demo, flashfleet.cli.draft_cmd, flashfleet.config; "
               "from flashfleet import Client, AsyncClient, FlashfleetError; "
               f"print(sorted({{m for m in sys.modules if m.split('.')[0] in {SERVER_ONLY!r}}}))")
    assert out.strip() == "[]"


def test_an_unknown_name_is_an_attribute_error():
    import flashfleet

    with pytest.raises(AttributeError, match="no attribute 'Clinet'"):
        flashfleet.Clinet  # noqa: B018
    from flashfleet import Client, InvalidArgument  # the documented import still works

    assert issubclass(InvalidArgument, flashfleet.FlashfleetError) and Client is flashfleet.Client


# --------------------------------------------------------------------------- import cycles

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flashfleet", "coordinator", "worker")  # [tool.setuptools.packages.find] in pyproject.toml
SCRIPT_DIRS = ("bench", "scripts", "tests")  # flat directories: their files import each other by bare name


def _modules() -> dict[str, Path]:
    """Module name -> file: dotted names in the packages, "dir/stem" in the script directories."""
    mods = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    for d in SCRIPT_DIRS:
        for f in (ROOT / d).glob("*.py"):
            mods[f"{d}/{f.stem}"] = f
    return mods


def _imported(node: ast.AST, name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The repo modules one import statement loads: the longest module prefix of each imported
    name (`from a.b import c`: a.b.c when that is a module, else a.b); in a script directory, a
    sibling file by its bare name first."""
    if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the importing module's package
            parts = name.split(".")
            parts = parts[: len(parts) - (path.name != "__init__.py") - (node.level - 1)]
            base = ".".join(parts + ([node.module] if node.module else []))
        targets = [f"{base}.{a.name}" if base else a.name for a in node.names]
    found = set()
    for t in targets:
        if "/" in name and f"{name.split('/')[0]}/{t.split('.')[0]}" in mods:
            found.add(f"{name.split('/')[0]}/{t.split('.')[0]}")
            continue
        parts = t.split(".")
        while parts and ".".join(parts) not in mods:
            parts.pop()
        if parts:
            found.add(".".join(parts))
    return found - {name}


def _import_graph(module_level_only: bool, only: str = "") -> dict[str, set[str]]:
    """Module -> the repo modules it imports; module-level statements only (those under `if`,
    `try` and `if TYPE_CHECKING:` included), or function bodies too. `only`: modules whose name
    starts with it, and edges among them."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        if not name.startswith(only):
            continue
        edges: set[str] = set()
        stack = list(ast.iter_child_nodes(ast.parse(path.read_text(encoding="utf-8"), str(path))))
        while stack:
            node = stack.pop()
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _imported(node, name, path, mods)
            elif not (module_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))):
                stack.extend(ast.iter_child_nodes(node))
        graph[name] = {m for m in edges if m.startswith(only)}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle_and_its_members_only():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_sees_module_level_and_function_level_imports_apart():
    module_level, everything = _import_graph(True), _import_graph(False)
    # flashfleet/cli/draft_cmd.py imports the training package inside its commands only.
    assert "worker.training.train" not in module_level["flashfleet.cli.draft_cmd"]
    assert "worker.training.train" in everything["flashfleet.cli.draft_cmd"]
    assert "worker.training.sequences" in module_level["worker.training.trainer"]
    assert "tests/test_training" in module_level["tests/test_extra_data"]


def test_no_import_cycles_among_the_repos_modules():
    """Module-level imports (TYPE_CHECKING blocks too) form no cycle: each module's dependencies
    load before it, whatever is imported first."""
    assert _cycles(_import_graph(module_level_only=True)) == []


def test_no_import_cycles_in_the_training_package_even_through_function_level_imports():
    """worker.training: not even an import deferred into a function closes a cycle (shared
    pieces live in the module that owns them)."""
    assert _cycles(_import_graph(module_level_only=False, only="worker.training")) == []
