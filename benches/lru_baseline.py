"""A plain-Python LRU store with the semantics of kvoffload's `CpuStore`, kept as a baseline.

One `OrderedDict` maps key -> [slot, pins] in recency order (least recent first); pins is -1
while the key's store is in flight. The rules are those of `CpuStore` under `"lru"`:

- `prepare_store` filters keys already pending or ready (and repeats), evicts unpinned ready
  keys from the least recent end, never a key offered in the same call, and is all-or-nothing;
  fresh slots are handed out in increasing order first, freed slots last-freed-first;
- `complete_store`, `prepare_load` and `complete_load` check the whole batch before changing
  anything;
- `touch` makes the earlier keys of the batch the most recent.

No events, stats or `reset`: the benchmark trace does not use them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

_PENDING = -1


class OrderedDictLruStore:
    __slots__ = ("_entries", "_free", "_next_fresh", "num_slots")

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots} is invalid; allowed: >= 1")
        self.num_slots = num_slots
        self._entries: OrderedDict[bytes, list[int]] = OrderedDict()
        self._next_fresh = 0
        self._free: list[int] = []

    def prepare_store(
        self, keys: Sequence[bytes]
    ) -> tuple[list[bytes], list[int], list[bytes]] | None:
        """`(keys_to_write, slots, evicted)`, or None when they cannot all fit now."""
        entries = self._entries
        new: list[bytes] = []
        seen: set[bytes] = set()
        for key in keys:
            if key in entries or key in seen:
                continue
            seen.add(key)
            new.append(key)
        free = self._free
        need = len(new) - (self.num_slots - self._next_fresh) - len(free)
        evicted: list[bytes] = []
        if need > 0:
            offered = set(keys)
            for key, entry in entries.items():
                if entry[1] == 0 and key not in offered:
                    evicted.append(key)
                    if len(evicted) == need:
                        break
            else:
                return None
            for key in evicted:
                free.append(entries.pop(key)[0])
        slots: list[int] = []
        for key in new:
            if self._next_fresh < self.num_slots:
                slot = self._next_fresh
                self._next_fresh += 1
            else:
                slot = free.pop()
            entries[key] = [slot, _PENDING]
            slots.append(slot)
        return new, slots, evicted

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        entries = self._entries
        for i, key in enumerate(keys):
            entry = entries.get(key)
            if entry is None or entry[1] != _PENDING:
                raise ValueError(f"complete_store: keys[{i}] is not pending")
        if len(set(keys)) != len(keys):
            raise ValueError("complete_store: a key is listed twice")
        for key in keys:
            if success:
                entries[key][1] = 0
            else:
                self._free.append(entries.pop(key)[0])

    def lookup_prefix(self, keys: Sequence[bytes]) -> tuple[int, bool]:
        entries = self._entries
        for i, key in enumerate(keys):
            entry = entries.get(key)
            if entry is None:
                return i, False
            if entry[1] == _PENDING:
                return i, True
        return len(keys), False

    def prepare_load(self, keys: Sequence[bytes]) -> list[int]:
        entries = self._entries
        for i, key in enumerate(keys):
            entry = entries.get(key)
            if entry is None or entry[1] == _PENDING:
                raise ValueError(f"prepare_load: keys[{i}] is not ready")
        slots = []
        for key in keys:
            entry = entries[key]
            entry[1] += 1
            slots.append(entry[0])
        return slots

    def complete_load(self, keys: Sequence[bytes]) -> None:
        entries = self._entries
        listed: dict[bytes, int] = {}
        for i, key in enumerate(keys):
            entry = entries.get(key)
            count = listed.get(key, 0) + 1
            if entry is None or entry[1] < count:
                raise ValueError(f"complete_load: keys[{i}] is not pinned that often")
            listed[key] = count
        for key in keys:
            entries[key][1] -= 1

    def touch(self, keys: Sequence[bytes]) -> None:
        entries = self._entries
        for key in reversed(keys):
            if key in entries:
                entries.move_to_end(key)

    def recency_order(self) -> list[bytes]:
        """Keys from least to most recently used."""
        return list(self._entries)
