"""The engine-agnostic scheduler side: per-request offload state, lookups and job planning."""

import warnings
from typing import Any

from kvoffload._rust import BlockSet
from kvoffload.scheduler.config import OffloadConfig
from kvoffload.scheduler.groups import KVGroup
from kvoffload.scheduler.hybrid import GroupSlice
from kvoffload.scheduler.jobs import (
    FinishPlan,
    JobResult,
    LoadJob,
    RequestUpdate,
    StateBlock,
    StepPlan,
    StoreJob,
    TierJob,
)
from kvoffload.scheduler.scheduler import OffloadScheduler
from kvoffload.scheduler.secondary_tier import TierLink
from kvoffload.scheduler.stats import SchedulerStats

__all__ = [
    "BlockSet",
    "FinishPlan",
    "GroupSlice",
    "JobResult",
    "KVGroup",
    "LoadJob",
    "OffloadConfig",
    "OffloadScheduler",
    "RequestUpdate",
    "SchedulerStats",
    "StateBlock",
    "StepPlan",
    "StoreJob",
    "TierJob",
    "TierLink",
]


def __getattr__(name: str) -> Any:
    # `RemoteJob` was renamed `TierJob` (a job of any secondary tier): the old name until the
    # next release.
    if name == "RemoteJob":
        warnings.warn(
            "kvoffload.scheduler.RemoteJob is deprecated: use TierJob", DeprecationWarning, 2
        )
        return TierJob
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
