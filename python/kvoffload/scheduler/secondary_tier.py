"""`SecondaryTier`: the scheduler's half of one secondary tier behind the CPU tier (a Redis
tier, or a disk); a chain of them is asked in order.

A lookup that runs past the CPU tier's ready prefix asks the tier, without blocking
(`RedisLookups`: "ask again" until the server has answered; `DiskLookups`: at once). The leading
run of hits is promoted: reserved as pending CPU-tier entries (neither evictable nor loadable) that
the workers fill, each its own shard; the request asks again until they are ready and then loads
them as any CPU hit, so every seed control and the load path stay those of the CPU tier. A chunk
that arrived on every worker becomes ready; one that did not is dropped and counts as a miss of
that tier from then on. Chunks whose CPU-tier store completed are written on (cascaded), held in
the CPU tier (`CpuStore.hold_for_write`: not evictable, yet not a load in flight) until every
worker's write has ended, so no slot is reused while a write reads it.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from kvoffload.scheduler.jobs import TierJob
from kvoffload.scheduler.stats import SchedulerStats
from kvoffload.store import CpuStore, KeyList, KeyStatus, StoreEvent
from kvoffload.tiers.announced import Announced
from kvoffload.tiers.kind import Lookups

_READY = int(KeyStatus.READY)  # an enum member read per key costs more than the comparison


@dataclass(frozen=True)
class TierLink:
    """One secondary tier as the scheduler sees it: its lookups, and the medium and locality a
    request's `kv_load_tiers` filters by."""

    lookups: Lookups
    locality: str = "REMOTE"
    medium: str = "STORAGE"
    writable: bool = True
    """False: a tier only read from (a directory shipped read-only): nothing is written to it."""
    sees_evictions: bool = True
    """Its workers report what their eviction removed (a disk does; Redis evicts unseen)."""


@dataclass
class _Job:
    keys: KeyList
    reports: int = 0
    ok: np.ndarray | None = None
    """Per key, 1 while every worker that reported has it (promoted, or in the tier)."""

    def report(self, reports: int, ok: bytes) -> None:
        mask = np.frombuffer(ok, dtype=np.uint8)
        self.ok = mask.copy() if self.ok is None else np.minimum(self.ok, mask)
        self.reports += reports


class SecondaryTier:
    """`world_size` workers each read their shard of every chunk, and `writers` of them (default:
    all; one per pipeline stage where every TP rank holds the same bytes, as with MLA) write it;
    a job ends once all of them have reported it. Writes go out behind the CPU tier in store
    order, at most `max_cascade_slots` chunks held at a time (default: half the tier), so a slow
    server never fills the CPU tier with holds: the rest wait in a backlog of at most
    `num_slots` keys, and a chunk evicted from the CPU tier before its turn, or pushed out of a
    full backlog, is not written (counted in `secondary_writes_dropped`); GPU stores are never held
    back. In a chain, `tier` is its place (0: right behind the CPU tier), `job_ids` the chain's
    one counter, so that a job id names one job of one tier, and `share` the number of tiers:
    each holds at most its share of the default budget, so that together they never hold more
    than half the tier (each its own, so a slow tier never holds back a fast one's writes)."""

    def __init__(
        self,
        store: CpuStore,
        lookups: Lookups,
        stats: SchedulerStats,
        *,
        world_size: int,
        writers: int | None = None,
        medium: str = "STORAGE",
        locality: str = "REMOTE",
        writable: bool = True,
        sees_evictions: bool = True,
        max_cascade_slots: int | None = None,
        tier: int = 0,
        job_ids: Iterator[int] | None = None,
        share: int = 1,
    ) -> None:
        self.store = store
        self.lookups = lookups
        self.tier = tier
        self._job_ids = itertools.count() if job_ids is None else job_ids
        self._share = share
        self.above: tuple[SecondaryTier, ...] = ()
        """The tiers before it in the chain: what it promotes is written to them on its way up
        (a chunk found in Redis reaches the disk in front of it)."""
        self.world_size = world_size
        self.writers = world_size if writers is None else writers
        self.medium = medium
        self.locality = locality
        self.writable = writable
        self._max_cascade_slots = max_cascade_slots
        self._stats = stats
        self._promotions: dict[int, _Job] = {}
        self._cascades: dict[int, _Job] = {}
        self._cascading_slots = 0
        self._backlog: deque[bytes] = deque()
        self._new_promotions: list[TierJob] = []
        self._new_cascades: list[TierJob] = []
        # Recorded only where the store records its own (nobody drains them otherwise).
        self._events: list[StoreEvent] | None = [] if store.enable_events else None
        # Its KV events follow each chunk where this engine sees all that happens to it.
        self._announced: Announced[bytes] = Announced(locality == "LOCAL" and sees_evictions)
        self._told_missing: dict[str, bytes] = {}
        """Request -> the key its lookups last found absent (withdrawn once, not per step)."""

    @property
    def max_cascade_slots(self) -> int:
        """Its share of half the usable tier by default (it follows a tier that is still
        growing)."""
        if self._max_cascade_slots is not None:
            return self._max_cascade_slots
        return max(1, self.store.usable_slots // 2 // self._share)

    def owns(self, job_id: int) -> bool:
        """Whether `job_id` is one of this tier's jobs still open."""
        return job_id in self._promotions or job_id in self._cascades

    def promote(
        self, request_id: str, keys: KeyList, first: int, start: int, end: int, rank: int
    ) -> bool:
        """Looks `keys[start:end]` up in the tier (the CPU tier has `keys[first:start]`
        ready and not `keys[start]`) and promotes its leading run of hits. True: ask again (a
        promotion started, or an answer is still out); False: the tier adds nothing now."""
        if self.lookups.down:
            return False  # a miss at once, not a step's wait for a check that fails anyway
        found, waiting = self.lookups.lookup_prefix(keys.view(start, end), request_id)
        self._stats.secondary_lookups += 1
        if self._events is not None and not waiting and start + found < end:
            self._found_missing(request_id, keys[start + found])
        if not found:
            return waiting
        # The CPU prefix is part of the batch so that making room never evicts it.
        plan = self.store.prepare_store(
            keys.view(first, start + found), rank=rank, first_position=first, partial=True
        )
        if plan is None or not plan.keys:
            self._stats.secondary_promotion_refusals += 1
            return waiting
        assert isinstance(plan.keys, KeyList)
        self._new_promotions.append(self._open(self._promotions, plan.keys, plan.slots))
        self._stats.secondary_promotions += 1
        return True

    def promoted(self, job_id: int, reports: int, ok: bytes) -> None:
        """`reports` more workers ended promotion `job_id`; `ok[i]` is 1 where all of them
        filled key `i`."""
        job = self._promotions[job_id]
        job.report(reports, ok)
        if job.reports < self.world_size:
            return
        del self._promotions[job_id]
        assert job.ok is not None
        if job.ok.all():
            self.store.complete_store(job.keys, True)
            self._stats.secondary_chunks_promoted += len(job.keys)
            for tier in self.above:
                tier.stored(job.keys)
            self._found(job.keys)
            return
        keys = job.keys.to_list()
        arrived = [k for k, good in zip(keys, job.ok, strict=True) if good]
        failed = [k for k, good in zip(keys, job.ok, strict=True) if not good]
        if arrived:
            self.store.complete_store(arrived, True)
            for tier in self.above:
                tier.stored(KeyList(arrived))
            self._found(KeyList(arrived))
        if failed:
            self.store.complete_store(failed, False)
            self.lookups.mark_miss(failed)
            # This engine treats them as gone from the tier (a miss for a while): say so.
            self._event("removed", failed)
        self._stats.secondary_chunks_promoted += len(arrived)
        self._stats.secondary_chunks_failed += len(failed)

    def stored(self, keys: KeyList) -> None:
        """A CPU-tier store of `keys` completed: they are written on, in order, as the budget
        allows (held at once, so no eviction can come between); never to a tier only read."""
        if not self.writable:
            return
        fits = self._cascading_slots + len(keys) <= self.max_cascade_slots
        # The common case, in two calls: nothing waits, the whole store fits the budget, and
        # every key is still there (a cache reset during its store leaves it absent).
        if not self._backlog and fits and bool((self.store.lookup(keys) == _READY).all()):
            slots = self.store.hold_for_write(keys)
            self._cascading_slots += len(keys)
            self._new_cascades.append(self._open(self._cascades, keys, slots))
            return
        self._backlog.extend(keys.to_list())
        overflow = len(self._backlog) - self.store.num_slots
        for _ in range(max(0, overflow)):
            self._backlog.popleft()
        self._stats.secondary_writes_dropped += max(0, overflow) * self.writers
        self._drain_backlog()

    def cascaded(self, job_id: int, reports: int, written: int, in_tier: bytes) -> None:
        """`reports` more writers ended cascade `job_id`, having written `written` shards (or
        found them there); `in_tier[i]` is 1 where each of them has key `i` in the tier (the
        others: the server down, a failed write)."""
        job = self._cascades[job_id]
        job.report(reports, in_tier)
        self._stats.secondary_shards_written += written
        self._stats.secondary_writes_dropped += reports * len(job.keys) - written
        if job.reports < self.writers:
            return
        del self._cascades[job_id]
        assert job.ok is not None
        # Per key in Python only when some write failed (a job's keys go to Rust as one batch).
        written_on: KeyList | list[bytes] = job.keys
        if not job.ok.all():
            keys = job.keys.to_list()
            written_on = [k for k, good in zip(keys, job.ok, strict=True) if good]
        gone = self._announced.take_gone(job_id)
        if gone:
            written_on = [k for k in written_on if k not in gone]
        self.lookups.mark_stored(written_on)
        if self._events is not None:
            self._event("stored", list(written_on))
        self.store.release_write(job.keys)
        self._cascading_slots -= len(job.keys)
        self._drain_backlog()

    def evicted(self, keys: list[bytes]) -> None:
        """A worker's handle on the tier evicted `keys` (removed their shards) to hold its
        capacity: misses from now on, and withdrawn."""
        if not keys:
            return
        self.lookups.forget(keys)
        if self._events is not None:
            writing = ((job_id, job.keys.to_list()) for job_id, job in self._cascades.items())
            withdrawn = self._announced.evicted(keys, writing)
            if withdrawn:
                self._events.append(StoreEvent("removed", withdrawn))

    def _found_missing(self, request_id: str, key: bytes) -> None:
        """A lookup found `key` absent. A tier that evicts unseen may hold it in a router's
        index (announced by any replica): withdrawn, once per request."""
        if self._announced.tracked or self._told_missing.get(request_id) == key:
            return
        self._told_missing[request_id] = key
        self._event("removed", [key])

    def _found(self, keys: KeyList) -> None:
        """A promotion found `keys` in the tier: announced if they were not (an earlier engine's
        chunks, or ones withdrawn while the breaker was open)."""
        if self._events is not None and self._announced.tracked:
            self._event("stored", keys.to_list())

    def _drain_backlog(self) -> None:
        """Holds the backlog's next keys that are still ready, up to the budget, as one job."""
        ready: list[bytes] = []
        while self._backlog and self._cascading_slots + len(ready) < self.max_cascade_slots:
            room = self.max_cascade_slots - self._cascading_slots - len(ready)
            batch = [self._backlog.popleft() for _ in range(min(room, len(self._backlog)))]
            status = self.store.lookup(batch)
            kept = [k for k, st in zip(batch, status.tolist(), strict=True) if st == _READY]
            self._stats.secondary_writes_dropped += (len(batch) - len(kept)) * self.writers
            ready.extend(kept)
        if not ready:
            return
        # A key twice in the backlog (stored, evicted, stored again) is written once.
        keys = KeyList(list(dict.fromkeys(ready)))
        slots = self.store.hold_for_write(keys)
        self._cascading_slots += len(keys)
        self._new_cascades.append(self._open(self._cascades, keys, slots))

    def take_jobs(self) -> tuple[list[TierJob], list[TierJob]]:
        """The promotions and cascades to hand the workers; sends this step's lookups."""
        self.lookups.flush()
        promotions, self._new_promotions = self._new_promotions, []
        cascades, self._new_cascades = self._new_cascades, []
        return promotions, cascades

    def take_events(self) -> list[StoreEvent]:
        """Oldest first (empty unless the store has `enable_events`): "stored" once every writer
        put a chunk there (or a promotion found one not announced), "removed" once a promotion of
        it failed, a lookup found it absent (a shared tier), a worker evicted it, or the tier's
        breaker opened (see `Announced`)."""
        if self._events is None:
            return []
        withdrawn = self._announced.breaker(self.lookups.down)
        if withdrawn:
            self._events.append(StoreEvent("removed", withdrawn))
        events, self._events = self._events, []
        return events

    def _event(self, kind: str, keys: list[bytes]) -> None:
        if self._events is None or not keys:
            return
        if kind == "stored":
            keys = self._announced.stored(keys)
        else:
            keys = self._announced.removed(keys)
        if keys:
            self._events.append(StoreEvent(kind, keys))

    def finish_request(self, request_id: str) -> None:
        self.lookups.cleanup(request_id)
        self._told_missing.pop(request_id, None)

    @property
    def has_work(self) -> bool:
        """Jobs not yet handed out or not yet ended, or lookups in flight."""
        return bool(
            self._promotions
            or self._cascades
            or self._new_promotions
            or self._new_cascades
            or self._backlog
            or self.lookups.in_flight()
        )

    def _open(self, jobs: dict[int, _Job], keys: KeyList, slots: np.ndarray) -> TierJob:
        job_id = next(self._job_ids)
        jobs[job_id] = _Job(keys)
        return TierJob(job_id, keys, np.asarray(slots, dtype=np.int64), self.tier)
