import logging

import pytest

from kvoffload import ConfigError, KVOffloadError, NotSupportedError
from kvoffload.scheduler import OffloadConfig


def cfg(**kw):
    return OffloadConfig.from_dict({"tokens_per_block": 16, "cpu_bytes_to_use": 1 << 30, **kw})


def test_defaults():
    c = cfg()
    assert (c.blocks_per_chunk, c.tokens_per_chunk) == (1, 16)
    assert c.offload_prompt_only is True
    assert c.eviction_policy == "lru"


def test_block_size_is_tokens_per_chunk():
    assert cfg(block_size=64).blocks_per_chunk == 4
    assert cfg(blocks_per_chunk=3).tokens_per_chunk == 48


def test_num_slots_from_cpu_bytes():
    c = cfg(cpu_bytes_to_use=10 * 2**21 + 5)
    assert c.num_slots(2**21) == 10
    with pytest.raises(ConfigError, match="cpu_bytes_to_use=100 holds no chunk"):
        cfg(cpu_bytes_to_use=100).num_slots(2**21)


def test_float_bytes_from_json_are_accepted_when_integral():
    assert cfg(cpu_bytes_to_use=1e10).cpu_bytes_to_use == 10_000_000_000


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"block_size": 40}, "block_size=40 is invalid: expected a multiple of"),
        ({"block_size": 32, "blocks_per_chunk": 2}, "both set"),
        ({"blocks_per_chunk": 0}, r"blocks_per_chunk=0 \(int\) is invalid"),
        ({"blocks_per_chunk": "2"}, r"blocks_per_chunk='2' \(str\)"),
        ({"cpu_bytes_to_use": -5}, "cpu_bytes_to_use=-5"),
        ({"cpu_bytes_to_use": 1.5}, "cpu_bytes_to_use=1.5"),
        ({"offload_prompt_only": "yes"}, "offload_prompt_only='yes'"),
        (
            {"eviction_policy": "fifo"},
            "eviction_policy='fifo' is invalid: expected one of lru, arc",
        ),
    ],
)
def test_bad_values_name_the_key(kw, match):
    with pytest.raises(ConfigError, match=match) as e:
        cfg(**kw)
    assert isinstance(e.value, ValueError) and isinstance(e.value, KVOffloadError)


def test_required_keys():
    with pytest.raises(ConfigError, match="cpu_bytes_to_use is required"):
        OffloadConfig.from_dict({"tokens_per_block": 16})
    with pytest.raises(ConfigError, match="tokens_per_block is required"):
        OffloadConfig.from_dict({"cpu_bytes_to_use": 1})


def test_unknown_keys_warn_once(caplog):
    with caplog.at_level(logging.WARNING):
        cfg(spec_name="KVOffloadSpec", colour="blue", zeta=1)
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["kvoffload ignores unknown kv_connector_extra_config keys: colour, zeta"]


def test_several_kv_groups_are_not_supported_yet():
    with pytest.raises(NotSupportedError, match="2 KV cache groups"):
        OffloadConfig.from_dict({"tokens_per_block": 16, "cpu_bytes_to_use": 1}, num_kv_groups=2)


def test_required_fields_of_the_dataclass_refuse_none():
    with pytest.raises(ConfigError, match="cpu_bytes_to_use is required"):
        OffloadConfig(tokens_per_block=16, blocks_per_chunk=1, cpu_bytes_to_use=None)  # type: ignore[arg-type]
