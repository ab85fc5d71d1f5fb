"""`DiskTier`: a disk tier (local NVMe, or a shared filesystem) for vLLM's
`TieringOffloadingSpec`.

vLLM loads it by module path from a `secondary_tiers` entry (`"type": "DiskTier",
"module_path": "kvoffload.vllm"`), beside or before a `RedisTier`: vLLM's tiering chains them
(CPU -> disk -> Redis). Chunks move between vLLM's CPU region and one checked file each on the
Rust data path's I/O threads, without the GIL; lookups answer from the data path's index, and
where it lacks a key (another engine's chunk written since the last rescan) say RETRY while the I/O
threads look for the files, so the scheduler thread never waits on the disk.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
)

from kvoffload.tiers.disk import (
    DISK_COUNTERS,
    DISK_GAUGES,
    KIND,
    DiskClient,
    DiskReport,
    DiskTierConfig,
)
from kvoffload.vllm.tiering.chunk_tier import ChunkTier, add_report, metric_definitions

logger = logging.getLogger(__name__)

_METRIC = "kvoffload:disk_tier_"


class DiskTier(ChunkTier):
    """A `SecondaryTierManager` on a directory; the docs' Disk tier page documents every key. A
    file that fails a check is removed and recomputed; a full filesystem drops the store."""

    kind = KIND
    _client: DiskClient
    config: DiskTierConfig

    def _open(self) -> None:
        config = self.config
        # vLLM's CPU region holds every worker's part of a chunk: one shard.
        self._client = self.kind.open_data_path(config, self._digest, self.block_size_bytes, 1)
        self._report = DiskReport(self._client)
        logger.info(
            "DiskTier %s: %d bytes, %s I/O, %d I/O threads%s",
            config.path,
            config.capacity_bytes,
            "direct" if self._client.direct else "buffered",
            config.io_threads,
            ", read-only (serves what the directory holds, writes nothing)"
            if config.read_only
            else "",
        )

    # --- lookups ---------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found, waiting = self._client.lookup_key(key, req_context.req_id)
        if found:
            return LookupResult.HIT
        return LookupResult.RETRY if waiting else LookupResult.MISS

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Nothing to do: a load that hits sets the file's time (the recency every engine sharing
        the directory evicts by)."""

    # --- jobs ------------------------------------------------------------------------------

    def _missed(self, keys: list[OffloadKey]) -> None:
        # Out of the index (vLLM's livelock guard): a miss until stored again, or until a rescan
        # lists its file again (a file a read failed on, not a damaged or missing one).
        self._client.note_missing(keys)

    def has_pending_work(self) -> bool:
        return bool(self._jobs) or self._client.probes_in_flight() > 0

    # --- per step --------------------------------------------------------------------------

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._client.flush()

    # --- metrics and lifetime --------------------------------------------------------------

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        return metric_definitions(_METRIC, DISK_COUNTERS, DISK_GAUGES)

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = OffloadingConnectorStats()
        for report in self._report.take().values():  # the one directory
            add_report(stats, _METRIC, report, DISK_GAUGES, (self.tier_type,))
        return stats

    @property
    def scanned(self) -> bool:
        """Whether what the directory held at start-up is in the index yet (until then those
        chunks are misses: the scan never delays a step)."""
        return self._client.scanned

    def stats(self) -> dict[str, int]:
        """The data path's counters (`chunks`: what its index holds)."""
        return self._client.stats()

    def shutdown(self) -> None:
        self.drain_jobs()
        self._client.close()
