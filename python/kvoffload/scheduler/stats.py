"""Counters of the scheduler side, for logs and vLLM's metrics."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field


@dataclass
class SchedulerStats:
    lookups: int = 0
    """Prefix lookups that reached the CPU-tier store."""
    deferred_lookups: int = 0
    """Lookups answered "retry next step" (a key still being stored, or jobs in flight)."""
    hit_tokens: int = 0
    """Tokens scheduled to be loaded instead of recomputed."""
    load_jobs: int = 0
    chunks_loaded: int = 0
    bytes_loaded: int = 0
    load_failures: int = 0
    store_jobs: int = 0
    chunks_stored: int = 0
    bytes_stored: int = 0
    store_failures: int = 0
    store_refusals: int = 0
    """Store offers the CPU tier could not take (full of pinned or pending chunks); retried."""
    secondary_lookups: int = 0
    """Lookups that went on past the CPU tier's prefix to a secondary tier (one per tier asked)."""
    secondary_promotions: int = 0
    """Promotion jobs started (hits reserved in the CPU tier, filled by the workers)."""
    secondary_promotion_refusals: int = 0
    """Secondary-tier hits not promoted: the CPU tier had no slot it could give them."""
    secondary_chunks_promoted: int = 0
    secondary_chunks_failed: int = 0
    """Promoted chunks some worker could not fill (absent, corrupt, the server down): recomputed."""
    secondary_shards_written: int = 0
    """Chunk shards (one per worker) written on to the secondary tiers (once per tier)."""
    secondary_writes_dropped: int = 0
    """Chunk shards not written on: backpressure, the server down, or a failed write."""
    ignored_params: dict[str, int] = field(default_factory=dict)
    """Invalid per-request `kv_transfer_params` values ignored, by key."""

    def __getattr__(self, name: str) -> int:
        # The secondary tiers' counters were `remote_*` (a disk is a secondary tier too): the
        # old names read the new ones until the next release.
        if name.startswith("remote_") and f"secondary_{name[7:]}" in self.__dataclass_fields__:
            warnings.warn(
                f"SchedulerStats.{name} is deprecated: use secondary_{name[7:]}",
                DeprecationWarning,
                stacklevel=2,
            )
            return int(getattr(self, f"secondary_{name[7:]}"))
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
