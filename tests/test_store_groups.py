"""CpuStore's hybrid-model batch calls: flags of used chunks, and ranges past a group's keys."""

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
