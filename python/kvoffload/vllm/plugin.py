"""vLLM's plugin hook (the `vllm.general_plugins` entry point in pyproject.toml): registers
`KVOffloadConnector` with vLLM's connector factory, so that `"kv_connector":
"KVOffloadConnector"` works without `kv_connector_module_path` (which keeps working). vLLM runs
general plugins in each of its processes, perhaps more than once, whether the engine uses
kvoffload or not; `VLLM_PLUGINS` can leave it out."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def register_connector() -> None:
    # Never stops an engine: one that does not use kvoffload runs this too, under any vLLM.
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        KVConnectorFactory.register_connector(
            "KVOffloadConnector", "kvoffload.vllm", "KVOffloadConnector"
        )
    except ValueError:
        pass  # registered already: by an earlier call in this process
    except Exception as exc:
        logger.warning(
            "kvoffload: could not register KVOffloadConnector with this vLLM's connector "
            'factory (%s); name it with "kv_connector_module_path": "kvoffload.vllm"',
            exc,
        )
