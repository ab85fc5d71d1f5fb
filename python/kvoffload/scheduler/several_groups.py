"""`SeveralGroupsPlanner`: a model of several KV-cache groups, or of a window group (sliding
window, chunked-local attention, Mamba). Block tables and new blocks come per group; what each
group keeps, hits and offers is `HybridPlanner`'s rule, and window and state blocks the engine
hands out again while their request runs fence the stores reading them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from kvoffload._rust import BlockSet
from kvoffload.scheduler import checks
from kvoffload.scheduler.hybrid import NULL_BLOCK, GroupSlice, GroupState, HybridPlanner
from kvoffload.scheduler.jobs import LoadJob, StoreJob
from kvoffload.scheduler.planner import CheckedUpdate, Context, Request
from kvoffload.store import KeyList, KeyStatus

_PENDING = int(KeyStatus.PENDING)


class SeveralGroupsPlanner:
    def __init__(self, ctx: Context, hybrid: HybridPlanner) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.hybrid = hybrid
        self._tabled: set[str] = set()
        """Requests that hold block tables."""

    # --- checks --------------------------------------------------------------------------------

    def new_groups(self) -> list[GroupState] | None:
        return self.hybrid.new_state()

    def check_local(self, req: Request, num_local_tokens: int) -> None:
        tpb = self.config.tokens_per_block
        if num_local_tokens % tpb:
            raise ValueError(
                f"num_local_tokens={num_local_tokens} for request {req.request_id!r} is invalid: "
                f"with several KV-cache groups a local prefix is whole GPU blocks (a multiple "
                f"of tokens_per_block={tpb})"
            )

    def check_tables(self, name: str, values: Sequence[Sequence[int]]) -> list[list[int]]:
        return checks.group_tables(name, values, self.hybrid.num_groups)

    def check_new_blocks(self, values: Sequence[Sequence[int]]) -> list[list[int]]:
        if type(values) is tuple and not values:  # RequestUpdate's default: nothing allocated
            return []
        return checks.group_tables("new_block_ids", values, self.hybrid.num_groups, empty_ok=True)

    def check_reallocated(self, values: Iterable[int] | BlockSet) -> BlockSet:
        # Asked for membership: a BlockSet (an engine's was checked as it was filled).
        return values if isinstance(values, BlockSet) else checks.realloc_set(values)

    def state_groups(self) -> list[int]:
        """The Mamba groups, whose states are stored from `StateBlock`s."""
        return [g for g in range(self.hybrid.num_groups) if self.hybrid.is_state(g)]

    # --- tables and keys ----------------------------------------------------------------------

    def extend_keys(self, req: Request, block_hashes: Sequence[bytes]) -> None:
        assert req.groups is not None
        self.hybrid.extend_keys(req.groups, block_hashes)

    def restart(self, req: Request) -> None:
        self.drop_tables(req)
        for state in req.groups or ():
            state.next_stored = 0

    def drop_tables(self, req: Request) -> None:
        for state in req.groups or ():
            state.block_ids = []
        self._tabled.discard(req.request_id)

    def set_tables(self, req: Request, tables: list[list[int]]) -> None:
        assert req.groups is not None
        for state, t in zip(req.groups, tables, strict=True):
            state.block_ids = t
        req.new_tables = True
        self._tabled.add(req.request_id)

    def has_blocks(self, req: Request) -> bool:
        return any(state.block_ids for state in req.groups or ())

    # --- lookups and loads --------------------------------------------------------------------

    def lookup(self, req: Request, num_local: int, num_tokens: int) -> int | None:
        assert req.groups is not None
        ctx = self.ctx
        ctx.stats.lookups += 1
        hit = self.hybrid.lookup(
            ctx.store,
            req.groups,
            num_local,
            num_tokens,
            req.max_load_tokens,
            ctx.loads_in_flight > 0,
        )
        if hit is None:
            ctx.stats.deferred_lookups += 1
            return None
        if hit:
            req.planned_load = (num_local, hit)
        return hit

    def load(self, req: Request, tables: list[list[int]], num_local: int, loadable: int) -> LoadJob:
        assert req.groups is not None
        ctx, cfg = self.ctx, self.config
        tpb, tpc = cfg.tokens_per_block, cfg.tokens_per_chunk
        num_cached = num_local + loadable
        end_chunk = -(-num_cached // tpc)
        # Pins, or raises with nothing pinned.
        plan = ctx.store.load_groups(
            [state.keys for state in req.groups],
            tables,
            first_block=-(-num_local // tpb),
            num_blocks=-(-num_cached // tpb),
            end_chunk=end_chunk,
            blocks_per_chunk=cfg.blocks_per_chunk,
            rank=ctx.rank(req),
            used=[state.used for state in req.groups],
            touch=cfg.eviction_policy == "arc",  # a reuse: ARC's frequent list
        )
        self.set_tables(req, tables)
        req.planned_load = None
        for state in req.groups:
            state.next_stored = max(state.next_stored, end_chunk)
        job_id = ctx.track("load", req, plan.keys, plan.gpu_block_ids)
        ctx.stats.hit_tokens += loadable
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

    # --- stores --------------------------------------------------------------------------------

    def store(self, c: CheckedUpdate) -> StoreJob | None:
        req = c.req
        assert req.groups is not None
        req.num_tokens = c.num_tokens
        if c.new_blocks:  # [] when the step allocated nothing
            for state, blocks in zip(req.groups, c.new_blocks, strict=True):
                state.block_ids.extend(blocks)
        ctx, hybrid = self.ctx, self.hybrid
        offloadable = self._offloadable(req, c.computed, req.num_tokens)
        whole = offloadable // hybrid.tpc
        for state in req.groups:
            if whole > state.next_stored:
                break
        else:
            # No group has a new chunk to offer (most decode steps): the frontiers stay.
            return None
        junction = c.shared_prefix_boundary
        boundaries = (req.num_prompt_tokens - 1,) + ((junction,) if junction else ())
        decoding = offloadable > req.num_prompt_tokens
        offers, ends = hybrid.offers(req.groups, offloadable, decoding, req.finishing, boundaries)
        plan = None
        bpc = self.config.blocks_per_chunk
        if offers:
            # A chunk another request is storing now is not a use of it (as in vLLM).
            plan = ctx.store.offer_group_store(
                offers,
                rank=ctx.rank(req),
                num_groups=hybrid.num_groups,
                windowed=hybrid.window_mask,
                blocks_per_chunk=bpc,
                used=[state.used for state in req.groups],
            )
            if plan is None:
                # The frontier stays: the same chunks are offered again next step.
                ctx.stats.store_refusals += 1
                return None
        for state, end in zip(req.groups, ends, strict=True):
            state.next_stored = max(state.next_stored, end)
        if plan is None or not plan.keys:
            return None
        parts = tuple(GroupSlice(g, n, n * bpc) for g, n in enumerate(plan.counts) if n)
        job_id = ctx.track("store", req, plan.keys, plan.blocks, plan.window_blocks)
        return StoreJob(
            job_id, req.request_id, plan.keys, plan.slots, plan.blocks, plan.chunks, parts
        )

    def would_store(self, c: CheckedUpdate) -> bool:
        # Whether any group has a chunk to offer (it may then turn out unreachable).
        req = c.req
        assert req.groups is not None
        offloadable = self._offloadable(req, c.computed, c.num_tokens)
        return any(
            self.hybrid.storable(g, state, offloadable, False, True) > state.next_stored
            for g, state in zip(self.hybrid.groups, req.groups, strict=True)
        )

    def store_state(
        self, state: tuple[Request, int, int, int], num_tokens: dict[str, int]
    ) -> StoreJob | None:
        """One Mamba state's store: its block read into the last block of its chunk's slot."""
        ctx = self.ctx
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
        if int(ctx.store.lookup(batch.keys)[0]) != _PENDING:
            chunk = int(batch.chunks[0])
            req.groups[group].mark_used(chunk, chunk + 1)
        plan = ctx.store.prepare_store(batch.keys, rank=ctx.rank(req), positions=batch.positions)
        if plan is None:
            # A hand-off is offered once: vLLM gives it up too.
            ctx.stats.store_refusals += 1
            return None
        if not plan.keys:
            return None
        assert isinstance(plan.keys, KeyList)
        src = np.array([block], dtype=np.int64)
        # The engine frees the block once the state has moved on: a reuse waits for the store.
        job_id = ctx.track("store", req, plan.keys, src, (block,))
        part = GroupSlice(group, 1, 1, self.config.blocks_per_chunk - 1)
        return StoreJob(job_id, req.request_id, plan.keys, plan.slots, src, batch.chunks, (part,))

    def _offloadable(self, req: Request, computed: int, num_tokens: int) -> int:
        n = min(computed, num_tokens)
        if req.max_offload_tokens is not None:
            n = min(n, req.max_offload_tokens)
        if self.config.offload_prompt_only:
            n = min(n, req.num_prompt_tokens)
        return n

    def touch_finished(self, req: Request) -> None:
        # Not a reuse (loads counted theirs), so ARC keeps once-stored chunks in its T1.
        assert req.groups is not None
        self.ctx.store.touch_group_used(
            [(state.keys, state.used) for state in req.groups], reuse=False
        )

    def reset_request(self, req: Request) -> None:
        window = self.hybrid.window_groups()
        bpc = self.config.blocks_per_chunk
        for g, state in enumerate(req.groups or ()):
            if g in window:
                # Blocks behind the frontier were never checked for reallocation (the window
                # may have freed them long ago): they are not stored again.
                frontier = min(state.next_stored * bpc, len(state.block_ids))
                state.block_ids[:frontier] = [NULL_BLOCK] * frontier
            state.next_stored = 0
            state.used = bytearray()

    def flush(self, reallocated: BlockSet) -> list[int]:
        """The stores in flight reading a window block handed out again (wait for them), and
        the tables that must not be read there any more (`HybridPlanner.drop_reallocated`);
        before this step's new blocks are appended."""
        ctx = self.ctx
        window = self.hybrid.window_groups()
        # Few stores are in flight, each reading a few window blocks; many blocks are handed out.
        flush = [
            j
            for j, job in ctx.jobs.items()
            if reallocated and job.window_blocks and reallocated.intersects(job.window_blocks)
        ]
        live: list[list[GroupState]] = []
        requests = ctx.requests
        for rid in list(self._tabled):
            req = requests.get(rid)
            if req is None or req.finished:
                self._tabled.discard(rid)
                continue
            if req.new_tables:
                req.new_tables = False
                continue
            if reallocated and window:
                assert req.groups is not None
                live.append(req.groups)
        self.hybrid.drop_reallocated(live, reallocated)
        return flush
