"""Byte settings as an operator writes them: an int of bytes, or "64GiB", "512MiB", "2TB"; each
key of both seams and both tiers takes them, and anything else is refused naming the key."""

from __future__ import annotations

import pytest

from kvoffload import ConfigError
from kvoffload.scheduler import OffloadConfig
from kvoffload.sizes import size_value
from kvoffload.tiers.disk import DiskTierConfig
from kvoffload.tiers.redis import RedisTierConfig


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("64GiB", 64 << 30),
        ("512MiB", 512 << 20),
        ("2TB", 2 * 10**12),
        ("1.5GiB", 3 << 29),
        ("64 gib", 64 << 30),
        (" 100B ", 100),
        ("1TiB", 1 << 40),
        ("4kB", 4000),
    ],
)
def test_a_size_string_is_its_bytes(text, size):
    assert size_value("cpu_bytes_to_use", text) == size


@pytest.mark.parametrize("text", ["64", "1.5B", "64 GiBs", "-1GiB", "1e3GB", "", "GiB", "0x40GiB"])
def test_anything_else_is_refused_naming_the_key(text):
    with pytest.raises(ConfigError, match=rf"cpu_bytes_to_use={text!r} is invalid: expected an "):
        size_value("cpu_bytes_to_use", text)


def test_other_values_are_left_for_the_settings_own_check():
    assert size_value("k", 12) == 12 and size_value("k", None) is None


def test_every_byte_setting_takes_one():
    config = OffloadConfig.from_dict({"cpu_bytes_to_use": "64GiB", "tokens_per_block": 16})
    assert config.cpu_bytes_to_use == 64 << 30
    disk = DiskTierConfig.from_dict(
        {
            "path": "/tmp/kv",
            "namespace": "m@1",
            "capacity_bytes": "2TiB",
            "max_store_bytes_in_flight": "512MiB",
        }
    )
    assert (disk.capacity_bytes, disk.max_store_bytes_in_flight) == (2 << 40, 512 << 20)
    redis = RedisTierConfig.from_dict(
        {"url": "redis://h:6379", "namespace": "m@1", "max_store_bytes_in_flight": "256MiB"}
    )
    assert redis.max_store_bytes_in_flight == 256 << 20


def test_a_bad_size_names_its_tier():
    with pytest.raises(ConfigError, match=r"DiskTier capacity_bytes='lots' is invalid"):
        DiskTierConfig.from_dict({"path": "/tmp/kv", "namespace": "m@1", "capacity_bytes": "lots"})
    with pytest.raises(ConfigError, match=r"RedisTier max_store_bytes_in_flight='1GB!' is inv"):
        RedisTierConfig.from_dict(
            {"url": "redis://h:6379", "namespace": "m@1", "max_store_bytes_in_flight": "1GB!"}
        )


def test_the_pool_piece_takes_one():
    pinning = pytest.importorskip("kvoffload.vllm.pinning")  # the connector's (torch)
    assert pinning.Pinning.from_extra({"pin_piece_bytes": "256MiB"}).piece_bytes == 256 << 20
