"""`HybridPlanner`: lookups, loads and stores of models with several KV-cache groups.

It decides as vLLM 0.33's `OffloadingConnector` does (`_lookup_complete_chunks`,
`update_state_after_alloc`, `_build_store_jobs`): full-attention groups are looked up first, then
window groups by window size, each window group hit only through the chunks its attention reads
before the boundary, until the hit converges; a hit with a window group stops one token short of
the request; window groups store only chunks a later hit can reach, and skip chunks whose blocks
they freed. Block id 0 is the engine's null block (vLLM reserves it): a window group's table holds
it where the group keeps no KV. The lookup and the load are one store call each
(`CpuStore.lookup_groups`, whose rules live in the core's `hybrid/lookup.rs`, and
`CpuStore.load_groups`), and `CpuStore.offer_group_store` picks an offer's chunks.

A Mamba group ("align" mode, `_build_aligned_boundary_store_jobs`) is looked up as a window of one
chunk, and its hits end on a chunk; its table is not positionally stable (the engine moves the
state between blocks), so it stores nothing from it: the engine hands over the block holding the
state at each block boundary it commits, and a boundary on a chunk is stored under that chunk's
key (`state_key`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvoffload import _rust
from kvoffload._rust import BlockSet
from kvoffload.scheduler.groups import KVGroup, cdiv
from kvoffload.store import CpuStore, GroupOffer, KeyList

NULL_BLOCK = 0
IntArray = npt.NDArray[np.int64]
_INT64 = np.dtype(np.int64)  # an instance: np.frombuffer resolves a class on every call
_Reach = tuple[int, int, int | None, list[int]]
"""`(need, shift, segment, tail_ends)` of a sliding-window group (`_rust.reachable_blocks`)."""


@dataclass(slots=True)
class GroupState:
    """One group of one request."""

    keys: KeyList = field(default_factory=KeyList)
    block_ids: list[int] = field(default_factory=list)
    next_stored: int = 0
    """Chunks below it were offered to the store (or loaded, or skipped as unreachable)."""
    used: bytearray = field(default_factory=bytearray)
    """One flag per chunk (from chunk 0; past its end: 0): whether the request offered its key
    (not while another request stored it) or loaded it: the keys it refreshes when it finishes,
    as vLLM's manager records them."""

    def mark_used(self, first: int, end: int) -> None:
        """Flags chunks `first..end` as used."""
        if len(self.used) < end:
            self.used.extend(bytes(end - len(self.used)))
        self.used[first:end] = b"\x01" * (end - first)


@dataclass(slots=True)  # read-only, like the jobs that hold it (see `jobs`)
class GroupSlice:
    """The part of a job that belongs to one group: `num_slots` of the job's slots (and keys) and
    `num_blocks` of its GPU blocks, in group order; the group's first block is block
    `skip_leading_blocks` of its first chunk."""

    group: int
    num_slots: int
    num_blocks: int
    skip_leading_blocks: int = 0


@dataclass(frozen=True)
class KeyBatch:
    """Keys picked from a request's groups: key `chunks[i]` of group `groups[i]`, in group order
    (chunk order within a group), gathered into one `KeyList` with one Rust call."""

    keys: KeyList
    groups: IntArray
    chunks: IntArray
    positions: bytes
    """Each key's place in the request's eviction order (an int64 array's bytes)."""


class HybridPlanner:
    def __init__(
        self,
        groups: Sequence[KVGroup],
        tokens_per_block: int,
        blocks_per_chunk: int,
        *,
        retention_interval: int | None = 0,
    ) -> None:
        """`retention_interval` is vLLM's `prefix_cache_retention_interval`: `None` keeps a
        window group's reachable tail at every chunk boundary, 0 only at the prompt's replay
        boundary (and a shared-prefix junction), `n` once every `n` tokens as well."""
        self.groups = tuple(groups)
        if not self.groups:
            raise ValueError("groups is empty: at least one KV-cache group is needed")
        for i, group in enumerate(self.groups):
            if not isinstance(group, KVGroup):
                raise ValueError(f"groups[{i}]={group!r} is invalid: expected a KVGroup")
        self.tpb = tokens_per_block
        self.bpc = blocks_per_chunk
        self.tpc = tokens_per_block * blocks_per_chunk
        if retention_interval is not None and (
            type(retention_interval) is not int or retention_interval < 0
        ):
            raise ValueError(
                f"retention_interval={retention_interval!r} is invalid: None or an int >= 0"
            )
        windowed = [i for i, g in enumerate(self.groups) if g.kind != "full"]
        if windowed and retention_interval and retention_interval % self.tpc:
            # vLLM refuses it for every window group.
            raise ValueError(
                f"retention_interval={retention_interval} (vLLM's "
                "prefix_cache_retention_interval) is invalid for a model with window layers; "
                f"allowed: a multiple of the chunk ({self.tpc} tokens)"
            )
        self.retention_interval = retention_interval
        self._specs = [g.spec(self.tpc) for g in self.groups]
        self._freeing = tuple(i for i in windowed if self.groups[i].kind != "mamba")
        """Sliding-window and chunked-local groups, which free blocks while their request runs."""
        self.window_mask = [g.kind != "full" for g in self.groups]
        """Per group: whether the engine may hand its blocks out again while the request runs."""
        self.num_groups = len(self.groups)

    def new_state(self) -> list[GroupState]:
        return [GroupState() for _ in self.groups]

    def batch(self, states: list[GroupState], picked: Sequence[tuple[int, int, int]]) -> KeyBatch:
        """The keys of chunks `first..end` of each `(group, first, end)` of `picked`, in that
        order. A key's place in its request's eviction order is chunk * groups + (groups - 1 -
        group): vLLM ranks the keys of one position (one per group) by key bytes, so the smaller
        group index leaves first."""
        if not picked:
            return _NO_KEYS
        ranges = [(g, states[g].keys, first, end) for g, first, end in picked]
        return _key_batch(_rust.group_ranges(ranges, self.num_groups))

    def extend_keys(self, states: list[GroupState], block_hashes: Sequence[bytes]) -> None:
        # Most steps complete no chunk (vLLM hashes a prompt's blocks up front): no call then.
        # Every group's keys come from the same hashes, so they grow together.
        if type(block_hashes) is not list or len(block_hashes) // self.bpc > len(states[0].keys):
            _rust.extend_group_keys([state.keys for state in states], block_hashes, self.bpc)

    # --- lookups ---------------------------------------------------------------------------------

    def lookup(
        self,
        store: CpuStore,
        states: list[GroupState],
        num_local: int,
        num_tokens: int,
        max_load_tokens: int | None,
        loads_in_flight: bool,
    ) -> int | None:
        """Tokens past `num_local` every group can load (0, or at least a chunk), or `None`: a
        chunk needed is being stored or loaded (ask again)."""
        return store.lookup_groups(
            [state.keys for state in states],
            self._specs,
            tokens_per_chunk=self.tpc,
            num_local=num_local,
            num_tokens=num_tokens,
            max_load_tokens=max_load_tokens,
            loads_in_flight=loads_in_flight,
        )

    # --- stores ----------------------------------------------------------------------------------

    def storable(
        self, group: KVGroup, state: GroupState, offloadable: int, decoding: bool, finished: bool
    ) -> int:
        n = offloadable // self.tpc
        if group.eagle and decoding and not finished:
            # The draft KV of the last accepted position may be rewritten after a rejection.
            n = max(0, n - 1)
        return min(n, len(state.block_ids) // self.bpc, len(state.keys))

    def offer(
        self,
        states: list[GroupState],
        offloadable: int,
        decoding: bool,
        finished: bool,
        boundaries: Sequence[int],
    ) -> tuple[KeyBatch, list[int]]:
        """The chunks to offer the store (`offers`, as one batch), and each group's storable
        end."""
        offers, ends = self.offers(states, offloadable, decoding, finished, boundaries)
        if not offers:
            return _NO_KEYS, ends
        return _key_batch(_rust.group_offer(offers, self.bpc, self.num_groups)), ends

    def offers(
        self,
        states: list[GroupState],
        offloadable: int,
        decoding: bool,
        finished: bool,
        boundaries: Sequence[int],
    ) -> tuple[list[GroupOffer], list[int]]:
        """Each group's store offer (`CpuStore.offer_group_store` picks its chunks), and each
        group's storable end. A window group offers only chunks with a block a later hit can
        reach, and none whose reachable blocks it has already freed (null)."""
        bpc = self.bpc
        offers: list[GroupOffer] = []
        ends: list[int] = []
        for gi, (group, state) in enumerate(zip(self.groups, states, strict=True)):
            n = self.storable(group, state, offloadable, decoding, finished)
            ends.append(n)
            start = state.next_stored
            if n <= start or group.kind == "mamba":  # states come from `state_key`
                continue
            table = state.block_ids[start * bpc : n * bpc]
            offers.append((gi, state.keys, table, start, self._reach(group, boundaries)))
        return offers, ends

    def reachable(
        self, group: KVGroup, start_block: int, end_block: int, boundaries: Sequence[int]
    ) -> npt.NDArray[np.bool_] | None:
        """vLLM's `reachable_block_mask` of a window group for blocks `[start, end)`, `None`
        when every block is reachable. The lookup's boundaries are chunk-aligned (the full
        attention chunk), which is what a window group's tail is kept at."""
        reach = self._reach(group, boundaries)
        mask = None if reach is None else _rust.reachable_blocks(start_block, end_block, reach)
        return None if mask is None else np.frombuffer(mask, dtype=np.bool_)

    def _reach(self, group: KVGroup, boundaries: Sequence[int]) -> _Reach | None:
        """The blocks a later hit reads of a sliding-window group (`_rust.reachable_blocks`):
        the `need` blocks before every `segment`-th block boundary from `shift`, and before the
        blocks ending each kept tail; `None` for any other group."""
        if group.kind != "sliding":
            return None
        tpb, tpc = self.tpb, self.tpc
        # Offloading restores all allocated history, the re-prefill tokens included.
        need = cdiv(group.window + group.extra_retained_tokens - 1, tpb) + int(group.eagle)
        shift = int(group.eagle)
        interval = self.retention_interval
        segment = tpc if interval is None else (interval or None)
        tails = [] if interval is None else [b // tpc * tpc // tpb + shift for b in boundaries]
        return need, shift, None if segment is None else segment // tpb, tails

    def state_key(
        self, states: list[GroupState], group: int, num_tokens: int, offloadable: int
    ) -> KeyBatch | None:
        """The key of Mamba group `group`'s state after `num_tokens` tokens, or `None` when no
        later hit can use it: not on a chunk boundary, past the `offloadable` tokens, or past the
        request's keys."""
        tpc = self.tpc
        if not 0 < num_tokens <= offloadable or num_tokens % tpc:
            return None
        chunk = num_tokens // tpc - 1
        if chunk >= len(states[group].keys):
            return None
        return self.batch(states, [(group, chunk, chunk + 1)])

    def drop_reallocated(self, requests: list[list[GroupState]], realloc: BlockSet) -> None:
        """A window group frees blocks behind its window while its request runs: ids of them the
        engine handed out again (`realloc`) no longer hold that request's KV, so the chunks not
        yet offered must not read them. `requests` holds each request's group states; call it
        before this step's new blocks are appended."""
        bpc = self.bpc
        for states in requests:
            for gi in self._freeing:
                realloc.null_members(states[gi].block_ids, states[gi].next_stored * bpc)

    def window_groups(self) -> tuple[int, ...]:
        """The sliding-window and chunked-local groups: they free blocks their stores read."""
        return self._freeing

    def is_state(self, group: int) -> bool:
        return self.groups[group].kind == "mamba"


def _key_batch(answer: tuple[KeyList, bytes, bytes, bytes]) -> KeyBatch:
    keys, groups, chunks, positions = answer
    return KeyBatch(keys, np.frombuffer(groups, _INT64), np.frombuffer(chunks, _INT64), positions)


_EMPTY: IntArray = np.empty(0, dtype=np.int64)
_EMPTY.flags.writeable = False
_NO_KEYS = KeyBatch(KeyList(), _EMPTY, _EMPTY, b"")
