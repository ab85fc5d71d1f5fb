"""`"kv_connector": "KVOffloadConnector"` without `kv_connector_module_path`: vLLM loads our
plugin (the installed package's `vllm.general_plugins` entry point) as an engine starts, and its
own factory then finds the connector. In a fresh process, as an engine's is."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.plugins import load_general_plugins

from kvoffload.vllm.plugin import register_connector

config = KVTransferConfig(kv_connector="KVOffloadConnector", kv_role="kv_both")

def find(when):
    try:
        cls = KVConnectorFactory.get_connector_class(config)
        print(when, cls.__module__, cls.__name__)
    except ValueError as exc:
        print(when, exc)

find("before:")
load_general_plugins()
find("after:")
register_connector()  # vLLM runs plugins in each of its processes, maybe more than once
find("again:")
"""


def run(**env: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [line for line in done.stdout.splitlines() if line.endswith("KVOffloadConnector")]


def test_vllm_finds_the_connector_by_name_once_it_loads_its_plugins():
    assert run() == [
        "before: Unsupported connector type: KVOffloadConnector",
        "after: kvoffload.vllm.connector.connector KVOffloadConnector",
        "again: kvoffload.vllm.connector.connector KVOffloadConnector",
    ]


def test_an_allowlist_without_it_leaves_it_out():
    """vLLM's `VLLM_PLUGINS` names the plugins it loads: without ours, the module path it is."""
    assert run(VLLM_PLUGINS="someone-else")[:2] == [
        "before: Unsupported connector type: KVOffloadConnector",
        "after: Unsupported connector type: KVOffloadConnector",
    ]


def test_a_factory_it_cannot_use_stops_nothing(monkeypatch, caplog):
    """Another vLLM's factory (a fake: the installed one takes the call) is one warning."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvoffload.vllm.plugin import register_connector

    def changed(name: str) -> None:
        raise TypeError("register_connector() missing 2 required positional arguments")

    monkeypatch.setattr(KVConnectorFactory, "register_connector", changed)
    register_connector()
    assert "could not register KVOffloadConnector" in caplog.text
    assert '"kv_connector_module_path": "kvoffload.vllm"' in caplog.text
