"""The two seams' `--kv-transfer-config`, as the suite and the benchmark start them."""

from __future__ import annotations

from typing import Any

MIB = 1 << 20


def ours(cpu_bytes_to_use: int = 64 * MIB, **extra: Any) -> dict[str, Any]:
    """`KVOffloadConnector`, the shipped defaults but for the keys given."""
    return {
        "kv_connector": "KVOffloadConnector",
        "kv_connector_module_path": "kvoffload.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes_to_use, **extra},
    }


def spec(cpu_bytes_to_use: int = 64 * MIB, **extra: Any) -> dict[str, Any]:
    """`KVOffloadSpec` inside vLLM's `OffloadingConnector`."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "KVOffloadSpec",
            "spec_module_path": "kvoffload.vllm",
            "cpu_bytes_to_use": cpu_bytes_to_use,
            **extra,
        },
    }
