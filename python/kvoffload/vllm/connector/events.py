"""vLLM's KV events from the scheduler's store events, one tier after the other.

Without `self_describing_kv_events` a chunk is announced as it always was: its key's block hash
(the chunk's last block) with no tokens. With it, each chunk is announced as vLLM 0.33's
`OffloadingConnector` announces one (`offloading/events.py`): one `BlockStored` carrying the hashes
of the chunk's blocks, its parent block's hash, its tokens and the block size, and a
`BlockRemoved` of the same hashes when it leaves, each with the tier's medium, locality and
ownership. A chunk's tokens and hashes are read from its request when its store is planned, or
when a lookup waits on a promotion, and kept while a tier whose every removal this engine sees
(the CPU tier, a node's disk) holds it; a shared tier's chunks are described while some such
tier, or a request at hand, has them (see `kvoffload.tiers.announced`).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent

from kvoffload.scheduler import StoreJob
from kvoffload.store import StoreEvent
from kvoffload.vllm.connector.settings import ConnectorSettings
from vllm import envs

if TYPE_CHECKING:
    from vllm.v1.request import Request

GROUP_SUFFIX = 4  # a key is the chunk's last block hash + the 4-byte KV-group index
_MASK = (1 << 64) - 1


def hash_converter() -> Callable[[bytes], Any]:
    """vLLM's `maybe_convert_block_hash` (a block hash as its events carry it), its setting read
    once: vLLM reads it from the environment at every call, 12x the conversion's own time."""
    if envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES:
        return lambda h: int.from_bytes(h, "big") & _MASK
    return lambda h: h


@dataclass(slots=True)
class _Chunk:
    hashes: tuple[Any, ...]
    """Its blocks' hashes, as the events carry them."""
    parent: Any
    tokens: array[int]
    lora_id: int | None
    lora_name: str | None
    group: int
    places: int = 0
    """The tracked places that announced it with its blocks and have not withdrawn it (bit `p`
    for place `p`)."""


class KVEvents:
    """Translates each tier's `StoreEvent`s; `record_stores` and `watch` snapshot what a
    self-describing event needs while the request is at hand."""

    def __init__(self, settings: ConnectorSettings) -> None:
        self.self_describing = settings.self_describing_events
        config = settings.config
        self._tokens_per_block = config.tokens_per_block
        self._blocks_per_chunk = config.blocks_per_chunk
        self._places: list[tuple[str, str | None, str | None]] = [("CPU", None, None)]
        self._places += [("STORAGE", t.locality, t.ownership) for t in settings.tiers]
        # Where a chunk's tokens are kept until its withdrawal: the places whose every removal
        # this engine sees (the CPU tier, a node's own disk). A shared tier's removals are found
        # by whichever replica loads the chunk, whenever: its chunks are described while some
        # tracked place or a request at hand has their tokens.
        self._tracked = [True] + [
            t.locality == "LOCAL" and t.kind.sees_evictions for t in settings.tiers
        ]
        self._full = frozenset(i for i, g in enumerate(settings.groups) if g.kind == "full")
        self._specs = settings.group_specs
        self._convert = hash_converter()
        self._chunks: dict[bytes, _Chunk] = {}
        """Chunks some tier announced (or will: `_planned`), by key."""
        self._planned: dict[int, list[bytes]] = {}
        """Store job -> the keys it will store: their snapshots are kept until it ends."""
        self._pins: dict[bytes, int] = {}
        """Key -> the store jobs planned for it that have not ended."""
        self._ended: list[int] = []
        self._watched: dict[str, Request] = {}
        """Requests waiting on a promotion: the chunks it brings are theirs."""
        self._watch_index: dict[bytes, tuple[Request, int]] | None = None
        """Their chunks by last block hash, built once per step that needs it."""

    # --- snapshots --------------------------------------------------------------------------

    def record_stores(self, jobs: Iterable[StoreJob], requests: Mapping[str, Request]) -> None:
        """Snapshots the chunks `jobs` store, from their requests."""
        chunks, pins = self._chunks, self._pins
        for job in jobs:
            request = requests.get(job.request_id)
            if request is None:
                continue
            planned = []
            for key, index in zip(job.keys.to_list(), job.chunk_indices.tolist(), strict=True):
                if key not in chunks:
                    chunk = self._snapshot(request, key, index)
                    if chunk is None:
                        continue
                    chunks[key] = chunk
                planned.append(key)
                pins[key] = pins.get(key, 0) + 1
            if planned:
                self._planned[job.job_id] = planned

    def job_ended(self, job_id: int) -> None:
        """A store job ended: what it snapshotted and no tier announced is dropped once this
        step's events are out (a failed store is never announced)."""
        if job_id in self._planned:
            self._ended.append(job_id)

    def watch(self, request: Request) -> None:
        """`request` waits on a promotion: the chunks it brings are snapshotted from it."""
        self._watched[request.request_id] = request

    def unwatch(self, request_id: str) -> None:
        self._watched.pop(request_id, None)

    def _snapshot(self, request: Request, key: bytes, index: int) -> _Chunk | None:
        group = int.from_bytes(key[-GROUP_SUFFIX:], "big")
        if group not in self._full:
            return None  # window and Mamba groups keep the placeholder, as in vLLM
        bpc, tpb = self._blocks_per_chunk, self._tokens_per_block
        first = index * bpc
        hashes = request.block_hashes[first : first + bpc]
        if len(hashes) < bpc or hashes[-1] != key[:-GROUP_SUFFIX]:
            return None
        lora = request.lora_request
        start = first * tpb
        return _Chunk(
            hashes=tuple(map(self._convert, hashes)),
            parent=self._convert(request.block_hashes[first - 1]) if first else None,
            tokens=array("i", request.all_token_ids[start : start + bpc * tpb]),
            lora_id=lora.adapter_id if lora is not None else None,
            lora_name=lora.name if lora is not None else None,
            group=group,
        )

    def _described(self, key: bytes, left: list[bytes]) -> _Chunk | None:
        """The chunk's snapshot: kept, or taken from a request waiting on it (then kept until
        this step's events are out, or while a tracked place holds it)."""
        chunk = self._chunks.get(key)
        if chunk is None and self._watched:
            chunk = self._from_watched(key)
            if chunk is not None:
                self._chunks[key] = chunk
                left.append(key)
        return chunk

    def _from_watched(self, key: bytes) -> _Chunk | None:
        """The snapshot of a promoted chunk, from a request waiting on it."""
        if self._watch_index is None:
            bpc = self._blocks_per_chunk
            self._watch_index = {
                bytes(request.block_hashes[(i + 1) * bpc - 1]): (request, i)
                for request in self._watched.values()
                for i in range(len(request.block_hashes) // bpc)
            }
        found = self._watch_index.get(key[:-GROUP_SUFFIX])
        return None if found is None else self._snapshot(found[0], key, found[1])

    # --- events -----------------------------------------------------------------------------

    def translate(self, tiers: Iterable[tuple[int, list[StoreEvent]]]) -> Iterator[KVCacheEvent]:
        """Each place's events (CPU first, then the chain), as vLLM's KV events."""
        if not self.self_describing:
            for place, events in tiers:
                medium, locality, _ = self._places[place]
                yield from _legacy(events, medium, locality, self._convert)
            return
        left: list[bytes] = []
        try:
            for place, events in tiers:
                for event in events:
                    if event.kind == "stored":
                        yield from self._stored(place, event.keys, left)
                    else:
                        yield from self._removed(place, event.keys, left)
        finally:
            self._settle(left)

    def _settle(self, left: list[bytes]) -> None:
        """Drops the snapshots no place holds and no planned store needs, once the step's
        events are out: a chunk the CPU tier evicted may be announced by a tier further down in
        the same step."""
        chunks, pins = self._chunks, self._pins
        for job_id in self._ended:
            for key in self._planned.pop(job_id, ()):
                n = pins.pop(key) - 1
                if n:
                    pins[key] = n
                else:
                    left.append(key)
        for key in left:
            chunk = chunks.get(key)
            if chunk is not None and not chunk.places and key not in pins:
                del chunks[key]
        self._ended = []
        self._watch_index = None

    def _stored(self, place: int, keys: list[bytes], left: list[bytes]) -> Iterator[KVCacheEvent]:
        medium, locality, ownership = self._places[place]
        bit = 1 << place if self._tracked[place] else 0
        for key in keys:
            chunk = self._described(key, left)
            if chunk is None:
                yield self._placeholder(key, medium, locality, ownership)
                continue
            if chunk.places & bit:
                continue  # announced there already (routers count each announcement)
            chunk.places |= bit
            kind, window = self._spec(chunk.group)
            yield BlockStored(
                block_hashes=list(chunk.hashes),
                parent_block_hash=chunk.parent,
                token_ids=chunk.tokens.tolist(),
                block_size=self._tokens_per_block,
                lora_id=chunk.lora_id,
                medium=medium,
                lora_name=chunk.lora_name,
                group_idx=chunk.group,
                kv_cache_spec_kind=kind,
                kv_cache_spec_sliding_window=window,
                locality=locality,
                ownership=ownership,
            )

    def _removed(self, place: int, keys: list[bytes], left: list[bytes]) -> Iterator[KVCacheEvent]:
        medium, locality, ownership = self._places[place]
        tracked, bit = self._tracked[place], 1 << place
        by_group: dict[int, list[Any]] = {}
        for key in keys:
            # Withdrawn in the form it was announced: a tracked place's chunk with its blocks
            # if it was described there; a shared tier's (announced by any replica) whenever
            # its tokens are at hand.
            chunk = self._chunks.get(key)
            if tracked and chunk is not None and not chunk.places & bit:
                chunk = None
            elif not tracked and chunk is None:
                chunk = self._described(key, left)
            if chunk is None:
                group = int.from_bytes(key[-GROUP_SUFFIX:], "big")
                by_group.setdefault(group, []).append(self._convert(key[:-GROUP_SUFFIX]))
                continue
            by_group.setdefault(chunk.group, []).extend(chunk.hashes)
            chunk.places &= ~bit
            left.append(key)
        for group, hashes in sorted(by_group.items()):
            yield BlockRemoved(
                block_hashes=hashes,
                medium=medium,
                group_idx=group,
                locality=locality,
                ownership=ownership,
            )

    def _spec(self, group: int) -> tuple[str | None, int | None]:
        return self._specs[group] if group < len(self._specs) else (None, None)

    def _placeholder(
        self, key: bytes, medium: str, locality: str | None, ownership: str | None
    ) -> BlockStored:
        """A chunk no snapshot describes (a window or Mamba group's, or one no request at hand
        told of): its last block's hash alone, as vLLM's placeholder, which no router matches a
        prompt through."""
        group = int.from_bytes(key[-GROUP_SUFFIX:], "big")
        kind, window = self._spec(group)
        return _bare_stored(
            [self._convert(key[:-GROUP_SUFFIX])],
            group,
            medium,
            locality,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=window,
            ownership=ownership,
        )


def _bare_stored(
    hashes: list[Any], group: int, medium: str, locality: str | None, **described: Any
) -> BlockStored:
    """A store of block hashes with no tokens: vLLM's placeholder, and every store without
    `self_describing_kv_events`."""
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=[],
        block_size=0,
        lora_id=None,
        medium=medium,
        lora_name=None,
        group_idx=group,
        locality=locality,
        **described,
    )


def _legacy(
    events: Iterable[StoreEvent],
    medium: str,
    locality: str | None,
    convert: Callable[[bytes], Any],
) -> Iterator[KVCacheEvent]:
    """The events without `self_describing_kv_events`: a chunk's key, no tokens."""
    for event in events:
        by_group: dict[int, list[Any]] = {}
        for k in event.keys:
            group = int.from_bytes(k[-GROUP_SUFFIX:], "big")
            by_group.setdefault(group, []).append(convert(k[:-GROUP_SUFFIX]))
        for group, hashes in sorted(by_group.items()):
            if event.kind == "stored":
                yield _bare_stored(hashes, group, medium, locality)
            else:
                yield BlockRemoved(
                    block_hashes=hashes, medium=medium, group_idx=group, locality=locality
                )
