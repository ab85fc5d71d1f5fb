"""vLLM 0.33 adapters: the only part of kvoffload that imports vllm.

`KVOffloadConnector` is vLLM's `--kv-transfer-config` entry point:
`{"kv_connector": "KVOffloadConnector", "kv_connector_module_path": "kvoffload.vllm", ...}`.
"""

try:
    import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("kvoffload.vllm needs vLLM 0.33: pip install 'kvoffload[vllm]'") from exc

from kvoffload.vllm.connector import KVOffloadConnector
from kvoffload.vllm.stats import KVOffloadStats

__all__ = ["KVOffloadConnector", "KVOffloadStats"]
