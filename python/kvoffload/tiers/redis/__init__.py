"""The Redis kind of secondary tier (Redis 7 / Valkey 8, one server or a cluster): engine-agnostic.

`RedisTierConfig` reads a `RedisTier` entry; `RedisClient` runs store, load and lookup jobs on the
Rust data path (`rust/kvoffload-redis`); `RedisLookups` answers existence checks without blocking;
`SeedCanary` checks that replicas hash blocks alike; `NodeReport` says what each node did, for
per-node metrics. `KIND` is what the seams open on an entry. The vLLM seams are
`kvoffload.vllm.RedisTier` (vLLM's tiering) and `KVOffloadConnector`'s `secondary_tiers`.
"""

from kvoffload.tiers.redis.canary import SeedCanary
from kvoffload.tiers.redis.client import RedisClient
from kvoffload.tiers.redis.config import RedisTierConfig
from kvoffload.tiers.redis.kind import KIND
from kvoffload.tiers.redis.lookups import RedisLookups
from kvoffload.tiers.redis.nodes import NODE_COUNTERS, NODE_GAUGES, NodeReport

__all__ = [
    "KIND",
    "NODE_COUNTERS",
    "NODE_GAUGES",
    "NodeReport",
    "RedisClient",
    "RedisLookups",
    "RedisTierConfig",
    "SeedCanary",
]
