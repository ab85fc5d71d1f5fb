"""`kvoffload --help` names the published documentation (the wheel ships no docs/)."""

from __future__ import annotations

import pytest

from kvoffload._docs import docs_root
from kvoffload.cli import main


def test_the_top_level_help_ends_with_the_documentation_url(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--help"]) == 0
    assert capsys.readouterr().out.rstrip().endswith(f"Documentation: {docs_root()}")
