"""`TierKind`: what a kind of secondary tier (Redis, a disk, ...) offers the seams, so that they
ask the kind instead of switching on types. A kind is a folder under `kvoffload/tiers/` with a
`KIND` and one line in `registry.py`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvoffload.store import KeyList, KeyRange
from kvoffload.tiers.shard import DataPath


class TierConfig(Protocol):
    """A checked `secondary_tiers` entry of one kind."""

    @property
    def namespace(self) -> str: ...
    @property
    def where(self) -> str:
        """The tier in logs and messages: a server (password masked) or a directory."""

    @property
    def read_only(self) -> bool:
        """Only read from: nothing is written to it."""

    @property
    def enable_kv_events(self) -> bool:
        """Whether vLLM's tiering publishes its events (our connector always does)."""

    @property
    def drain_timeout_s(self) -> float:
        """How long a shutdown waits for the jobs in flight."""


class Lookups(Protocol):
    """The scheduler's non-blocking existence checks against one secondary tier."""

    def lookup_prefix(self, keys: KeyRange, request: str) -> tuple[int, bool]: ...
    def flush(self) -> None: ...
    def mark_miss(self, keys: list[bytes]) -> None: ...
    def forget(self, keys: list[bytes]) -> None:
        """A worker's handle evicted `keys` (no load failed): misses until stored again."""

    def mark_stored(self, keys: KeyList | list[bytes]) -> None: ...
    def cleanup(self, request: str) -> None: ...
    def in_flight(self) -> int: ...
    @property
    def down(self) -> bool: ...


class TierLookups(Lookups, Protocol):
    """The scheduler's handle on one secondary tier: its lookups and their upkeep."""

    def start(self, none_hash: bytes) -> None:
        """The first step has vLLM's `NONE_HASH` (e.g. to check that replicas hash alike)."""

    def note_workers_down(self, down: bool) -> None:
        """Whether some worker's data path finds the tier down now (a handle that does no I/O
        of its own learns it from them)."""

    def take_report(self) -> dict[str, dict[str, int]]:
        """What the lookups' own connections did since the last call, per place (`Report`)."""

    def close(self) -> None: ...


class Reporter(Protocol):
    def take(self) -> dict[str, dict[str, int]]:
        """Per place: the counters' increments since the last call and the gauges now; only the
        places where something moved."""


@dataclass(frozen=True)
class Report:
    """A kind's per-place metrics (a node of a Redis tier, a disk's directory)."""

    key: str
    """Their key in the stats a worker sends the scheduler."""
    metric: str
    """The Prometheus name prefix (`vllm:` + this + counter)."""
    label: str
    """The label naming the place."""
    counters: Mapping[str, str]
    """Monotonic counters and their help texts (summed over workers)."""
    gauges: Mapping[str, str]
    """Gauges and their help texts (merged over workers by the worse value, `worst`)."""
    renamed_from: tuple[str, ...] = ()
    """Former `metric` prefixes, exported as well until the next release."""


# The breaker's states from best to worst: up (0), half-open (2), down (1).
_BREAKER_RANK = {0: 0, 2: 1, 1: 2}


def worst(name: str, a: int, b: int) -> int:
    """Two sources' values of gauge `name` as one: the larger, and for a breaker the worse state
    (down before half-open)."""
    if name == "breaker_state":
        return max(a, b, key=lambda v: _BREAKER_RANK.get(v, 0))
    return max(a, b)


class TierKind(Protocol):
    """One kind of secondary tier, named by the `type` of its entries."""

    @property
    def name(self) -> str:
        """The entry's `type` (e.g. "RedisTier")."""

    @property
    def locality(self) -> str:
        """The locality its entries default to ("LOCAL" or "REMOTE")."""

    @property
    def sees_evictions(self) -> bool:
        """Whether its data paths report what their eviction removes (`DataPath.take_evicted`):
        then a `LOCAL` tier's KV events follow each chunk exactly (see `Announced`)."""

    @property
    def report(self) -> Report | None:
        """Its per-place metrics, if it has any."""

    def parse(self, entry: Mapping[str, Any]) -> TierConfig:
        """A checked entry, or a `ConfigError` naming the key."""

    def check_shards(self, config: Any, num_shards: int, chunk_bytes: int) -> str | None:
        """Why `config` cannot hold a chunk split into `num_shards` shards of `chunk_bytes`
        (e.g. a capacity too small), or None."""

    def open_lookups(
        self, config: Any, digests: Sequence[bytes], chunk_bytes: int, num_shards: int
    ) -> TierLookups:
        """The scheduler's handle; `digests`: each shard's namespace digest (a chunk counts
        only when every shard is there)."""

    def open_data_path(
        self, config: Any, digest: bytes, chunk_bytes: int, num_shards: int
    ) -> DataPath:
        """A worker's data path for its shard, keyed under `digest`."""

    def reporter(self, paths: Sequence[Any]) -> Reporter:
        """The per-place report of a worker's data paths of this kind (asked only of a kind
        with a `report`)."""
