"""Eight threads hammer one CpuStore with mixed operations on their own keys and on shared ones:
they finish without error or deadlock, and afterwards the invariants hold and the event stream
agrees with the final state."""

from __future__ import annotations

import random
import threading

from kvoffload import CpuStore, InvalidStateError, KeyList, KeyStatus

THREADS = 8
STEPS = 300
NUM_SLOTS = 48
SHARED = [b"shared-%02d" % i for i in range(24)]


def own_keys(t: int) -> list[bytes]:
    return [b"t%d-key-%02d" % (t, i) for i in range(16)]


def worker(t: int, store: CpuStore, barrier: threading.Barrier, counts: dict[str, int]) -> None:
    rng = random.Random(t)
    mine = own_keys(t)
    barrier.wait()
    for _ in range(STEPS):
        keys = rng.sample(mine, rng.randint(1, 4)) + rng.sample(SHARED, rng.randint(0, 3))
        rng.shuffle(keys)
        op = rng.random()
        if op < 0.4:
            plan = store.prepare_store(keys)
            if plan is None:
                counts["refused"] += 1
                continue
            # The keys this call reserved are pending and this thread's to complete.
            success = rng.random() < 0.85
            store.lookup_prefix(plan.keys)
            store.complete_store(plan.keys, success)
            counts["stored"] += len(plan.keys) if success else 0
        elif op < 0.65:
            hits, _pending = store.lookup_prefix(keys)
            ready = keys[:hits]
            try:
                slots = store.prepare_load(ready)
            except InvalidStateError:
                # Evicted or reset by another thread between the lookup and the load.
                counts["lost_race"] += 1
                continue
            assert len(slots) == len(ready)
            assert all(0 <= s < NUM_SLOTS for s in slots.tolist())
            store.touch(ready)
            # Pinned: no other thread can evict them or start storing them again until they are
            # released; only a reset (thread 0) can make them answer absent meanwhile.
            assert set(store.lookup(ready).tolist()) <= {KeyStatus.READY, KeyStatus.ABSENT}
            store.complete_load(ready)
            counts["loaded"] += len(ready)
        elif op < 0.8:
            store.lookup(keys)
        elif op < 0.97:
            store.touch(keys)
        elif t == 0:
            store.reset()
        else:
            store.stats()
            store.recency_order()


def test_eight_threads_hammering_one_store():
    store = CpuStore(NUM_SLOTS, "lru", enable_events=True)
    barrier = threading.Barrier(THREADS)
    counts = [
        dict.fromkeys(["refused", "stored", "lost_race", "loaded"], 0) for _ in range(THREADS)
    ]
    errors: list[BaseException] = []

    def run(t: int) -> None:
        try:
            worker(t, store, barrier, counts[t])
        except BaseException as e:  # reported below, with the thread's traceback
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(t,), daemon=True) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in threads), "a thread is stuck: deadlock?"
    if errors:
        raise errors[0]

    store.check_invariants()
    st = store.stats()
    assert (st.pending, st.pinned) == (0, 0)
    assert st.used_slots <= NUM_SLOTS
    # A store completed after a reset doomed it does not count as completed.
    assert 0 < st.stores_completed <= sum(c["stored"] for c in counts)
    assert sum(c["loaded"] for c in counts) > 0
    assert st.evictions > 0

    # Replay the events: each key announced stored once before it is announced removed, and
    # the announced keys are exactly the ready ones now.
    announced: set[bytes] = set()
    for event in store.take_events():
        for key in event.keys:
            if event.kind == "stored":
                assert key not in announced
                announced.add(key)
            else:
                assert event.kind == "removed"
                announced.remove(key)
    universe = SHARED + [k for t in range(THREADS) for k in own_keys(t)]
    statuses = store.lookup(universe).tolist()
    ready = {k for k, s in zip(universe, statuses, strict=True) if s == KeyStatus.READY}
    assert announced == ready
    assert len(ready) == st.ready


def test_pinned_keys_survive_concurrent_churn():
    """Keys pinned by a load stay put while seven threads churn the store around them."""
    store = CpuStore(16, "lru", enable_events=True)
    hot = [b"hot-%d" % i for i in range(4)]
    plan = store.prepare_store(hot)
    assert plan is not None
    store.complete_store(plan.keys)
    # The hot keys are the least recent: first in line for eviction, were they not pinned.
    assert store.prepare_load(hot).tolist() == [0, 1, 2, 3]
    errors: list[BaseException] = []
    evicted: list[bytes] = []

    def storer(t: int) -> None:
        try:
            for i in range(0, 600, 3):
                p = store.prepare_store([b"cold-%d-%d" % (t, i + j) for j in range(3)])
                if p is not None:
                    evicted.extend(p.evicted)
                    store.complete_store(p.keys)
        except BaseException as e:
            errors.append(e)

    def reader() -> None:
        try:
            for _ in range(600):
                assert store.lookup_prefix(hot) == (4, False)
                store.touch(hot[::-1])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=storer, args=(t,), daemon=True) for t in range(5)]
    threads += [threading.Thread(target=reader, daemon=True) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in threads), "a thread is stuck: deadlock?"
    assert errors == []
    assert len(evicted) > 100
    assert not set(hot) & set(evicted)
    store.check_invariants()
    assert store.prepare_load(hot).tolist() == [0, 1, 2, 3]
    store.complete_load(hot + hot)
    st = store.stats()
    assert (st.pinned, st.pending, st.ready) == (0, 0, 16)


def test_concurrent_extends_of_one_key_list_append_each_chunk_once():
    # Each extender reads the length, makes the new keys without the lock, then appends under
    # it: one that lost the race must skip what the other appended, not append it again.
    hashes = [i.to_bytes(32, "big") for i in range(400)]
    for _ in range(20):
        keys = KeyList()
        barrier = threading.Barrier(4)

        def extend(keys: KeyList = keys, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            for end in range(2, 401, 2):
                keys.extend_chunk_keys(hashes[:end], 2)

        threads = [threading.Thread(target=extend) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert list(keys) == [h + b"\0\0\0\0" for h in hashes[1::2]]
