import pickle
import threading
import time

import numpy as np
import pytest

from kvoffload import CpuStore, KeyList, KeyRange, _rust


def test_sequence_behaviour():
    keys = KeyList([b"a", b"bb", b"ccc"])
    assert len(keys) == 3
    assert (keys[0], keys[-1]) == (b"a", b"ccc")
    assert list(keys) == [b"a", b"bb", b"ccc"] == keys.to_list()
    assert keys == [b"a", b"bb", b"ccc"]
    assert keys != [b"a", b"bb"]
    assert keys == KeyList(k for k in [b"a", b"bb", b"ccc"])
    assert keys != 42
    with pytest.raises(IndexError, match="index 3 out of range for length 3"):
        keys[3]
    assert pickle.loads(pickle.dumps(keys)) == keys


def test_views_and_copies():
    keys = KeyList([b"a", b"bb", b"ccc"])
    view = keys.view(1, 3)
    assert isinstance(view, KeyRange)
    assert (len(view), view.start, view.end, list(view)) == (2, 1, 3, [b"bb", b"ccc"])
    assert KeyList(view) == [b"bb", b"ccc"]
    with pytest.raises(ValueError, match=r"view\(2, 4\) is out of range: need start <= end <= 3"):
        keys.view(2, 4)


def test_bad_keys_are_named():
    with pytest.raises(TypeError, match=r"keys\[1\] must be bytes, got str"):
        KeyList([b"a", "b"])
    with pytest.raises(ValueError, match=r"keys\[1\] has length 0"):
        KeyList([b"a", b""])
    with pytest.raises(TypeError, match="got a single bytes object"):
        KeyList(b"abc")


def test_extend_chunk_keys_reads_only_new_hashes():
    hashes = [bytes([i]) * 32 for i in range(7)]
    keys = KeyList()
    assert keys.extend_chunk_keys(hashes[:4], 3) == 1
    # Hashes of chunks that already have keys are not read again: junk there is never seen.
    assert keys.extend_chunk_keys(["junk", "junk", "junk", *hashes[3:]], 3, 2) == 1
    assert list(keys) == [hashes[2] + bytes(4), hashes[5] + (2).to_bytes(4, "big")]
    with pytest.raises(TypeError, match=r"block_hashes\[6\] must be bytes, got int"):
        keys.extend_chunk_keys([*hashes[:6], 5, 5, 5], 3)
    with pytest.raises(ValueError, match="block_hashes=an entry of 61 bytes at index 8"):
        keys.extend_chunk_keys([*hashes[:6], b"x", b"x", b"y" * 61], 3)
    assert len(keys) == 2  # failed calls added nothing


def test_extend_group_keys_gives_each_group_its_suffix_from_one_read():
    hashes = [bytes([i]) * 32 for i in range(7)]
    sliding, full = KeyList(), KeyList()
    full.extend_chunk_keys(hashes[:3], 3, 1)  # one group ahead of the other
    assert _rust.extend_group_keys([sliding, full], hashes[:6], 3) == 3
    assert list(sliding) == [hashes[2] + bytes(4), hashes[5] + bytes(4)]
    assert list(full) == [hashes[2] + (1).to_bytes(4, "big"), hashes[5] + (1).to_bytes(4, "big")]
    # A bad hash refuses the call for every group: none grows.
    with pytest.raises(ValueError, match="block_hashes=an entry of 61 bytes at index 8"):
        _rust.extend_group_keys([sliding, full], [*hashes[:6], b"x", b"x", b"y" * 61], 3)
    with pytest.raises(TypeError, match=r"block_hashes\[6\] must be bytes, got int"):
        _rust.extend_group_keys([sliding, full], [*hashes[:6], 5, 5, 5], 3)
    assert (len(sliding), len(full)) == (2, 2)
    assert _rust.extend_group_keys([], hashes, 3) == 0


def test_store_reads_key_lists_in_place():
    keys = KeyList([bytes([i]) * 36 for i in range(6)])
    store = CpuStore(8)
    plan = store.prepare_store(keys.view(2, 5))
    assert isinstance(plan.keys, KeyList)
    assert plan.keys == [bytes([i]) * 36 for i in (2, 3, 4)]
    np.testing.assert_array_equal(plan.indices, [0, 1, 2])
    store.complete_store(plan.keys)
    assert store.lookup_prefix(keys.view(2, 6)) == (3, False)
    assert store.lookup_prefix(keys) == (0, False)
    np.testing.assert_array_equal(store.prepare_load(keys.view(3, 5)), [1, 2])
    store.complete_load(keys.view(3, 5))
    # Offering the whole list again writes only the three new keys.
    assert store.prepare_store(keys).keys == [bytes([i]) * 36 for i in (0, 1, 5)]


def test_a_slow_iterable_does_not_block_readers_of_the_list():
    # Converting the hashes runs Python code that releases the GIL; no lock may be held then.
    keys = KeyList()
    seen = []

    def slow_hashes():
        for i in range(3):
            time.sleep(0.05)
            yield bytes([i + 1]) * 32

    writer = threading.Thread(target=lambda: keys.extend_chunk_keys(slow_hashes(), 1))
    writer.start()
    time.sleep(0.02)
    reader = threading.Thread(target=lambda: seen.append(len(keys)))
    reader.start()
    writer.join(5)
    reader.join(5)
    assert not writer.is_alive() and not reader.is_alive()
    assert seen in ([0], [3]) and len(keys) == 3


def _i64(values: list[int]) -> bytes:
    return np.asarray(values, dtype=np.int64).tobytes()


def test_positions_may_be_given_as_int64_bytes():
    by_list, by_bytes, reversed_ = CpuStore(8), CpuStore(8), CpuStore(8)
    keys = [b"k0", b"k1", b"k2"]
    runs = ((by_list, [4, 2, 0]), (by_bytes, _i64([4, 2, 0])), (reversed_, _i64([0, 2, 4])))
    for store, positions in runs:
        rank = store.new_rank()
        assert store.prepare_store(keys, rank=rank, positions=positions) is not None
        store.complete_store(keys)
    assert by_list.recency_order() == by_bytes.recency_order()
    assert by_bytes.recency_order() != reversed_.recency_order()  # the positions did count
    with pytest.raises(ValueError, match="positions has 3 bytes"):
        by_list.prepare_store([b"k9"], rank=0, positions=b"abc")
