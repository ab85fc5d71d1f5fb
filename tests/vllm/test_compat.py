"""The supported vLLM versions, checked once at import."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvoffload.errors import NotSupportedError
from kvoffload.vllm.compat import SUPPORTED, check_version


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0", "0.33.1.dev12+g1234abc", "0.32.3rc1"])
def test_supported_versions_pass(version: str) -> None:
    check_version(version)


@pytest.mark.parametrize("version", ["0.31.9", "0.34.0", "1.0.0", "dev"])
def test_other_versions_stop_with_the_range(version: str) -> None:
    with pytest.raises(NotSupportedError) as err:
        check_version(version)
    assert str(err.value) == (
        f"kvoffload supports vLLM >=0.32,<0.34; this environment has vLLM {version}"
    )


def test_import_stops_on_another_version() -> None:
    """What vLLM's connector loading shows: one line naming the range, before any adapter
    imports a name that version lacks."""
    code = "import vllm; vllm.__version__ = '0.35.0'; import kvoffload.vllm"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (
        "kvoffload.errors.NotSupportedError: kvoffload supports vLLM "
        f"{SUPPORTED}; this environment has vLLM 0.35.0"
    )
