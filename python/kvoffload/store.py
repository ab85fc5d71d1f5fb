"""`CpuStore`: the CPU-tier block store (key index, eviction, pins, events) of kvoffload.

A thin facade over the Rust store: each method is one call into Rust for the whole batch, with
the GIL released while the store works, so the object is safe to share between threads.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from kvoffload import _rust

# Re-exported: `kvoffload.KeyList` is this class, so the API reference renders it as one.
from kvoffload._rust import KeyList as KeyList
from kvoffload._rust import KeyRange as KeyRange

MAX_KEY_LEN: int = _rust.MAX_KEY_LEN
MAX_SLOTS: int = _rust.MAX_SLOTS
POLICY_NAMES: tuple[str, ...] = tuple(_rust.POLICY_NAMES)

Keys = Iterable[bytes] | KeyList | KeyRange
"""A batch of keys, each 1..=MAX_KEY_LEN bytes: a `KeyList` or a view of one (read in place, the
fastest), a list of `bytes`, or any iterable of `bytes`."""
GroupOffer = tuple[
    int, KeyList, list[int], int, "tuple[int, int, int | None, Sequence[int]] | None"
]
"""One group's store offer of a request: `(group, keys, table, first_chunk, reach)`, its keys
and its blocks of chunks `first_chunk..` (whole chunks), `reach` a sliding-window group's
(`HybridPlanner`)."""


GroupSpec = tuple[str, "int | None", int, int, bool]
"""A KV-cache group as `CpuStore.lookup_groups` takes it: `(kind, window_chunks, window,
extra_retained_tokens, eagle)` (`KVGroup.spec`)."""


class KeyStatus(enum.IntEnum):
    ABSENT = 0
    PENDING = 1
    READY = 2


class PrefixLookup(NamedTuple):
    """`hits` leading keys are ready; `pending` tells whether the first one that is not is being
    stored (ask again next step) rather than absent."""

    hits: int
    pending: bool


class StorePlan(NamedTuple):
    """What `prepare_store` accepted: write `keys[i]` (at position `indices[i]` of the offer) to
    `slots[i]`, then call `complete_store(keys)`. `keys` is a list of `bytes`, or a `KeyList` when a
    `KeyList` (or a view) was offered. `evicted` left the store to make room,
    oldest first."""

    keys: list[bytes] | KeyList
    indices: npt.NDArray[np.int64]
    slots: npt.NDArray[np.int64]
    evicted: list[bytes]


class GroupStorePlan(NamedTuple):
    """What `offer_group_store` accepted: write `keys[i]` (chunk `chunks[i]` of its group) to
    `slots[i]` from GPU blocks `blocks[i * blocks_per_chunk : (i + 1) * blocks_per_chunk]`, then
    call `complete_store(keys)`. The keys are in group order, `counts[g]` of them group `g`'s;
    `window_blocks` are the live blocks of window groups among `blocks`."""

    keys: KeyList
    slots: npt.NDArray[np.int64]
    chunks: npt.NDArray[np.int64]
    blocks: npt.NDArray[np.int64]
    counts: list[int]
    window_blocks: list[int]


class GroupLoadPlan(NamedTuple):
    """What `load_groups` pinned: load `keys[i]` from `slots[i]`; `parts` are each loading
    group's `(group, num_slots, num_blocks, skip_leading_blocks)`, in group order, and
    `gpu_block_ids` the blocks they write, in that order."""

    keys: KeyList
    slots: npt.NDArray[np.int64]
    gpu_block_ids: npt.NDArray[np.int64]
    parts: list[tuple[int, int, int, int]]


@dataclass(frozen=True)
class StoreEvent:
    kind: str
    """`"stored"` (keys became ready) or `"removed"` (evicted or reset)."""
    keys: list[bytes]


@dataclass(frozen=True)
class StoreStats:
    num_slots: int
    usable_slots: int
    """Slots that may be handed out now (the rest wait for their memory, see
    `CpuStore.set_usable_slots`)."""
    used_slots: int
    ready: int
    pending: int
    pinned: int
    hits: int
    misses: int
    evictions: int
    store_refusals: int
    stores_completed: int
    stores_failed: int
    metadata_bytes_per_slot: float
    """Index metadata per slot (entries with their key copies, hash table, ghost lists)."""
    arc_target_t1: float
    """ARC's adaptive target size of its recency list (0 under LRU)."""


_STATS_FIELDS = tuple(f.name for f in fields(StoreStats))


# dtype objects, not classes: np.frombuffer resolves a class on every call (half its cost here).
_INT64 = np.dtype(np.int64)
_UINT8 = np.dtype(np.uint8)


def _int64s(raw: bytes) -> npt.NDArray[np.int64]:
    return np.frombuffer(raw, dtype=_INT64)


def _check_positions(rank: int | None, positions: Sequence[int] | bytes | None) -> None:
    if positions is not None and rank is None:
        raise ValueError(
            "positions were given without a rank: they place keys within a request's rank "
            "(from new_rank); pass both, or neither"
        )


class CpuStore:
    """The CPU-tier store: `num_slots` chunk-sized slots and the keys that live in them.

    A key goes absent → pending (`prepare_store`) → ready (`complete_store`); a ready key can be
    pinned by loads (`prepare_load` / `complete_load`). Pending and pinned keys are never evicted.
    Any call given a bad batch raises and changes nothing.

    `eviction_policy` is one of `POLICY_NAMES` (`"lru"`, `"arc"`). With `enable_events=True` the
    store records stored/removed batches for `take_events` (off by default: nobody draining them
    would make them grow without bound). With `usable_slots`, only slots below it are handed out
    until `set_usable_slots` raises it (a tier whose memory is still being pinned); until then a
    store that does not fit is "cannot store now".
    """

    __slots__ = ("_inner", "enable_events")

    def __init__(
        self,
        num_slots: int,
        eviction_policy: str = "lru",
        *,
        enable_events: bool = False,
        usable_slots: int | None = None,
    ) -> None:
        if isinstance(num_slots, bool):
            raise TypeError(f"num_slots must be an int, got bool ({num_slots!r})")
        try:
            n = operator.index(num_slots)
        except TypeError:
            raise TypeError(
                f"num_slots must be an int, got {type(num_slots).__name__} ({num_slots!r})"
            ) from None
        if not 1 <= n <= MAX_SLOTS:
            raise ValueError(f"num_slots={n} is invalid; allowed: an integer in 1..={MAX_SLOTS}")
        if not isinstance(eviction_policy, str):
            raise TypeError(
                f"eviction_policy must be a str, one of {', '.join(POLICY_NAMES)}; "
                f"got {type(eviction_policy).__name__}"
            )
        if usable_slots is not None and (
            isinstance(usable_slots, bool) or not isinstance(usable_slots, int)
        ):
            raise TypeError(f"usable_slots must be an int or None, got {usable_slots!r}")
        self._inner = _rust.Store(n, eviction_policy, bool(enable_events), usable_slots)
        self.enable_events = bool(enable_events)

    @property
    def num_slots(self) -> int:
        return self._inner.num_slots

    @property
    def usable_slots(self) -> int:
        return self._inner.usable_slots

    def set_usable_slots(self, usable: int) -> None:
        """Raises the slots that may be handed out (never lowers them), up to `num_slots`."""
        if isinstance(usable, bool) or not isinstance(usable, int):
            raise TypeError(f"usable must be an int, got {usable!r}")
        self._inner.set_usable_slots(usable)

    @property
    def eviction_policy(self) -> str:
        return self._inner.eviction_policy

    @property
    def events_enabled(self) -> bool:
        return self._inner.events_enabled

    def new_rank(self) -> int:
        """A rank for one request (see `prepare_store`)."""
        return self._inner.new_rank()

    def prepare_store(
        self,
        keys: Keys,
        *,
        rank: int | None = None,
        first_position: int = 0,
        positions: Sequence[int] | bytes | None = None,
        partial: bool = False,
    ) -> StorePlan | None:
        """Reserves slots for the keys that are neither pending nor ready (duplicates count once),
        evicting unpinned ready keys if needed; keys of this batch are never evicted for it.
        Returns `None` ("cannot store now") when they do not all fit: nothing else changed.

        With `partial=True`, a batch that could never fit whole (its new and resident keys
        outnumber the slots) stores the longest run of its new keys, in order, that fits now
        (the head of a prefix is what lookups hit); the plan lists only those. Without it such a
        batch is refused every time, as vLLM's manager does.

        With a `rank` from `new_rank`, the keys are used by that request, key `j` at position
        `first_position + j` of it: under `lru` a request's keys then leave as one group, ordered
        by the rank it drew, tails before heads, across all its calls (vLLM 0.33's LRU); new keys
        take that place and ready keys of the batch move up to it if they sort below it (also
        when the call is refused). Without a rank, new keys are the most recent.
        `positions` (one per key; a sequence of ints, or an int64 array's `tobytes()`) replaces
        `first_position + j` when a call's keys are not consecutive; a negative one means "no
        position": a new key then takes a plain use and a resident one stays where it is."""
        _check_positions(rank, positions)
        out = self._inner.prepare_store(keys, rank, first_position, positions, partial)
        if out is None:
            return None
        to_write, indices, slots, evicted = out
        return StorePlan(to_write, _int64s(indices), _int64s(slots), evicted)

    def offer_group_store(
        self,
        offers: Sequence[GroupOffer],
        *,
        rank: int,
        num_groups: int,
        windowed: list[bool],
        blocks_per_chunk: int,
        used: list[bytearray],
    ) -> GroupStorePlan | None:
        """`prepare_store` of a hybrid model's offer (`_rust.group_offer`'s chunks of `offers`,
        ranked in request `rank`'s eviction order), in one call with what its job needs: the
        plan, with the blocks of each key read from its offer's table (`None`: the store cannot
        take the keys now). Each group's offered chunks that no other store is writing now are a
        use of them, even when refused: flagged in its `used` (one byte per chunk, grown as
        needed). `windowed` flags the window groups."""
        out = self._inner.offer_group_store(
            offers, blocks_per_chunk, num_groups, rank, windowed, used
        )
        if out is None:
            return None
        to_write, slots, planned, blocks, counts, window_blocks = out
        return GroupStorePlan(
            to_write, _int64s(slots), _int64s(planned), _int64s(blocks), counts, window_blocks
        )

    def complete_store(self, keys: Keys, success: bool = True) -> None:
        """Ends the stores of `keys` (all pending): ready on success; on failure they are removed
        and their slots freed."""
        self._inner.complete_store(keys, success)

    def lookup_prefix(self, keys: Keys) -> PrefixLookup:
        """Counts the leading ready keys; stops at the first that is not."""
        hits, pending = self._inner.lookup_prefix(keys)
        return PrefixLookup(hits, pending)

    def lookup_groups(
        self,
        keys: Sequence[KeyList],
        specs: Sequence[GroupSpec],
        *,
        tokens_per_chunk: int,
        num_local: int,
        num_tokens: int,
        max_load_tokens: int | None,
        loads_in_flight: bool,
    ) -> int | None:
        """A hybrid model's lookup of one request, group `g` with chunk keys `keys[g]`, as
        vLLM's `OffloadingConnector` decides it (`HybridPlanner.lookup`): the tokens past
        `num_local` every group can load (0, or at least a chunk), or `None` when a chunk needed
        is being stored, or, with `loads_in_flight`, loaded (ask again). Counts hits and misses
        as `lookup_prefix` and `lookup` do."""
        return self._inner.lookup_groups(
            keys,
            specs,
            tokens_per_chunk,
            num_local,
            num_tokens,
            max_load_tokens,
            loads_in_flight,
        )

    def first_pinned(self, keys: Keys) -> int:
        """The position of the first key with a load in flight, or `len(keys)` if none has."""
        return self._inner.first_pinned(keys)

    def lookup(self, keys: Keys) -> npt.NDArray[np.uint8]:
        """The `KeyStatus` value of every key."""
        return np.frombuffer(self._inner.lookup(keys), dtype=_UINT8)

    def prepare_load(
        self,
        keys: Keys,
        *,
        rank: int | None = None,
        first_position: int = 0,
        positions: Sequence[int] | bytes | None = None,
    ) -> npt.NDArray[np.int64]:
        """Pins every key (all must be ready) for a load and returns their slots. With a `rank`,
        each key moves up to its place in that request's group if it sorts below it (see
        `prepare_store`)."""
        _check_positions(rank, positions)
        return _int64s(self._inner.prepare_load(keys, rank, first_position, positions))

    def load_groups(
        self,
        keys: Sequence[KeyList],
        tables: Sequence[list[int]],
        *,
        first_block: int,
        num_blocks: int,
        end_chunk: int,
        blocks_per_chunk: int,
        rank: int,
        used: Sequence[bytearray],
        touch: bool = False,
    ) -> GroupLoadPlan:
        """`prepare_load` of a hybrid model's load of GPU blocks `first_block..num_blocks` up to
        chunk `end_chunk`: group `g` (keys `keys[g]`, table `tables[g]`) loads from its first
        block that is not the null block (0; a window group holds only its window), and its
        loaded chunks are flagged in `used[g]`. Keys are ranked in request `rank`'s eviction
        order and, with `touch`, used again (`touch`). Raises ValueError when a table is too
        short or has a null block among those the load writes, and InvalidStateError when a
        key is not ready: nothing is pinned then."""
        out = self._inner.load_groups(
            keys,
            tables,
            first_block,
            num_blocks,
            end_chunk,
            blocks_per_chunk,
            rank,
            used,
            touch,
        )
        to_load, slots, gpu, parts = out
        return GroupLoadPlan(to_load, _int64s(slots), _int64s(gpu), parts)

    def complete_load(self, keys: Keys) -> None:
        """Unpins every key once (each must be pinned as often as it is listed)."""
        self._inner.complete_load(keys)

    def hold_for_write(self, keys: Keys) -> npt.NDArray[np.int64]:
        """Holds every key's slot (each ready, listed once) while a write to a secondary tier
        reads it, and returns the slots: the key cannot be evicted, as if pinned, but it is not
        a load in flight (`first_pinned` does not see it). Holds are counted (one per tier of a
        chain, at most 15 at a time)."""
        return _int64s(self._inner.hold_for_write(keys))

    def release_write(self, keys: Keys) -> None:
        """Ends one write hold of each of `keys` (each held, listed once)."""
        self._inner.release_write(keys)

    def touch(self, keys: Keys, *, reuse: bool = True) -> None:
        """Marks resident keys as used so the earlier keys of the batch become the most recent.
        `reuse=False` only refreshes their order: under ARC a key is promoted to the frequent list
        only when it is really used again (a load hit), not when the request that stored it
        refreshes its prefix order."""
        self._inner.touch(keys, reuse)

    def touch_group_used(
        self, groups: Sequence[tuple[KeyList, bytearray]], *, reuse: bool = True
    ) -> None:
        """`touch` of the keys each `(keys, used)` group flags used (`offer_group_store`), by
        chunk, then group: how vLLM refreshes a finished request's keys."""
        self._inner.touch_group_used(groups, reuse)

    def reset(self) -> None:
        """Drops every ready, unpinned key; pending and pinned keys miss from now on and leave
        when their store or last load completes."""
        self._inner.reset()

    def take_events(self) -> list[StoreEvent]:
        """Drains the recorded events, oldest first (empty unless `enable_events`)."""
        return [StoreEvent(kind, keys) for kind, keys in self._inner.take_events()]

    def stats(self) -> StoreStats:
        raw = self._inner.stats()
        return StoreStats(**{name: raw[name] for name in _STATS_FIELDS})  # type: ignore[arg-type]

    def recency_order(self) -> list[list[bytes]]:
        """Keys from least to most recently used: `[lru]` or `[t1, t2]` under ARC."""
        return self._inner.recency_order()

    def check_invariants(self) -> None:
        """Verifies the store's internal consistency (O(slots used)) and raises `KVOffloadError`
        naming the first broken invariant; for tests and debugging."""
        self._inner.check_invariants()

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"CpuStore(num_slots={s.num_slots}, eviction_policy={self.eviction_policy!r}, "
            f"ready={s.ready}, pending={s.pending}, pinned={s.pinned})"
        )
