"""A shared tier (a Redis/Valkey server, or a cluster of `nodes` primaries) behind every
instance of a fleet.

It holds `capacity` chunks by key. Every chunk an instance stores in its CPU tier is written to
it behind the store; an instance looks it up for the rest of a prefix its CPU tier misses, and a
hit is copied into that instance's CPU tier before it loads as a CPU hit. Each instance has one
network link to it, one transfer at a time per direction (as its PCIe link), each costing
`latency_ms` (one pipelined batch) plus its bytes at `gbps`. With `node_gbps`, each node's own
network link is modelled too, shared by every instance: a batch's chunks go to the nodes that
own their slots (as the real tier routes them), and it lands when both the instance's link and
every node link it used have moved it. Eviction approximates Redis's `allkeys-lru` with
`maxmemory-samples 5` over the whole tier (keys spread evenly over the nodes): sample 5 keys at
random, evict the least recently used of them.

The same model stands for an instance's own disk tier (`disk_tier`): one per instance, its link the
drive's (`gbps` per direction, `latency_ms` per batch), its eviction the disk tier's least
recently used (`lru_samples=64`: about exact).
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
    nodes: int = 1
    """Primaries the keys are spread over (a Redis Cluster's), each with its own link."""
    node_gbps: float | None = None
    """GB/s of each node's link, per direction, shared by every instance; None: not modelled."""
    lru_samples: int = LRU_SAMPLES
    """Keys sampled per eviction (1 to 64; the disk tier's exact LRU: 64)."""

    def __post_init__(self) -> None:
        if type(self.lru_samples) is not int or not 1 <= self.lru_samples <= 64:
            raise ValueError(
                f"lru_samples={self.lru_samples!r} is invalid: expected an int in [1, 64]"
            )
        if type(self.nodes) is not int or not 1 <= self.nodes <= 1000:
            raise ValueError(f"nodes={self.nodes!r} is invalid: expected an int in [1, 1000]")
        if self.node_gbps is not None and (
            not isinstance(self.node_gbps, (int, float)) or not 0 < self.node_gbps < math.inf
        ):
            raise ValueError(
                f"node_gbps={self.node_gbps!r} is invalid: expected a finite number > 0 or None"
            )
        if type(self.capacity) is not int or self.capacity < 1:
            raise ValueError(f"capacity={self.capacity!r} is invalid: expected an int >= 1")
        if not isinstance(self.gbps, (int, float)) or not 0 < self.gbps < math.inf:
            raise ValueError(f"gbps={self.gbps!r} is invalid: expected a finite number > 0")
        if not isinstance(self.latency_ms, (int, float)) or not 0 <= self.latency_ms < math.inf:
            raise ValueError(
                f"latency_ms={self.latency_ms!r} is invalid: expected a finite number >= 0"
            )


def disk_tier(
    capacity: int, *, gbps: float | None = None, latency_ms: float | None = None, seed: int = 0
) -> SharedTierConfig:
    """An instance's disk tier of `capacity` chunks: by default an NVMe drive's 5 GB/s per
    direction (2 MiB chunks, `O_DIRECT`) and 0.1 ms a batch; least recently used out first."""
    return SharedTierConfig(
        capacity,
        gbps=5.0 if gbps is None else gbps,
        latency_ms=0.1 if latency_ms is None else latency_ms,
        seed=seed,
        lru_samples=64,
    )


class SimulatedSharedTier:
    """The server: which keys it holds and when each becomes readable (in Rust: a batch of
    keys is one call)."""

    def __init__(self, config: SharedTierConfig) -> None:
        self.config = config
        self._keys = _rust.SampledLru(config.capacity, config.lru_samples, config.seed)
        self._node_free = {"read": [0.0] * config.nodes, "write": [0.0] * config.nodes}
        self.node_bytes = {"read": [0] * config.nodes, "write": [0] * config.nodes}
        """Bytes each node's link moved, per direction."""

    def node_transfer(self, kind: str, keys: Keys, bytes_per_chunk: int, now: float) -> float:
        """Moves `keys` over the links of the nodes that own them (one batch per node, in
        parallel); returns when the last node is done (`now` when node links are not
        modelled)."""
        cfg = self.config
        counts = _rust.cluster_node_counts(keys, cfg.nodes)
        done = now
        for node, chunks in enumerate(counts):
            if not chunks:
                continue
            self.node_bytes[kind][node] += chunks * bytes_per_chunk
            if cfg.node_gbps is None:
                continue
            free = self._node_free[kind]
            seconds = cfg.latency_ms / 1e3 + chunks * bytes_per_chunk / (cfg.node_gbps * 1e9)
            free[node] = max(now, free[node]) + seconds
            done = max(done, free[node])
        return done

    def __len__(self) -> int:
        return len(self._keys)

    def lookup_prefix(self, keys: Keys, now: float) -> int:
        """How many leading `keys` are readable at `now`; a hit is a use (its recency moves)."""
        return self._keys.lookup_prefix(keys, now)

    def peek_prefix(self, keys: Keys, now: float) -> int:
        """`lookup_prefix` without the use: what a router indexing the tier sees."""
        return self._keys.peek_prefix(keys, now)

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

    def _transfer(self, kind: str, keys: KeyList, now: float) -> float:
        cfg = self.tier.config
        chunks = len(keys)
        seconds = cfg.latency_ms / 1e3 + chunks * self.bytes_per_chunk / (cfg.gbps * 1e9)
        self._free[kind] = max(now, self._free[kind]) + seconds
        nodes_done = self.tier.node_transfer(kind, keys, self.bytes_per_chunk, now)
        return max(self._free[kind], nodes_done)

    def read(self, keys: KeyList, now: float) -> float:
        """Copies the hit chunks `keys` to this instance; returns when they have arrived."""
        self.bytes_read += len(keys) * self.bytes_per_chunk
        return self._transfer("read", keys, now)

    def write(self, keys: KeyList, now: float) -> None:
        """Writes chunks this instance just stored in its CPU tier; the GPU waits for none."""
        self.bytes_written += len(keys) * self.bytes_per_chunk
        self.evictions += self.tier.put(keys, self._transfer("write", keys, now))
