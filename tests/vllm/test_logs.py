"""kvoffload's log lines reach vLLM's log: vLLM configures only its own `vllm` logger (in each
process, before it builds a connector), so our start-up lines would otherwise go unprinted."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import logging, sys
from vllm.config import LoggingConfig
from vllm.logger import configure_logging
configure_logging(LoggingConfig(log_level="INFO"))
from kvoffload.vllm.logs import log_beside_vllm
{setup}
log_beside_vllm()
logging.getLogger("kvoffload.vllm.pinning").info("kvoffload: the probe line")
logging.getLogger("kvoffload.vllm.pinning").debug("kvoffload: a debug line")
"""


def run(setup: str = "") -> str:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(setup=setup)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout + out.stderr


def test_kvoffload_info_lines_are_printed_where_vllms_are():
    out = run()
    assert "kvoffload: the probe line" in out
    assert "a debug line" not in out  # vLLM's level (INFO) holds for ours too


def test_a_logging_setup_of_the_users_own_is_left_alone():
    out = run("logging.basicConfig(level=logging.WARNING, stream=sys.stderr)")
    assert "the probe line" not in out
