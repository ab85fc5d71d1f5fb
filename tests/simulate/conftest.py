from __future__ import annotations

import json

import pytest

from kvoffload.cli import main


@pytest.fixture
def run_cli(capsys):
    """Runs `kvoffload simulate ARGS --json` and returns (exit code, JSON or None, stderr)."""

    def run(*args: str, json_out: bool = True) -> tuple[int, dict | None, str]:
        code = main(["simulate", *args, *(["--json"] if json_out else [])])
        out, err = capsys.readouterr()
        return code, json.loads(out) if json_out and code != 2 else out, err

    return run
