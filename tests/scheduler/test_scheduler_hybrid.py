"""`OffloadScheduler` with two KV-cache groups (a sliding window of 8 tokens, group 0, beside full
attention, group 1), driven directly: 4-token blocks, 12-token chunks. A 24-token prompt stores
its two full-attention chunks and the sliding chunk a hit at 12 reads (blocks 1 and 2: the
window's 7 tokens before it); the same prompt then loads 12 tokens, per group from its first
block the window keeps."""

from __future__ import annotations

import numpy as np
import pytest

from kvoffload.scheduler import (
    BlockSet,
    GroupSlice,
    KVGroup,
    OffloadConfig,
    OffloadScheduler,
    RequestUpdate,
)

GROUPS = (KVGroup("sliding", 8), KVGroup())
HASHES = [bytes([i]) * 32 for i in range(6)]


def scheduler(**kw) -> OffloadScheduler:
    config = OffloadConfig(tokens_per_block=4, blocks_per_chunk=3, cpu_bytes_to_use=64 * 100)
    return OffloadScheduler.create(config, 100, groups=GROUPS, **kw)


def stored(s: OffloadScheduler) -> OffloadScheduler:
    """ "a" computes its 24-token prompt and finishes; its stores complete."""
    s.add_request("a", 24)
    assert s.lookup("a", 0, 24, HASHES) == 0
    s.on_allocated("a", [[11, 12, 13, 14, 15, 16], [1, 2, 3, 4, 5, 6]])
    (job,) = s.plan_step([RequestUpdate("a", 24, 24, block_hashes=HASHES)]).store_jobs
    assert job.parts == (GroupSlice(0, 1, 3), GroupSlice(1, 2, 6))
    assert job.gpu_block_ids.tolist() == [11, 12, 13, 1, 2, 3, 4, 5, 6]
    assert job.chunk_indices.tolist() == [0, 0, 1]
    s.complete_job(job.job_id, True)
    s.finish_request("a")
    return s


def test_a_repeat_loads_each_group_from_its_first_live_block():
    s = stored(scheduler())
    s.add_request("b", 24)
    # The hit stops a token short of the prompt, on a chunk: 12 tokens.
    assert s.lookup("b", 0, 24, HASHES) == 12
    load = s.on_allocated("b", [[0, 21, 22, 23, 24, 25], [31, 32, 33, 34, 35, 36]], 12)
    assert load is not None
    assert load.parts == (GroupSlice(0, 1, 2, 1), GroupSlice(1, 1, 3, 0))
    assert load.gpu_block_ids.tolist() == [21, 22, 31, 32, 33]
    assert len(load.slots) == 2 and load.num_tokens == 12


@pytest.mark.parametrize(
    ("tables", "match"),
    [
        ([21, 22, 23], "expected 2 sequences of GPU block ids, one per KV-cache group"),
        ([[21, 22, 23]], "expected 2 sequences"),
        (None, "expected 2 sequences"),
        ([[0, 21, 22], [31, 32]], r"tables of lengths \[3, 2\]"),
        ([[0, 21, -1], [31, 32, 33]], r"block_ids\[0\]=\[0, 21, -1\] is invalid"),
        ([[0, 21, 0], [31, 32, 33]], "group 0 has the null block"),
    ],
)
def test_bad_tables_are_refused_and_change_nothing(tables, match):
    s = stored(scheduler())
    s.add_request("b", 24)
    assert s.lookup("b", 0, 24, HASHES) == 12
    with pytest.raises(ValueError, match=match):
        s.on_allocated("b", tables, 12)
    # Nothing was pinned: the same load goes through with good tables.
    assert s.on_allocated("b", [[0, 21, 22], [31, 32, 33]], 12) is not None


@pytest.mark.parametrize(
    "tables",
    [
        ((0, 21, 22), (31, 32, 33)),
        [np.array([0, 21, 22]), np.array([31, 32, 33], dtype=np.int32)],
        [[np.int64(0), 21, 22], range(31, 34)],
    ],
)
def test_tables_of_other_int_kinds_load_as_lists_do(tables):
    s = stored(scheduler())
    s.add_request("b", 24)
    assert s.lookup("b", 0, 24, HASHES) == 12
    load = s.on_allocated("b", tables, 12)
    assert load.gpu_block_ids.tolist() == [21, 22, 31, 32, 33]
    assert s.plan_step([RequestUpdate("b", 13, 24, block_hashes=HASHES)]).store_jobs == []


@pytest.mark.parametrize("bad", [[True, True, True], [0, 21, 2.0], [0, 21, None], [0, 21, 2**63]])
def test_bad_items_in_a_table_are_refused(bad):
    s = stored(scheduler())
    s.add_request("b", 24)
    assert s.lookup("b", 0, 24, HASHES) == 12
    with pytest.raises(ValueError, match=r"block_ids\[0\]=.* is invalid"):
        s.on_allocated("b", [bad, [31, 32, 33]], 12)


@pytest.mark.parametrize("bad", [{3, -1}, {True}, {2.5}, frozenset({-2})])
def test_bad_reallocated_blocks_are_refused_in_any_container(bad):
    s = scheduler()
    with pytest.raises(ValueError, match=r"reallocated_block_ids=.* is invalid"):
        s.plan_step([], reallocated_block_ids=bad)
    assert s.plan_step([], reallocated_block_ids={3, 4}).flush_job_ids == []


def realloc_case(realloc) -> list[int]:
    """ "a" (every chunk boundary kept) computes chunk 0, then chunk 1 with `realloc` handed out
    again in the same schedule: the window group's blocks of chunk 1, taken before that
    schedule, that the engine gave to another request, are not read. Returns the second store's
    (group, chunk) pairs."""
    s = scheduler(retention_interval=None)
    s.add_request("a", 24)
    assert s.lookup("a", 0, 24, HASHES) == 0
    s.on_allocated("a", [[11, 12, 13, 14, 15, 16], [1, 2, 3, 4, 5, 6]])
    (first,) = s.plan_step([RequestUpdate("a", 12, 24, block_hashes=HASHES)]).store_jobs
    assert first.chunk_indices.tolist() == [0, 0]
    plan = s.plan_step([RequestUpdate("a", 24, 24)], reallocated_block_ids=realloc)
    assert plan.flush_job_ids == []  # chunk 0's store reads neither block
    (job,) = plan.store_jobs
    groups = [p.group for p in job.parts for _ in range(p.num_slots)]
    return list(zip(groups, job.chunk_indices.tolist(), strict=True))


def test_a_window_block_handed_out_again_is_not_stored():
    # Chunk 1 of the sliding group is read through blocks 15 and 16 (the 7 tokens before 24).
    assert realloc_case([]) == [(0, 1), (1, 1)]
    assert realloc_case([14]) == [(0, 1), (1, 1)]  # a block no hit reads: stored anyway
    assert realloc_case([15, 99]) == [(1, 1)]
    blocks = BlockSet()
    blocks.add([16, 3])
    assert realloc_case(blocks) == [(1, 1)]  # the full group's blocks are held by "a"


def test_a_store_in_flight_reading_a_window_block_handed_out_again_is_flushed():
    s = scheduler()
    s.add_request("a", 24)
    s.lookup("a", 0, 24, HASHES)
    s.on_allocated("a", [[11, 12, 13, 14, 15, 16], [1, 2, 3, 4, 5, 6]])
    (job,) = s.plan_step([RequestUpdate("a", 24, 24, block_hashes=HASHES)]).store_jobs
    # Full-attention blocks are held by "a" until the job is reported; window blocks are not.
    assert s.plan_step([], reallocated_block_ids=[1, 6, 14]).flush_job_ids == []
    assert s.plan_step([], reallocated_block_ids=[99, 12]).flush_job_ids == [job.job_id]
    s.complete_job(job.job_id, True)
    assert s.plan_step([], reallocated_block_ids=[12]).flush_job_ids == []


def test_block_set_answers_membership_and_nulls_tables_in_place():
    blocks = BlockSet()
    blocks.add([7, 3, 7])
    blocks.add((1 << 40, 0))
    blocks.discard(0)
    blocks.discard(12345)  # absent: nothing changes
    for odd in (-1, 2**64, True, "7"):
        blocks.discard(odd)  # never a member
    assert len(blocks) == 3 and 3 in blocks and (1 << 40) in blocks
    assert 4 not in blocks and "3" not in blocks and -3 not in blocks
    assert blocks.to_list() == [3, 7, 1 << 40]
    assert blocks.intersects((8, 7)) and blocks.intersects([1 << 40])
    assert not blocks.intersects([8, 9]) and not blocks.intersects([])
    table = [3, 9, 7, 3, 0]
    assert blocks.null_members(table, 1) == 2
    assert table == [3, 9, 0, 0, 0]
    assert blocks.null_members(table, 10) == 0


@pytest.mark.parametrize("bad", [[1, -2], [True], [2.5], (1, "x"), [2**63]])
def test_block_set_refuses_what_is_not_a_block_id_and_adds_nothing(bad):
    blocks = BlockSet()
    with pytest.raises(ValueError, match=r"new_blocks\[\d\] is invalid: expected an int >= 0"):
        blocks.add(bad, "new_blocks")
    assert len(blocks) == 0


def test_a_local_prefix_of_part_of_a_block_is_refused():
    s = stored(scheduler())
    s.add_request("b", 24)
    with pytest.raises(ValueError, match=r"num_local_tokens=5 .*multiple of tokens_per_block=4"):
        s.lookup("b", 5, 24, HASHES)
    assert s.lookup("b", 4, 24, HASHES) == 0  # 8 more tokens: less than a chunk (as vLLM)


def test_bad_new_blocks_are_refused_before_any_plan():
    s = scheduler()
    s.add_request("a", 24)
    s.lookup("a", 0, 24, HASHES)
    s.on_allocated("a", [[11, 12, 13], [1, 2, 3]])
    with pytest.raises(ValueError, match=r"new_block_ids=.* expected 2 sequences"):
        s.plan_step([RequestUpdate("a", 24, 24, [14, 15], HASHES)])
    assert s.plan_step([RequestUpdate("a", 24, 24, [[14, 15, 16], [4, 5, 6]], HASHES)]).store_jobs


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"groups": [KVGroup(), "sliding"]}, r"groups\[1\]='sliding' is invalid"),
        ({"groups": []}, "groups is empty"),
        ({"groups": None, "retention_interval": -5}, "retention_interval=-5 is invalid"),
        (
            {"groups": [KVGroup("chunked_local", 24), KVGroup()], "retention_interval": 5},
            r"retention_interval=5 .* a multiple of the chunk \(12 tokens\)",
        ),
    ],
)
def test_bad_groups_stop_construction_naming_the_parameter(kw, match):
    config = OffloadConfig(tokens_per_block=4, blocks_per_chunk=3, cpu_bytes_to_use=6400)
    with pytest.raises(ValueError, match=match):
        OffloadScheduler.create(config, 100, **kw)


@pytest.mark.parametrize(
    ("group", "match"),
    [
        (dict(kind="linear"), "kind='linear' is invalid"),
        (dict(kind="mamba", window=4), "window=4 of a mamba group is invalid"),
        (dict(kind="mamba", eagle=True), "eagle=True is invalid for a mamba group"),
        (
            dict(kind="mamba", extra_retained_tokens=3),
            "extra_retained_tokens=3 is invalid for a mamba",
        ),
        (dict(kind="sliding"), "window=0 of a sliding group is invalid"),
        (dict(kind="full", window=8), "window=8 of a full group is invalid"),
        (dict(kind="sliding", window=8, extra_retained_tokens=-1), "extra_retained_tokens=-1"),
        (dict(eagle=1), "eagle=1 is invalid"),
    ],
)
def test_bad_group_specs_are_refused(group, match):
    with pytest.raises(ValueError, match=match):
        KVGroup(**group)


def test_block_tables_copies_only_the_plain_shape():
    from kvoffload import _rust

    given = ([4, 5], (6, 7))
    tables = _rust.block_tables(given, 2)
    assert tables == [[4, 5], [6, 7]] and tables[0] is not given[0]
    # Anything else is for the caller to explain (`on_allocated`'s messages).
    for odd in ([[4, 5], [6]], [[4, 5]], [4, 5], [[True], [1]], [[-1], [1]], {1: [2]}, "ab"):
        assert _rust.block_tables(odd, 2) is None
