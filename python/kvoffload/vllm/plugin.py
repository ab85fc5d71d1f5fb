"""vLLM's plugin hook (the `vllm.general_plugins` entry point in pyproject.toml): registers
`KVOffloadConnector` with vLLM's connector factory, so that `"kv_connector":
"KVOffloadConnector"` works without `kv_connector_module_path` (which keeps working). vLLM runs
general plugins in each of its processes, perhaps more than once; `VLLM_PLUGINS` can leave it
out."""

from __future__ import annotations


def register_connector() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(
            "KVOffloadConnector", "kvoffload.vllm", "KVOffloadConnector"
        )
    except ValueError:
        pass  # registered already: by an earlier call in this process
