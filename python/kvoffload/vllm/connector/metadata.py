"""What crosses between vLLM's scheduler process and its workers each step."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvoffload.scheduler import LoadJob, StoreJob, TierJob


@dataclass
class KVOffloadMetadata(KVConnectorMetadata):
    """Scheduler → workers: this step's jobs (the scheduler's own picklable job objects)."""

    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)
    flush_job_ids: list[int] = field(default_factory=list)
    """Jobs of requests preempted in this step, whose GPU blocks this step may hand out: wait for
    them before its forward pass."""
    held_request_ids: list[str] = field(default_factory=list)
    """Finished requests whose GPU blocks vLLM keeps until each worker reports them in
    `finished_sending` (once their stores are done)."""
    promotions: list[TierJob] = field(default_factory=list)
    """Secondary tier -> CPU slots, each worker its own shard."""
    cascades: list[TierJob] = field(default_factory=list)
    """CPU slots -> secondary tier, each worker its own shard."""


@dataclass
class KVOffloadHandshakeMetadata(KVConnectorHandshakeMetadata):
    """Worker → scheduler once, after `register_kv_caches` and before the first step (vLLM's
    handshake): how much of this worker's CPU pool is ready, so that the first step already plans
    against it."""

    rank: int
    """The worker's place in its engine's PP x PCP x TP grid (`worker_rank`)."""
    usable_slots: int


@dataclass
class KVOffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers → scheduler: jobs finished since the last step, `job_id -> (workers, ok)`;
    vLLM merges the workers' objects with `aggregate`."""

    results: dict[int, tuple[int, bool]] = field(default_factory=dict)
    promoted: dict[int, tuple[int, bytes]] = field(default_factory=dict)
    """Promotions ended: `job_id -> (workers, per key 1 if every one of them filled it)`."""
    cascaded: dict[int, tuple[int, int, bytes]] = field(default_factory=dict)
    """Cascades ended: `job_id -> (workers, shards written or found there, per key 1 if every one
    of them has it in the tier)`."""
    usable_slots: dict[int, int] = field(default_factory=dict)
    """`rank -> slots` of a worker whose CPU pool grew (it is pinned piece by piece)."""
    tiers_down: dict[tuple[int, int], bool] = field(default_factory=dict)
    """`(rank, tier) -> down` of a worker whose secondary tier's breaker opened or closed since
    its last report (the scheduler's lookups of a disk skip it while it is down on any
    worker)."""
    evicted: dict[int, list[bytes]] = field(default_factory=dict)
    """`tier -> keys` whose shards a worker's handle evicted since its last report (a chunk is
    gone once any of its shards is)."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVOffloadWorkerMetadata:
        """Both objects' reports: counts add up, a job (a promoted key) is ok only if every
        report says so."""
        assert isinstance(other, KVOffloadWorkerMetadata)
        results = dict(self.results)
        for job_id, (count, ok) in other.results.items():
            seen, all_ok = results.get(job_id, (0, True))
            results[job_id] = (seen + count, all_ok and ok)
        promoted = dict(self.promoted)
        for job_id, (workers, filled) in other.promoted.items():
            if job_id in promoted:
                seen, mine = promoted[job_id]
                promoted[job_id] = (seen + workers, _both(mine, filled))
            else:
                promoted[job_id] = (workers, filled)
        cascaded = dict(self.cascaded)
        for job_id, (workers, written, in_tier) in other.cascaded.items():
            if job_id in cascaded:
                seen, wrote, mine = cascaded[job_id]
                cascaded[job_id] = (seen + workers, wrote + written, _both(mine, in_tier))
            else:
                cascaded[job_id] = (workers, written, in_tier)
        usable = dict(self.usable_slots)
        for rank, slots in other.usable_slots.items():
            usable[rank] = max(slots, usable.get(rank, 0))
        evicted = {tier: list(keys) for tier, keys in self.evicted.items()}
        for tier, keys in other.evicted.items():
            evicted.setdefault(tier, []).extend(keys)
        return KVOffloadWorkerMetadata(
            results, promoted, cascaded, usable, {**self.tiers_down, **other.tiers_down}, evicted
        )


def _both(a: bytes, b: bytes) -> bytes:
    """Per key, 1 only if both reports say 1: the bytes' minimum."""
    return np.minimum(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8)).tobytes()
