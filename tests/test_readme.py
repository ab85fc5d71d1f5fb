"""Every Python block of the README runs as pasted, so the examples cannot rot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"
BLOCKS = [
    (README.read_text()[: m.start()].count("\n") + 2, m.group(1))
    for m in re.finditer(r"```python\n(.*?)```", README.read_text(), re.S)
]


@pytest.mark.parametrize(("line", "code"), BLOCKS, ids=[f"line{line}" for line, _ in BLOCKS])
def test_readme_block_runs(line, code):
    if "import torch" in code:
        pytest.importorskip("torch")
    if "vllm" in code:
        pytest.importorskip("vllm")
    exec(compile(code, f"README.md:{line}", "exec"), {})


def test_there_are_blocks_to_run():
    assert len(BLOCKS) >= 3
