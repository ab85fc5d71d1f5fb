"""Every Python block of the README and of the docs site runs as pasted, so the examples cannot
rot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCKS = [
    (page.relative_to(ROOT).as_posix(), text[: m.start()].count("\n") + 2, m.group(1))
    for page in PAGES
    for text in [page.read_text()]
    for m in re.finditer(r"```python\n(.*?)```", text, re.S)
]


@pytest.mark.parametrize(
    ("page", "line", "code"), BLOCKS, ids=[f"{page}:{line}" for page, line, _ in BLOCKS]
)
def test_block_runs(page, line, code):
    if "import torch" in code:
        pytest.importorskip("torch")
    if "vllm" in code:
        pytest.importorskip("vllm")
    exec(compile(code, f"{page}:{line}", "exec"), {})


def test_there_are_blocks_to_run():
    pages = {page for page, _, _ in BLOCKS}
    assert "docs/library.md" in pages
    assert len(BLOCKS) >= 3
