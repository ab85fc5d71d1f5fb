"""vLLM adapters (0.32 and 0.33): the only part of kvoffload that imports vllm. One wing per way
into vLLM, each named in `--kv-transfer-config`:

- `connector/`: `KVOffloadConnector`, our connector end to end (`{"kv_connector":
  "KVOffloadConnector", "kv_connector_module_path": "kvoffload.vllm", ...}`);
- `spec/`: `KVOffloadSpec`, our manager and copy worker inside vLLM's own `OffloadingConnector`
  (`{"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"spec_name":
  "KVOffloadSpec", "spec_module_path": "kvoffload.vllm", ...}}`);
- `tiering/`: `RedisTier` (a shared Redis/Valkey tier) and `DiskTier` (a disk tier) for vLLM's own
  `TieringOffloadingSpec` (`"secondary_tiers": [{"type": "RedisTier", "module_path":
  "kvoffload.vllm", "url": ..., "namespace": ...}, {"type": "DiskTier", "module_path":
  "kvoffload.vllm", "path": ..., "capacity_bytes": ..., "namespace": ...}]`; vLLM's tiering chains
  the entries in order).

What they share: `compat` (the vLLM versions' differences), `logs`, `pinning` (how a CPU pool is
prepared).
"""

try:
    import vllm  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("kvoffload.vllm needs vLLM: pip install 'kvoffload[vllm]'") from exc

from kvoffload.vllm.compat import check_version

check_version()  # before any import of a name another vLLM version may lack

from kvoffload.vllm.connector import KVOffloadConnector, KVOffloadStats
from kvoffload.vllm.spec import KVOffloadManager, KVOffloadSpec, KVOffloadWorker
from kvoffload.vllm.tiering import DiskTier, RedisTier

__all__ = [
    "DiskTier",
    "KVOffloadConnector",
    "KVOffloadManager",
    "KVOffloadSpec",
    "KVOffloadStats",
    "KVOffloadWorker",
    "RedisTier",
]
