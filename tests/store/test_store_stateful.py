"""A hypothesis state machine over CpuStore, checked step by step against a small pure-Python
reference model: exact under LRU (victims, slots, order, events, counters); under ARC everything
but the choice of victims, which must be valid (the right number, each ready, unpinned and not
offered in the same call)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvoffload import CpuStore, InvalidStateError, KeyStatus

ABSENT, PENDING, READY = KeyStatus.ABSENT, KeyStatus.PENDING, KeyStatus.READY
KEYS = [bytes([i]) * (1 + (i * 29) % 64) for i in range(10)]
KEY_LISTS = st.lists(st.sampled_from(KEYS), max_size=6)


@dataclass
class Entry:
    slot: int
    ready: bool = False
    pins: int = 0
    doomed: bool = False  # reset while pending or pinned: answers absent, leaves when released


class Model:
    def __init__(self, num_slots: int, lru: bool) -> None:
        self.n = num_slots
        self.lru = lru
        self.entries: dict[bytes, Entry] = {}
        self.order: list[bytes] = []  # every resident key, least recent first (LRU only)
        self.known_t2: set[bytes] = set()  # ARC: touched while ready, resident since
        self.next_fresh = 0
        self.free: list[int] = []
        self.counters = dict.fromkeys(
            ["hits", "misses", "evictions", "store_refusals", "stores_completed", "stores_failed"],
            0,
        )

    def status(self, key: bytes) -> int:
        e = self.entries.get(key)
        if e is None or e.doomed:
            return ABSENT
        return READY if e.ready else PENDING

    def evictable(self, key: bytes) -> bool:
        e = self.entries[key]
        return e.ready and e.pins == 0 and not e.doomed

    def release(self, key: bytes) -> None:
        e = self.entries.pop(key)
        self.order.remove(key)
        self.known_t2.discard(key)
        self.free.append(e.slot)

    def prepare_store(self, keys, store_evicted):
        new = []
        indices = []
        for i, key in enumerate(keys):
            if key in self.entries or key in new:
                continue
            new.append(key)
            indices.append(i)
        need = len(new) - (self.n - self.next_fresh) - len(self.free)
        candidates = [k for k in self.order if self.evictable(k) and k not in keys]
        # A key dropped by reset but still busy blocks the whole offer.
        blocked = any(key in self.entries and self.entries[key].doomed for key in keys)
        if blocked or need > len(candidates):
            self.counters["store_refusals"] += 1
            return None
        need = max(need, 0)
        if self.lru or store_evicted is None:
            victims = candidates[:need]
        else:
            victims = list(store_evicted)
            assert len(victims) == need
            assert len(set(victims)) == need
            assert all(v in candidates for v in victims), "ARC evicted a key it must not"
        for v in victims:
            self.release(v)
        self.counters["evictions"] += len(victims)
        slots = []
        for key in new:
            if self.next_fresh < self.n:
                slot = self.next_fresh
                self.next_fresh += 1
            else:
                slot = self.free.pop()
            self.entries[key] = Entry(slot)
            self.order.append(key)
            slots.append(slot)
        return new, indices, slots, victims

    def complete_store(self, keys, success):
        """The keys that became ready, or the error message's index."""
        for i, key in enumerate(keys):
            e = self.entries.get(key)
            if e is None or e.ready:
                return i
        for i, key in enumerate(keys):
            if key in keys[:i]:
                return i
        stored = []
        for key in keys:
            e = self.entries[key]
            if success and not e.doomed:
                e.ready = True
                self.counters["stores_completed"] += 1
                stored.append(key)
            else:
                self.counters["stores_failed"] += not success
                self.release(key)
        return stored

    def lookup_prefix(self, keys):
        for i, key in enumerate(keys):
            s = self.status(key)
            if s != READY:
                self.counters["hits"] += i
                self.counters["misses"] += s == ABSENT
                return i, s == PENDING
        self.counters["hits"] += len(keys)
        return len(keys), False

    def lookup(self, keys):
        out = [self.status(k) for k in keys]
        self.counters["hits"] += out.count(READY)
        self.counters["misses"] += out.count(ABSENT)
        return out

    def prepare_load(self, keys):
        for i, key in enumerate(keys):
            if self.status(key) != READY:
                return i
        slots = []
        for key in keys:
            self.entries[key].pins += 1
            slots.append(self.entries[key].slot)
        return slots

    def complete_load(self, keys):
        for i, key in enumerate(keys):
            e = self.entries.get(key)
            if e is None or e.pins == 0:
                return i
        for i, key in enumerate(keys):
            if keys[: i + 1].count(key) > self.entries[key].pins:
                return i
        gone = []
        for key in keys:
            e = self.entries[key]
            e.pins -= 1
            if e.pins == 0 and e.doomed:
                gone.append(key)
        for key in gone:
            self.release(key)
        return None

    def touch(self, keys):
        moved: list[bytes] = []
        for key in reversed(keys):
            e = self.entries.get(key)
            if e is not None and not e.doomed:
                self.order.remove(key)
                self.order.append(key)
                if key in moved:
                    moved.remove(key)
                moved.append(key)
                if e.ready:
                    self.known_t2.add(key)
        return moved

    def reset(self):
        removed = []
        for key, e in sorted(self.entries.items(), key=lambda kv: kv[1].slot):
            if e.ready and e.pins == 0:
                self.release(key)
                removed.append(key)
            else:
                if e.ready and not e.doomed:
                    removed.append(key)
                e.doomed = True
        return removed

    def stats(self):
        es = list(self.entries.values())
        return {
            "num_slots": self.n,
            "used_slots": len(es),
            # Keys dropped by reset but not yet released count nowhere but in used_slots.
            "ready": sum(e.ready and not e.doomed for e in es),
            "pending": sum(not e.ready and not e.doomed for e in es),
            "pinned": sum(e.pins > 0 and not e.doomed for e in es),
            **self.counters,
        }


class StoreMachine(RuleBasedStateMachine):
    policy = "lru"

    @initialize(num_slots=st.integers(1, 6), events=st.booleans())
    def start(self, num_slots, events):
        self.store = CpuStore(num_slots, self.policy, enable_events=events)
        self.model = Model(num_slots, self.policy == "lru")
        self.events_on = events
        self.expected_events: list[tuple[str, list[bytes]]] = []

    def snapshot(self):
        """What a refused or failed call leaves as it was (reserved memory may grow)."""
        stats = replace(self.store.stats(), metadata_bytes_per_slot=0.0)
        return (stats, self.store.recency_order())

    def expect_event(self, kind, keys):
        if keys:
            self.expected_events.append((kind, list(keys)))

    def draw_from(self, data, candidates):
        """Mostly keys in the right state, sometimes any key (then the call may fail)."""
        keys = data.draw(st.lists(st.sampled_from(candidates), max_size=4)) if candidates else []
        if data.draw(st.integers(0, 4)) == 0:
            keys.insert(data.draw(st.integers(0, len(keys))), data.draw(st.sampled_from(KEYS)))
        return keys

    def expect_state_error(self, call, keys, index):
        before = self.snapshot()
        with pytest.raises(InvalidStateError, match=rf"keys\[{index}\]"):
            call(keys)
        assert self.snapshot() == before

    @rule(keys=KEY_LISTS)
    def prepare_store(self, keys):
        before = self.snapshot()
        plan = self.store.prepare_store(keys)
        want = self.model.prepare_store(keys, None if plan is None else plan.evicted)
        if want is None:
            assert plan is None
            stats, order = self.snapshot()
            assert order == before[1]  # refused: nothing moved
            assert stats == replace(before[0], store_refusals=before[0].store_refusals + 1)
            return
        assert plan is not None
        new, indices, slots, victims = want
        assert plan.keys == new
        assert plan.indices.tolist() == indices
        assert plan.slots.tolist() == slots
        assert plan.evicted == victims
        self.expect_event("removed", victims)

    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data, success):
        pending = [k for k, e in self.model.entries.items() if not e.ready]
        keys = self.draw_from(data, pending)
        outcome = self.model.complete_store(keys, success)
        if isinstance(outcome, int):
            self.expect_state_error(
                lambda ks: self.store.complete_store(ks, success), keys, outcome
            )
        else:
            self.store.complete_store(keys, success)
            self.expect_event("stored", outcome)

    @rule(keys=KEY_LISTS)
    def lookup_prefix(self, keys):
        assert self.store.lookup_prefix(keys) == self.model.lookup_prefix(keys)

    @rule(data=st.data())
    def prepare_load(self, data):
        ready = [k for k in KEYS if self.model.status(k) == READY]
        keys = self.draw_from(data, ready)
        outcome = self.model.prepare_load(keys)
        if isinstance(outcome, int):
            self.expect_state_error(self.store.prepare_load, keys, outcome)
        else:
            assert self.store.prepare_load(keys).tolist() == outcome

    @rule(data=st.data())
    def complete_load(self, data):
        pinned = [k for k, e in self.model.entries.items() for _ in range(e.pins)]
        keys = self.draw_from(data, pinned)
        outcome = self.model.complete_load(keys)
        if isinstance(outcome, int):
            self.expect_state_error(self.store.complete_load, keys, outcome)
        else:
            self.store.complete_load(keys)

    @rule(keys=KEY_LISTS)
    def touch(self, keys):
        t2_before = self.store.recency_order()[-1]
        self.store.touch(keys)
        moved = self.model.touch(keys)
        if self.policy == "arc":
            t1, t2 = self.store.recency_order()
            for lst in (t1, t2):
                mine = [k for k in moved if k in lst]
                assert lst[len(lst) - len(mine) :] == mine
            for key in moved:
                if self.model.entries[key].ready:
                    assert key in t2
                else:  # seen again during its own store: not promoted
                    assert (key in t2) == (key in t2_before)

    @rule()
    def reset(self):
        self.store.reset()
        self.expect_event("removed", self.model.reset())

    @invariant()
    def agrees_with_the_model(self):
        if not hasattr(self, "store"):
            return
        self.store.check_invariants()
        got = [(e.kind, e.keys) for e in self.store.take_events()]
        assert got == (self.expected_events if self.events_on else [])
        self.expected_events = []
        stats = self.store.stats()
        want = self.model.stats()
        assert {name: getattr(stats, name) for name in want} == want
        assert self.store.lookup(KEYS).tolist() == self.model.lookup(KEYS)
        slots = [e.slot for e in self.model.entries.values()]
        assert len(set(slots)) == len(slots) <= self.model.n
        order = self.store.recency_order()
        if self.model.lru:
            assert order == [self.model.order]
        else:
            t1, t2 = order
            assert sorted(t1 + t2) == sorted(self.model.entries)
            assert self.model.known_t2 <= set(t2)


class ArcStoreMachine(StoreMachine):
    policy = "arc"


SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

TestLruStore = StoreMachine.TestCase
TestLruStore.settings = SETTINGS
TestArcStore = ArcStoreMachine.TestCase
TestArcStore.settings = SETTINGS
