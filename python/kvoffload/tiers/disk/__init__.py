"""The disk kind of secondary tier (local NVMe or a shared filesystem): engine-agnostic.

`DiskTierConfig` reads a `DiskTier` entry and `DiskClient` runs store and load jobs on the Rust
data path (`rust/kvoffload-disk`): one checked file per chunk, written atomically, with an index
that answers lookups without I/O and holds `capacity_bytes`; `DiskLookups` is the scheduler's view
of it; `DiskReport` says what each directory did, for metrics. `KIND` is what the seams open on an
entry. The vLLM seams are `kvoffload.vllm.DiskTier` (vLLM's tiering) and `KVOffloadConnector`'s
`secondary_tiers`.
"""

from kvoffload.tiers.disk.client import DiskClient
from kvoffload.tiers.disk.config import DRAIN_TIMEOUT_S, DiskTierConfig, file_bytes
from kvoffload.tiers.disk.kind import KIND
from kvoffload.tiers.disk.lookups import DiskLookups
from kvoffload.tiers.disk.report import DISK_COUNTERS, DISK_GAUGES, DiskReport

__all__ = [
    "DISK_COUNTERS",
    "DISK_GAUGES",
    "DRAIN_TIMEOUT_S",
    "KIND",
    "DiskClient",
    "DiskLookups",
    "DiskReport",
    "DiskTierConfig",
    "file_bytes",
]
