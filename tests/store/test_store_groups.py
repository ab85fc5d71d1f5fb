"""CpuStore's hybrid-model batch calls: flags of used chunks, ranges past a group's keys, loads."""

import os

import pytest

from kvoffload import _rust
from kvoffload.store import CpuStore, KeyList


def keys(n: int, group: int = 0) -> KeyList:
    k = KeyList()
    k.extend_chunk_keys([os.urandom(32) for _ in range(n)], 1, group)
    return k


def test_an_offer_of_lower_chunks_keeps_the_flags_already_set():
    s, k = CpuStore(8), keys(6)
    used = bytearray(b"\x00\x00\x01\x00\x01")
    plan = s.offer_group_store(
        [(0, k, [7, 8], 0, None)],
        rank=s.new_rank(),
        num_groups=1,
        windowed=[False],
        blocks_per_chunk=1,
        used=[used],
    )
    assert plan is not None and plan.blocks.tolist() == [7, 8]
    assert bytes(used) == b"\x01\x01\x01\x00\x01"
    # A higher chunk grows the flags with zeros up to it.
    s.offer_group_store(
        [(0, k, [9], 6 - 1, None)],
        rank=s.new_rank(),
        num_groups=1,
        windowed=[False],
        blocks_per_chunk=1,
        used=[used],
    )
    assert bytes(used) == b"\x01\x01\x01\x00\x01\x01"


def test_a_range_past_the_keys_is_refused_not_allocated():
    k = keys(4)
    with pytest.raises(ValueError, match="chunks the group has keys for"):
        _rust.group_ranges([(0, k, 0, 2**33)], 1)


def stored(s: CpuStore, k: KeyList, first: int, end: int) -> None:
    plan = s.prepare_store(k.view(first, end))
    assert plan is not None
    s.complete_store(plan.keys)


def test_load_groups_pins_each_group_from_its_first_live_block():
    # 2 blocks per chunk, 4-chunk tables; the sliding group (0) holds only its window: chunks
    # 2..4, its first live block 5. The full group (1) loads chunks 1..4 past a 2-block prefix.
    s = CpuStore(16)
    sliding, full = keys(4, 0), keys(4, 1)
    stored(s, sliding, 2, 4)
    stored(s, full, 0, 4)
    used = [bytearray(), bytearray()]
    tables = [[0, 0, 0, 0, 0, 15, 16, 17], [1, 2, 3, 4, 5, 6, 7, 8]]
    plan = s.load_groups(
        [sliding, full],
        tables,
        first_block=2,
        num_blocks=8,
        end_chunk=4,
        blocks_per_chunk=2,
        rank=s.new_rank(),
        used=used,
    )
    assert plan.parts == [(0, 2, 3, 1), (1, 3, 6, 0)]
    assert plan.gpu_block_ids.tolist() == [15, 16, 17, 3, 4, 5, 6, 7, 8]
    assert list(plan.keys) == [sliding[2], sliding[3], full[1], full[2], full[3]]
    assert len(plan.slots) == 5 and s.first_pinned(full.view(1, 4)) == 0
    assert [bytes(u) for u in used] == [b"\x00\x00\x01\x01", b"\x00\x01\x01\x01"]
    s.complete_load(plan.keys)


def test_a_refused_load_groups_pins_and_flags_nothing():
    s = CpuStore(16)
    sliding, full = keys(2, 0), keys(2, 1)
    stored(s, full, 0, 2)
    stored(s, sliding, 0, 1)  # chunk 1 of the sliding group is not stored
    used = [bytearray(), bytearray()]
    args = dict(first_block=0, num_blocks=2, end_chunk=2, blocks_per_chunk=1, rank=s.new_rank())
    with pytest.raises(_rust.InvalidStateError):
        s.load_groups([sliding, full], [[1, 2], [3, 4]], used=used, **args)
    with pytest.raises(ValueError, match="null block"):
        s.load_groups([sliding, full], [[1, 0], [3, 4]], used=used, **args)
    with pytest.raises(ValueError, match="used has 1 flag arrays"):
        s.load_groups([sliding, full], [[1, 2], [3, 4]], used=used[:1], **args)
    assert s.first_pinned(full.view(0, 2)) == 2 and s.first_pinned(sliding.view(0, 1)) == 1
    # The flags may have grown with zeros (what chunks past the end read as), none is set.
    assert not any(any(u) for u in used)


def test_a_load_whose_flags_cannot_grow_pins_nothing():
    s = CpuStore(16)
    sliding, full = keys(2, 0), keys(2, 1)
    stored(s, sliding, 0, 2)
    stored(s, full, 0, 2)
    used = [bytearray(), bytearray()]
    args = dict(first_block=0, num_blocks=2, blocks_per_chunk=1, rank=s.new_rank(), used=used)
    view = memoryview(used[1])  # an exported bytearray cannot be resized
    with pytest.raises(BufferError):
        s.load_groups([sliding, full], [[1, 2], [3, 4]], end_chunk=2, **args)
    view.release()
    assert s.first_pinned(sliding.view(0, 2)) == 2 and s.first_pinned(full.view(0, 2)) == 2
    assert not any(used[0]) and used[1] == bytearray()  # grown, perhaps, but nothing flagged
    # An end chunk that is not the one of the last block is refused.
    with pytest.raises(ValueError, match="end_chunk=1 is invalid"):
        s.load_groups([sliding, full], [[1, 2], [3, 4]], end_chunk=1, **args)


def test_lookup_groups_refuses_specs_that_do_not_fit_their_kind():
    s, k = CpuStore(8), keys(3)
    ask = dict(tokens_per_chunk=16, num_local=0, num_tokens=48, max_load_tokens=None)
    for spec, match in [
        (("sliding", None, 20, 0, False), "window_chunks=None of a sliding group is invalid"),
        (("sliding", 0, 20, 0, False), "window_chunks=0 of a sliding group is invalid"),
        (("full", 2, 0, 0, False), "window_chunks=2 of a full group is invalid"),
        (("linear", 1, 0, 0, False), 'kind="linear" is invalid'),
    ]:
        with pytest.raises(ValueError, match=match):
            s.lookup_groups([k], [spec], loads_in_flight=False, **ask)
    with pytest.raises(ValueError, match="specs has 2 groups for 1 key lists"):
        s.lookup_groups([k], [("full", None, 0, 0, False)] * 2, loads_in_flight=False, **ask)
    assert s.stats().misses == 0  # nothing was looked up
