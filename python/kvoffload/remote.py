"""Deprecated: the Redis tier moved to `kvoffload.tiers.redis` (removed in the next release).

The old names resolve to the new ones, with a `DeprecationWarning`."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_STATUSES = ("OK", "MISSING", "CORRUPT", "FAILED", "DROPPED", "EXISTS")
_MOVED = {
    "RemoteTierConfig": ("kvoffload.tiers.redis", "RedisTierConfig"),
    "RemoteClient": ("kvoffload.tiers.redis", "RedisClient"),
    "RemoteLookups": ("kvoffload.tiers.redis", "RedisLookups"),
    "SeedCanary": ("kvoffload.tiers.redis", "SeedCanary"),
    "NodeReport": ("kvoffload.tiers.redis", "NodeReport"),
    "NODE_COUNTERS": ("kvoffload.tiers.redis", "NODE_COUNTERS"),
    "NODE_GAUGES": ("kvoffload.tiers.redis", "NODE_GAUGES"),
    "TierIdentity": ("kvoffload.tiers", "TierIdentity"),
    "FORMAT_VERSION": ("kvoffload.tiers", "FORMAT_VERSION"),
    "ShardIO": ("kvoffload.tiers", "ShardIO"),
    "Completion": ("kvoffload.tiers", "Completion"),
    **{s: ("kvoffload.tiers", s) for s in _STATUSES},
}
__all__ = list(_MOVED)


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, new = _MOVED[name]
    warnings.warn(
        f"kvoffload.remote.{name} is deprecated: use {module}.{new}",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(module), new)
