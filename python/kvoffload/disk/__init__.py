"""The disk tier (local NVMe or a shared filesystem) behind the CPU tier: engine-agnostic.

`DiskTierConfig` reads a `secondary_tiers` entry and `DiskClient` runs store and load jobs on the
Rust data path (`rust/kvoffload-disk`): one checked file per chunk, written atomically, with an
index that answers lookups without I/O and holds `capacity_bytes`; `DiskLookups` is the
scheduler's view of it (a link of `secondary_tiers` in `OffloadScheduler`). The vLLM seams are
`kvoffload.vllm.DiskTier` (vLLM's tiering) and `KVOffloadConnector`'s `secondary_tiers`.
"""

from kvoffload.disk.client import DiskClient
from kvoffload.disk.config import DRAIN_TIMEOUT_S, DiskTierConfig, file_bytes
from kvoffload.disk.lookups import DiskLookups
from kvoffload.disk.report import DISK_COUNTERS, DISK_GAUGES, DiskReport, worst

__all__ = [
    "DISK_COUNTERS",
    "DISK_GAUGES",
    "DRAIN_TIMEOUT_S",
    "DiskClient",
    "DiskLookups",
    "DiskReport",
    "DiskTierConfig",
    "file_bytes",
    "worst",
]
