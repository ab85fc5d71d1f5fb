"""`SharedTier`: the scheduler's half of a shared (remote) tier behind the CPU tier.

A lookup that runs past the CPU tier's ready prefix asks the remote tier, without blocking
(`RemoteLookups`: "ask again" until the server has answered). The leading run of remote hits is
promoted: reserved as pending CPU-tier entries (neither evictable nor loadable) that the workers
fill, each its own shard; the request asks again until they are ready and then loads them as any
CPU hit, so every seed control and the load path stay those of the CPU tier. A chunk that arrived
on every worker becomes ready; one that did not is dropped and counts as a remote miss from then
on. Chunks whose CPU-tier store completed are written on (cascaded) one step later, pinned in the
CPU tier until every worker's write has ended, so no slot is reused while a write reads it.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvoffload.scheduler.jobs import RemoteJob
from kvoffload.scheduler.stats import SchedulerStats
from kvoffload.store import CpuStore, KeyList, KeyStatus


class Lookups(Protocol):
    """What `kvoffload.remote.RemoteLookups` offers."""

    def lookup(self, key: bytes, request: Hashable) -> bool | None: ...
    def flush(self) -> None: ...
    def mark_miss(self, keys: Collection[bytes]) -> None: ...
    def cleanup(self, request: Hashable) -> None: ...
    def in_flight(self) -> int: ...


@dataclass
class _Job:
    keys: KeyList
    reports: int = 0
    ok: np.ndarray | None = None
    """Promotions: per key, 1 while every worker that reported has it."""


class SharedTier:
    """`world_size` workers each move their shard of every chunk; a job ends once all have
    reported it. `max_cascade_slots` bounds the CPU slots pinned by writes in flight: past it,
    a completed store is not written on (counted in `remote_writes_dropped`), so a slow server
    never fills the CPU tier with pins."""

    def __init__(
        self,
        store: CpuStore,
        lookups: Lookups,
        stats: SchedulerStats,
        *,
        world_size: int,
        medium: str = "STORAGE",
        locality: str = "REMOTE",
        max_cascade_slots: int | None = None,
    ) -> None:
        self.store = store
        self.lookups = lookups
        self.world_size = world_size
        self.medium = medium
        self.locality = locality
        self.max_cascade_slots = (
            store.num_slots // 2 if max_cascade_slots is None else max_cascade_slots
        )
        self._stats = stats
        self._next_id = 0
        self._promotions: dict[int, _Job] = {}
        self._cascades: dict[int, _Job] = {}
        self._cascading_slots = 0
        self._new_promotions: list[RemoteJob] = []
        self._new_cascades: list[RemoteJob] = []

    def promote(
        self, request_id: str, keys: KeyList, first: int, start: int, end: int, rank: int
    ) -> bool:
        """Looks `keys[start:end]` up in the remote tier (the CPU tier has `keys[first:start]`
        ready and not `keys[start]`) and promotes its leading run of hits. True: ask again (a
        promotion started, or an answer is still out); False: the remote tier adds nothing now."""
        found, waiting = 0, False
        for key in keys.view(start, end).to_list():
            verdict = self.lookups.lookup(key, request_id)
            if verdict is False:
                break
            if verdict is None:
                waiting = True  # keep asking: the rest of the prefix goes out in the same batch
            elif not waiting:
                found += 1
        self._stats.remote_lookups += 1
        if not found:
            return waiting
        # The CPU prefix is part of the batch so that making room never evicts it.
        plan = self.store.prepare_store(
            keys.view(first, start + found), rank=rank, first_position=first, partial=True
        )
        if plan is None or not plan.keys:
            self._stats.remote_promotion_refusals += 1
            return waiting
        assert isinstance(plan.keys, KeyList)
        self._new_promotions.append(self._open(self._promotions, plan.keys, plan.slots))
        self._stats.remote_promotions += 1
        return True

    def promoted(self, job_id: int, reports: int, ok: bytes) -> None:
        """`reports` more workers ended promotion `job_id`; `ok[i]` is 1 where all of them
        filled key `i`."""
        job = self._promotions[job_id]
        mask = np.frombuffer(ok, dtype=np.uint8)
        job.ok = mask.copy() if job.ok is None else np.minimum(job.ok, mask)
        job.reports += reports
        if job.reports < self.world_size:
            return
        del self._promotions[job_id]
        keys = job.keys.to_list()
        arrived = [k for k, good in zip(keys, job.ok, strict=True) if good]
        failed = [k for k, good in zip(keys, job.ok, strict=True) if not good]
        if arrived:
            self.store.complete_store(arrived, True)
        if failed:
            self.store.complete_store(failed, False)
            self.lookups.mark_miss(failed)
        self._stats.remote_chunks_promoted += len(arrived)
        self._stats.remote_chunks_failed += len(failed)

    def stored(self, keys: KeyList) -> None:
        """A CPU-tier store of `keys` completed: pin what is still there and write it on."""
        status = self.store.lookup(keys)
        ready = [k for k, s in zip(keys.to_list(), status, strict=True) if s == KeyStatus.READY]
        if not ready:
            return
        if self._cascading_slots + len(ready) > self.max_cascade_slots:
            self._stats.remote_writes_dropped += len(ready)
            return
        slots = self.store.prepare_load(ready)
        self._cascading_slots += len(ready)
        self._new_cascades.append(self._open(self._cascades, KeyList(ready), slots))

    def cascaded(self, job_id: int, reports: int, written: int, dropped: int) -> None:
        """`reports` more workers ended cascade `job_id`, having written `written` shards and
        not written `dropped` (backpressure, the server down, a failed write)."""
        job = self._cascades[job_id]
        job.reports += reports
        self._stats.remote_shards_written += written
        self._stats.remote_writes_dropped += dropped
        if job.reports < self.world_size:
            return
        del self._cascades[job_id]
        self.store.complete_load(job.keys)
        self._cascading_slots -= len(job.keys)

    def take_jobs(self) -> tuple[list[RemoteJob], list[RemoteJob]]:
        """The promotions and cascades to hand the workers; sends this step's remote lookups."""
        self.lookups.flush()
        promotions, self._new_promotions = self._new_promotions, []
        cascades, self._new_cascades = self._new_cascades, []
        return promotions, cascades

    def finish_request(self, request_id: str) -> None:
        self.lookups.cleanup(request_id)

    @property
    def has_work(self) -> bool:
        """Jobs not yet handed out or not yet ended, or lookups in flight."""
        return bool(
            self._promotions
            or self._cascades
            or self._new_promotions
            or self._new_cascades
            or self.lookups.in_flight()
        )

    def _open(self, jobs: dict[int, _Job], keys: KeyList, slots: np.ndarray) -> RemoteJob:
        job_id = self._next_id
        self._next_id += 1
        jobs[job_id] = _Job(keys)
        return RemoteJob(job_id, keys, np.asarray(slots, dtype=np.int64))
