"""`KVOffloadManager`: vLLM's `OffloadingManager` contract over our Rust `CpuStore`.

It makes the decisions vLLM 0.33's `CPUOffloadingManager` makes on the same calls (which keys are
stored where, evicted, hit; the same events) under `lru`; the per-key Python work vLLM's manager
does for its heap, ref counts and policy is one Rust call per batch here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace
from itertools import compress
from typing import cast

import numpy as np
import numpy.typing as npt
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingMetrics
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvoffload.store import CpuStore
from kvoffload.transfer.progress import PoolProgress
from kvoffload.vllm.compat import ConfigInfoMapping, failed_store_event

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Access:
    """What one request has used, for one generation of the store (vLLM's
    `_RequestCacheAccess` and its LRU request rank)."""

    owner: object
    generation: int
    rank: int | None = None
    seen: dict[bytes, int | None] = field(default_factory=dict)
    """Keys the request stored or reused, in first-use order, with their positions."""
    unpositioned: bool = False
    """Some key of `seen` has no position (vLLM then keeps first-use order at the finish)."""
    finished: bool = False
    inserted: set[bytes] = field(default_factory=set)
    """ARC only (as `reused`): keys this request stored, and ready keys it used again."""
    reused: set[bytes] = field(default_factory=set)


class KVOffloadManager(OffloadingManager):
    """The scheduler-side manager of `KVOffloadSpec`: a `CpuStore` of `num_chunks` slots, for
    keys of `num_kv_groups` KV-cache groups (the group index is a key's last 4 bytes).

    `lookup` is called by vLLM once per key: it answers from two sets mirroring the store's
    resident and pending keys, kept in step by the batch calls that change them, so that no
    lookup crosses into Rust.
    """

    def __init__(
        self,
        num_chunks: int,
        eviction_policy: str = "lru",
        *,
        enable_events: bool = False,
        num_kv_groups: int = 1,
        config_info: ConfigInfoMapping | None = None,
        progress: PoolProgress | None = None,
    ) -> None:
        """With `progress`, the workers prepare their pools in the background: the tier starts
        empty ("cannot store now") and grows to what every worker has ready."""
        self._num_chunks = num_chunks
        self._policy = eviction_policy
        self._progress = progress
        self._said_missing = False
        self._store = CpuStore(num_chunks, eviction_policy, usable_slots=self._usable())
        self._arc = eviction_policy == "arc"
        # Mirrors of the store's key states, for vLLM's per-key lookups (see the class doc).
        self._resident: set[bytes] = set()
        """Pending or ready."""
        self._pending: set[bytes] = set()
        self._generation = 0
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._allocation_sizes: list[int] = []
        self._config_info: ConfigInfoMapping = config_info or {}
        if type(num_kv_groups) is not int or num_kv_groups < 1:
            raise ValueError(f"num_kv_groups={num_kv_groups!r} is invalid; allowed: an int >= 1")
        self._num_kv_groups = num_kv_groups

    @property
    def store(self) -> CpuStore:
        return self._store

    # --- per-request state ----------------------------------------------------------------------

    def _access(self, ctx: ReqContext) -> _Access:
        state = ctx.get_state(_Access)
        if state is None or state.owner is not self or state.generation != self._generation:
            state = _Access(self, self._generation)
            ctx.set_state(state)
        return state

    def _ranked(self, keys: Sequence[bytes], positions: list[int]) -> list[int]:
        """The positions to rank `keys` by. vLLM breaks a tie between two keys of a request at
        one position (one per KV group) by key bytes, i.e. the smaller group index leaves first:
        scaling positions by the number of groups keeps that order in the rank."""
        g = self._num_kv_groups
        if g == 1:
            return positions
        return [
            p * g + g - 1 - min(int.from_bytes(k[-4:], "big"), g - 1) if p >= 0 else -1
            for k, p in zip(keys, positions, strict=True)
        ]

    def _record(self, state: _Access, keys: Sequence[bytes], positions: list[int | None]) -> None:
        """The request's first use of `keys` (at `positions`)."""
        if not keys:
            return
        if state.rank is None:  # drawn at the request's first use, as vLLM's LRU does
            state.rank = self._store.new_rank()
        state.seen.update(zip(keys, positions, strict=True))
        if None in positions:
            state.unpositioned = True

    # --- OffloadingManager ----------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._access(req_context)
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if key in self._pending:
            return LookupResult.HIT_PENDING
        return LookupResult.HIT if key in self._resident else LookupResult.MISS

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        keys = list(keys)
        state = self._access(req_context)
        position_of = _position_getter(req_context)
        seen = state.seen
        if seen.keys().isdisjoint(keys):
            found = list(map(position_of, keys))
            self._record(state, keys, found)
        else:
            fresh = [key not in seen for key in keys]
            found = [position_of(k) if f else None for k, f in zip(keys, fresh, strict=True)]
            self._record(state, list(compress(keys, fresh)), list(compress(found, fresh)))
        positions = _or_minus_one(found)
        slots = self._store.prepare_load(
            keys, rank=state.rank, positions=self._ranked(keys, positions)
        )
        if self._arc:
            state.reused.update(k for k in keys if k not in state.inserted)
        return _cpu_spec(slots)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._store.touch(list(keys))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._store.complete_load(list(keys))

    def _usable(self) -> int | None:
        # Capped: a file another engine wrote (a reused engine_id) must not pass the tier.
        return None if self._progress is None else min(self._progress.usable(), self._num_chunks)

    def _grow(self) -> None:
        store = self._store
        if self._progress is not None and store.usable_slots < store.num_slots:
            # Every worker publishes when it registers its KV caches, before the first step: a
            # rank still missing then writes another file (another host, another engine_id).
            missing = self._progress.missing_ranks()
            if missing and not self._said_missing:
                self._said_missing = True
                logger.error(
                    "kvoffload: pin_in_background=true, but workers %s report no progress to "
                    "%s: the CPU tier stays empty. KVOffloadSpec needs every worker on the "
                    "scheduler's host under the engine's own engine_id; set pin_in_background "
                    "to false (the pool is then pinned before the first step)",
                    missing,
                    self._progress.path,
                )
            usable = min(self._progress.usable(), store.num_slots)
            if usable > store.usable_slots:
                store.set_usable_slots(usable)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        self._grow()
        keys = list(keys)
        state = self._access(req_context)
        resident, pending, seen = self._resident, self._pending, state.seen
        position_of = _position_getter(req_context)
        if resident.isdisjoint(keys) and seen.keys().isdisjoint(keys):
            # The usual offer: chunks new to the tier and to the request.
            num_new = len(keys)
            found = list(map(position_of, keys))
            self._record(state, keys, found)
        else:
            # Absent keys take their position; ready keys the request has not used yet move up
            # to theirs; pending keys are not a use (as in vLLM).
            absent = [key not in resident for key in keys]
            num_new = absent.count(True)
            fresh = [
                (a or key not in pending) and key not in seen
                for key, a in zip(keys, absent, strict=True)
            ]
            found = [
                position_of(key) if a or f else None
                for key, a, f in zip(keys, absent, fresh, strict=True)
            ]
            self._record(state, list(compress(keys, fresh)), list(compress(found, fresh)))
        positions = _or_minus_one(found)
        if self._arc:  # ready keys offered again are a reuse, even when nothing can be stored
            state.reused.update(
                k for k in keys if k in resident and k not in pending and k not in state.inserted
            )
        if num_new:
            self._allocation_sizes.append(num_new)
        elif max(positions, default=-1) < 0:
            return PrepareStoreOutput([], CPULoadStoreSpec([]), [])
        plan = self._store.prepare_store(
            keys, rank=state.rank, positions=self._ranked(keys, positions)
        )
        if plan is None:
            return None
        evicted = cast("list[OffloadKey]", plan.evicted)
        resident.difference_update(evicted)
        stored = cast("list[OffloadKey]", plan.keys)  # a list, since a list was offered
        resident.update(stored)
        pending.update(stored)
        if self._arc:
            state.inserted.update(stored)
        if evicted and self._events is not None:
            self._events.append(OffloadingEvent(evicted, Medium.CPU, removed=True))
        return PrepareStoreOutput(stored, _cpu_spec(plan.slots), evicted)

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        pending = self._pending
        if not isinstance(keys, set | frozenset):
            keys = dict.fromkeys(keys)  # a key listed twice completes once
        # Keys no longer pending (the store was reset since) are skipped, as in vLLM.
        if pending.issuperset(keys):
            done = list(keys)
        else:
            done = [key for key in keys if key in pending]
        if not done:
            return
        self._store.complete_store(done, success)
        pending.difference_update(done)
        if not success:
            self._resident.difference_update(done)
        if self._events is not None:
            # A failed allocation only releases metadata: never announced as stored.
            event = (
                OffloadingEvent(done, Medium.CPU, removed=False)
                if success
                else failed_store_event(done)
            )
            if event is not None:
                self._events.append(event)

    def on_request_finished(self, req_context: ReqContext) -> None:
        state = req_context.get_state(_Access)
        if (
            state is None
            or state.owner is not self
            or state.generation != self._generation
            or state.finished
        ):
            return
        state.finished = True
        if state.unpositioned:  # positions are read at the finish in vLLM: some may be set now
            position_of = _position_getter(req_context)
            for key in state.seen:
                state.seen[key] = position_of(key)
            state.unpositioned = None in state.seen.values()
        order = _prefix_order(state.seen, not state.unpositioned, self._num_kv_groups == 1)
        if not self._arc:
            self._store.touch(order)
            return
        inserted_only = state.inserted - state.reused
        self._store.touch([k for k in order if k in inserted_only], reuse=False)
        self._store.touch([k for k in order if k in state.reused], reuse=True)

    def reset_cache(self) -> None:
        # What was announced is withdrawn (vLLM's own CPU manager leaves it to the GPU cache's
        # AllBlocksCleared, which routers read as the GPU's alone).
        ready = [key for key in self._resident if key not in self._pending]
        if ready and self._events is not None:
            self._events.append(OffloadingEvent(cast("list[OffloadKey]", ready), Medium.CPU, True))
        # vLLM's connector never completes a job from before the reset, and fences the reuse of
        # their slots itself: a new store forgets them all, slots restart at 0.
        self._store = CpuStore(self._num_chunks, self._policy, usable_slots=self._usable())
        self._resident.clear()
        self._pending.clear()
        self._generation += 1

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events is None:
            return
        events, self._events = self._events, []
        for event in events:
            if getattr(event, "metadata_only", False):
                # A retry may hold the key again by now.
                keys = [key for key in event.keys if key not in self._resident]
                if not keys:
                    continue
                event = replace(event, keys=keys)
            yield event

    def shutdown(self) -> None:
        if self._progress is not None:
            self._progress.close(unlink=True)  # whoever stops last leaves nothing in /dev/shm

    def get_stats(self) -> OffloadingConnectorStats:
        stats = OffloadingConnectorStats()
        s = self._store.stats()
        # In use = pinned by a transfer: pending stores and ready keys with loads in flight.
        usage = (s.pending + s.pinned) / self._num_chunks
        write = s.pending / self._num_chunks
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, usage)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, write)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, max(usage - write, 0.0))
        for size in self._allocation_sizes:
            stats.observe_histogram(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, size)
        self._allocation_sizes.clear()
        return stats

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        return [self._config_info]


def _position_getter(ctx: ReqContext) -> Callable[[bytes], int | None]:
    # vLLM 0.33's ReqContext keeps key positions in a dict: its `get` is one C call per key,
    # where the public accessor is a Python call (the fallback, should the dict go).
    positions = getattr(ctx, "_offload_key_positions", None)
    if isinstance(positions, dict):
        return cast("Callable[[bytes], int | None]", positions.get)
    return cast("Callable[[bytes], int | None]", ctx.get_offload_key_position)


def _or_minus_one(positions: list[int | None]) -> list[int]:
    if None not in positions:
        return cast("list[int]", positions)
    return [-1 if p is None else p for p in positions]


def _cpu_spec(slots: npt.NDArray[np.int64]) -> CPULoadStoreSpec:
    # vLLM's constructor takes any int sequence (it makes an int32 array of it).
    return CPULoadStoreSpec(cast("list[int]", slots))


def _prefix_order(
    seen: dict[bytes, int | None], all_positioned: bool, one_group: bool
) -> list[bytes]:
    """A request's keys head to tail, as vLLM orders them when the request finishes: by KV group
    (the key's last 4 bytes), each group by position, then all by position (stable); positions
    order only keys that all have one."""
    if all_positioned:
        keys = list(seen) if one_group else sorted(seen, key=lambda k: k[-4:])  # stable
        keys.sort(key=seen.__getitem__)  # type: ignore[arg-type]
        return keys
    by_group: dict[bytes, list[bytes]] = {}
    for key in seen:
        by_group.setdefault(key[-4:], []).append(key)
    out: list[bytes] = []
    for group in sorted(by_group):
        members = by_group[group]
        if all(seen[k] is not None for k in members):
            members.sort(key=seen.__getitem__)  # type: ignore[arg-type]
        out.extend(members)
    return out
