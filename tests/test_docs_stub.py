"""The docs build reads python/ without importing it (mkdocs.yml: `allow_inspection: false`; the
docs venv has neither the package nor its extension), so the API reference shows a class of the
extension with the docstrings `_rust.pyi` carries: they must be there, and be the extension's."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

from kvoffload import _rust

ROOT = Path(__file__).parents[1]
STUB = ast.parse((ROOT / "python" / "kvoffload" / "_rust.pyi").read_text())
REFERENCE = (ROOT / "docs" / "reference.md").read_text()


def _stub_docs() -> dict[str, str | None]:
    docs: dict[str, str | None] = {}
    for node in STUB.body:
        if isinstance(node, ast.ClassDef):
            docs[node.name] = ast.get_docstring(node)
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    docs[f"{node.name}.{item.name}"] = ast.get_docstring(item)
    return docs


def _words(doc: str | None) -> str:
    # The stub wraps its lines to ruff's width, the Rust to rustfmt's.
    return " ".join((doc or "").split())


def _extension_classes_in_reference() -> set[str]:
    names: set[str] = set()
    for entry in re.findall(r"^::: (\S+)$", REFERENCE, re.M):
        try:
            obj = importlib.import_module(entry)
        except ModuleNotFoundError:
            module, _, attr = entry.rpartition(".")
            obj = getattr(importlib.import_module(module), attr)
        # A module entry shows its public members too.
        shown = [obj] if inspect.isclass(obj) else [getattr(obj, n) for n in dir(obj)]
        names |= {
            c.__name__ for c in shown if inspect.isclass(c) and getattr(_rust, c.__name__, 0) is c
        }
    return names


def test_every_extension_class_the_reference_shows_has_its_docstrings_in_the_stub():
    shown = _extension_classes_in_reference()
    assert {"BlockSet", "KeyList", "KVOffloadError", "InvalidStateError"} <= shown
    stub = _stub_docs()
    for name in sorted(shown):
        cls = getattr(_rust, name)
        assert _words(stub[name]) == _words(cls.__doc__), name
        for member, value in vars(cls).items():
            if not member.startswith("_") and value.__doc__:
                assert _words(stub.get(f"{name}.{member}")) == _words(value.__doc__), member


def test_every_docstring_of_the_stub_is_the_extensions():
    documented = {name: doc for name, doc in _stub_docs().items() if doc}
    assert "KeyRange" in documented
    for name, doc in documented.items():
        obj = _rust
        for part in name.split("."):
            obj = getattr(obj, part)
        assert _words(doc) == _words(obj.__doc__), name
