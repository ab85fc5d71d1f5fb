"""`OffloadScheduler`: per-request offload state, lookups, and store/load job planning.

Engine-agnostic: it speaks in request ids, token counts, block hashes and GPU block ids; the vLLM
adapter translates. The call order for one request:

1. `add_request` when it arrives (parses its `kv_transfer_params` caps);
2. `lookup` when the engine considers scheduling it (may repeat; pins nothing, but with
   secondary tiers it may start a promotion, which reserves CPU slots);
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

import itertools
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvoffload._rust import BlockSet
from kvoffload.scheduler import checks
from kvoffload.scheduler.config import OffloadConfig
from kvoffload.scheduler.groups import KVGroup
from kvoffload.scheduler.hybrid import HybridPlanner
from kvoffload.scheduler.jobs import (
    FinishPlan,
    JobResult,
    LoadJob,
    RequestUpdate,
    StateBlock,
    StepPlan,
    StoreJob,
    TierJob,
)
from kvoffload.scheduler.one_group import OneGroupPlanner
from kvoffload.scheduler.params import (
    MAX_LOAD_TOKENS,
    MAX_OFFLOAD_TOKENS,
    checked_params,
    parse_load_tiers,
    parse_token_cap,
    tier_allowed,
)
from kvoffload.scheduler.planner import CheckedUpdate, Context, Planner, Request
from kvoffload.scheduler.secondary_tier import SecondaryTier, TierLink
from kvoffload.scheduler.several_groups import SeveralGroupsPlanner
from kvoffload.scheduler.stats import SchedulerStats
from kvoffload.store import CpuStore

logger = logging.getLogger(__name__)


class OffloadScheduler:
    def __init__(
        self,
        config: OffloadConfig,
        store: CpuStore,
        *,
        bytes_per_chunk: int = 0,
        secondary_tiers: Sequence[TierLink] = (),
        world_size: int = 1,
        writers: int | None = None,
        groups: Sequence[KVGroup] | None = None,
        retention_interval: int | None = 0,
    ) -> None:
        """`bytes_per_chunk` (all workers together) only feeds the byte counters of the stats.
        `secondary_tiers` stand behind the CPU tier in lookup order (a chain: CPU -> first ->
        second ...), each read by `world_size` workers and written by `writers` of them
        (default: all; see `SecondaryTier`): a lookup asks them in order for the rest of the prefix,
        every chunk whose CPU-tier store completes is written on to each of them, and a chunk
        promoted from one is written to those before it.

        `groups` are the model's KV-cache groups (default: one full-attention group). With more,
        or a window group, block tables and new blocks are given per group, and
        `retention_interval` (vLLM's `prefix_cache_retention_interval`) says at which boundaries
        a sliding-window group keeps what a hit reads (`HybridPlanner`)."""
        self.config = config
        groups = None if groups is None else tuple(groups)
        # Checked with one group too: a bad value is a bad value.
        hybrid = HybridPlanner(
            (KVGroup(),) if groups is None else groups,
            config.tokens_per_block,
            config.blocks_per_chunk,
            retention_interval=retention_interval,
        )
        several = groups not in (None, (KVGroup(),))
        if several and secondary_tiers:
            raise ValueError("secondary tiers are not supported with several KV-cache groups yet")
        self.store = store
        self.bytes_per_chunk = bytes_per_chunk
        ctx = self._ctx = Context(config, store)
        self._requests = ctx.requests
        self._jobs = ctx.jobs
        self._stats = ctx.stats
        job_ids = itertools.count()
        self.secondary_tiers = tuple(
            SecondaryTier(
                store,
                link.lookups,
                ctx.stats,
                world_size=world_size,
                writers=writers,
                medium=link.medium,
                locality=link.locality,
                writable=link.writable,
                sees_evictions=link.sees_evictions,
                tier=i,
                job_ids=job_ids,
                share=len(secondary_tiers),
            )
            for i, link in enumerate(secondary_tiers)
        )
        for i, tier in enumerate(self.secondary_tiers):
            tier.above = self.secondary_tiers[:i]
        self._several = SeveralGroupsPlanner(ctx, hybrid) if several else None
        self._planner: Planner = self._several or OneGroupPlanner(ctx)

    @classmethod
    def create(
        cls,
        config: OffloadConfig,
        bytes_per_chunk: int,
        *,
        enable_events: bool = False,
        usable_slots: int | None = None,
        secondary_tiers: Sequence[TierLink] = (),
        world_size: int = 1,
        writers: int | None = None,
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
            secondary_tiers=secondary_tiers,
            world_size=world_size,
            writers=writers,
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
        num_prompt_tokens = checks.count("num_prompt_tokens", num_prompt_tokens)
        ignored = self._stats.ignored_params
        kv_transfer_params = checked_params(request_id, kv_transfer_params, ignored)
        self._requests[request_id] = Request(
            request_id,
            num_prompt_tokens,
            max_offload_tokens=parse_token_cap(
                request_id, kv_transfer_params, MAX_OFFLOAD_TOKENS, ignored
            ),
            max_load_tokens=parse_token_cap(
                request_id, kv_transfer_params, MAX_LOAD_TOKENS, ignored
            ),
            num_tokens=num_prompt_tokens,
            groups=self._planner.new_groups(),
        )
        if self.secondary_tiers:
            tiers = parse_load_tiers(request_id, kv_transfer_params, ignored)
            self._requests[request_id].load_tiers = tuple(
                t for t in self.secondary_tiers if tier_allowed(tiers, t.medium, t.locality)
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
        flight from before a preemption, or a secondary tier is being asked or promoting).

        A lookup that starts a promotion reserves CPU slots and may evict: the engine must call
        `on_allocated` for a request before it looks the next one up (as vLLM does).
        `read=False` (a request that must not read any cache) looks nothing up: 0, or `None`
        while its own jobs from before a preemption are in flight."""
        req = self._request(request_id)
        num_local_tokens = checks.count("num_local_tokens", num_local_tokens)
        num_tokens = checks.count("num_tokens", num_tokens)
        planner = self._planner
        planner.check_local(req, num_local_tokens)
        # (Re)starting at token 0: the engine hands over the whole block table in on_allocated.
        planner.restart(req)
        req.stored_chunks = 0
        req.planned_load = None
        req.num_tokens = num_tokens
        if req.jobs:
            self._stats.deferred_lookups += 1
            return None
        planner.extend_keys(req, block_hashes)
        if not read:
            return 0
        return planner.lookup(req, num_local_tokens, num_tokens)

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
        num_external_tokens = checks.count("num_external_tokens", num_external_tokens)
        planner = self._planner
        tables = planner.check_tables("block_ids", block_ids)
        planned = req.planned_load
        if num_external_tokens == 0:
            planner.set_tables(req, tables)
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
        return planner.load(req, tables, num_local, loadable)

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
        planner = self._planner
        reallocated = planner.check_reallocated(reallocated_block_ids)
        checked = [self._check_update(u) for u in updates]
        ids = [c.req.request_id for c in checked]
        if len(set(ids)) != len(ids):
            raise ValueError(f"updates name a request twice: {sorted(ids)}")
        states = [self._check_state(b) for b in state_blocks]
        flush = planner.flush(reallocated)
        promotions: list[TierJob] = []
        cascades: list[TierJob] = []
        for tier in self.secondary_tiers:
            tier_promotions, tier_cascades = tier.take_jobs()
            promotions += tier_promotions
            cascades += tier_cascades
        jobs: list[StoreJob] = []
        if states:
            assert self._several is not None  # one group has no state groups to name
            tokens = {c.req.request_id: c.num_tokens for c in checked}
            jobs += [j for b in states if (j := self._several.store_state(b, tokens)) is not None]
        jobs += [job for c in checked if (job := planner.store(c)) is not None]
        return StepPlan(jobs, flush, promotions, cascades)

    def preempt_request(self, request_id: str) -> list[int]:
        """The engine takes the request's GPU blocks back. Returns its in-flight jobs: wait for
        them before those blocks are reused. Its stored chunks stay in the CPU tier."""
        req = self._request(request_id)
        self._planner.drop_tables(req)
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
        checked: list[tuple[Request, CheckedUpdate | None]] = []
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
            job = None if c is None else self._planner.store(c)
            jobs.append([] if job is None else [job])
        plans = []
        for (req, _), req_jobs in zip(checked, jobs, strict=True):
            # Refresh recency once per request, in prefix order, so its head outlives its tail.
            self._planner.touch_finished(req)
            req.finished = True
            for tier in self.secondary_tiers:
                tier.finish_request(req.request_id)
            if not req.jobs:
                del self._requests[req.request_id]
            # A preempted request holds no GPU blocks: its jobs were flushed before they were
            # reused.
            hold = bool(req.jobs) and self._planner.has_blocks(req)
            plans.append(FinishPlan(req_jobs, hold_blocks=hold))
        return plans

    def would_hold_blocks(self, request_id: str, final: RequestUpdate | None = None) -> bool:
        """Whether `finish_request(request_id, final)` could answer `hold_blocks`: the request
        holds GPU blocks that jobs in flight, or its final store, read. Changes nothing, so an
        engine can free the blocks at once when it is False and finish the request later."""
        req = self._request(request_id)
        if not self._planner.has_blocks(req):
            return False
        if req.jobs:
            return True
        if final is None:
            return False
        return self._planner.would_store(self._check_update(final))

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
                for tier in self.secondary_tiers:
                    tier.stored(job.keys)
            else:
                self._stats.store_failures += 1
        else:
            self._ctx.loads_in_flight -= 1
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
        failed = job.gpu_block_ids if job.kind == "load" and not success else checks.NO_BLOCKS
        return JobResult(job_id, job.request_id, job.kind, success, failed, released)

    def reset(self) -> None:
        """Empties the CPU tier (`CpuStore.reset`) and starts every live request's stores over:
        each offers its chunks again from the first, with a new rank. A request that finished
        and whose blocks the engine freed must be finished (`finish_request`) first: its final
        store would read them from the first chunk."""
        self.store.reset()
        for req in self._requests.values():
            req.stored_chunks = 0
            req.rank = None
            self._planner.reset_request(req)

    def is_loading(self, request_id: str) -> bool:
        """Whether a load of the request is in flight (it is waiting for its KV)."""
        req = self._requests.get(request_id)
        return req is not None and any(self._jobs[j].kind == "load" for j in req.jobs)

    def secondary_tier_of(self, job_id: int) -> SecondaryTier:
        """The secondary tier whose promotion or cascade `job_id` is (still open)."""
        for tier in self.secondary_tiers:
            if tier.owns(job_id):
                return tier
        raise ValueError(f"job_id={job_id!r} is no open job of a secondary tier")

    @property
    def has_jobs_in_flight(self) -> bool:
        """Copies, or secondary-tier jobs and lookups, not yet reported."""
        return bool(self._jobs) or any(t.has_work for t in self.secondary_tiers)

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

    def _request(self, request_id: str) -> Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise ValueError(
                f"request_id={request_id!r} is not tracked (add_request it first, or it finished)"
            ) from None

    def _check_update(self, u: RequestUpdate) -> CheckedUpdate:
        """Raises on a bad update. Its only change is deriving keys for new block hashes, which
        the same hashes always give again, so a retry after an error sees the same state."""
        # Thousands of updates a run, most of them decode steps: the usual values are checked
        # inline, anything else by the helpers that explain it.
        req = self._requests.get(u.request_id) or self._request(u.request_id)
        if req.finished:
            raise ValueError(f"request_id={u.request_id!r} already finished")
        computed, num_tokens = u.num_computed_tokens, u.num_tokens
        if type(computed) is not int or computed < 0:
            computed = checks.count("num_computed_tokens", computed)
        if type(num_tokens) is not int or num_tokens < 0:
            num_tokens = checks.count("num_tokens", num_tokens)
        if computed > num_tokens:
            raise ValueError(
                f"num_computed_tokens={computed} for request {u.request_id!r} is more than its "
                f"num_tokens={num_tokens}: KV exists only for tokens the request has"
            )
        planner = self._planner
        new_blocks = planner.check_new_blocks(u.new_block_ids)
        junction = u.shared_prefix_boundary
        if type(junction) is not int or junction < 0:
            junction = checks.count("shared_prefix_boundary", junction)
        if u.block_hashes is not None:
            planner.extend_keys(req, u.block_hashes)
        return CheckedUpdate(req, computed, num_tokens, new_blocks, junction)

    def _check_state(self, b: StateBlock) -> tuple[Request, int, int, int]:
        if not isinstance(b, StateBlock):
            raise ValueError(f"state_blocks holds {b!r}: expected StateBlock items")
        req = self._requests.get(b.request_id)
        if req is None:
            raise ValueError(
                f"state_blocks names request_id={b.request_id!r}, which is not tracked "
                "(add_request it first, or it finished)"
            )
        return (req, *checks.state_block(b, self._planner.state_groups()))
