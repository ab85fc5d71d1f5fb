"""Deprecated: the disk tier moved to `kvoffload.tiers.disk` (removed in the next release).

The old names resolve to the new ones, with a `DeprecationWarning`."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_MOVED = {
    **{
        name: "kvoffload.tiers.disk"
        for name in (
            "DISK_COUNTERS",
            "DISK_GAUGES",
            "DRAIN_TIMEOUT_S",
            "DiskClient",
            "DiskLookups",
            "DiskReport",
            "DiskTierConfig",
            "file_bytes",
        )
    },
    "worst": "kvoffload.tiers",
}
__all__ = list(_MOVED)


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = _MOVED[name]
    warnings.warn(
        f"kvoffload.disk.{name} is deprecated: use {module}.{name}",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(module), name)
