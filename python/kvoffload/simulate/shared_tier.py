"""A shared tier (a Redis/Valkey server) behind every instance of a fleet.

It holds `capacity` chunks by key. Every chunk an instance stores in its CPU tier is written to
it behind the store; an instance looks it up for the rest of a prefix its CPU tier misses, and a
hit is copied into that instance's CPU tier before it loads as a CPU hit. Each instance has one
network link to it, one transfer at a time per direction (as its PCIe link), each costing
`latency_ms` (one pipelined batch) plus its bytes at `gbps`. Eviction approximates Redis's
`allkeys-lru` with `maxmemory-samples 5`: sample 5 keys at random, evict the least recently
used of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvoffload import _rust
from kvoffload.store import KeyList, Keys

LRU_SAMPLES = 5
"""Redis's default `maxmemory-samples`."""


@dataclass(frozen=True)
class SharedTierConfig:
    capacity: int
    """Chunks the tier holds."""
    gbps: float = 12.5
    """GB/s of each instance's link, per direction (100 Gb Ethernet moves about 12.5)."""
    latency_ms: float = 0.5
    """The round trip of one batch (a pipelined read or write)."""
    seed: int = 0
    """Seeds the eviction's sampling (0 to 2**64 - 1)."""

    def __post_init__(self) -> None:
        if type(self.capacity) is not int or self.capacity < 1:
            raise ValueError(f"capacity={self.capacity!r} is invalid: expected an int >= 1")
        if not isinstance(self.gbps, (int, float)) or not 0 < self.gbps < math.inf:
            raise ValueError(f"gbps={self.gbps!r} is invalid: expected a finite number > 0")
        if not isinstance(self.latency_ms, (int, float)) or not 0 <= self.latency_ms < math.inf:
            raise ValueError(
                f"latency_ms={self.latency_ms!r} is invalid: expected a finite number >= 0"
            )


class SimulatedSharedTier:
    """The server: which keys it holds and when each becomes readable (in Rust: a batch of
    keys is one call)."""

    def __init__(self, config: SharedTierConfig) -> None:
        self.config = config
        self._keys = _rust.SampledLru(config.capacity, LRU_SAMPLES, config.seed)

    def __len__(self) -> int:
        return len(self._keys)

    def lookup_prefix(self, keys: Keys, now: float) -> int:
        """How many leading `keys` are readable at `now`; a hit is a use (its recency moves)."""
        return self._keys.lookup_prefix(keys, now)

    def put(self, keys: Keys, ready_at: float) -> int:
        """Writes `keys`, readable from `ready_at` (when the write lands); returns how many keys
        were evicted for them. Rewriting a key refreshes it and keeps it readable."""
        return self._keys.put(keys, ready_at)


class SharedTierLink:
    """One instance's link to the tier: its reads and writes, one at a time per direction, and
    what they moved."""

    def __init__(self, tier: SimulatedSharedTier, bytes_per_chunk: int) -> None:
        self.tier = tier
        self.bytes_per_chunk = bytes_per_chunk
        self._free = {"read": 0.0, "write": 0.0}
        self.bytes_read = 0
        self.bytes_written = 0
        self.evictions = 0
        """Keys the tier evicted for this instance's writes."""

    def _transfer(self, kind: str, chunks: int, now: float) -> float:
        cfg = self.tier.config
        seconds = cfg.latency_ms / 1e3 + chunks * self.bytes_per_chunk / (cfg.gbps * 1e9)
        self._free[kind] = max(now, self._free[kind]) + seconds
        return self._free[kind]

    def read(self, chunks: int, now: float) -> float:
        """Copies `chunks` hit chunks to this instance; returns when they have arrived."""
        self.bytes_read += chunks * self.bytes_per_chunk
        return self._transfer("read", chunks, now)

    def write(self, keys: KeyList, now: float) -> None:
        """Writes chunks this instance just stored in its CPU tier; the GPU waits for none."""
        self.bytes_written += len(keys) * self.bytes_per_chunk
        self.evictions += self.tier.put(keys, self._transfer("write", len(keys), now))
