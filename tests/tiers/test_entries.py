"""`secondary_tiers` read entry by entry through the registry of kinds, without vLLM: each bad
entry is one `ConfigError` naming its index, the key, the value and what is allowed."""

from __future__ import annotations

import pytest

from kvoffload import ConfigError
from kvoffload.tiers import parse_entries, registry

REDIS = {"type": "RedisTier", "url": "redis://h:6379/0", "namespace": "m@1"}
DISK = {"type": "DiskTier", "path": "/mnt/kv", "capacity_bytes": 1 << 30, "namespace": "m@1"}


def test_a_chain_gives_each_entry_its_kind_config_and_locality():
    entries = parse_entries([DISK, {**REDIS, "locality": "LOCAL"}])
    assert [(k.name, c.where, loc) for k, c, loc in entries] == [
        ("DiskTier", "/mnt/kv", "LOCAL"),
        ("RedisTier", "redis://h:6379/0", "LOCAL"),
    ]
    assert [k is registry.kind(k.name) for k, _, _ in entries] == [True, True]


@pytest.mark.parametrize(
    ("tiers", "message"),
    [
        (
            [{"type": "S3Tier"}],
            "secondary_tiers[0] type='S3Tier' is invalid; allowed: 'RedisTier', 'DiskTier'",
        ),
        ([DISK, {"type": 7}], "secondary_tiers[1] type=7 is invalid; allowed: 'RedisTier'"),
        (
            [{**REDIS, 7: 1, "colour": "red"}],
            "secondary_tiers[0]: unknown RedisTier key(s): 'colour', 7; allowed: ",
        ),
        (
            [{**DISK, "namespace": " "}],
            "secondary_tiers[0]: DiskTier namespace=' ' is invalid: it is required",
        ),
        ([REDIS, dict(REDIS)], "secondary_tiers[1] is secondary_tiers[0] again"),
        ([{**REDIS, "locality": "MARS"}], "secondary_tiers[0] locality='MARS' is invalid"),
        ([], "secondary_tiers is an empty list"),
    ],
)
def test_a_bad_entry_is_one_clear_error(tiers, message):
    with pytest.raises(ConfigError) as err:
        parse_entries(tiers)
    assert str(err.value).startswith(message), str(err.value)
