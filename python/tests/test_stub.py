"""The typed stub (`__init__.pyi`) covers the package: every exported name, and every public
method and property of its classes."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import mstar_chunking

STUB = Path(__file__).resolve().parents[1] / "mstar_chunking" / "__init__.pyi"


def stub_names() -> tuple[set[str], dict[str, set[str]]]:
    tree = ast.parse(STUB.read_text())
    top: set[str] = set()
    members: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            top.add(node.name)
            members[node.name] = {
                n.name if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) else n.target.id  # type: ignore[union-attr]
                for n in node.body
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                or (isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name))
            }
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            top.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            top.add(node.target.id)
        elif isinstance(node, ast.ImportFrom):
            top.update(a.asname or a.name for a in node.names)
    return top, members


def test_every_exported_name_is_in_the_stub():
    top, _ = stub_names()
    missing = [n for n in mstar_chunking.__all__ if n not in top]
    assert missing == []


def test_every_public_member_of_every_class_is_in_the_stub():
    _, members = stub_names()
    for name in mstar_chunking.__all__:
        obj = getattr(mstar_chunking, name)
        if not inspect.isclass(obj) or issubclass(obj, BaseException):
            continue
        public = {m for m in dir(obj) if not m.startswith("_")} - set(dir(tuple)) - set(dir(object))
        if name == "PreparedInputs":
            public -= {"get", "items", "keys", "values"}
        missing = sorted(public - members.get(name, set()))
        assert missing == [], (name, missing)


SOURCE = STUB.with_suffix(".py")


def _defs(path: Path) -> dict[str, ast.AST]:
    """The module's functions and its classes' methods, by `name` or `Class.name` (the last of
    a name defined twice), with their docstrings' owners."""
    out: dict[str, ast.AST] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = node
        elif isinstance(node, ast.ClassDef):
            out[node.name] = node
            for n in node.body:
                if isinstance(n, ast.FunctionDef):
                    out[f"{node.name}.{n.name}"] = n
    return out


def _params(f: ast.FunctionDef) -> list[str]:
    a = f.args
    return [p.arg for p in [*a.posonlyargs, *a.args]] + [
        f"*{a.vararg.arg}" if a.vararg else ""
    ] + [p.arg for p in a.kwonlyargs] + [f"**{a.kwarg.arg}" if a.kwarg else ""]


def test_the_docstrings_have_one_source_and_the_stub_matches_its_signatures():
    # The docstrings are written once, in `__init__.py`; the stub carries only the types.
    stub, source = _defs(STUB), _defs(SOURCE)
    documented = [name for name, node in stub.items() if ast.get_docstring(node) is not None]  # type: ignore[arg-type]
    assert documented == [], f"docstrings belong in {SOURCE.name}, not the stub: {documented}"
    # Every function and method defined in Python takes the parameters its stub names.
    shared = [n for n in stub if n in source and isinstance(stub[n], ast.FunctionDef)]
    assert "ChunkingManagement.set_budgets" in shared, shared
    differ = {
        n: (_params(stub[n]), _params(source[n]))  # type: ignore[arg-type]
        for n in shared
        if _params(stub[n]) != _params(source[n])  # type: ignore[arg-type]
    }
    assert differ == {}, differ
    # And every public one the stub names is documented there.
    undocumented = [
        n for n in shared
        if not n.rsplit(".", 1)[-1].startswith("_") and ast.get_docstring(source[n]) is None  # type: ignore[arg-type]
    ]
    assert undocumented == [], undocumented
