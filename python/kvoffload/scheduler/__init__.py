"""The engine-agnostic scheduler side: per-request offload state, lookups and job planning."""

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
