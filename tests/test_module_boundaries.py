"""A module uses only the public names of another: no `from m import _name` and no `x._name` whose
`_name` the module does not define itself (a method of its own class, a field it sets), in the
packages' code (flashfleet, coordinator, worker; generated protobuf modules excepted). A private
name is free to change with its module; what another module needs is made public, with a
docstring."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flashfleet", "coordinator", "worker")
# Underscored names that are public API of other libraries: namedtuple's methods (grpc's
# handler tuples), and mlx-lm's `TokenizerWrapper._tokenizer`, the only way to its Hugging Face
# tokenizer.
ALLOWED = {"_replace", "_asdict", "_fields", "_tokenizer"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined(tree: ast.AST) -> set[str]:
    """Private names a module defines: its functions, classes, names it binds, attributes it
    sets on anything (`self._x = ...`) and fields it declares."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            out.add(node.attr)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
    return {n for n in out if _private(n)}


def foreign_private_uses(path: Path) -> list[str]:
    """`file:line name` for each private name of another module `path` imports or reads."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    own = _defined(tree)
    rel = path.relative_to(ROOT)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found += [f"{rel}:{node.lineno} import {a.name}" for a in node.names if _private(a.name)]
        elif (isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own
              and node.attr not in ALLOWED):
            found.append(f"{rel}:{node.lineno} .{node.attr}")
    return found


def _files():
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            if not f.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                yield f


def test_no_module_uses_another_modules_private_names():
    found = [use for f in _files() for use in foreign_private_uses(f)]
    assert not found, "\n".join(found)


def test_the_checker_finds_a_foreign_private_name(tmp_path, monkeypatch):
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    f = tmp_path / "m.py"
    f.write_text("from a import _hidden, shown\n"
                 "class C:\n    def _own(self):\n        self._x = 1\n        return self._own\n"
                 "def f(draft, c):\n    c._x\n    return draft._embed(1)\n")
    assert foreign_private_uses(f) == ["m.py:1 import _hidden", "m.py:8 ._embed"]
