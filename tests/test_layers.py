"""The package's layers, read from the sources' imports (no import runs): what each folder may
depend on, so that a tier stays one room and the engine-agnostic parts stay free of vLLM."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "python" / "kvoffload"
KINDS = ("kvoffload.tiers.redis", "kvoffload.tiers.disk")


def imports(path: Path) -> set[str]:
    """Every module `path` imports, at any depth (a function's lazy import too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: a relative import"
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def sources(folder: str = "") -> list[Path]:
    return sorted((PACKAGE / folder).rglob("*.py"))


def module(path: Path) -> str:
    return ".".join(("kvoffload", *path.relative_to(PACKAGE).with_suffix("").parts))


def under(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_sources_are_found():
    assert len(sources("tiers")) >= 15
    assert "kvoffload.tiers.redis.client" in {module(p) for p in sources("tiers")}


@pytest.mark.parametrize("folder", ["tiers", "scheduler"])
def test_engine_agnostic_folders_import_neither_vllm_nor_torch(folder):
    for path in sources(folder):
        bad = {n for n in imports(path) if under(n, "vllm", "torch", "kvoffload.vllm")}
        assert not bad, f"{module(path)} imports {sorted(bad)}"


def test_only_the_vllm_adapters_import_vllm():
    for path in sources():
        if under(module(path), "kvoffload.vllm"):
            continue
        bad = {n for n in imports(path) if under(n, "vllm", "kvoffload.vllm")}
        assert not bad, f"{module(path)} imports {sorted(bad)}"


def test_tiers_import_no_scheduler_and_the_scheduler_no_tier_kind():
    for path in sources("tiers"):
        bad = {n for n in imports(path) if under(n, "kvoffload.scheduler", "kvoffload.transfer")}
        assert not bad, f"{module(path)} imports {sorted(bad)}"
    for path in sources("scheduler"):
        bad = {n for n in imports(path) if under(n, *KINDS)}
        assert not bad, f"{module(path)} imports {sorted(bad)}"


def test_a_kind_is_named_only_in_its_folder_and_its_vllm_tiering_adapter():
    """The connector asks a kind (`kvoffload.tiers.registry`); only vLLM's tiering seam, one
    adapter per kind, holds a kind's types."""
    for path in sources():
        name = module(path)
        if under(name, "kvoffload.tiers", "kvoffload.vllm.tiering"):
            continue
        bad = {n for n in imports(path) if under(n, *KINDS)}
        assert not bad, f"{name} imports {sorted(bad)}"
    for kind in KINDS:
        other = next(k for k in KINDS if k != kind)
        for path in sources(kind.removeprefix("kvoffload.").replace(".", "/")):
            bad = {n for n in imports(path) if under(n, other)}
            assert not bad, f"{module(path)} imports {sorted(bad)}"
