"""The connector's scheduler half: vLLM's scheduler hooks translated onto `OffloadScheduler`."""

from __future__ import annotations

import logging
from collections import ChainMap
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import KVCacheEvent
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import RequestStatus

from kvoffload.scheduler import (
    BlockSet,
    LoadJob,
    OffloadScheduler,
    RequestUpdate,
    SchedulerStats,
    StateBlock,
    TierLink,
)
from kvoffload.scheduler.trace_recorder import TraceRecorder
from kvoffload.tiers import TierLookups, TierSettings
from kvoffload.vllm.compat import request_blocks
from kvoffload.vllm.connector.events import KVEvents
from kvoffload.vllm.connector.metadata import (
    KVOffloadHandshakeMetadata,
    KVOffloadMetadata,
    KVOffloadWorkerMetadata,
)
from kvoffload.vllm.connector.settings import ConnectorSettings
from kvoffload.vllm.connector.stats import KVOffloadStats, add_reports, stats_delta

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class SchedulerSide:
    def __init__(self, settings: ConnectorSettings) -> None:
        self.settings = settings
        self.tier_lookups: list[TierLookups] = []
        """Each secondary tier's lookups, in chain order."""
        self._started = False
        self._down: dict[tuple[int, int], bool] = {}
        """`(rank, tier) -> down`: each worker's breakers, as last reported."""
        try:
            for tier in settings.tiers:
                self.tier_lookups.append(self._lookups(tier))
        except BaseException:
            self.shutdown()  # closes the tiers opened before the one that failed
            raise
        links = [
            TierLink(
                lookups,
                tier.locality,
                writable=not tier.config.read_only,
                sees_evictions=tier.kind.sees_evictions,
            )
            for lookups, tier in zip(self.tier_lookups, settings.tiers, strict=True)
        ]
        self.scheduler = OffloadScheduler.create(
            settings.config,
            settings.bytes_per_chunk,
            usable_slots=0 if settings.pinning.in_background else None,
            enable_events=settings.enable_events,
            secondary_tiers=links,
            world_size=settings.world_size,
            writers=settings.num_shards,
            groups=settings.groups if settings.hybrid else None,
            retention_interval=settings.retention_interval,
        )
        self._hybrid = settings.hybrid
        # Window groups free blocks behind their window while a request runs, and Mamba groups
        # the blocks their state has moved on from: blocks handed out again in a step are not
        # read by the stores still to plan, and fence the ones in flight.
        self._watch_reallocation = any(g.kind != "full" for g in settings.groups)
        self._has_state = any(g.kind == "mamba" for g in settings.groups)
        self._allocated_blocks = BlockSet()
        self._requests: dict[str, Request] = {}
        self._reports = KVOffloadWorkerMetadata()
        """Jobs some but not all workers reported."""
        self._allocated: set[str] = set()
        """Requests given GPU blocks in this step (update_state_after_alloc)."""
        self._finishing: dict[str, RequestUpdate] = {}
        """Finished requests, ended in the next build_connector_meta (as vLLM's connector does)."""
        self.events = KVEvents(settings)
        self._ending: dict[str, Request] = {}
        """The finishing requests themselves, while their last stores are snapshotted."""
        # This step's output, handed to the workers by build_connector_meta.
        self._loads: list[LoadJob] = []
        self._held: list[str] = []
        self._stats_mark = SchedulerStats()
        self._usable: dict[int, int] = {}
        """Each worker's usable CPU slots; the tier uses what all of them have."""
        self._usable_reported = -1
        self._said_bad_report = False
        self.trace = (
            None
            if settings.record_trace is None
            else TraceRecorder(
                settings.record_trace.for_replica(settings.dp_index, settings.dp_size),
                settings.config.tokens_per_block,
            )
        )
        logger.info(
            "kvoffload: %d CPU-tier slots of %d tokens (%d bytes over %d workers), policy %s, "
            "offload_prompt_only=%s, secondary tiers: %s%s",
            settings.num_slots,
            settings.config.tokens_per_chunk,
            settings.bytes_per_chunk,
            settings.world_size,
            settings.config.eviction_policy,
            settings.config.offload_prompt_only,
            " -> ".join(f"{t.kind.name} {t.config.where} ({t.locality})" for t in settings.tiers)
            or "none",
            f" ({settings.num_shards} shard(s) per chunk, KV replicated over TP ranks)"
            if settings.tiers and settings.replicated
            else "",
        )

    def _lookups(self, tier: TierSettings) -> TierLookups:
        """The scheduler's lookups against one secondary tier, on connections of their own."""
        settings = self.settings
        digests = [tier.shard_digest(r) for r in range(settings.num_shards)]
        return tier.kind.open_lookups(
            tier.config, digests, settings.chunk_bytes, settings.num_shards
        )

    def on_new_request(self, request: Request) -> None:
        rid = request.request_id
        if rid not in self._requests:
            self._requests[rid] = request
            self.scheduler.add_request(rid, request.num_prompt_tokens, request.kv_transfer_params)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self.on_new_request(request)
        hit = self.scheduler.lookup(
            request.request_id,
            num_computed_tokens,
            request.num_tokens,
            request.block_hashes,
            read=not request.skip_reading_prefix_cache,
        )
        if self.events.self_describing and self.tier_lookups:
            if hit is None:
                self.events.watch(request)
            else:
                self.events.unwatch(request.request_id)
        if hit is None:
            return None, False
        # Always asynchronous: vLLM keeps the request waiting until the load is reported, and a
        # hit of the whole prompt is legal (vLLM then recomputes the last token).
        return hit, hit > 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        tables = blocks.get_block_ids()
        if self._watch_reallocation:
            for table in tables:
                self._allocated_blocks.add(table, "block_ids")
        block_ids = tables if self._hybrid else tables[0]
        load = self.scheduler.on_allocated(request.request_id, block_ids, num_external_tokens)
        self._allocated.add(request.request_id)
        if load is not None:
            self._loads.append(load)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVOffloadMetadata:
        # Which in-flight jobs must finish before this step's forward pass: those of requests
        # preempted now, whose blocks vLLM has freed and may hand out in this very step. Other
        # blocks under a job are held (a finished request keeps its blocks until its stores are
        # reported, request_finished; a loading one until its load is), but for the window and
        # Mamba blocks freed while a request runs, which `plan_step` fences.
        flush: list[int] = []
        for rid in scheduler_output.preempted_req_ids or ():
            # One preempted and given new blocks in this very step (a reset of running requests)
            # had no jobs (its lookup would have waited), and its new table stands.
            if self.scheduler.has_request(rid) and rid not in self._allocated:
                flush.extend(self.scheduler.preempt_request(rid))
        self._allocated = set()
        # Looked up by request; the order that counts (vLLM's: running, then new, so that the
        # store decides as vLLM's does) is num_scheduled_tokens'.
        blocks = {rid: (g, full) for rid, g, full in request_blocks(scheduler_output)}
        allocated, self._allocated_blocks = self._allocated_blocks, BlockSet()
        updates = []
        for rid, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self._requests[rid]
            groups, full_table = blocks[rid]
            # New and resumed requests handed over their whole table in update_state_after_alloc.
            new_blocks: Any = ()
            if groups and not full_table:
                new_blocks = groups if self._hybrid else groups[0]
                if self._watch_reallocation:
                    for table in groups:
                        allocated.add(table, "new_block_ids")
            # Speculative drafts are scheduled past num_tokens; their KV may be rejected.
            computed = min(request.num_computed_tokens + num_scheduled, request.num_tokens)
            updates.append(
                RequestUpdate(
                    rid,
                    computed,
                    request.num_tokens,
                    new_blocks,
                    request.block_hashes,
                    request.shared_prefix_boundary,
                )
            )
        if self._watch_reallocation:
            copies = scheduler_output.kv_cache_block_copies
            if copies:
                allocated.add([copy.dst_block_id for copy in copies], "kv_cache_block_copies")
            allocated.discard(0)  # the null block
        step = self.scheduler.plan_step(updates, allocated, self._state_blocks(scheduler_output))
        flush.extend(step.flush_job_ids)
        stores = step.store_jobs
        finals = [
            (rid, self._finishing.pop(rid))
            for rid in scheduler_output.finished_req_ids
            if rid in self._finishing
        ]
        for plan in self.scheduler.finish_requests(finals):
            stores.extend(plan.store_jobs)
        if self.events.self_describing:
            self.events.record_stores(stores, ChainMap(self._requests, self._ending))
            for rid, _ in finals:
                self._ending.pop(rid, None)
        meta = KVOffloadMetadata(
            loads=self._loads,
            stores=stores,
            flush_job_ids=sorted(set(flush)),
            held_request_ids=self._held,
            promotions=step.promote_jobs,
            cascades=step.cascade_jobs,
        )
        self._loads, self._held = [], []
        if self.tier_lookups and not self._started:
            # vLLM sets NONE_HASH after it builds the connector: handed over at the first step.
            none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
            if none_hash is not None:
                self._started = True
                for lookups in self.tier_lookups:
                    lookups.start(bytes(none_hash))
        return meta

    def _state_blocks(self, scheduler_output: SchedulerOutput) -> list[StateBlock]:
        """The Mamba "align" states vLLM committed in this step (its exact blocks: a Mamba table
        is not positionally stable)."""
        if not self._has_state:
            return []
        block_state = scheduler_output.kv_connector_block_state
        if block_state is None:
            return []
        return [
            StateBlock(rid, group, block_id, num_tokens)
            for rid, entries in block_state.boundary_state_offloads.items()
            if self.scheduler.has_request(rid)
            for group, block_id, num_tokens in entries
        ]

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, KVOffloadWorkerMetadata):
            return
        reports = self._reports.aggregate(meta).results
        for job_id, (count, ok) in list(reports.items()):
            if count >= self.settings.world_size:
                del reports[job_id]
                self.scheduler.complete_job(job_id, ok)
                self.events.job_ended(job_id)
        self._reports = KVOffloadWorkerMetadata(reports)
        if meta.usable_slots:
            self._grow(meta.usable_slots)
        if meta.tiers_down:
            self._down.update(meta.tiers_down)
            for i in {tier for _, tier in meta.tiers_down}:
                self.tier_lookups[i].note_workers_down(
                    any(d for (_, t), d in self._down.items() if t == i)
                )
        # Each secondary tier counts the workers' reports of its jobs itself.
        tier_of = self.scheduler.secondary_tier_of
        for job_id, (count, ok_keys) in meta.promoted.items():
            tier_of(job_id).promoted(job_id, count, ok_keys)
        for job_id, (count, written, in_tier) in meta.cascaded.items():
            tier_of(job_id).cascaded(job_id, count, written, in_tier)
        for i, keys in meta.evicted.items():
            self.scheduler.secondary_tiers[i].evicted(list(dict.fromkeys(keys)))

    def on_handshake(self, metadata: Iterable[object]) -> None:
        """Each worker's ready slots, once its KV caches are registered: the first step plans
        against them. Others' metadata (next to ours in a MultiConnector) is not ours to read."""
        reported = {
            m.rank: m.usable_slots for m in metadata if isinstance(m, KVOffloadHandshakeMetadata)
        }
        if not reported:
            return
        self._grow(reported)
        missing = sorted(set(range(self.settings.world_size)) - set(self._usable))
        if missing:
            # vLLM keys the handshake by (pp_rank, tp_rank): ranks that share a key (prefill
            # context parallelism without decode context parallelism) reach it as one.
            logger.warning(
                "kvoffload: vLLM's handshake reported no CPU pool for workers %s: the CPU tier "
                "starts empty and grows once every worker has reported with a step's results",
                missing,
            )

    def _grow(self, reported: dict[int, int]) -> None:
        """A slot counts once every worker has its memory ready (each pins its own pool)."""
        world_size = self.settings.world_size
        store = self.scheduler.store
        for rank, slots in reported.items():
            if not (type(rank) is int and 0 <= rank < world_size and type(slots) is int):
                if not self._said_bad_report:
                    self._said_bad_report = True
                    logger.error(
                        "kvoffload: a worker reported rank=%r, usable_slots=%r; allowed: a rank "
                        "in 0..%d and an int (ignored)",
                        rank,
                        slots,
                        world_size - 1,
                    )
                continue
            # More than the tier holds is another pool's size: never more than ours.
            self._usable[rank] = min(max(slots, self._usable.get(rank, 0)), store.num_slots)
        if len(self._usable) < world_size:
            return
        usable = min(self._usable.values())
        if usable > store.usable_slots:
            if store.usable_slots == 0 or usable == store.num_slots:
                logger.info(
                    "kvoffload: the CPU tier may use %d of its %d slots", usable, store.num_slots
                )
            store.set_usable_slots(usable)

    def request_finished(self, request: Request) -> bool:
        """Whether vLLM must keep the request's GPU blocks until the workers report it in
        `finished_sending`: stores in flight, or its last store (planned in the next
        build_connector_meta), read them."""
        rid = request.request_id
        if self.trace is not None:
            self._record(request)
        self._requests.pop(rid, None)
        self.events.unwatch(rid)
        if not self.scheduler.has_request(rid):
            return False
        if request.status == RequestStatus.FINISHED_ABORTED:
            computed = min(request.num_computed_tokens, request.num_tokens)
        else:
            # The last sampled token never had its KV computed.
            computed = max(request.num_prompt_tokens, request.num_tokens - 1)
        final = RequestUpdate(
            rid,
            computed,
            request.num_tokens,
            block_hashes=request.block_hashes,
            shared_prefix_boundary=request.shared_prefix_boundary,
        )
        self._finishing[rid] = final
        if self.events.self_describing:
            self._ending[rid] = request
        # A request still loading is waiting for its KV: vLLM holds its blocks until the load is
        # reported in finished_recving, and would free them twice if we held them too.
        hold = not self.scheduler.is_loading(rid) and self.scheduler.would_hold_blocks(rid, final)
        if hold:
            self._held.append(rid)
        return hold

    def _record(self, request: Request) -> None:
        assert self.trace is not None
        # The oldest request the scheduler holds (insertion order) starts a new file's clock,
        # so that the requests it will hold arrived after it (one still waiting for its first
        # lookup may not have; the recorder counts it from the clock's start).
        oldest = next(iter(self._requests.values()), request)
        n_prompt = request.num_prompt_tokens
        self.trace.record(
            request.arrival_time,
            min(oldest.arrival_time, request.arrival_time),
            n_prompt,
            request.num_output_tokens,
            request.block_hashes[: n_prompt // self.settings.config.tokens_per_block],
        )

    def take_events(self) -> Iterator[KVCacheEvent]:
        """The CPU tier's events, then each secondary tier's (`KVEvents`)."""
        places = [(0, self.scheduler.store.take_events())]
        places += [(i + 1, t.take_events()) for i, t in enumerate(self.scheduler.secondary_tiers)]
        return self.events.translate(places)

    def get_stats(self) -> KVOffloadStats | None:
        now = self.scheduler.stats()
        delta: dict[str, int | float] = dict(stats_delta(now, self._stats_mark))
        self._stats_mark = now
        store = self.scheduler.store
        if store.usable_slots != self._usable_reported:
            # Reported when the tier grows (once for a tier pinned before the first step).
            self._usable_reported = store.usable_slots
            delta["cpu_tier_usable_bytes"] = store.usable_slots * self.settings.bytes_per_chunk
            delta["cpu_tier_ready_ratio"] = store.usable_slots / store.num_slots
        if self.trace is not None:
            dropped = self.trace.take_dropped()
            if dropped:
                delta["trace_lines_dropped"] = dropped
        stats = KVOffloadStats(data=delta)
        # The lookups' own connections (their failures); the workers report what they moved.
        add_reports(
            stats.data,
            (
                (tier.kind, lookups.take_report())
                for tier, lookups in zip(self.settings.tiers, self.tier_lookups, strict=True)
            ),
        )
        return None if stats.is_empty() else stats

    def reset_cache(self) -> bool:
        # Requests that finished since the last step may have had their blocks freed: they end
        # without their final stores, which would otherwise be planned from chunk 0 over blocks
        # now another request's (vLLM's connector drops their state too).
        finals = [(rid, None) for rid in self._finishing]
        self._finishing.clear()
        self._ending.clear()
        self.scheduler.finish_requests(finals)
        self.scheduler.reset()
        return True

    def has_pending_push_work(self) -> bool:
        return self.scheduler.has_jobs_in_flight

    def shutdown(self) -> None:
        trace = getattr(self, "trace", None)  # None while __init__ fails before it is made
        if trace is not None:
            trace.close()
        for lookups in self.tier_lookups:
            lookups.close()
