# Hand-written stub for the PyO3 extension; `mypy.stubtest kvoffload._rust` checks it matches.
# The docstrings of the classes docs/reference.md shows are copied here from the Rust so that the
# docs build reads them without the extension (tests/test_docs_stub.py keeps them equal).
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import final

__all__ = [
    "MAX_KEY_LEN",
    "MAX_SLOTS",
    "POLICY_NAMES",
    "REMOTE_CORRUPT",
    "REMOTE_DROPPED",
    "REMOTE_EXISTS",
    "REMOTE_FAILED",
    "REMOTE_MISSING",
    "REMOTE_OK",
    "BlockSet",
    "DiskTier",
    "InvalidStateError",
    "KVOffloadError",
    "KeyList",
    "KeyRange",
    "RemoteError",
    "RemoteLookups",
    "RemoteTier",
    "SampledLru",
    "Store",
    "_colliding_keys",
    "are_block_ids",
    "block_tables",
    "cluster_node_counts",
    "extend_group_keys",
    "group_offer",
    "group_ranges",
    "load_window",
    "load_window_chunks",
    "loadable_tokens",
    "mask_remote_url",
    "reachable_blocks",
    "storable_chunks",
    "window_hits",
]

MAX_KEY_LEN: int
MAX_SLOTS: int
POLICY_NAMES: list[str]
REMOTE_OK: int
REMOTE_MISSING: int
REMOTE_CORRUPT: int
REMOTE_FAILED: int
REMOTE_DROPPED: int
REMOTE_EXISTS: int

class KVOffloadError(Exception):
    """Base class of every kvoffload error."""

class InvalidStateError(KVOffloadError):
    """A key is not in the state the call needs (e.g. loading a key that is not ready)."""

class RemoteError(KVOffloadError): ...

@final
class BlockSet:
    """GPU blocks handed out in one schedule (`kvoffload_core::BlockSet`): filled by the engine
    adapter as it sees the block tables, asked for membership by the scheduler."""

    def __new__(cls) -> BlockSet: ...
    def add(self, ids: Iterable[int], name: str = "block_ids") -> None:
        """Adds every id of `ids` (Python ints, as engines hand them out); a ValueError naming
        `name` (and adding nothing) when one is not an int in `0..2**63`."""

    def discard(self, id: object) -> None:
        """Removes `id` if it is in the set (anything that is not a block id never is)."""

    def __contains__(self, key: object, /) -> bool: ...
    def __len__(self) -> int: ...
    def to_list(self) -> list[int]:
        """The ids, ascending."""

    def intersects(self, ids: Iterable[int]) -> bool:
        """Whether any id of `ids` (an iterable of block ids) is in the set."""

    def null_members(self, table: list[int], start: int) -> int:
        """Replaces every block of `table` (a list of block ids) from index `start` on that is in
        the set by the null block (0), in place; returns how many it replaced."""

@final
class KeyList:
    """Keys in one contiguous buffer. Store calls read it in place, so a request's chunk keys never
    become Python objects on the hot path; it is also a read-only sequence of `bytes`."""

    def __new__(cls, keys: _Keys | None = None) -> KeyList: ...
    def __len__(self) -> int: ...
    def __getitem__(self, index: int, /) -> bytes: ...
    def __iter__(self) -> Iterator[bytes]: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __reduce__(self) -> tuple[type[KeyList], tuple[list[bytes]]]: ...
    def to_list(self) -> list[bytes]: ...
    def view(self, start: int, end: int) -> KeyRange:
        """A view of keys `start..end` that store calls accept without copying."""

    def extend_chunk_keys(
        self, block_hashes: Iterable[bytes], blocks_per_chunk: int, group_idx: int = 0
    ) -> int:
        """Appends the keys of complete chunks that `block_hashes` (a request's hashes from its
        first block) has beyond the chunks already here; reads only the new hashes. Returns how
        many."""

@final
class KeyRange:
    """Keys `start..end` of a `KeyList`, as made by `KeyList.view`."""

    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[bytes]: ...
    def to_list(self) -> list[bytes]: ...

_Keys = Iterable[bytes] | KeyList | KeyRange
_Reach = tuple[int, int, int | None, Sequence[int]]
_Offer = tuple[int, KeyList, list[int], int, _Reach | None]
"""A group's store offer: `(group, keys, table, first_chunk, reach)` (`group_offer`)."""

@final
class Store:
    def __new__(
        cls,
        num_slots: int,
        eviction_policy: str = "lru",
        enable_events: bool = False,
        usable_slots: int | None = None,
    ) -> Store: ...
    @property
    def num_slots(self) -> int: ...
    @property
    def usable_slots(self) -> int: ...
    def set_usable_slots(self, usable: int) -> None: ...
    @property
    def eviction_policy(self) -> str: ...
    @property
    def events_enabled(self) -> bool: ...
    def prepare_store(
        self,
        keys: _Keys,
        rank: int | None = None,
        first_position: int = 0,
        positions: Sequence[int] | bytes | None = None,
        partial: bool = False,
    ) -> tuple[list[bytes] | KeyList, bytes, bytes, list[bytes]] | None: ...
    def offer_group_store(
        self,
        offers: Sequence[_Offer],
        blocks_per_chunk: int,
        num_groups: int,
        rank: int,
        windowed: Sequence[bool],
        used: Sequence[bytearray],
    ) -> tuple[KeyList, bytes, bytes, bytes, list[int], list[int]] | None: ...
    def complete_store(self, keys: _Keys, success: bool = True) -> None: ...
    def lookup_prefix(self, keys: _Keys) -> tuple[int, bool]: ...
    def lookup(self, keys: _Keys) -> bytes: ...
    def lookup_groups(
        self,
        keys: Sequence[KeyList],
        specs: Sequence[tuple[str, int | None, int, int, bool]],
        tokens_per_chunk: int,
        num_local: int,
        num_tokens: int,
        max_load_tokens: int | None,
        loads_in_flight: bool,
    ) -> int | None: ...
    def first_pinned(self, keys: _Keys) -> int: ...
    def prepare_load(
        self,
        keys: _Keys,
        rank: int | None = None,
        first_position: int = 0,
        positions: Sequence[int] | bytes | None = None,
    ) -> bytes: ...
    def load_groups(
        self,
        keys: Sequence[KeyList],
        tables: Sequence[list[int]],
        first_block: int,
        num_blocks: int,
        end_chunk: int,
        blocks_per_chunk: int,
        rank: int,
        used: Sequence[bytearray],
        touch: bool,
    ) -> tuple[KeyList, bytes, bytes, list[tuple[int, int, int, int]]]: ...
    def new_rank(self) -> int: ...
    def complete_load(self, keys: _Keys) -> None: ...
    def hold_for_write(self, keys: _Keys) -> bytes: ...
    def release_write(self, keys: _Keys) -> None: ...
    def touch_group_used(
        self, groups: Sequence[tuple[KeyList, bytearray]], reuse: bool = True
    ) -> None: ...
    def touch(self, keys: _Keys, reuse: bool = True) -> None: ...
    def reset(self) -> None: ...
    def take_events(self) -> list[tuple[str, list[bytes]]]: ...
    def stats(self) -> dict[str, int | float]: ...
    def recency_order(self) -> list[list[bytes]]: ...
    def check_invariants(self) -> None: ...

@final
class RemoteTier:
    def __new__(
        cls,
        url: str,
        namespace: bytes,
        chunk_bytes: int,
        *,
        connect_timeout_s: float = 1.0,
        job_timeout_s: float = 2.0,
        min_bandwidth_mb_s: float = 100.0,
        connections: int = 2,
        breaker_failures: int = 3,
        breaker_cooldown_s: float = 2.0,
        ttl_s: float | None = None,
        max_store_bytes_in_flight: int = 1073741824,
        touch_on_hit: bool = True,
        tls_ca_file: str | os.PathLike[str] | None = None,
        tls_cert_file: str | os.PathLike[str] | None = None,
        tls_key_file: str | os.PathLike[str] | None = None,
        tls_server_name: str | None = None,
        lookup_namespaces: list[bytes] | None = None,
        cluster: bool | None = None,
        password_file: str | os.PathLike[str] | None = None,
        password_env: str | None = None,
    ) -> RemoteTier: ...
    @property
    def startup_error(self) -> str | None: ...
    @property
    def last_error(self) -> str | None: ...
    @property
    def state(self) -> str: ...
    @property
    def chunk_bytes(self) -> int: ...
    def canary(
        self, name: bytes, identity: bytes, timeout_s: float = 1.0
    ) -> tuple[str, bytes | None]: ...
    def submit_lookup(self, keys: list[bytes]) -> int: ...
    def submit_store(
        self, keys: list[bytes], buffer: object, base: int, capacity: int, offsets: list[int]
    ) -> int: ...
    def submit_load(
        self, keys: list[bytes], buffer: object, base: int, capacity: int, offsets: list[int]
    ) -> int: ...
    def poll(self) -> list[tuple[int, bytes]]: ...
    def wait(self, timeout_s: float) -> list[tuple[int, bytes]]: ...
    def drain(self, timeout_s: float) -> list[tuple[int, bytes]]: ...
    def in_flight(self) -> int: ...
    def stats(self) -> dict[str, int]: ...
    def node_stats(self) -> dict[str, dict[str, int]]: ...
    def close(self) -> None: ...

@final
class DiskTier:
    def __new__(
        cls,
        path: str | os.PathLike[str],
        namespace: bytes,
        chunk_bytes: int,
        capacity_bytes: int,
        *,
        direct_io: str = "auto",
        io_threads: int = 8,
        rescan_interval_s: float = 10.0,
        max_store_bytes_in_flight: int = 1073741824,
        breaker_failures: int = 3,
        breaker_cooldown_s: float = 10.0,
        evict_files: bool = True,
        read_only: bool = False,
        probes_per_step: int = 64,
        probe_miss_ttl_s: float = 1.0,
        file_mode: int = 0o600,
        report_evictions: bool = False,
    ) -> DiskTier: ...
    @property
    def chunk_bytes(self) -> int: ...
    @property
    def direct(self) -> bool: ...
    @property
    def scanned(self) -> bool: ...
    @property
    def last_error(self) -> str | None: ...
    @property
    def state(self) -> str: ...
    @property
    def writes(self) -> str: ...
    @property
    def notes(self) -> list[str]: ...
    def lookup_prefix(self, keys: _Keys) -> int: ...
    def lookup(self, keys: _Keys, request: str) -> tuple[int, bool]: ...
    def lookup_key(self, key: bytes, request: str) -> tuple[bool, bool]: ...
    def flush(self) -> None: ...
    def probes_in_flight(self) -> int: ...
    def note_present(self, keys: _Keys) -> None: ...
    def forget(self, keys: _Keys) -> None: ...
    def take_evicted(self) -> list[bytes]: ...
    def note_missing(self, keys: _Keys) -> None: ...
    def submit_store(
        self, keys: list[bytes], buffer: object, base: int, capacity: int, offsets: list[int]
    ) -> int: ...
    def submit_load(
        self, keys: list[bytes], buffer: object, base: int, capacity: int, offsets: list[int]
    ) -> int: ...
    def poll(self) -> list[tuple[int, bytes]]: ...
    def drain(self, timeout_s: float) -> list[tuple[int, bytes]]: ...
    def in_flight(self) -> int: ...
    def stats(self) -> dict[str, int]: ...
    def close(self) -> None: ...

@final
class SampledLru:
    def __new__(cls, capacity: int, samples: int = 5, seed: int = 0) -> SampledLru: ...
    def lookup_prefix(self, keys: _Keys, now: float) -> int: ...
    def peek_prefix(self, keys: _Keys, now: float) -> int: ...
    def put(self, keys: _Keys, ready_at: float) -> int: ...
    def check_invariants(self) -> None: ...
    def __len__(self) -> int: ...

@final
class RemoteLookups:
    def __new__(cls, tier: RemoteTier) -> RemoteLookups: ...
    def lookup(self, key: bytes, request: str) -> bool | None: ...
    def lookup_prefix(self, keys: _Keys, request: str) -> tuple[int, bool]: ...
    def flush(self) -> None: ...
    def mark_miss(self, keys: _Keys) -> None: ...
    def cleanup(self, request: str) -> None: ...
    def in_flight(self) -> int: ...
    def __len__(self) -> int: ...

def mask_remote_url(url: str) -> str: ...
def cluster_node_counts(keys: _Keys, nodes: int) -> list[int]: ...
def storable_chunks(
    computed_tokens: int,
    num_tokens: int,
    num_prompt_tokens: int,
    max_offload_tokens: int | None,
    offload_prompt_only: bool,
    tokens_per_chunk: int,
    num_gpu_blocks: int,
    blocks_per_chunk: int,
    num_keys: int,
) -> int: ...
def load_window(
    num_tokens: int,
    num_local_tokens: int,
    max_load_tokens: int | None,
    num_keys: int,
    tokens_per_chunk: int,
) -> tuple[int, int, int] | None: ...
def loadable_tokens(
    window: tuple[int, int, int], hits: int, num_local_tokens: int, tokens_per_chunk: int
) -> int: ...
def are_block_ids(values: object) -> bool: ...
def block_tables(values: object, n: int) -> list[list[int]] | None: ...
def load_window_chunks(
    spec: tuple[str, int | None, int, int, bool], num_tokens: int, tokens_per_chunk: int
) -> int | None: ...
def window_hits(status: bytes, window: int, first_window: int) -> int | None: ...
def reachable_blocks(start: int, end: int, reach: _Reach) -> bytes | None: ...
def group_offer(
    offers: Sequence[_Offer],
    blocks_per_chunk: int,
    num_groups: int,
) -> tuple[KeyList, bytes, bytes, bytes]: ...
def group_ranges(
    ranges: Sequence[tuple[int, KeyList, int, int]], num_groups: int
) -> tuple[KeyList, bytes, bytes, bytes]: ...
def extend_group_keys(
    lists: Sequence[KeyList], block_hashes: Iterable[bytes], blocks_per_chunk: int
) -> int: ...
def _colliding_keys(n: int, bits: int = 12) -> list[bytes]: ...
