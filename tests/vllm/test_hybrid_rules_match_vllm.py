"""Property tests: the hybrid-model rules of our engine-agnostic scheduler (`groups.py`,
`hybrid.py`) give the same answers as vLLM 0.33's own code on the same random inputs.

vLLM's functions are called directly (unbound methods on fake `self`s, classmethods with real
specs), so a drift in either implementation shows up as a counterexample here. Status arrays use
ours: 0 = absent (vLLM MISS), 1 = pending (HIT_PENDING), 2 = ready (HIT); our store never
answers RETRY, so it is never generated.
"""

from __future__ import annotations

import logging
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    get_sliding_window_size_in_chunks,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    GroupOffloadConfig,
    OffloadingConnectorScheduler,
    RequestOffloadState,
    SchedulerOffloadConfig,
)
from vllm.v1.core.single_type_kv_cache_manager import (
    ChunkedLocalAttentionManager,
    FullAttentionManager,
    SlidingWindowManager,
)
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_offload.base import LookupResult
from vllm.v1.request import RequestStatus

from kvoffload import _rust
from kvoffload.scheduler.groups import KVGroup, cdiv
from kvoffload.scheduler.hybrid import GroupState, HybridPlanner
from kvoffload.store import CpuStore, KeyList

ABSENT, PENDING, READY = 0, 1, 2
TO_VLLM = {ABSENT: LookupResult.MISS, PENDING: LookupResult.HIT_PENDING, READY: LookupResult.HIT}
_SPEC = {"num_kv_heads": 1, "head_size": 8, "dtype": torch.float16}


def random_status(rng: random.Random, n: int) -> list[int]:
    """Statuses biased towards ready, with a per-case mix (some cases all ready, some sparse)."""
    p_absent = rng.choice([0.0, 0.05, 0.15, 0.3, 0.6])
    p_pending = rng.choice([0.0, 0.0, 0.05, 0.2])
    out = []
    for _ in range(n):
        r = rng.random()
        out.append(0 if r < p_absent else 1 if r < p_absent + p_pending else 2)
    return out


class FakeManager:
    """vLLM's `OffloadingManager.lookup` answering from a key -> status map."""

    def __init__(self, status_of: dict) -> None:
        self.status_of = status_of
        self.calls = 0

    def lookup(self, key, req_context):
        self.calls += 1
        return TO_VLLM[self.status_of[key]]


def vllm_spec(group: KVGroup, tpb: int):
    if group.kind == "sliding":
        return SlidingWindowSpec(
            block_size=tpb,
            sliding_window=group.window,
            extra_retained_tokens=group.extra_retained_tokens,
            **_SPEC,
        )
    if group.kind == "chunked_local":
        return ChunkedLocalAttentionSpec(block_size=tpb, attention_chunk_size=group.window, **_SPEC)
    return FullAttentionSpec(block_size=tpb, **_SPEC)


_MANAGER = {
    "full": FullAttentionManager,
    "sliding": SlidingWindowManager,
    "chunked_local": ChunkedLocalAttentionManager,
}


def vllm_group_config(index: int, group: KVGroup, tpb: int, bpc: int) -> GroupOffloadConfig:
    spec = vllm_spec(group, tpb)
    return GroupOffloadConfig(
        group_idx=index,
        tokens_per_block=tpb,
        tokens_per_chunk=tpb * bpc,
        hashes_per_chunk=bpc,
        kv_event_group_spec=None,  # type: ignore[arg-type]
        sliding_window_size_in_chunks=get_sliding_window_size_in_chunks(spec, tpb * bpc),
        kv_cache_spec=spec,
        manager_cls=_MANAGER[group.kind],
        is_eagle_group=group.eagle,
    )


def random_group(rng: random.Random, kind: str, tpc: int) -> KVGroup:
    if kind == "full":
        return KVGroup("full", eagle=rng.random() < 0.2)
    window = rng.randint(1, 5 * tpc + 3)
    extra = rng.choice([0, 0, rng.randint(1, 2 * tpc)]) if kind == "sliding" else 0
    return KVGroup(kind, window, extra, eagle=rng.random() < 0.3)  # type: ignore[arg-type]


# --- 1. window_hits vs _sliding_window_lookup --------------------------------------------------


def vllm_window_lookup(status: list[int], window: int, first_window: int) -> int | None:
    fake = SimpleNamespace(manager=FakeManager(dict(enumerate(status))))
    return OffloadingConnectorScheduler._sliding_window_lookup(
        fake,  # type: ignore[arg-type]
        list(range(len(status))),
        window,
        None,  # type: ignore[arg-type]
        first_window,
    )


WINDOW_CASES = 6000


def test_window_hits_matches_sliding_window_lookup() -> None:
    rng = random.Random(1)
    seen = set()
    for _ in range(WINDOW_CASES):
        status = random_status(rng, rng.randint(0, 40))
        window = rng.randint(1, 6)
        first = window if rng.random() < 0.4 else window + rng.randint(1, 3)
        theirs = vllm_window_lookup(status, window, first)
        ours = _rust.window_hits(bytes(status), window, first)
        assert ours == theirs, (status, window, first)
        seen.add("none" if theirs is None else "zero" if theirs == 0 else "hit")
    assert seen == {"none", "zero", "hit"}


def test_window_hits_exhaustive_small() -> None:
    """Every status string of length <= 6 over every window <= 3 and first window <= 5."""
    import itertools

    for n in range(7):
        for status in itertools.product((0, 1, 2), repeat=n):
            for window in range(1, 4):
                for first in range(window, 6):
                    theirs = vllm_window_lookup(list(status), window, first)
                    ours = _rust.window_hits(bytes(status), window, first)
                    assert ours == theirs, (status, window, first)


# --- 2. CpuStore.lookup_prefix vs _maximal_prefix_lookup ------------------------------------


def vllm_prefix_lookup(status: list[int]) -> int | None:
    fake = SimpleNamespace(
        manager=FakeManager(dict(enumerate(status))),
        _events_tracker=SimpleNamespace(record_lookup=lambda *a: None),
    )
    return OffloadingConnectorScheduler._maximal_prefix_lookup(
        fake,  # type: ignore[arg-type]
        list(range(len(status))),
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        0,
    )


def test_lookup_prefix_matches_maximal_prefix_lookup() -> None:
    import itertools

    rng = random.Random(2)
    cases = [list(s) for n in range(7) for s in itertools.product((0, 1, 2), repeat=n)]
    cases += [random_status(rng, rng.randint(0, 40)) for _ in range(5000)]
    for status in cases:
        theirs = vllm_prefix_lookup(status)
        # Our full-attention lookup: the real store's lookup_prefix (a key being stored defers).
        store = CpuStore(max(1, len(status)))
        keys = [i.to_bytes(8, "big") for i in range(len(status))]
        present = [k for k, st in zip(keys, status, strict=True) if st != ABSENT]
        if present:
            store.prepare_store(present)
            store.complete_store([k for k, st in zip(keys, status, strict=True) if st == READY])
        hits, pending = store.lookup_prefix(keys)
        assert (None if pending else hits) == theirs, status


# --- 3. window sizes in chunks -----------------------------------------------------------------


def test_window_chunks_match_vllm() -> None:
    rng = random.Random(3)
    for _ in range(4000):
        tpb = rng.choice([1, 2, 4, 16])
        bpc = rng.randint(1, 4)
        tpc = tpb * bpc
        kind = rng.choice(["full", "sliding", "chunked_local"])
        group = random_group(rng, kind, tpc)
        config = vllm_group_config(0, group, tpb, bpc)
        assert group.window_chunks(tpc) == config.sliding_window_size_in_chunks, (group, tpc)
        for _ in range(5):
            num_tokens = rng.randint(0, 12 * tpc)
            assert _rust.load_window_chunks(group.spec(tpc), num_tokens, tpc) == (
                config.load_window_size_in_chunks(num_tokens)
            ), (group, tpc, num_tokens)


# --- 4. reachable vs SlidingWindowManager.reachable_block_mask ---------------------------------


def vllm_reachable(
    group: KVGroup,
    tpb: int,
    bpc: int,
    interval: int | None,
    start: int,
    end: int,
    boundaries: tuple[int, ...],
    final_segment_end_block: int | None = None,
) -> list[bool] | None:
    """As the connector's `_reachable_store_block_mask` calls it: a sliding spec widened by
    its extra retained tokens, the full-attention chunk as alignment."""
    spec = vllm_spec(group, tpb)
    if isinstance(spec, SlidingWindowSpec):
        spec = SlidingWindowSpec(
            block_size=tpb,
            sliding_window=group.window + group.extra_retained_tokens,
            extra_retained_tokens=0,
            **_SPEC,
        )
    return _MANAGER[group.kind].reachable_block_mask(
        start_block=start,
        end_block=end,
        alignment_tokens=tpb * bpc,
        kv_cache_spec=spec,
        use_eagle=group.eagle,
        retention_interval=interval,
        reachable_boundaries=boundaries,
        final_segment_end_block=final_segment_end_block,
    )


def same_mask(ours, theirs) -> bool:
    if ours is None or theirs is None:
        return ours is None and theirs is None
    return ours.dtype == np.bool_ and ours.tolist() == list(theirs)


def random_reach_case(rng: random.Random, kinds=("sliding",)):
    tpb = rng.choice([1, 2, 4, 16])
    bpc = rng.randint(1, 4)
    tpc = tpb * bpc
    group = random_group(rng, rng.choice(kinds), tpc)
    interval = rng.choice([None, 0, tpc * rng.randint(1, 6)])
    if rng.random() < 0.7:  # the connector's ranges are whole chunks
        start = rng.randint(0, 10) * bpc
        end = start + rng.randint(0, 10) * bpc
    else:
        start = rng.randint(0, 30)
        end = start + rng.randint(0, 30)
    boundaries = tuple(rng.randint(0, (end + 3) * tpb) for _ in range(rng.randint(0, 2)))
    return tpb, bpc, group, interval, start, end, boundaries


REACH_CASES = 5000


def test_reachable_matches_reachable_block_mask() -> None:
    rng = random.Random(4)
    kinds = set()
    for _ in range(REACH_CASES):
        tpb, bpc, group, interval, start, end, boundaries = random_reach_case(
            rng, ("sliding", "sliding", "sliding", "chunked_local", "full")
        )
        planner = HybridPlanner([group], tpb, bpc, retention_interval=interval)
        ours = planner.reachable(group, start, end, boundaries)
        theirs = vllm_reachable(group, tpb, bpc, interval, start, end, boundaries)
        assert same_mask(ours, theirs), (group, tpb, bpc, interval, start, end, boundaries)
        kinds.add("dense" if theirs is None else "all" if all(theirs) else "sparse")
    assert kinds == {"dense", "all", "sparse"}


def test_final_segment_end_block_is_moot_at_chunk_alignment() -> None:
    """The connector passes `final_segment_end_block` = its store horizon in chunks * bpc, and
    only when `retention_interval` is None and the group is not EAGLE (else None). Then a segment
    is one chunk, so the horizon never ends a partial segment: our omission of it is exact."""
    rng = random.Random(5)
    for _ in range(REACH_CASES):
        tpb, bpc, group, _, start, end, boundaries = random_reach_case(rng)
        group = KVGroup("sliding", group.window, group.extra_retained_tokens, eagle=False)
        planner = HybridPlanner([group], tpb, bpc, retention_interval=None)
        horizon = rng.randint(0, 25) * bpc
        ours = planner.reachable(group, start, end, boundaries)
        theirs = vllm_reachable(group, tpb, bpc, None, start, end, boundaries, horizon)
        assert same_mask(ours, theirs), (group, tpb, bpc, start, end, boundaries, horizon)
        assert theirs == vllm_reachable(group, tpb, bpc, None, start, end, boundaries, None)


def test_final_segment_end_block_matters_only_where_the_connector_never_passes_it() -> None:
    """Documents what our omission would miss: vLLM's manager keeps the tail of a partial final
    segment, which exists only for a horizon that is not a segment multiple: with
    `retention_interval` = k chunks, k >= 2 (the connector then passes None), or a horizon off
    the chunk grid (the connector's horizon is whole chunks). EAGLE groups ignore it."""
    tpb, bpc = 4, 2
    group = KVGroup("sliding", 5)  # need = 1 block
    planner = HybridPlanner([group], tpb, bpc, retention_interval=2 * tpb * bpc)
    ours = planner.reachable(group, 0, 8, ())
    assert ours is not None and ours.tolist() == [False, False, False, True] * 2
    # The connector: retention_interval is set, so the horizon is None: the same mask as ours.
    assert vllm_reachable(group, tpb, bpc, 2 * tpb * bpc, 0, 8, (), None) == ours.tolist()
    # A horizon of 3 chunks (6 blocks) would also keep block 5, the end of its partial segment.
    with_horizon = vllm_reachable(group, tpb, bpc, 2 * tpb * bpc, 0, 8, (), 6)
    assert with_horizon == [False, False, False, True, False, True, False, True]
    # retention_interval None, a horizon off the chunk grid (block 5): block 4 kept as well.
    dense = HybridPlanner([group], tpb, bpc, retention_interval=None).reachable(group, 0, 8, ())
    assert dense is not None and dense.tolist() == [False, True] * 4
    off_grid = vllm_reachable(group, tpb, bpc, None, 0, 8, (), 5)
    assert off_grid == [False, True, False, True, True, True, False, True]
    # EAGLE: ignored.
    eagle = KVGroup("sliding", 5, eagle=True)
    assert vllm_reachable(eagle, tpb, bpc, None, 0, 8, (), 5) == vllm_reachable(
        eagle, tpb, bpc, None, 0, 8, (), None
    )


# --- 5. HybridPlanner.lookup vs _lookup_complete_chunks ----------------------------------------


def real_store(status_of: dict[bytes, int], loading: set[bytes]) -> CpuStore:
    """Our store with every key of `status_of` in its status (ready, being stored, absent), and
    the keys of `loading` (ready ones) pinned by a load in flight."""
    store = CpuStore(max(1, len(status_of)))
    present = [k for k, st in status_of.items() if st != ABSENT]
    if present:
        store.prepare_store(present)
        store.complete_store([k for k in present if status_of[k] == READY])
    if loading:
        store.prepare_load(sorted(loading))
    return store


def vllm_scheduler(groups: list[KVGroup], tpb: int, bpc: int, status_of, loading):
    """An `OffloadingConnectorScheduler` with only what `_lookup_complete_chunks` reads, its
    group order built as its `__init__` does."""
    sched = object.__new__(OffloadingConnectorScheduler)
    configs = tuple(vllm_group_config(i, g, tpb, bpc) for i, g in enumerate(groups))
    sched.config = SimpleNamespace(kv_group_configs=configs)
    full = [i for i, c in enumerate(configs) if c.sliding_window_size_in_chunks is None]
    sliding = [i for i, c in enumerate(configs) if c.sliding_window_size_in_chunks is not None]
    sliding.sort(key=lambda i: configs[i].sliding_window_size_in_chunks, reverse=True)
    sched._full_attention_groups = tuple(full)
    sched._sliding_window_groups = tuple(sliding)
    sched._lookup_groups = tuple(full) + tuple(sliding)
    sched._mamba_align_size = None
    sched._chunks_being_loaded = loading
    sched.manager = FakeManager(status_of)
    sched._events_tracker = SimpleNamespace(record_lookup=lambda *a: None)
    return sched


def key(group: int, chunk: int) -> bytes:
    return chunk.to_bytes(4, "big") + group.to_bytes(4, "big")


def random_groups(rng: random.Random, tpc: int) -> list[KVGroup]:
    """1 to 3 groups, a full-attention one among them most of the time, in any order; windows
    of a few chunks, so that hits inside a prompt of a few dozen chunks are common."""
    choices = ["sliding", "sliding", "chunked_local", "full"]
    kinds = ["full"] + [rng.choice(choices) for _ in range(rng.randint(0, 2))]
    if rng.random() < 0.15:
        kinds[0] = "sliding"  # no full-attention group at all
    rng.shuffle(kinds)
    groups = [random_group(rng, kind, tpc) for kind in kinds]
    return [
        KVGroup(g.kind, min(g.window, rng.randint(1, 4 * tpc)), g.extra_retained_tokens, g.eagle)
        if g.kind != "full"
        else g
        for g in groups
    ]


def random_lookup_case(rng: random.Random) -> dict:
    tpb = rng.choice([1, 2, 4, 8])
    bpc = rng.randint(1, 3)
    tpc = tpb * bpc
    groups = random_groups(rng, tpc)
    # The load window is wider than the lookup's only where the hit ends one token short of a
    # chunk-aligned prompt and window - 1 + extra_retained_tokens is a whole number of chunks.
    groups = [
        KVGroup(g.kind, g.window, tpc - (g.window - 1) % tpc, g.eagle)
        if g.kind == "sliding" and rng.random() < 0.3
        else g
        for g in groups
    ]
    num_tokens = rng.randint(0, 25 * tpc + tpc - 1)
    if rng.random() < 0.4:
        num_tokens -= num_tokens % tpc
    num_chunks = num_tokens // tpc
    num_local = 0
    if rng.random() < 0.35 and num_tokens:
        num_local = rng.randint(0, (num_tokens - 1) // tpb) * tpb
    max_load = None if rng.random() < 0.6 else rng.randint(0, num_tokens + tpc)
    status_of: dict[bytes, int] = {}
    # Often every chunk stored (a repeated prompt), so that the hit's right edge is the prompt's
    # unaligned end and a sliding group's first window is the wider load window.
    warm = rng.random() < 0.5
    for gi in range(len(groups)):
        if warm and (groups[gi].kind == "full" or rng.random() < 0.5):
            status = [2] * num_chunks
            for _ in range(rng.choice([0, 0, 1, 2])):  # a few holes or keys being stored
                if num_chunks:
                    status[rng.randrange(num_chunks)] = rng.choice([0, 0, 1])
        else:
            status = random_status(rng, num_chunks)
        if rng.random() < 0.3:  # a prefix stored by a shorter earlier turn
            cut = rng.randint(0, num_chunks)
            status = [s if c < cut else 0 for c, s in enumerate(status)]
        status_of.update((key(gi, c), s) for c, s in enumerate(status))
    loading: set[bytes] | None = None
    if rng.random() < 0.5:
        # A chunk being loaded is stored.
        p_loading = rng.choice([0.0, 0.02, 0.1])
        loading = {k for k, st in status_of.items() if st == READY and rng.random() < p_loading}
    return {
        "tpb": tpb,
        "bpc": bpc,
        "groups": groups,
        "num_tokens": num_tokens,
        "num_local": num_local,
        "max_load": max_load,
        "status_of": status_of,
        "loading": loading,
    }


def run_lookup(case: dict) -> tuple[int | None, int | None]:
    tpb, bpc, groups = case["tpb"], case["bpc"], case["groups"]
    num_chunks = case["num_tokens"] // (tpb * bpc)
    sched = vllm_scheduler(groups, tpb, bpc, case["status_of"], case["loading"])
    req_status = SimpleNamespace(
        num_locally_computed_tokens=case["num_local"],
        max_load_tokens=case["max_load"],
        req=SimpleNamespace(num_tokens=case["num_tokens"], request_id="r"),
        req_context=None,
        group_states=tuple(
            SimpleNamespace(
                offload_keys=[key(gi, c) for c in range(num_chunks)], lookup_hit_end_chunk_idx=0
            )
            for gi in range(len(groups))
        ),
    )
    theirs = OffloadingConnectorScheduler._lookup_complete_chunks(sched, req_status)  # type: ignore[arg-type]

    planner = HybridPlanner(groups, tpb, bpc)
    states = [
        GroupState(keys=KeyList([key(gi, c) for c in range(num_chunks)]))
        for gi in range(len(groups))
    ]
    ours = planner.lookup(
        real_store(case["status_of"], case["loading"] or set()),
        states,
        case["num_local"],
        case["num_tokens"],
        case["max_load"],
        bool(case["loading"]),
    )
    return ours, theirs


LOOKUP_CASES = 6000


def test_lookup_matches_lookup_complete_chunks() -> None:
    rng = random.Random(6)
    outcomes = {"none": 0, "zero": 0, "hit": 0}
    eagle_hits = window_hits_ = 0
    for _ in range(LOOKUP_CASES):
        case = random_lookup_case(rng)
        ours, theirs = run_lookup(case)
        assert ours == theirs, case
        outcomes["none" if theirs is None else "zero" if theirs == 0 else "hit"] += 1
        if theirs:
            eagle_hits += any(g.eagle for g in case["groups"])
            window_hits_ += any(g.kind != "full" for g in case["groups"])
    # The random cases reach every outcome, often, also with EAGLE and window groups.
    assert min(outcomes.values()) > LOOKUP_CASES // 20, outcomes
    assert eagle_hits > 100 and window_hits_ > 300, (eagle_hits, window_hits_)


# --- 6. HybridPlanner.offer vs _build_store_jobs's choice of chunks ----------------------------


class FakeReqState:
    """What `_build_store_jobs` reads of a `RequestOffloadState`, with its own methods."""

    storable_chunks = RequestOffloadState.storable_chunks
    advance_stored_idx = RequestOffloadState.advance_stored_idx

    def __init__(self, config, req, group_states, max_offload_tokens) -> None:
        self.config = config
        self.req = req
        self.group_states = group_states
        self.max_offload_tokens = max_offload_tokens
        self.req_context = None


class CapturingManager:
    """`prepare_store` records the keys the connector chose, then refuses (None), so the
    connector only counts a failure and changes no state."""

    def __init__(self) -> None:
        self.offered: list[bytes] | None = None

    def prepare_store(self, keys, req_context):
        self.offered = list(keys)
        return None


def random_store_case(rng: random.Random) -> dict:
    tpb = rng.choice([1, 2, 4, 8])
    bpc = rng.randint(1, 3)
    tpc = tpb * bpc
    groups = random_groups(rng, tpc)
    interval = rng.choice([None, None, 0, tpc * rng.randint(1, 4)])
    num_prompt = rng.randint(1, 20 * tpc)
    num_tokens = num_prompt + (rng.randint(0, 6 * tpc) if rng.random() < 0.5 else 0)
    finished = rng.random() < 0.3
    if finished:
        computed = max(num_prompt, num_tokens - 1)
    else:
        computed = rng.randint(0, num_tokens)
    num_chunks = num_tokens // tpc
    tables: list[list[int]] = []
    next_ids = iter(range(1, 10**6))
    for g in groups:
        num_blocks = min(cdiv(computed, tpb) + rng.randint(0, 2 * bpc), cdiv(num_tokens, tpb))
        table = [next(next_ids) for _ in range(num_blocks)]
        if g.kind != "full":
            # Blocks behind the window freed (null), a few more freed and handed out again.
            freed = max(0, computed - g.window + 1 - g.extra_retained_tokens) // tpb
            freed = rng.choice([0, freed, max(0, freed - rng.randint(0, 2 * bpc))])
            table[: min(freed, num_blocks)] = [0] * min(freed, num_blocks)
            for _ in range(rng.choice([0, 0, 1, 3])):
                if table:
                    table[rng.randrange(len(table))] = 0
        tables.append(table)
    next_stored = [rng.randint(0, num_chunks) if rng.random() < 0.5 else 0 for _ in groups]
    return {
        "tpb": tpb,
        "bpc": bpc,
        "groups": groups,
        "interval": interval,
        "num_prompt": num_prompt,
        "num_tokens": num_tokens,
        "computed": computed,
        "finished": finished,
        "junction": rng.choice([0, 0, rng.randint(1, num_tokens)]),
        "max_offload": None if rng.random() < 0.8 else rng.randint(0, num_tokens),
        "tables": tables,
        "next_stored": next_stored,
    }


def run_store(case: dict):
    tpb, bpc, groups = case["tpb"], case["bpc"], case["groups"]
    tpc = tpb * bpc
    num_chunks = case["num_tokens"] // tpc
    configs = tuple(vllm_group_config(i, g, tpb, bpc) for i, g in enumerate(groups))
    config = SchedulerOffloadConfig(
        kv_group_configs=configs,
        blocks_per_chunk=bpc,
        tokens_per_hash=tpb,
        num_workers=1,
        offload_prompt_only=False,
        supports_partial_tail=False,
        alignment_tokens=tpc,
        retention_interval=case["interval"],
    )
    finished = case["finished"]
    req = SimpleNamespace(
        status=RequestStatus.FINISHED_STOPPED if finished else RequestStatus.RUNNING,
        is_finished=lambda: finished,
        num_computed_tokens=case["computed"],
        num_prompt_tokens=case["num_prompt"],
        num_tokens=case["num_tokens"],
        shared_prefix_boundary=case["junction"],
    )
    group_states = tuple(
        SimpleNamespace(
            offload_keys=[key(gi, c) for c in range(num_chunks)],
            block_ids=list(case["tables"][gi]),
            next_stored_chunk_idx=case["next_stored"][gi],
        )
        for gi in range(len(groups))
    )
    req_status = FakeReqState(config, req, group_states, case["max_offload"])
    sched = object.__new__(OffloadingConnectorScheduler)
    sched.config = config
    sched.manager = CapturingManager()
    sched._req_status = {"r": req_status}
    sched._connector_stats = SimpleNamespace(increase_counter=lambda *a, **k: None)
    output = SimpleNamespace(
        num_scheduled_tokens={} if finished else {"r": 0},
        finished_req_ids={"r"} if finished else set(),
    )
    OffloadingConnectorScheduler._build_store_jobs(sched, output)  # type: ignore[arg-type]
    theirs = sched.manager.offered or []
    offloadable = OffloadingConnectorScheduler._calc_num_offloadable_tokens(
        sched,  # type: ignore[arg-type]
        req_status,  # type: ignore[arg-type]
        case["computed"],
    )
    their_ends = [
        req_status.storable_chunks(c, gs, offloadable)
        for c, gs in zip(configs, group_states, strict=True)
    ]

    planner = HybridPlanner(groups, tpb, bpc, retention_interval=case["interval"])
    states = [
        GroupState(
            keys=KeyList([key(gi, c) for c in range(num_chunks)]),
            block_ids=list(case["tables"][gi]),
            next_stored=case["next_stored"][gi],
        )
        for gi in range(len(groups))
    ]
    boundaries = (case["num_prompt"] - 1,) + ((case["junction"],) if case["junction"] else ())
    decoding = offloadable > case["num_prompt"]
    offer, ends = planner.offer(states, offloadable, decoding, finished, boundaries)
    return (list(offer.keys), ends), (theirs, their_ends)


STORE_CASES = 4000


@pytest.fixture
def quiet_vllm_logger():
    """The refused `prepare_store` makes the connector warn once per case."""
    logger = logging.getLogger("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


def test_offer_matches_build_store_jobs(quiet_vllm_logger) -> None:
    rng = random.Random(7)
    offered = filtered = 0
    for _ in range(STORE_CASES):
        case = random_store_case(rng)
        ours, theirs = run_store(case)
        assert ours == theirs, case
        offered += bool(theirs[0])
        # Some chunks in the storable range not offered: unreachable or freed, filtered out.
        in_range = sum(max(0, e - n) for e, n in zip(theirs[1], case["next_stored"], strict=True))
        filtered += in_range > len(theirs[0])
    assert offered > STORE_CASES // 3 and filtered > STORE_CASES // 10, (offered, filtered)
