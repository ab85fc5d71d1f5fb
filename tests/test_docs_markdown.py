"""Prose that Markdown would render as something else: a wrapped line that begins with `>=` becomes
a block quote (the comparison then reads as `=`, set apart from its sentence)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def quoted_comparisons(text: str) -> list[int]:
    """The line numbers of `text` that begin with `>=` outside code blocks."""
    found: list[int] = []
    fence = ""
    for number, line in enumerate(text.splitlines(), 1):
        opening = re.match(r"\s*(```+|~~~+)", line)
        if opening and (not fence or opening.group(1).startswith(fence)):
            fence = "" if fence else opening.group(1)
        elif not fence and re.match(r"\s*>\s*=", line):
            found.append(number)
    return found


def test_no_line_of_prose_begins_with_a_comparison() -> None:
    found = {
        page.relative_to(ROOT).as_posix(): lines
        for page in PAGES
        if (lines := quoted_comparisons(page.read_text()))
    }
    assert found == {}


def test_only_prose_lines_are_reported() -> None:
    text = "a wrapped sentence, at least\n>= 10x\n```text\n>= in a code block\n```\n  >= 1\n"
    assert quoted_comparisons(text) == [2, 6]
