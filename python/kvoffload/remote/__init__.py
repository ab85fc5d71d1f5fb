"""The shared tier (Redis 7 / Valkey 8) behind the CPU tier: engine-agnostic.

`RemoteTierConfig` reads a `secondary_tiers` entry, `TierIdentity` makes the namespace digest that
keeps incompatible replicas apart, `RemoteLookups` answers existence checks without blocking, and
`RemoteClient` runs store, load and lookup jobs on the Rust
data path (`rust/kvoffload-remote`), `ShardIO` moves one worker's shard of each chunk between its
CPU slots and the tier, `SeedCanary` checks that replicas hash blocks alike, and `NodeReport` says
what each node did for per-node metrics. The vLLM seams are
`kvoffload.vllm.RedisTier` and `KVOffloadConnector`'s `secondary_tiers`.
"""

from kvoffload.remote.canary import SeedCanary
from kvoffload.remote.client import (
    CORRUPT,
    DROPPED,
    EXISTS,
    FAILED,
    MISSING,
    OK,
    Completion,
    RemoteClient,
)
from kvoffload.remote.config import RemoteTierConfig
from kvoffload.remote.lookups import RemoteLookups
from kvoffload.remote.namespace import FORMAT_VERSION, TierIdentity
from kvoffload.remote.nodes import NODE_COUNTERS, NODE_GAUGES, NodeReport
from kvoffload.remote.shard import ShardIO

__all__ = [
    "CORRUPT",
    "DROPPED",
    "EXISTS",
    "FAILED",
    "FORMAT_VERSION",
    "MISSING",
    "NODE_COUNTERS",
    "NODE_GAUGES",
    "OK",
    "Completion",
    "NodeReport",
    "RemoteClient",
    "RemoteLookups",
    "RemoteTierConfig",
    "SeedCanary",
    "ShardIO",
    "TierIdentity",
]
