"""The disk kind: what the seams open on a `DiskTier` entry."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvoffload.tiers.disk.client import DiskClient
from kvoffload.tiers.disk.config import DiskTierConfig, file_bytes
from kvoffload.tiers.disk.lookups import DiskLookups
from kvoffload.tiers.disk.report import DISK_COUNTERS, DISK_GAUGES, DiskReport
from kvoffload.tiers.kind import Report

_UNBOUNDED = 1 << 60
"""The lookup index's capacity, in bytes: never reached."""


class DiskKind:
    name = "DiskTier"
    locality = "LOCAL"
    sees_evictions = True
    report = Report("disk_tiers", "kvoffload_disk_", "path", DISK_COUNTERS, DISK_GAUGES)

    def parse(self, entry: Mapping[str, Any]) -> DiskTierConfig:
        return DiskTierConfig.from_dict(entry)

    def check_shards(self, config: DiskTierConfig, num_shards: int, chunk_bytes: int) -> str | None:
        need = num_shards * file_bytes(chunk_bytes)
        if config.capacity_bytes >= need:
            return None
        return (
            f"DiskTier capacity_bytes={config.capacity_bytes} holds no chunk: it is split over "
            f"{num_shards} shard(s) of every chunk (one per worker), each needing at least one "
            f"{file_bytes(chunk_bytes)}-byte file; allowed: >= {need}"
        )

    def open_lookups(
        self, config: DiskTierConfig, digests: Sequence[bytes], chunk_bytes: int, num_shards: int
    ) -> DiskLookups:
        # A chunk's shards are written together: the first stands for all. Its index forgets
        # only what the workers report evicted (or a rescan finds gone), never by a capacity of
        # its own: it holds what they hold, so a chunk announced in KV events is a hit.
        return DiskLookups.open(config, digests[0], chunk_bytes, _UNBOUNDED)

    def open_data_path(
        self, config: DiskTierConfig, digest: bytes, chunk_bytes: int, num_shards: int
    ) -> DiskClient:
        capacity = config.shard_capacity_bytes(num_shards)
        # A worker drains its evictions every step: its scheduler withdraws them from KV events.
        return DiskClient(
            config, digest, chunk_bytes, capacity_bytes=capacity, report_evictions=True
        )

    def reporter(self, paths: Sequence[DiskClient]) -> DiskReport:
        return DiskReport(*paths)


KIND = DiskKind()
