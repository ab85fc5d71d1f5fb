"""Names renamed for one word per concept keep working, with a `DeprecationWarning`, until the
next release: the modules `kvoffload.remote` and `kvoffload.disk` (now `kvoffload.tiers.redis`,
`kvoffload.tiers.disk`) and `SchedulerStats.remote_*` (now `secondary_*`)."""

from __future__ import annotations

import importlib

import pytest

from kvoffload import tiers
from kvoffload.scheduler import SchedulerStats
from kvoffload.tiers import disk, redis


@pytest.mark.parametrize(
    ("module", "old", "new"),
    [
        ("kvoffload.remote", "RemoteTierConfig", redis.RedisTierConfig),
        ("kvoffload.remote", "RemoteClient", redis.RedisClient),
        ("kvoffload.remote", "RemoteLookups", redis.RedisLookups),
        ("kvoffload.remote", "TierIdentity", tiers.TierIdentity),
        ("kvoffload.remote", "EXISTS", tiers.EXISTS),
        ("kvoffload.disk", "DiskTierConfig", disk.DiskTierConfig),
        ("kvoffload.disk", "worst", tiers.worst),
    ],
)
def test_a_moved_name_resolves_to_the_new_one_with_a_warning(module, old, new):
    with pytest.warns(DeprecationWarning, match=rf"{module}\.{old} is deprecated: use "):
        assert getattr(importlib.import_module(module), old) is new


def test_remote_job_is_tier_job():
    import kvoffload.scheduler

    with pytest.warns(DeprecationWarning, match="use TierJob"):
        assert kvoffload.scheduler.RemoteJob is kvoffload.scheduler.TierJob


def test_an_unknown_name_of_a_moved_module_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'RedisClient'"):
        importlib.import_module("kvoffload.remote").RedisClient  # noqa: B018


def test_scheduler_stats_read_their_old_names():
    stats = SchedulerStats(secondary_lookups=3, secondary_writes_dropped=7)
    with pytest.warns(DeprecationWarning, match="use secondary_lookups"):
        assert stats.remote_lookups == 3
    with pytest.warns(DeprecationWarning):
        assert stats.remote_writes_dropped == 7
    with pytest.raises(AttributeError):
        stats.remote_hit_tokens  # noqa: B018
