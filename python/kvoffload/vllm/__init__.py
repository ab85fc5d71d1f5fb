"""vLLM adapters (0.32 and 0.33): the only part of kvoffload that imports vllm.

Two seams, both named in `--kv-transfer-config`: `KVOffloadConnector` (our connector end to end:
`{"kv_connector": "KVOffloadConnector", "kv_connector_module_path": "kvoffload.vllm", ...}`) and
`KVOffloadSpec` (our manager and copy worker inside vLLM's own `OffloadingConnector`:
`{"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"spec_name":
"KVOffloadSpec", "spec_module_path": "kvoffload.vllm", ...}}`). `RedisTier` is a shared Redis/Valkey
tier for vLLM's own `TieringOffloadingSpec` (`"secondary_tiers": [{"type": "RedisTier",
"module_path": "kvoffload.vllm", "url": ..., "namespace": ...}]`), and `DiskTier` a disk tier for
it (`{"type": "DiskTier", "module_path": "kvoffload.vllm", "path": ..., "capacity_bytes": ...,
"namespace": ...}`); vLLM's tiering chains the entries in order.
"""

try:
    import vllm  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("kvoffload.vllm needs vLLM: pip install 'kvoffload[vllm]'") from exc

from kvoffload.vllm.compat import check_version

check_version()  # before any import of a name another vLLM version may lack

from kvoffload.vllm.connector import KVOffloadConnector
from kvoffload.vllm.disk_tier import DiskTier
from kvoffload.vllm.redis_tier import RedisTier
from kvoffload.vllm.spec import KVOffloadSpec
from kvoffload.vllm.spec_manager import KVOffloadManager
from kvoffload.vllm.spec_worker import KVOffloadWorker
from kvoffload.vllm.stats import KVOffloadStats

__all__ = [
    "DiskTier",
    "KVOffloadConnector",
    "KVOffloadManager",
    "KVOffloadSpec",
    "KVOffloadStats",
    "KVOffloadWorker",
    "RedisTier",
]
