"""The shared tier (Redis 7 / Valkey 8) behind the CPU tier: engine-agnostic.

`RemoteTierConfig` reads a `secondary_tiers` entry, `TierIdentity` makes the namespace digest that
keeps incompatible replicas apart, `RemoteLookups` answers existence checks without blocking, and
`RemoteClient` runs store, load and lookup jobs on the Rust
data path (`rust/kvoffload-remote`). The vLLM seam is `kvoffload.vllm.RedisTier`.
"""

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

__all__ = [
    "CORRUPT",
    "DROPPED",
    "EXISTS",
    "FAILED",
    "FORMAT_VERSION",
    "MISSING",
    "OK",
    "Completion",
    "RemoteClient",
    "RemoteLookups",
    "RemoteTierConfig",
    "TierIdentity",
]
