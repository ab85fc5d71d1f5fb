"""The disk tier (local NVMe or a shared filesystem) behind the CPU tier: engine-agnostic.

`DiskTierConfig` reads a `secondary_tiers` entry and `DiskClient` runs store and load jobs on the
Rust data path (`rust/kvoffload-disk`): one checked file per chunk, written atomically, with an
index that answers lookups without I/O and holds `capacity_bytes`. The vLLM seam is
`kvoffload.vllm.DiskTier` (vLLM's tiering).
"""

from kvoffload.disk.client import DiskClient
from kvoffload.disk.config import DiskTierConfig

__all__ = ["DiskClient", "DiskTierConfig"]
