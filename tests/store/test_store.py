"""CpuStore through the Python API: every state transition, the exact walks of issue 2, errors,
reset, events and stats, with the numbers each step must produce."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kvoffload import (
    MAX_KEY_LEN,
    POLICY_NAMES,
    CpuStore,
    InvalidStateError,
    KeyStatus,
    KVOffloadError,
    PrefixLookup,
    StoreEvent,
)

ABSENT, PENDING, READY = KeyStatus.ABSENT, KeyStatus.PENDING, KeyStatus.READY


def k(i: int) -> bytes:
    """A vLLM-shaped key: a 32-byte block hash and a 4-byte group index."""
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")


def ks(*ids: int) -> list[bytes]:
    return [k(i) for i in ids]


def ids(keys) -> list[int]:
    return [int.from_bytes(key[:32], "big") for key in keys]


def store(s: CpuStore, *key_ids: int):
    plan = s.prepare_store(ks(*key_ids))
    assert plan is not None, f"no room for {key_ids}"
    s.complete_store(plan.keys)
    s.check_invariants()
    return plan


def order(s: CpuStore) -> list[list[int]]:
    return [ids(lst) for lst in s.recency_order()]


def statuses(s: CpuStore, *key_ids: int) -> list[int]:
    return s.lookup(ks(*key_ids)).tolist()


def state(s: CpuStore):
    """Everything a caller can see without changing it."""
    return (s.stats(), s.recency_order())


def events(s: CpuStore) -> list[tuple[str, list[int]]]:
    return [(e.kind, ids(e.keys)) for e in s.take_events()]


# --- state transitions -------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_absent_to_pending_to_ready(policy):
    s = CpuStore(4, policy, enable_events=True)
    assert statuses(s, 1) == [ABSENT]
    assert s.lookup_prefix(ks(1)) == PrefixLookup(0, False)

    plan = s.prepare_store(ks(1))
    assert plan is not None
    assert plan.keys == ks(1)
    assert plan.slots.dtype == np.int64
    assert plan.slots.tolist() == [0]
    assert plan.evicted == []
    assert statuses(s, 1) == [PENDING]
    assert s.lookup_prefix(ks(1)) == PrefixLookup(0, True)
    st = s.stats()
    assert (st.used_slots, st.pending, st.ready) == (1, 1, 0)
    assert s.take_events() == []  # a pending key is not announced

    s.complete_store(ks(1))
    s.check_invariants()
    assert statuses(s, 1) == [READY]
    assert s.lookup_prefix(ks(1)) == PrefixLookup(1, False)
    st = s.stats()
    assert (st.used_slots, st.pending, st.ready, st.stores_completed) == (1, 0, 1, 1)
    assert s.take_events() == [StoreEvent("stored", ks(1))]


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_pending_to_absent_on_failure(policy):
    s = CpuStore(4, policy, enable_events=True)
    plan = s.prepare_store(ks(1, 2))
    assert plan is not None
    assert plan.slots.tolist() == [0, 1]
    s.complete_store(ks(2, 1), success=False)
    s.check_invariants()
    assert statuses(s, 1, 2) == [ABSENT, ABSENT]
    st = s.stats()
    assert (st.used_slots, st.pending, st.ready, st.stores_failed, st.stores_completed) == (
        0,
        0,
        0,
        2,
        0,
    )
    assert s.take_events() == []  # no event claims they were stored
    assert s.recency_order() == [[]] * len(s.recency_order())


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_ready_to_pinned_and_back(policy):
    s = CpuStore(2, policy)
    store(s, 1, 2)
    slots = s.prepare_load(ks(2, 1, 2))  # 2 listed twice: pinned twice
    assert slots.dtype == np.int64
    assert slots.tolist() == [1, 0, 1]
    assert statuses(s, 1, 2) == [READY, READY]  # a pinned key still hits
    assert s.stats().pinned == 2

    # Both pinned: a new key cannot evict either.
    assert s.prepare_store(ks(3)) is None
    s.complete_load(ks(1))
    assert s.stats().pinned == 1
    s.complete_load(ks(2))
    assert s.stats().pinned == 1  # 2 is still pinned once
    plan = s.prepare_store(ks(3))  # only 1 is evictable
    assert plan is not None
    assert (ids(plan.evicted), plan.slots.tolist()) == ([1], [0])
    s.complete_load(ks(2))
    assert s.stats().pinned == 0
    s.check_invariants()


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_ready_to_absent_by_eviction(policy):
    s = CpuStore(1, policy, enable_events=True)
    store(s, 1)
    plan = s.prepare_store(ks(2))
    assert plan is not None
    assert (ids(plan.keys), plan.slots.tolist(), ids(plan.evicted)) == ([2], [0], [1])
    assert statuses(s, 1, 2) == [ABSENT, PENDING]
    assert events(s) == [("stored", [1]), ("removed", [1])]
    s.complete_store(plan.keys)
    assert events(s) == [("stored", [2])]
    assert s.stats().evictions == 1


def test_prepare_store_filters_present_and_repeated_keys():
    s = CpuStore(8)
    store(s, 1)
    assert s.prepare_store(ks(2)) is not None  # 2 pending
    plan = s.prepare_store(ks(1, 3, 2, 3, 4, 1))
    assert plan is not None
    assert ids(plan.keys) == [3, 4]
    assert plan.indices.tolist() == [1, 4]
    assert plan.slots.tolist() == [2, 3]
    # The keys to write come from the copy the store read, equal to what was offered.
    offered = ks(5)
    plan = s.prepare_store(offered)
    assert plan is not None
    assert plan.keys == offered
    # Nothing new: an empty plan, not a refusal.
    plan = s.prepare_store(ks(1, 2, 3))
    assert plan is not None
    assert (plan.keys, plan.slots.tolist(), plan.evicted) == ([], [], [])
    assert s.stats().store_refusals == 0
    s.check_invariants()


def test_same_call_keys_are_never_evicted_for_each_other():
    s = CpuStore(2)
    store(s, 1, 2)
    # 1 is offered again, so only 2 may make room for 3.
    plan = s.prepare_store(ks(1, 3))
    assert plan is not None
    assert (ids(plan.evicted), plan.slots.tolist()) == ([2], [1])
    s.complete_store(plan.keys)
    # Both residents offered with a new key: nothing may be evicted.
    assert s.prepare_store(ks(1, 3, 4)) is None
    assert order(s) == [[1, 3]]


def test_lookup_prefix_stops_at_the_first_key_that_is_not_ready():
    s = CpuStore(8)
    store(s, 1, 2, 3)
    assert s.prepare_store(ks(4)) is not None
    assert s.lookup_prefix(ks(1, 2, 3, 4, 5)) == (3, True)  # 4 is pending: retry later
    assert s.lookup_prefix(ks(1, 2, 5, 3)) == (2, False)  # 5 is absent
    assert s.lookup_prefix(ks(5, 1)) == (0, False)
    assert s.lookup_prefix([]) == (0, False)
    assert statuses(s, 3, 4, 5) == [READY, PENDING, ABSENT]
    st = s.stats()
    # hits: 3 + 2 + 0 + 1 (lookup of 3); misses: 5 twice in prefixes + once in lookup.
    assert (st.hits, st.misses) == (6, 3)


# --- the walks of issue 2 ----------------------------------------------------------------------


def test_lru_walk():
    s = CpuStore(4, "lru", enable_events=True)
    for i in (1, 2, 3, 4):
        assert store(s, i).slots.tolist() == [i - 1]
    assert order(s) == [[1, 2, 3, 4]]

    s.touch(ks(1))
    assert order(s) == [[2, 3, 4, 1]]
    plan = store(s, 5)
    assert (ids(plan.evicted), plan.slots.tolist()) == ([2], [1])
    assert order(s) == [[3, 4, 1, 5]]

    # Pin 3 with a load; 6 and 7 in one call evict 4 and 1, never 3.
    assert s.prepare_load(ks(3)).tolist() == [2]
    plan = store(s, 6, 7)
    assert ids(plan.evicted) == [4, 1]
    assert plan.slots.tolist() == [0, 3]  # 1's slot was freed last, so it is reused first
    assert statuses(s, 1, 2, 3, 4, 5, 6, 7) == [ABSENT, ABSENT, READY, ABSENT, READY, READY, READY]
    assert events(s) == [
        ("stored", [1]),
        ("stored", [2]),
        ("stored", [3]),
        ("stored", [4]),
        ("removed", [2]),
        ("stored", [5]),
        ("removed", [4, 1]),
        ("stored", [6, 7]),
    ]

    # Pin 5 and 6 too: only 7 is an unpinned ready key, so two new keys cannot be stored now.
    assert s.prepare_load(ks(5, 6)).tolist() == [1, 0]
    stats_before, order_before = state(s)
    assert s.prepare_store(ks(8, 9)) is None
    stats_after, order_after = state(s)
    assert order_after == order_before
    assert stats_after.store_refusals == stats_before.store_refusals + 1 == 1
    assert replace(stats_after, store_refusals=0) == replace(stats_before, store_refusals=0)
    assert s.take_events() == []
    assert statuses(s, 3, 5, 6, 7, 8, 9) == [READY] * 4 + [ABSENT] * 2
    assert s.prepare_load(ks(3, 5, 6, 7)).tolist() == [2, 1, 0, 3]  # same slots as before
    s.complete_load(ks(3, 5, 6, 7, 3, 5, 6))
    assert s.stats().pinned == 0

    # Five new keys never fit in four slots, even with nothing pinned.
    assert s.prepare_store(ks(8, 9, 10, 11, 12)) is None
    assert s.stats().store_refusals == 2
    assert order(s) == [[3, 5, 6, 7]]
    assert s.take_events() == []

    # A failed complete_store frees its slots; the next store reuses the last freed slot first.
    plan = s.prepare_store(ks(8, 9))
    assert plan is not None
    assert (ids(plan.evicted), plan.slots.tolist()) == ([3, 5], [1, 2])
    s.complete_store(ks(8, 9), success=False)
    s.check_invariants()
    assert statuses(s, 8, 9) == [ABSENT, ABSENT]
    assert s.stats().used_slots == 2
    assert store(s, 10).slots.tolist() == [2]
    assert store(s, 11).slots.tolist() == [1]
    assert events(s) == [("removed", [3, 5]), ("stored", [10]), ("stored", [11])]
    assert order(s) == [[6, 7, 10, 11]]


def test_fresh_slots_before_freed_slots():
    s = CpuStore(4)
    assert s.prepare_store(ks(1, 2)) is not None
    s.complete_store(ks(1, 2), success=False)
    assert store(s, 3, 4, 5, 6).slots.tolist() == [2, 3, 1, 0]


def test_touch_keeps_the_head_of_a_prefix():
    s = CpuStore(4)
    store(s, 1, 2, 3, 4)
    s.touch(ks(1, 2, 99))  # 99 is absent: ignored
    assert order(s) == [[3, 4, 2, 1]]
    plan = store(s, 5, 6)
    assert ids(plan.evicted) == [3, 4]


@pytest.mark.parametrize(("policy", "survives"), [("arc", True), ("lru", False)])
def test_arc_keeps_a_key_used_twice_through_a_scan(policy, survives):
    s = CpuStore(4, policy)
    store(s, 1)
    # The second use of 1: a lookup hit, which the caller touches.
    assert s.lookup_prefix(ks(1)) == (1, False)
    s.touch(ks(1))
    for i in range(100, 120):  # a scan of once-used keys
        store(s, i)
    assert (statuses(s, 1) == [READY]) is survives
    if policy == "arc":
        assert order(s) == [[117, 118, 119], [1]]
        assert s.stats().evictions == 17


def test_arc_touch_during_the_store_is_not_a_second_use():
    s = CpuStore(4, "arc")
    assert s.prepare_store(ks(1)) is not None
    s.touch(ks(1))  # seen again while its store is in flight
    s.complete_store(ks(1))
    assert order(s) == [[1], []]
    for i in range(100, 104):
        store(s, i)
    assert statuses(s, 1) == [ABSENT]


def test_arc_ghost_hit_moves_a_returning_key_to_the_frequent_list():
    # The published ARC (FAST'03, Fig. 4) with c = 2, step by step.
    s = CpuStore(2, "arc")
    store(s, 1, 2)  # T1 = [1, 2]
    s.touch(ks(1))  # a hit: T1 = [2], T2 = [1]
    plan = store(s, 3)  # |T1| = 1 > p = 0: T1's oldest leaves for B1
    assert ids(plan.evicted) == [2]
    assert order(s) == [[3], [1]]
    plan = store(s, 2)  # a B1 ghost: p = 0 + max(|B2|/|B1|, 1) = 1, then |T1| = 1 is not > p
    assert ids(plan.evicted) == [1]
    assert order(s) == [[3], [2]]
    assert s.stats().arc_target_t1 == 1.0


def test_arc_a_full_t1_forgets_its_oldest_key_entirely():
    # Case IV(a) with |T1| = c: the oldest key of T1 leaves without a ghost, so its return is
    # a plain miss (into T1), not a ghost hit.
    s = CpuStore(2, "arc")
    store(s, 1, 2)
    assert ids(store(s, 3).evicted) == [1]
    assert ids(store(s, 1).evicted) == [2]
    assert order(s) == [[3, 1], []]
    assert s.stats().arc_target_t1 == 0.0


# --- errors ------------------------------------------------------------------------------------


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match=r"num_slots=0 is invalid"):
        CpuStore(0)
    with pytest.raises(ValueError, match=r"num_slots=-3 is invalid"):
        CpuStore(-3)
    with pytest.raises(TypeError, match=r"num_slots must be an int, got bool \(True\)"):
        CpuStore(True)
    with pytest.raises(TypeError, match=r"num_slots must be an int, got float \(4\.0\)"):
        CpuStore(4.0)
    with pytest.raises(TypeError, match=r"num_slots must be an int, got str \('4'\)"):
        CpuStore("4")
    with pytest.raises(ValueError, match=r'eviction_policy="fifo" is unknown; valid policies: lru'):
        CpuStore(4, "fifo")
    with pytest.raises(ValueError) as info:
        CpuStore(4, "LRU")
    assert all(name in str(info.value) for name in POLICY_NAMES)
    with pytest.raises(TypeError, match=r"eviction_policy must be a str"):
        CpuStore(4, None)  # type: ignore[arg-type]
    assert CpuStore(np.int64(3)).num_slots == 3


CALLS = {
    "prepare_store": lambda s, keys: s.prepare_store(keys),
    "complete_store": lambda s, keys: s.complete_store(keys),
    "lookup_prefix": lambda s, keys: s.lookup_prefix(keys),
    "lookup": lambda s, keys: s.lookup(keys),
    "prepare_load": lambda s, keys: s.prepare_load(keys),
    "complete_load": lambda s, keys: s.complete_load(keys),
    "touch": lambda s, keys: s.touch(keys),
}


def busy_store() -> CpuStore:
    """A store with ready, pinned and pending keys, and events waiting."""
    s = CpuStore(4, enable_events=True)
    store(s, 1, 2)
    s.prepare_load(ks(2))
    assert s.prepare_store(ks(3)) is not None
    return s


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize(
    ("bad", "exc", "message"),
    [
        ("not bytes", TypeError, r"keys\[1\] must be bytes, got str"),
        (bytearray(b"x"), TypeError, r"keys\[1\] must be bytes, got bytearray"),
        (None, TypeError, r"keys\[1\] must be bytes, got NoneType"),
        (b"", ValueError, r"keys\[1\] has length 0; keys must be 1..=64 bytes"),
        (b"x" * 65, ValueError, r"keys\[1\] has length 65; keys must be 1..=64 bytes"),
    ],
)
def test_bad_keys_are_refused_and_change_nothing(call, bad, exc, message):
    s = busy_store()
    before = state(s)
    with pytest.raises(exc, match=message):
        CALLS[call](s, [k(1), bad, k(2)])
    assert state(s) == before
    assert events(s) == [("stored", [1, 2])]
    s.check_invariants()


def test_key_length_limits():
    assert MAX_KEY_LEN == 64
    s = CpuStore(2)
    store(s, 0)
    plan = s.prepare_store([b"\x01", b"\x02" * 64])
    assert plan is not None
    assert plan.slots.tolist() == [1, 0]  # evicted k(0)


def test_keys_must_be_a_batch():
    s = CpuStore(2)
    with pytest.raises(TypeError, match="single bytes object"):
        s.prepare_store(k(1))
    with pytest.raises(TypeError):
        s.prepare_store(None)  # type: ignore[arg-type]
    # Any sequence of bytes works, not only lists.
    plan = s.prepare_store(tuple(ks(1, 2)))
    assert plan is not None
    assert plan.slots.tolist() == [0, 1]
    assert s.stats().pending == 2


def test_prepare_store_accepts_any_iterable():
    s = CpuStore(4)
    plan = s.prepare_store(key for key in ks(1, 2))
    assert plan is not None
    assert (plan.keys, plan.slots.tolist()) == (ks(1, 2), [0, 1])
    plan = s.prepare_store({k(3)})
    assert plan is not None
    assert (plan.keys, plan.slots.tolist()) == (ks(3), [2])

    def broken():
        yield k(4)
        raise RuntimeError("the iterable fails midway")

    before = state(s)
    with pytest.raises(RuntimeError, match="midway"):
        s.prepare_store(broken())
    assert state(s) == before
    assert statuses(s, 4) == [ABSENT]


@pytest.mark.parametrize(
    ("call", "keys", "message"),
    [
        ("prepare_load", ks(3), r"prepare_load: keys\[0\] \(0x[0-9a-f]{72}\) is pending"),
        ("prepare_load", ks(1, 9), r"prepare_load: keys\[1\] .* is absent, needs to be ready"),
        ("complete_load", ks(1), r"complete_load: keys\[0\] .* is ready, needs to be pinned"),
        ("complete_load", ks(2, 2), r"complete_load: keys\[1\] .* listed more often"),
        ("complete_load", ks(3), r"complete_load: keys\[0\] .* is pending, needs to be pinned"),
        ("complete_store", ks(1), r"complete_store: keys\[0\] .* is ready, needs to be pending"),
        ("complete_store", ks(3, 9), r"complete_store: keys\[1\] .* is absent"),
        ("complete_store", ks(3, 3), r"complete_store: keys\[1\] .* is listed twice"),
        ("complete_store", ks(2), r"is ready and pinned, needs to be pending"),
    ],
)
def test_invalid_state_errors_change_nothing(call, keys, message):
    s = busy_store()
    s.take_events()
    before = state(s)
    with pytest.raises(InvalidStateError, match=message) as info:
        CALLS[call](s, keys)
    assert isinstance(info.value, KVOffloadError)
    assert state(s) == before
    assert s.take_events() == []
    s.check_invariants()
    # Pins are unchanged too: 2 is pinned exactly once.
    s.complete_load(ks(2))
    with pytest.raises(InvalidStateError):
        s.complete_load(ks(2))


def test_failed_complete_load_undoes_its_earlier_unpins():
    s = CpuStore(4)
    store(s, 1, 2)
    s.prepare_load(ks(1, 2))
    with pytest.raises(InvalidStateError, match=r"keys\[2\]"):
        s.complete_load(ks(1, 2, 1))
    assert s.stats().pinned == 2
    s.complete_load(ks(2, 1))
    assert s.stats().pinned == 0


# --- reset -------------------------------------------------------------------------------------


def test_reset_drops_ready_keys_now_and_busy_keys_when_released():
    s = CpuStore(4, enable_events=True)
    store(s, 1, 2, 3)
    s.prepare_load(ks(2))
    assert s.prepare_store(ks(4)) is not None
    s.take_events()

    s.reset()
    s.check_invariants()
    # 2 is pinned but was announced stored, so it is announced removed now with 1 and 3;
    # 4 was never announced.
    assert events(s) == [("removed", [1, 2, 3])]
    assert statuses(s, 1, 2, 3, 4) == [ABSENT] * 4
    assert s.lookup_prefix(ks(2)) == (0, False)
    st = s.stats()
    # In use until released, counted nowhere else.
    assert (st.used_slots, st.ready, st.pending, st.pinned) == (2, 0, 0, 0)
    with pytest.raises(InvalidStateError, match=r"absent \(reset\)"):
        s.prepare_load(ks(2))
    # An offer holding a key that reset dropped but that is still busy is refused ("cannot
    # store now"), so the caller offers it again once the key is released.
    assert s.prepare_store(ks(4, 5)) is None
    assert s.stats().store_refusals == 1

    # The loads and stores in flight still complete, and then their keys leave.
    s.complete_load(ks(2))
    s.complete_store(ks(4))
    s.check_invariants()
    assert events(s) == []
    assert statuses(s, 2, 4) == [ABSENT, ABSENT]
    st = s.stats()
    assert (st.used_slots, st.ready, st.pending, st.pinned) == (0, 0, 0, 0)
    assert st.stores_completed == 3 and st.stores_failed == 0
    # Reset freed slots 0 and 2, then 2's load freed 1 and 4's store 3: last freed first.
    assert store(s, 4, 5, 6).slots.tolist() == [3, 1, 2]


def test_reset_forgets_arc_history():
    s = CpuStore(2, "arc")
    store(s, 1, 2)
    store(s, 3)  # 1 becomes a ghost
    s.reset()
    assert s.stats().used_slots == 0
    store(s, 4, 5)
    store(s, 1)  # no longer a ghost: enters the recent list
    assert order(s) == [[5, 1], []]
    assert s.stats().arc_target_t1 == 0.0


# --- events ------------------------------------------------------------------------------------


def test_events_are_ordered_and_drained():
    s = CpuStore(2, enable_events=True)
    assert s.events_enabled
    store(s, 1, 2)
    plan = s.prepare_store(ks(3, 4))
    assert plan is not None
    s.complete_store(ks(4))
    s.complete_store(ks(3))
    s.reset()
    assert s.take_events() == [
        StoreEvent("stored", ks(1, 2)),
        StoreEvent("removed", ks(1, 2)),  # before the stores that needed their slots
        StoreEvent("stored", ks(4)),
        StoreEvent("stored", ks(3)),
        StoreEvent("removed", ks(4, 3)),  # reset: slot order
    ]
    assert s.take_events() == []


def test_events_are_off_by_default():
    s = CpuStore(1)
    assert not s.events_enabled
    store(s, 1)
    store(s, 2)
    s.reset()
    assert s.take_events() == []


# --- stats -------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_stats(policy):
    s = CpuStore(3, policy)
    st = s.stats()
    assert (st.num_slots, st.used_slots, st.ready, st.pending, st.pinned) == (3, 0, 0, 0, 0)
    store(s, 1, 2)
    assert s.prepare_store(ks(3)) is not None
    s.prepare_load(ks(1, 1))
    s.lookup_prefix(ks(1, 2, 3))  # 2 hits, stops at pending 3: no miss
    s.lookup(ks(1, 4, 3))  # 1 hit, 1 miss
    assert s.prepare_store(ks(5, 6)) is None  # only 2 is evictable
    plan = s.prepare_store(ks(5))
    assert plan is not None
    assert ids(plan.evicted) == [2]
    s.complete_store(ks(5), success=False)
    st = s.stats()
    assert st.num_slots == 3
    assert st.used_slots == 2
    assert (st.ready, st.pending, st.pinned) == (1, 1, 1)
    assert (st.hits, st.misses) == (3, 1)
    assert (st.evictions, st.store_refusals) == (1, 1)
    assert (st.stores_completed, st.stores_failed) == (2, 1)
    assert st.arc_target_t1 == 0.0
    # Entries hold a copy of the key: 64 bytes of key room plus links, index and free list.
    assert 80 <= st.metadata_bytes_per_slot <= 200


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_metadata_bytes_per_slot_when_full(policy):
    n = 4096
    s = CpuStore(n, policy)
    keys = [i.to_bytes(32, "big") + b"\0\0\0\0" for i in range(2 * n)]
    for b in range(0, 2 * n, 64):
        plan = s.prepare_store(keys[b : b + 64])
        assert plan is not None
        s.complete_store(plan.keys)
    st = s.stats()
    assert (st.used_slots, st.evictions) == (n, n)
    assert st.metadata_bytes_per_slot <= 128
    s.check_invariants()


def test_repr():
    s = CpuStore(4, "arc")
    store(s, 1)
    assert repr(s) == "CpuStore(num_slots=4, eviction_policy='arc', ready=1, pending=0, pinned=0)"


def test_num_slots_beyond_the_u32_slot_ids_is_named():
    with pytest.raises(ValueError, match=r"num_slots=1180591620717411303424 is invalid"):
        CpuStore(2**70)


def test_ranked_lru_orders_a_request_as_one_group_tails_first():
    s = CpuStore(8, "lru")
    a = s.new_rank()
    s.complete_store(s.prepare_store(ks(10, 11), rank=a).keys)
    b = s.new_rank()
    s.complete_store(s.prepare_store(ks(20), rank=b).keys)
    # a's later chunks (positions 2 and 3) still sort with a, before its head.
    s.complete_store(s.prepare_store(ks(12, 13), rank=a, first_position=2).keys)
    assert order(s) == [[13, 12, 11, 10, 20]]
    # Loading b's chunk for a newer request moves it up; an older rank leaves it alone.
    c = s.new_rank()
    s.prepare_load(ks(20), rank=c)
    s.prepare_load(ks(10), rank=a)
    assert order(s) == [[13, 12, 11, 10, 20]]
    s.complete_load(ks(20, 10))
    s.touch(ks(10, 11, 12, 13), reuse=False)  # a finishes: head most recent
    assert order(s) == [[20, 13, 12, 11, 10]]
    s.check_invariants()


def test_ranks_are_ignored_under_arc():
    s = CpuStore(4, "arc")
    r = s.new_rank()
    s.complete_store(s.prepare_store(ks(1, 2), rank=r, first_position=5).keys)
    assert order(s) == [[1, 2], []]


def test_first_pinned():
    s = CpuStore(4, "lru")
    store(s, 1, 2, 3)
    assert s.first_pinned(ks(1, 2, 3)) == 3
    s.prepare_load(ks(2))
    assert s.first_pinned(ks(1, 2, 3)) == 1
    assert s.first_pinned(ks(3, 9)) == 2
    s.complete_load(ks(2))
    assert s.first_pinned(ks(1, 2, 3)) == 3


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"positions": [16, 32]}, ValueError, "positions were given without a rank"),
        ({"rank": True, "positions": [16]}, ValueError, r"positions=<1 values for 2 keys>"),
        ({"rank": True, "positions": [16, None]}, TypeError, "positions must be a sequence of"),
        ({"rank": True, "positions": "ab"}, TypeError, "positions must be a sequence of"),
        ({"rank": True, "positions": [16, 2**70]}, TypeError, "positions must be a sequence of"),
    ],
)
def test_bad_positions_are_refused_and_change_nothing(kwargs, error, match):
    store = CpuStore(4)
    store.prepare_store([b"r"])
    before = store.recency_order()
    if kwargs.get("rank") is True:
        kwargs = {**kwargs, "rank": store.new_rank()}
    for call in (store.prepare_store, store.prepare_load):
        with pytest.raises(error, match=match):
            call([b"a", b"b"] if call == store.prepare_store else [b"r", b"r"], **kwargs)
    assert store.recency_order() == before
    assert (store.stats().pending, store.stats().pinned) == (1, 0)


def test_prepare_store_hands_back_the_callers_key_objects():
    keys = [bytes([i]) * 36 for i in range(3)]
    plan = CpuStore(4).prepare_store(keys)
    assert all(a is b for a, b in zip(plan.keys, keys, strict=True))


def test_huge_pools_cost_nothing_until_used():
    # These aborted the process ("memory allocation failed") or took tens of seconds before.
    store = CpuStore(2**31, "arc")
    assert store.num_slots == 2**31
    store.complete_store(store.prepare_store([b"a", b"b"]).keys)
    assert store.stats().used_slots == 2
    with pytest.raises(ValueError, match=r"num_slots=2147483649 is invalid"):
        CpuStore(2**31 + 1)


def test_a_petabyte_tier_is_configured_at_once():
    from kvoffload.scheduler import OffloadConfig, OffloadScheduler

    config = OffloadConfig.from_dict({"tokens_per_block": 16, "cpu_bytes_to_use": 10**15})
    sched = OffloadScheduler.create(config, bytes_per_chunk=2 << 20)
    assert sched.store.num_slots == 10**15 // (2 << 20)


def test_a_write_hold_is_not_a_load_and_keeps_its_key():
    store = CpuStore(2)
    plan = store.prepare_store([b"a", b"b"])
    store.complete_store(plan.keys)
    assert store.hold_for_write([b"a"]).tolist() == plan.slots[:1].tolist()
    assert store.first_pinned([b"a", b"b"]) == 2  # held, but no load in flight
    assert store.stats().pinned == 1
    new = store.prepare_store([b"c"])  # room is made from b, not from the held a
    assert new is not None and new.evicted == [b"b"]
    with pytest.raises(InvalidStateError, match=r"release_write: keys\[0\].*held for a write"):
        store.release_write([b"c"])
    store.release_write([b"a"])
    assert store.stats().pinned == 0
    store.check_invariants()
