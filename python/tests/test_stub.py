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
