"""Secondary tiers behind the CPU tier (vLLM's word): engine-agnostic, no vLLM, no torch.

What every kind shares lives here: the status of each key of a job (`status`), the namespace
digest that keeps incompatible replicas apart (`identity`), a worker's shard of each chunk moved
between its CPU slots and a tier (`shard`), the checks every entry starts with (`checks`), the
`secondary_tiers` list (`entries`), and `TierKind`, what a kind offers the seams (`kind`). Each
kind is a folder (`redis/`, `disk/`) named in `registry`, keyed by its entries' `type`.
"""

from kvoffload.tiers.entries import TierSettings, parse_entries
from kvoffload.tiers.identity import FORMAT_VERSION, TierIdentity
from kvoffload.tiers.kind import Lookups, Report, TierConfig, TierKind, TierLookups, worst
from kvoffload.tiers.shard import DataPath, ShardIO
from kvoffload.tiers.status import CORRUPT, DROPPED, EXISTS, FAILED, MISSING, OK, Completion

__all__ = [
    "CORRUPT",
    "DROPPED",
    "EXISTS",
    "FAILED",
    "FORMAT_VERSION",
    "MISSING",
    "OK",
    "Completion",
    "DataPath",
    "Lookups",
    "Report",
    "ShardIO",
    "TierConfig",
    "TierIdentity",
    "TierKind",
    "TierLookups",
    "TierSettings",
    "parse_entries",
    "worst",
]
