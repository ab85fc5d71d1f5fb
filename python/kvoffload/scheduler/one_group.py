"""`OneGroupPlanner`: a model of one full-attention KV-cache group, the usual case. A request's
keys, block table and store frontier are its own fields; secondary tiers may stand behind the CPU
tier."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from kvoffload import _rust
from kvoffload._rust import BlockSet
from kvoffload.scheduler import checks
from kvoffload.scheduler.hybrid import GroupState
from kvoffload.scheduler.jobs import IntArray, LoadJob, StoreJob
from kvoffload.scheduler.planner import CheckedUpdate, Context, Request
from kvoffload.store import KeyList

_GROUP_IDX = 0


class OneGroupPlanner:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.config = ctx.config

    # --- checks --------------------------------------------------------------------------------

    def new_groups(self) -> list[GroupState] | None:
        return None

    def check_local(self, req: Request, num_local_tokens: int) -> None:
        return  # a local prefix may end inside a block

    def check_tables(self, name: str, values: Sequence[int]) -> IntArray:
        return checks.block_ids(name, values)

    def check_new_blocks(self, values: Sequence[int]) -> IntArray:
        return checks.block_ids("new_block_ids", values)

    def check_reallocated(self, values: Iterable[int] | BlockSet) -> IntArray:
        # The jobs' block arrays are asked with an array.
        if isinstance(values, BlockSet):
            return np.asarray(values.to_list(), dtype=np.int64)
        return checks.block_ids("reallocated_block_ids", list(values))

    def state_groups(self) -> list[int]:
        return []

    # --- tables and keys ----------------------------------------------------------------------

    def extend_keys(self, req: Request, block_hashes: Sequence[bytes]) -> None:
        # Reads only the hashes past the chunks that already have keys.
        bpc = self.config.blocks_per_chunk
        if type(block_hashes) is not list or len(block_hashes) >= (len(req.keys) + 1) * bpc:
            req.keys.extend_chunk_keys(block_hashes, bpc, _GROUP_IDX)

    def restart(self, req: Request) -> None:
        self.drop_tables(req)  # its frontier is `req.stored_chunks`, which the scheduler resets

    def drop_tables(self, req: Request) -> None:
        req.block_ids = []

    def set_tables(self, req: Request, tables: IntArray) -> None:
        req.block_ids = tables.tolist()

    def has_blocks(self, req: Request) -> bool:
        return bool(req.block_ids)

    # --- lookups and loads --------------------------------------------------------------------

    def lookup(self, req: Request, num_local: int, num_tokens: int) -> int | None:
        ctx, tpc = self.ctx, self.config.tokens_per_chunk
        window = _rust.load_window(num_tokens, num_local, req.max_load_tokens, len(req.keys), tpc)
        if window is None:
            return 0
        first, end, _ = window
        ctx.stats.lookups += 1
        hits, pending = ctx.store.lookup_prefix(req.keys.view(first, end))
        if pending:
            ctx.stats.deferred_lookups += 1
            return None
        if first + hits < end:
            # The chain in order: the first tier that promotes, or is still being asked, ends
            # this lookup; the next ones are asked once it has nothing more.
            for tier in req.load_tiers:
                if tier.promote(req.request_id, req.keys, first, first + hits, end, ctx.rank(req)):
                    ctx.stats.deferred_lookups += 1
                    return None
        loadable = _rust.loadable_tokens(window, hits, num_local, tpc)
        if loadable and ctx.loads_in_flight:
            # Chunks another request is loading now will be GPU prefix-cache hits once that load
            # lands: wait for it rather than copy them twice (as vLLM's connector does).
            end = -(-(num_local + loadable) // tpc)
            if ctx.store.first_pinned(req.keys.view(first, end)) < end - first:
                ctx.stats.deferred_lookups += 1
                return None
        if loadable:
            req.planned_load = (num_local, loadable)
        return loadable

    def load(self, req: Request, tables: IntArray, num_local: int, loadable: int) -> LoadJob:
        ctx, cfg = self.ctx, self.config
        tpc, bpc = cfg.tokens_per_chunk, cfg.blocks_per_chunk
        first = num_local // tpc
        end = -(-(num_local + loadable) // tpc)
        if end * bpc > len(tables):
            raise ValueError(
                f"block_ids has {len(tables)} blocks for request {req.request_id!r}; the load of "
                f"{loadable} tokens needs {end * bpc}"
            )
        skip = (num_local - first * tpc) // cfg.tokens_per_block
        dst = tables[first * bpc + skip : end * bpc]
        keys = KeyList(req.keys.view(first, end))
        # Pins, or raises with nothing pinned.
        slots = ctx.store.prepare_load(keys, rank=ctx.rank(req), first_position=first)
        if cfg.eviction_policy == "arc":
            ctx.store.touch(keys)  # a reuse: ARC's frequent list
        req.block_ids, req.planned_load = tables.tolist(), None
        job_id = ctx.track("load", req, keys, dst)
        # Loaded chunks are in the CPU tier already; chunks before them are on the GPU.
        req.stored_chunks = max(req.stored_chunks, end)
        ctx.stats.hit_tokens += loadable
        return LoadJob(job_id, req.request_id, keys, slots, dst, skip, loadable, first)

    # --- stores --------------------------------------------------------------------------------

    def store(self, c: CheckedUpdate) -> StoreJob | None:
        req = c.req
        req.num_tokens = c.num_tokens
        req.block_ids.extend(c.new_blocks.tolist())
        ctx, bpc = self.ctx, self.config.blocks_per_chunk
        n = self._storable(req, c.computed, req.num_tokens)
        start = req.stored_chunks
        if n <= start:
            return None
        # A request longer than the whole tier offers all its chunks: the ones stored already
        # are then protected, and a partial store keeps the head (what later requests can hit)
        # instead of evicting it for the tail; the rest is given up, not offered again.
        first = 0 if n > ctx.store.usable_slots else start
        # Built before the store changes anything, so nothing below can fail half-way.
        chunks = np.asarray(req.block_ids[first * bpc : n * bpc], dtype=np.int64).reshape(-1, bpc)
        plan = ctx.store.prepare_store(
            req.keys.view(first, n), rank=ctx.rank(req), first_position=first, partial=True
        )
        if plan is None:
            # The frontier stays: the same chunks are offered again next step.
            ctx.stats.store_refusals += 1
            return None
        req.stored_chunks = n
        if not plan.keys:
            return None
        src = chunks[plan.indices].reshape(-1)
        assert isinstance(plan.keys, KeyList)
        job_id = ctx.track("store", req, plan.keys, src)
        return StoreJob(job_id, req.request_id, plan.keys, plan.slots, src, plan.indices + first)

    def would_store(self, c: CheckedUpdate) -> bool:
        return self._storable(c.req, c.computed, c.num_tokens) > c.req.stored_chunks

    def _storable(self, req: Request, num_computed_tokens: int, num_tokens: int) -> int:
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

    def touch_finished(self, req: Request) -> None:
        # Not a reuse (loads counted theirs), so ARC keeps once-stored chunks in its T1.
        self.ctx.store.touch(req.keys.view(0, req.stored_chunks), reuse=False)

    def reset_request(self, req: Request) -> None:
        return  # its frontier is `req.stored_chunks`, which the scheduler resets

    def flush(self, reallocated: IntArray) -> list[int]:
        jobs = self.ctx.jobs
        if not jobs or not reallocated.size:
            return []
        ids = list(jobs)
        blocks = [jobs[j].gpu_block_ids for j in ids]
        hit = np.isin(np.concatenate(blocks), reallocated)
        if not hit.any():
            return []
        owner = np.repeat(np.arange(len(ids)), [len(b) for b in blocks])
        return sorted(ids[i] for i in set(owner[hit].tolist()))
