"""What crosses between vLLM's scheduler process and its workers each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvoffload.scheduler import LoadJob, StoreJob


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


@dataclass
class KVOffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers → scheduler: jobs finished since the last step, `job_id -> (workers, ok)`;
    vLLM merges the workers' objects with `aggregate`."""

    results: dict[int, tuple[int, bool]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVOffloadWorkerMetadata:
        """Both objects' reports: counts add up, a job is ok only if every report says so."""
        assert isinstance(other, KVOffloadWorkerMetadata)
        merged = dict(self.results)
        for job_id, (count, ok) in other.results.items():
            seen, all_ok = merged.get(job_id, (0, True))
            merged[job_id] = (seen + count, all_ok and ok)
        return KVOffloadWorkerMetadata(merged)
