"""`OffloadScheduler`: per-request offload state, lookups, and store/load job planning.

Engine-agnostic: it speaks in request ids, token counts, block hashes and GPU block ids; the vLLM
adapter translates. The call order for one request:

1. `add_request` when it arrives (parses its `kv_transfer_params` caps);
2. `lookup` when the engine considers scheduling it (may repeat; pins nothing, but with a shared
   tier it may start a promotion, which reserves CPU slots);
3. `on_allocated` with its GPU block table once scheduled → the `LoadJob`, if any;
4. `plan_step` once each engine step is scheduled, before its forward pass → `StoreJob`s, and the
   in-flight jobs to wait for before the forward pass overwrites a reallocated block;
5. `complete_job` for every finished job; `preempt_request` / `finish_request` (or
   `finish_requests`) as they happen.

Between `lookup` and `on_allocated` of one request, nothing may call `plan_step`,
`finish_request` or another request's `lookup` (each can evict the chunks the lookup found to
make room for stores or promotions).
"""

from __future__ import annotations

import logging
import operator
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import numpy as np

from kvoffload import _rust
from kvoffload._rust import BlockSet
from kvoffload.scheduler.config import OffloadConfig
from kvoffload.scheduler.groups import KVGroup
from kvoffload.scheduler.hybrid import (
    NULL_BLOCK,
    GroupSlice,
    GroupState,
    HybridPlanner,
)
from kvoffload.scheduler.jobs import (
    FinishPlan,
    IntArray,
    JobResult,
    LoadJob,
    RequestUpdate,
    StateBlock,
    StepPlan,
    StoreJob,
)
from kvoffload.scheduler.params import (
    MAX_LOAD_TOKENS,
    MAX_OFFLOAD_TOKENS,
    checked_params,
    parse_load_tiers,
    parse_token_cap,
    tier_allowed,
)
from kvoffload.scheduler.shared_tier import Lookups, SharedTier
from kvoffload.scheduler.stats import SchedulerStats
from kvoffload.store import CpuStore, KeyList, KeyStatus

logger = logging.getLogger(__name__)

_GROUP_IDX = 0  # a model with one full-attention group; others are planned by HybridPlanner
_NO_BLOCKS: IntArray = np.empty(0, dtype=np.int64)
_NO_BLOCKS.flags.writeable = False
_PENDING = int(KeyStatus.PENDING)
_MAX_ID = np.iinfo(np.int64).max


def _short(values: object, shown: int = 5) -> str:
    """`values` for an error message: a long sequence shows its first items and a count."""
    try:
        items = list(values)  # type: ignore[call-overload]
    except TypeError:
        return repr(values)
    if len(items) <= shown:
        return repr(values)
    head = ", ".join(repr(v) for v in items[:shown])
    return f"[{head}, ... and {len(items) - shown} more]"


def _block_ids(name: str, values: Sequence[int] | IntArray) -> IntArray:
    """`values` as GPU block ids, or a ValueError naming `name`: every id an int >= 0."""
    if isinstance(values, (list, tuple)):
        if not values:
            return _NO_BLOCKS  # most decode steps allocate nothing
        if _rust.are_block_ids(values):
            # C-speed conversion of a list of ints (vLLM's tables).
            return np.frombuffer(array("q", values), dtype=np.int64)
        if any(isinstance(v, bool) for v in values):  # numpy would take True for 1
            raise ValueError(
                f"{name}={_short(values)} is invalid: expected a sequence of ints >= 0 "
                "(GPU block ids)"
            )
    ids = np.asarray(values)
    if ids.size == 0:
        return _NO_BLOCKS
    if (
        ids.ndim != 1
        or ids.dtype.kind not in "iu"
        or int(ids.min()) < 0
        or int(ids.max()) > _MAX_ID  # a uint64 past int64
    ):
        raise ValueError(
            f"{name}={_short(values)} is invalid: expected a sequence of ints >= 0 (GPU block ids)"
        )
    return ids.astype(np.int64, copy=False)


def _realloc_set(values: Iterable[int]) -> BlockSet:
    """`values` as a `BlockSet`, or a ValueError naming `reallocated_block_ids`."""
    blocks = BlockSet()
    blocks.add(_block_ids("reallocated_block_ids", list(values)).tolist())
    return blocks


def _block_list(name: str, values: Sequence[int] | IntArray) -> list[int]:
    """`values` as a new list of GPU block ids, or a ValueError naming `name` (`_block_ids`)."""
    if type(values) in (list, tuple) and _rust.are_block_ids(values):
        return list(values)  # vLLM's tables: a plain copy, not a round trip through numpy
    ids: list[int] = _block_ids(name, values).tolist()
    return ids


def _count(name: str, value: int) -> int:
    """`value` as a token count, or a ValueError naming `name`."""
    if type(value) is int and value >= 0:
        return value  # the usual answer, asked thousands of times a run
    if isinstance(value, bool) or not hasattr(value, "__index__") or operator.index(value) < 0:
        raise ValueError(f"{name}={value!r} is invalid: expected an int >= 0")
    return operator.index(value)


@dataclass(slots=True)
class _Request:
    request_id: str
    num_prompt_tokens: int
    max_offload_tokens: int | None
    max_load_tokens: int | None
    num_tokens: int = 0
    keys: KeyList = field(default_factory=KeyList)
    block_ids: list[int] = field(default_factory=list)
    stored_chunks: int = 0
    """Chunks `[0, stored_chunks)` were offered to the store (or loaded, or local)."""
    planned_load: tuple[int, int] | None = None
    """`(num_local_tokens, loadable_tokens)` of the last lookup."""
    jobs: set[int] = field(default_factory=set)
    finishing: bool = False
    """Its final stores are being planned (no speculative token can be rejected any more)."""
    finished: bool = False
    rank: int | None = None
    """The request's place in the store's LRU order, drawn at its first store or load."""
    load_remote: bool = True
    """Its `kv_load_tiers` let it load from the shared tier."""
    groups: list[GroupState] | None = None
    """With several KV-cache groups (or a window group): each group's keys, table and store
    frontier, in place of `keys`, `block_ids` and `stored_chunks`."""
    new_tables: bool = False
    """With `groups`: its tables were handed over since the last `plan_step` (they hold blocks
    allocated in this step, not blocks handed out again)."""


class _CheckedUpdate(NamedTuple):
    req: _Request
    computed: int
    num_tokens: int
    new_blocks: IntArray
    group_blocks: list[list[int]] | None
    """With several groups: each group's new blocks (`new_blocks` is then empty)."""
    shared_prefix_boundary: int


class _InFlight(NamedTuple):
    kind: Literal["store", "load"]
    request_id: str
    keys: KeyList
    gpu_block_ids: IntArray
    window_blocks: Sequence[int] = ()
    """With several groups: the window and state blocks a store reads. Only window and Mamba
    groups free blocks while their request still runs (and the engine may hand them out again);
    every other block a job touches is held by its request."""


class OffloadScheduler:
    def __init__(
        self,
        config: OffloadConfig,
        store: CpuStore,
        *,
        bytes_per_chunk: int = 0,
        remote: Lookups | None = None,
        world_size: int = 1,
        remote_locality: str = "REMOTE",
        groups: Sequence[KVGroup] | None = None,
        retention_interval: int | None = 0,
    ) -> None:
        """`bytes_per_chunk` (all workers together) only feeds the byte counters of the stats.
        With `remote` (a `RemoteLookups`), a shared tier of `remote_locality` stands behind the
        CPU tier, moved by `world_size` workers (see `SharedTier`).

        `groups` are the model's KV-cache groups (default: one full-attention group). With more,
        or a window group, block tables and new blocks are given per group, and
        `retention_interval` (vLLM's `prefix_cache_retention_interval`) says at which boundaries
        a sliding-window group keeps what a hit reads (`HybridPlanner`)."""
        self.config = config
        groups = None if groups is None else tuple(groups)
        # Checked with one group too: a bad value is a bad value.
        planner = HybridPlanner(
            (KVGroup(),) if groups is None else groups,
            config.tokens_per_block,
            config.blocks_per_chunk,
            retention_interval=retention_interval,
        )
        self.hybrid = None if groups in (None, (KVGroup(),)) else planner
        if self.hybrid is not None and remote is not None:
            raise ValueError(
                "a shared tier (remote) is not supported with several KV-cache groups yet"
            )
        self.store = store
        self.bytes_per_chunk = bytes_per_chunk
        self._requests: dict[str, _Request] = {}
        self._jobs: dict[int, _InFlight] = {}
        self._next_job_id = 0
        self._loads_in_flight = 0
        self._stats = SchedulerStats()
        self._tabled: set[str] = set()
        """With several groups: requests that hold block tables."""
        self.shared_tier = (
            None
            if remote is None
            else SharedTier(
                store, remote, self._stats, world_size=world_size, locality=remote_locality
            )
        )

    @classmethod
    def create(
        cls,
        config: OffloadConfig,
        bytes_per_chunk: int,
        *,
        enable_events: bool = False,
        usable_slots: int | None = None,
        remote: Lookups | None = None,
        world_size: int = 1,
        remote_locality: str = "REMOTE",
        groups: Sequence[KVGroup] | None = None,
        retention_interval: int | None = 0,
    ) -> OffloadScheduler:
        """A scheduler with its own CPU-tier store sized from `config.cpu_bytes_to_use` (with
        `usable_slots`, a store that grows as its memory gets ready: `CpuStore`)."""
        store = CpuStore(
            config.num_slots(bytes_per_chunk),
            config.eviction_policy,
            enable_events=enable_events,
            usable_slots=usable_slots,
        )
        return cls(
            config,
            store,
            bytes_per_chunk=bytes_per_chunk,
            remote=remote,
            world_size=world_size,
            remote_locality=remote_locality,
            groups=groups,
            retention_interval=retention_interval,
        )

    # --- request lifecycle -------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        num_prompt_tokens: int,
        kv_transfer_params: Mapping[str, Any] | None = None,
    ) -> None:
        """Starts tracking a request. `kv_transfer_params` that are not a mapping, and invalid
        caps or `kv_load_tiers` entries in it, are ignored with one warning each and counted in
        `stats().ignored_params`."""
        if request_id in self._requests:
            raise ValueError(f"request_id={request_id!r} is already tracked")
        num_prompt_tokens = _count("num_prompt_tokens", num_prompt_tokens)
        ignored = self._stats.ignored_params
        kv_transfer_params = checked_params(request_id, kv_transfer_params, ignored)
        self._requests[request_id] = _Request(
            request_id,
            num_prompt_tokens,
            max_offload_tokens=parse_token_cap(
                request_id, kv_transfer_params, MAX_OFFLOAD_TOKENS, ignored
            ),
            max_load_tokens=parse_token_cap(
                request_id, kv_transfer_params, MAX_LOAD_TOKENS, ignored
            ),
            num_tokens=num_prompt_tokens,
            groups=None if self.hybrid is None else self.hybrid.new_state(),
        )
        if self.shared_tier is not None:
            tiers = parse_load_tiers(request_id, kv_transfer_params, ignored)
            shared = self.shared_tier
            self._requests[request_id].load_remote = tier_allowed(
                tiers, shared.medium, shared.locality
            )

    def lookup(
        self,
        request_id: str,
        num_local_tokens: int,
        num_tokens: int,
        block_hashes: Sequence[bytes],
        *,
        read: bool = True,
    ) -> int | None:
        """Tokens beyond the `num_local_tokens` already on the GPU that can be loaded from the CPU
        tier (0 or at least one chunk), or `None`: ask again next step (a needed chunk is still
        being stored or is being loaded for another request, or the request still has jobs in
        flight from before a preemption, or the shared tier is being asked or promoting).

        A lookup that starts a promotion reserves CPU slots and may evict: the engine must call
        `on_allocated` for a request before it looks the next one up (as vLLM does).
        `read=False` (a request that must not read any cache) looks nothing up: 0, or `None`
        while its own jobs from before a preemption are in flight."""
        req = self._request(request_id)
        num_local_tokens = _count("num_local_tokens", num_local_tokens)
        num_tokens = _count("num_tokens", num_tokens)
        tpb = self.config.tokens_per_block
        if req.groups is not None and num_local_tokens % tpb:
            raise ValueError(
                f"num_local_tokens={num_local_tokens} for request {request_id!r} is invalid: "
                f"with several KV-cache groups a local prefix is whole GPU blocks (a multiple "
                f"of tokens_per_block={tpb})"
            )
        # (Re)starting at token 0: the engine hands over the whole block table in on_allocated.
        self._drop_tables(req)
        req.stored_chunks = 0
        req.planned_load = None
        req.num_tokens = num_tokens
        for state in req.groups or ():
            state.next_stored = 0
        if req.jobs:
            self._stats.deferred_lookups += 1
            return None
        self._extend_keys(req, block_hashes)
        if not read:
            return 0
        if req.groups is not None:
            return self._lookup_groups(req, num_local_tokens, num_tokens)
        tpc = self.config.tokens_per_chunk
        window = _rust.load_window(
            num_tokens, num_local_tokens, req.max_load_tokens, len(req.keys), tpc
        )
        if window is None:
            return 0
        first, end, _ = window
        self._stats.lookups += 1
        hits, pending = self.store.lookup_prefix(req.keys.view(first, end))
        if pending:
            self._stats.deferred_lookups += 1
            return None
        shared = self.shared_tier
        if shared is not None and req.load_remote and first + hits < end:
            if shared.promote(req.request_id, req.keys, first, first + hits, end, self._rank(req)):
                self._stats.deferred_lookups += 1
                return None
        loadable = _rust.loadable_tokens(window, hits, num_local_tokens, tpc)
        if loadable and self._loads_in_flight:
            # Chunks another request is loading now will be GPU prefix-cache hits once that load
            # lands: wait for it rather than copy them twice (as vLLM's connector does).
            end = -(-(num_local_tokens + loadable) // tpc)
            if self.store.first_pinned(req.keys.view(first, end)) < end - first:
                self._stats.deferred_lookups += 1
                return None
        if loadable:
            req.planned_load = (num_local_tokens, loadable)
        return loadable

    def on_allocated(
        self,
        request_id: str,
        block_ids: Sequence[int] | Sequence[Sequence[int]],
        num_external_tokens: int = 0,
    ) -> LoadJob | None:
        """The engine scheduled the request with this GPU block table (with several KV-cache
        groups, one per group) and accepted `num_external_tokens` from the last `lookup` (0, or
        all it offered). Pins the chunks and returns the load, if any.

        Raises (changing nothing) on bad arguments, and `InvalidStateError` when a chunk the
        lookup found was evicted since: the engine must then compute those tokens itself. That
        cannot happen when `lookup` and `on_allocated` run in the same step, before that step's
        `plan_step` or `finish_request` (which make room by evicting)."""
        req = self._request(request_id)
        num_external_tokens = _count("num_external_tokens", num_external_tokens)
        tables = None
        if req.groups is not None:
            tables = self._group_tables("block_ids", block_ids)
            table = _NO_BLOCKS
        else:
            table = _block_ids("block_ids", block_ids)  # type: ignore[arg-type]
        planned = req.planned_load
        if num_external_tokens == 0:
            if tables is None:
                req.block_ids = table.tolist()
            else:
                self._set_tables(req, tables)
            req.planned_load = None
            return None
        if planned is None or num_external_tokens != planned[1]:
            offered = 0 if planned is None else planned[1]
            allowed = f"0 or {offered}" if offered else "0 (it offered nothing)"
            raise ValueError(
                f"num_external_tokens={num_external_tokens} for request {request_id!r} is not "
                f"what its last lookup offered; allowed: {allowed}"
            )
        num_local, loadable = planned
        if tables is not None:
            return self._load_groups(req, tables, num_local, loadable)
        tpc, bpc = self.config.tokens_per_chunk, self.config.blocks_per_chunk
        first = num_local // tpc
        end = -(-(num_local + loadable) // tpc)
        if end * bpc > len(table):
            raise ValueError(
                f"block_ids has {len(table)} blocks for request {request_id!r}; the load of "
                f"{loadable} tokens needs {end * bpc}"
            )
        skip = (num_local - first * tpc) // self.config.tokens_per_block
        dst = table[first * bpc + skip : end * bpc]
        keys = KeyList(req.keys.view(first, end))
        # Pins, or raises with nothing pinned.
        slots = self.store.prepare_load(keys, rank=self._rank(req), first_position=first)
        if self.config.eviction_policy == "arc":
            self.store.touch(keys)  # a reuse: ARC's frequent list
        req.block_ids, req.planned_load = table.tolist(), None
        job_id = self._track("load", req, keys, dst)
        self._loads_in_flight += 1
        # Loaded chunks are in the CPU tier already; chunks before them are on the GPU.
        req.stored_chunks = max(req.stored_chunks, end)
        self._stats.load_jobs += 1
        self._stats.hit_tokens += loadable
        return LoadJob(job_id, request_id, keys, slots, dst, skip, loadable, first)

    def plan_step(
        self,
        updates: Iterable[RequestUpdate],
        reallocated_block_ids: Iterable[int] | BlockSet = (),
        state_blocks: Iterable[StateBlock] = (),
    ) -> StepPlan:
        """Call when the engine has scheduled a step, before its forward pass runs: `updates`
        say what the step computes for each running request (and the blocks allocated to it in
        this schedule), `reallocated_block_ids` every GPU block handed out in this schedule
        (any iterable of ids, or a `BlockSet`, which an engine fills as it goes),
        `state_blocks` the Mamba states committed in it (one store each, before the others, as
        vLLM plans them). Returns the stores to submit and the in-flight jobs (stores or loads)
        that touch a reallocated block: wait for those before the forward pass overwrites it.
        With several KV-cache groups only window and state blocks count (the engine holds every
        other block a job touches until the job is reported), and window tables stop reading
        reallocated ones.

        The whole batch is checked before anything changes: a bad update raises and plans
        nothing."""
        # The engine's thousands of ids in a BlockSet were checked as it added them. One group
        # asks the jobs' block arrays (an array), several groups ask membership (a BlockSet).
        given = reallocated_block_ids
        if self.hybrid is None:
            realloc = (
                np.asarray(given.to_list(), dtype=np.int64)
                if isinstance(given, BlockSet)
                else _block_ids("reallocated_block_ids", list(given))
            )
        else:
            blocks = given if isinstance(given, BlockSet) else _realloc_set(given)
        checked = [self._check_update(u) for u in updates]
        ids = [c.req.request_id for c in checked]
        if len(set(ids)) != len(ids):
            raise ValueError(f"updates name a request twice: {sorted(ids)}")
        states = [self._check_state(b) for b in state_blocks]
        if self.hybrid is None:
            flush = self._jobs_touching(realloc)
        else:
            flush = self._plan_reallocation(blocks)
        promotions, cascades = (
            ([], []) if self.shared_tier is None else self.shared_tier.take_jobs()
        )
        tokens = {c.req.request_id: c.num_tokens for c in checked}
        jobs = [job for b in states if (job := self._store_state(b, tokens)) is not None]
        jobs += [job for c in checked if (job := self._store_update(c)) is not None]
        return StepPlan(jobs, flush, promotions, cascades)

    def preempt_request(self, request_id: str) -> list[int]:
        """The engine takes the request's GPU blocks back. Returns its in-flight jobs: wait for
        them before those blocks are reused. Its stored chunks stay in the CPU tier."""
        req = self._request(request_id)
        self._drop_tables(req)
        req.planned_load = None
        return sorted(req.jobs)

    def finish_request(self, request_id: str, final: RequestUpdate | None = None) -> FinishPlan:
        """The request finished or was aborted. `final` reports tokens computed since the last
        `plan_step`, so their chunks are stored too. Keep its GPU blocks while `hold_blocks`."""
        return self.finish_requests([(request_id, final)])[0]

    def finish_requests(
        self, finals: Iterable[tuple[str, RequestUpdate | None]]
    ) -> list[FinishPlan]:
        """`finish_request` for several requests at once, as vLLM's connector ends the requests
        that finished in one step: every final store is planned first, then each request's
        chunks are refreshed. The whole batch is checked before anything changes."""
        checked: list[tuple[_Request, _CheckedUpdate | None]] = []
        for request_id, final in finals:
            req = self._request(request_id)
            if final is None:
                checked.append((req, None))
                continue
            if final.request_id != request_id:
                raise ValueError(
                    f"final.request_id={final.request_id!r} is not request_id={request_id!r}"
                )
            checked.append((req, self._check_update(final)))
        ids = [req.request_id for req, _ in checked]
        if len(set(ids)) != len(ids):
            raise ValueError(f"finals name a request twice: {sorted(ids)}")
        jobs: list[list[StoreJob]] = []
        for req, c in checked:
            req.finishing = True
            job = None if c is None else self._store_update(c)
            jobs.append([] if job is None else [job])
        plans = []
        for (req, _), req_jobs in zip(checked, jobs, strict=True):
            # Refresh recency once per request, in prefix order, so its head outlives its tail;
            # not a reuse (loads counted theirs), so ARC keeps once-stored chunks in its T1.
            if req.groups is None:
                self.store.touch(req.keys.view(0, req.stored_chunks), reuse=False)
            else:
                self.store.touch_group_used(
                    [(state.keys, state.used) for state in req.groups], reuse=False
                )
            req.finished = True
            if self.shared_tier is not None:
                self.shared_tier.finish_request(req.request_id)
            if not req.jobs:
                del self._requests[req.request_id]
            # A preempted request holds no GPU blocks: its jobs were flushed before they were
            # reused.
            plans.append(FinishPlan(req_jobs, hold_blocks=bool(req.jobs) and self._has_blocks(req)))
        return plans

    def would_hold_blocks(self, request_id: str, final: RequestUpdate | None = None) -> bool:
        """Whether `finish_request(request_id, final)` could answer `hold_blocks`: the request
        holds GPU blocks that jobs in flight, or its final store, read. Changes nothing, so an
        engine can free the blocks at once when it is False and finish the request later."""
        req = self._request(request_id)
        if not self._has_blocks(req):
            return False
        if req.jobs:
            return True
        if final is None:
            return False
        c = self._check_update(final)
        if req.groups is not None:
            # Whether any group has a chunk to offer (it may then turn out unreachable).
            assert self.hybrid is not None
            offloadable = self._offloadable(req, c.computed, c.num_tokens)
            return any(
                self.hybrid.storable(g, state, offloadable, False, True) > state.next_stored
                for g, state in zip(self.hybrid.groups, req.groups, strict=True)
            )
        return self._storable(req, c.computed, c.num_tokens) > req.stored_chunks

    def complete_job(self, job_id: int, success: bool) -> JobResult:
        """A transfer ended. A failed store drops its chunks; a failed load reports the GPU blocks
        it did not fill (recompute them)."""
        job = self._jobs.pop(job_id, None)
        if job is None:
            raise ValueError(f"job_id={job_id!r} is not in flight")
        req = self._requests[job.request_id]
        req.jobs.discard(job_id)
        n = len(job.keys)
        if job.kind == "store":
            self.store.complete_store(job.keys, success)
            if success:
                self._stats.chunks_stored += n
                self._stats.bytes_stored += n * self.bytes_per_chunk
                if self.shared_tier is not None:
                    self.shared_tier.stored(job.keys)
            else:
                self._stats.store_failures += 1
        else:
            self._loads_in_flight -= 1
            self.store.complete_load(job.keys)
            if success:
                self._stats.chunks_loaded += n
                self._stats.bytes_loaded += n * self.bytes_per_chunk
            else:
                self._stats.load_failures += 1
                # The engine retries the request from scratch; a lookup would offer the same
                # chunks again, and a copy that keeps failing would loop forever.
                req.max_load_tokens = 0
                logger.warning(
                    "load job %d of request %s failed: its %d tokens' blocks are recomputed, "
                    "and it loads nothing more",
                    job_id,
                    req.request_id,
                    len(job.gpu_block_ids) * self.config.tokens_per_block,
                )
        released = req.finished and not req.jobs
        if released:
            del self._requests[req.request_id]
        failed = job.gpu_block_ids if job.kind == "load" and not success else _NO_BLOCKS
        return JobResult(job_id, job.request_id, job.kind, success, failed, released)

    def reset(self) -> None:
        """Empties the CPU tier (`CpuStore.reset`) and starts every live request's stores over:
        each offers its chunks again from the first, with a new rank. A request that finished
        and whose blocks the engine freed must be finished (`finish_request`) first: its final
        store would read them from the first chunk."""
        self.store.reset()
        window = () if self.hybrid is None else self.hybrid.window_groups()
        bpc = self.config.blocks_per_chunk
        for req in self._requests.values():
            req.stored_chunks = 0
            req.rank = None
            for g, state in enumerate(req.groups or ()):
                if g in window:
                    # Blocks behind the frontier were never checked for reallocation (the window
                    # may have freed them long ago): they are not stored again.
                    frontier = min(state.next_stored * bpc, len(state.block_ids))
                    state.block_ids[:frontier] = [NULL_BLOCK] * frontier
                state.next_stored = 0
                state.used = bytearray()

    def is_loading(self, request_id: str) -> bool:
        """Whether a load of the request is in flight (it is waiting for its KV)."""
        req = self._requests.get(request_id)
        return req is not None and any(self._jobs[j].kind == "load" for j in req.jobs)

    @property
    def has_jobs_in_flight(self) -> bool:
        """Copies, or shared-tier jobs and lookups, not yet reported."""
        return bool(self._jobs) or (self.shared_tier is not None and self.shared_tier.has_work)

    def stats(self) -> SchedulerStats:
        """A snapshot of the counters."""
        # Asked every step by the connector: a copy of the counters' own dict, not copy.copy
        # (its __reduce_ex__ round trip) or dataclasses.replace (which re-runs __init__).
        snapshot = SchedulerStats.__new__(SchedulerStats)
        snapshot.__dict__.update(vars(self._stats))
        snapshot.ignored_params = dict(snapshot.ignored_params)
        return snapshot

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def jobs_in_flight(self) -> list[int]:
        return sorted(self._jobs)

    # --- internals ---------------------------------------------------------------------------

    def _request(self, request_id: str) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise ValueError(
                f"request_id={request_id!r} is not tracked (add_request it first, or it finished)"
            ) from None

    @staticmethod
    def _has_blocks(req: _Request) -> bool:
        if req.groups is None:
            return bool(req.block_ids)
        return any(state.block_ids for state in req.groups)

    def _drop_tables(self, req: _Request) -> None:
        req.block_ids = []
        for state in req.groups or ():
            state.block_ids = []
        self._tabled.discard(req.request_id)

    def _rank(self, req: _Request) -> int:
        if req.rank is None:
            req.rank = self.store.new_rank()
        return req.rank

    def _extend_keys(self, req: _Request, block_hashes: Sequence[bytes]) -> None:
        # Reads only the hashes past the chunks that already have keys.
        if req.groups is not None:
            assert self.hybrid is not None
            self.hybrid.extend_keys(req.groups, block_hashes)
            return
        bpc = self.config.blocks_per_chunk
        if type(block_hashes) is not list or len(block_hashes) >= (len(req.keys) + 1) * bpc:
            req.keys.extend_chunk_keys(block_hashes, bpc, _GROUP_IDX)

    def _track(
        self,
        kind: Literal["store", "load"],
        req: _Request,
        keys: KeyList,
        blocks: IntArray,
        window_blocks: Sequence[int] = (),
    ) -> int:
        job_id = self._next_job_id
        self._next_job_id += 1
        self._jobs[job_id] = _InFlight(kind, req.request_id, keys, blocks, window_blocks)
        req.jobs.add(job_id)
        return job_id

    def _check_update(self, u: RequestUpdate) -> _CheckedUpdate:
        """Raises on a bad update. Its only change is deriving keys for new block hashes, which
        the same hashes always give again, so a retry after an error sees the same state."""
        # Thousands of updates a run, most of them decode steps: the usual values are checked
        # inline, anything else by the helpers that explain it.
        req = self._requests.get(u.request_id) or self._request(u.request_id)
        if req.finished:
            raise ValueError(f"request_id={u.request_id!r} already finished")
        computed, num_tokens = u.num_computed_tokens, u.num_tokens
        if type(computed) is not int or computed < 0:
            computed = _count("num_computed_tokens", computed)
        if type(num_tokens) is not int or num_tokens < 0:
            num_tokens = _count("num_tokens", num_tokens)
        if computed > num_tokens:
            raise ValueError(
                f"num_computed_tokens={computed} for request {u.request_id!r} is more than its "
                f"num_tokens={num_tokens}: KV exists only for tokens the request has"
            )
        group_blocks = None
        if req.groups is not None:
            new = u.new_block_ids
            if type(new) is tuple and not new:  # RequestUpdate's default: nothing allocated
                group_blocks = []
            else:
                group_blocks = self._group_tables("new_block_ids", new, empty_ok=True)
            new_blocks = _NO_BLOCKS
        else:
            new_blocks = _block_ids("new_block_ids", u.new_block_ids)  # type: ignore[arg-type]
        junction = u.shared_prefix_boundary
        if type(junction) is not int or junction < 0:
            junction = _count("shared_prefix_boundary", junction)
        if u.block_hashes is not None:
            self._extend_keys(req, u.block_hashes)
        return _CheckedUpdate(req, computed, num_tokens, new_blocks, group_blocks, junction)

    def _store_update(self, c: _CheckedUpdate) -> StoreJob | None:
        """Records a checked update and plans the request's stores; cannot fail half-way."""
        c.req.num_tokens = c.num_tokens
        if c.req.groups is not None:
            if c.group_blocks:  # [] when the step allocated nothing
                for state, blocks in zip(c.req.groups, c.group_blocks, strict=True):
                    state.block_ids.extend(blocks)
            return self._store_groups(c.req, c.computed, c.shared_prefix_boundary)
        c.req.block_ids.extend(c.new_blocks.tolist())
        return self._plan_store(c.req, c.computed)

    def _storable(self, req: _Request, num_computed_tokens: int, num_tokens: int) -> int:
        cfg = self.config
        return _rust.storable_chunks(
            num_computed_tokens,
            num_tokens,
            req.num_prompt_tokens,
            req.max_offload_tokens,
            cfg.offload_prompt_only,
            cfg.tokens_per_chunk,
            len(req.block_ids),
            cfg.blocks_per_chunk,
            len(req.keys),
        )

    def _plan_store(self, req: _Request, num_computed_tokens: int) -> StoreJob | None:
        bpc = self.config.blocks_per_chunk
        n = self._storable(req, num_computed_tokens, req.num_tokens)
        start = req.stored_chunks
        if n <= start:
            return None
        # A request longer than the whole tier offers all its chunks: the ones stored already
        # are then protected, and a partial store keeps the head (what later requests can hit)
        # instead of evicting it for the tail; the rest is given up, not offered again.
        first = 0 if n > self.store.usable_slots else start
        # Built before the store changes anything, so nothing below can fail half-way.
        chunks = np.asarray(req.block_ids[first * bpc : n * bpc], dtype=np.int64).reshape(-1, bpc)
        plan = self.store.prepare_store(
            req.keys.view(first, n), rank=self._rank(req), first_position=first, partial=True
        )
        if plan is None:
            # The frontier stays: the same chunks are offered again next step.
            self._stats.store_refusals += 1
            return None
        req.stored_chunks = n
        if not plan.keys:
            return None
        src = chunks[plan.indices].reshape(-1)
        assert isinstance(plan.keys, KeyList)
        job_id = self._track("store", req, plan.keys, src)
        self._stats.store_jobs += 1
        return StoreJob(job_id, req.request_id, plan.keys, plan.slots, src, plan.indices + first)

    # --- several KV-cache groups (HybridPlanner) -------------------------------------------------

    def _group_tables(
        self, name: str, values: Sequence[int] | Sequence[Sequence[int]], *, empty_ok: bool = False
    ) -> list[list[int]]:
        """One block table per group (new lists), or a ValueError naming `name`."""
        assert self.hybrid is not None
        n = self.hybrid.num_groups
        if empty_ok and len(values) == 0:
            return []
        tables = _rust.block_tables(values, n)
        if tables is not None:
            return tables  # vLLM's tables: checked and copied in one call
        allowed = f"expected {n} sequences of GPU block ids, one per KV-cache group"
        if type(values) not in (list, tuple) and (
            not isinstance(values, Sequence) or isinstance(values, (str, bytes))
        ):
            raise ValueError(f"{name}={_short(values)} is invalid: {allowed}")
        if len(values) != n or any(isinstance(v, (int, np.integer)) for v in values):
            raise ValueError(f"{name}={_short(values)} is invalid: {allowed}")
        tables = [_block_list(f"{name}[{g}]", v) for g, v in enumerate(values)]  # type: ignore[arg-type]
        if len({len(t) for t in tables}) > 1:
            # Every group's table covers the request's tokens (vLLM's are of one length).
            raise ValueError(
                f"{name} has tables of lengths {[len(t) for t in tables]}: {allowed}, of one length"
            )
        return tables

    def _set_tables(self, req: _Request, tables: list[list[int]]) -> None:
        assert req.groups is not None
        for state, t in zip(req.groups, tables, strict=True):
            state.block_ids = t
        req.new_tables = True
        self._tabled.add(req.request_id)

    def _lookup_groups(self, req: _Request, num_local: int, num_tokens: int) -> int | None:
        assert self.hybrid is not None and req.groups is not None
        self._stats.lookups += 1
        hit = self.hybrid.lookup(
            self.store,
            req.groups,
            num_local,
            num_tokens,
            req.max_load_tokens,
            self._loads_in_flight > 0,
        )
        if hit is None:
            self._stats.deferred_lookups += 1
            return None
        if hit:
            req.planned_load = (num_local, hit)
        return hit

    def _load_groups(
        self, req: _Request, tables: list[list[int]], num_local: int, loadable: int
    ) -> LoadJob:
        assert self.hybrid is not None and req.groups is not None
        tpb, tpc = self.config.tokens_per_block, self.config.tokens_per_chunk
        num_cached = num_local + loadable
        end_chunk = -(-num_cached // tpc)
        # Pins, or raises with nothing pinned.
        plan = self.store.load_groups(
            [state.keys for state in req.groups],
            tables,
            first_block=-(-num_local // tpb),
            num_blocks=-(-num_cached // tpb),
            end_chunk=end_chunk,
            blocks_per_chunk=self.config.blocks_per_chunk,
            rank=self._rank(req),
            used=[state.used for state in req.groups],
            touch=self.config.eviction_policy == "arc",  # a reuse: ARC's frequent list
        )
        self._set_tables(req, tables)
        req.planned_load = None
        for state in req.groups:
            state.next_stored = max(state.next_stored, end_chunk)
        job_id = self._track("load", req, plan.keys, plan.gpu_block_ids)
        self._loads_in_flight += 1
        self._stats.load_jobs += 1
        self._stats.hit_tokens += loadable
        parts = tuple(GroupSlice(*part) for part in plan.parts)
        first = min((end_chunk - p.num_slots for p in parts), default=end_chunk)
        return LoadJob(
            job_id,
            req.request_id,
            plan.keys,
            plan.slots,
            plan.gpu_block_ids,
            0,
            loadable,
            first,
            parts,
        )

    def _offloadable(self, req: _Request, computed: int, num_tokens: int) -> int:
        n = min(computed, num_tokens)
        if req.max_offload_tokens is not None:
            n = min(n, req.max_offload_tokens)
        if self.config.offload_prompt_only:
            n = min(n, req.num_prompt_tokens)
        return n

    def _store_groups(self, req: _Request, computed: int, junction: int) -> StoreJob | None:
        assert self.hybrid is not None and req.groups is not None
        offloadable = self._offloadable(req, computed, req.num_tokens)
        whole = offloadable // self.hybrid.tpc
        for state in req.groups:
            if whole > state.next_stored:
                break
        else:
            # No group has a new chunk to offer (most decode steps): the frontiers stay.
            return None
        boundaries = (req.num_prompt_tokens - 1,) + ((junction,) if junction else ())
        decoding = offloadable > req.num_prompt_tokens
        offers, ends = self.hybrid.offers(
            req.groups, offloadable, decoding, req.finishing, boundaries
        )
        plan = None
        bpc = self.config.blocks_per_chunk
        if offers:
            # A chunk another request is storing now is not a use of it (as in vLLM).
            plan = self.store.offer_group_store(
                offers,
                rank=self._rank(req),
                num_groups=self.hybrid.num_groups,
                windowed=self.hybrid.window_mask,
                blocks_per_chunk=bpc,
                used=[state.used for state in req.groups],
            )
            if plan is None:
                # The frontier stays: the same chunks are offered again next step.
                self._stats.store_refusals += 1
                return None
        for state, end in zip(req.groups, ends, strict=True):
            state.next_stored = max(state.next_stored, end)
        if plan is None or not plan.keys:
            return None
        parts = tuple(GroupSlice(g, n, n * bpc) for g, n in enumerate(plan.counts) if n)
        job_id = self._track("store", req, plan.keys, plan.blocks, plan.window_blocks)
        self._stats.store_jobs += 1
        return StoreJob(
            job_id, req.request_id, plan.keys, plan.slots, plan.blocks, plan.chunks, parts
        )

    def _check_state(self, b: StateBlock) -> tuple[_Request, int, int, int]:
        if not isinstance(b, StateBlock):
            raise ValueError(f"state_blocks holds {b!r}: expected StateBlock items")
        req = self._requests.get(b.request_id)
        if req is None:
            raise ValueError(
                f"state_blocks names request_id={b.request_id!r}, which is not tracked "
                "(add_request it first, or it finished)"
            )
        mamba = (
            []
            if self.hybrid is None
            else [g for g in range(self.hybrid.num_groups) if self.hybrid.is_state(g)]
        )
        group = b.group
        if isinstance(group, bool) or not hasattr(group, "__index__") or group not in mamba:
            allowed = ", ".join(map(str, mamba)) or "this model has none"
            raise ValueError(
                f"StateBlock group={group!r} of request {b.request_id!r} is invalid; allowed: "
                f"the index of a mamba group ({allowed})"
            )
        (block,) = _block_ids("StateBlock block_id", [b.block_id]).tolist()
        return req, operator.index(group), block, _count("StateBlock num_tokens", b.num_tokens)

    def _store_state(
        self, state: tuple[_Request, int, int, int], num_tokens: dict[str, int]
    ) -> StoreJob | None:
        """One Mamba state's store: its block read into the last block of its chunk's slot."""
        assert self.hybrid is not None
        req, group, block, boundary = state
        if block == NULL_BLOCK or req.finished:
            return None
        assert req.groups is not None
        total = num_tokens.get(req.request_id, req.num_tokens)
        batch = self.hybrid.state_key(
            req.groups, group, boundary, self._offloadable(req, total, total)
        )
        if batch is None:
            return None
        if int(self.store.lookup(batch.keys)[0]) != _PENDING:
            chunk = int(batch.chunks[0])
            req.groups[group].mark_used(chunk, chunk + 1)
        plan = self.store.prepare_store(batch.keys, rank=self._rank(req), positions=batch.positions)
        if plan is None:
            # A hand-off is offered once: vLLM gives it up too.
            self._stats.store_refusals += 1
            return None
        if not plan.keys:
            return None
        assert isinstance(plan.keys, KeyList)
        src = np.array([block], dtype=np.int64)
        # The engine frees the block once the state has moved on: a reuse waits for the store.
        job_id = self._track("store", req, plan.keys, src, (block,))
        self._stats.store_jobs += 1
        part = GroupSlice(group, 1, 1, self.config.blocks_per_chunk - 1)
        return StoreJob(job_id, req.request_id, plan.keys, plan.slots, src, batch.chunks, (part,))

    def _plan_reallocation(self, realloc: BlockSet) -> list[int]:
        """The stores in flight reading a window block handed out again (wait for them), and
        the tables that must not be read there any more (`HybridPlanner.drop_reallocated`);
        before this step's new blocks are appended."""
        assert self.hybrid is not None
        window = self.hybrid.window_groups()
        # Few stores are in flight, each reading a few window blocks; many blocks are handed out.
        flush = [
            j
            for j, job in self._jobs.items()
            if realloc and job.window_blocks and realloc.intersects(job.window_blocks)
        ]
        live: list[list[GroupState]] = []
        for rid in list(self._tabled):
            req = self._requests.get(rid)
            if req is None or req.finished:
                self._tabled.discard(rid)
                continue
            if req.new_tables:
                req.new_tables = False
                continue
            if realloc and window:
                assert req.groups is not None
                live.append(req.groups)
        self.hybrid.drop_reallocated(live, realloc)
        return flush

    def _jobs_touching(self, realloc: IntArray) -> list[int]:
        if not self._jobs or not realloc.size:
            return []
        ids = list(self._jobs)
        blocks = [self._jobs[j].gpu_block_ids for j in ids]
        hit = np.isin(np.concatenate(blocks), realloc)
        if not hit.any():
            return []
        owner = np.repeat(np.arange(len(ids)), [len(b) for b in blocks])
        return sorted(ids[i] for i in set(owner[hit].tolist()))
