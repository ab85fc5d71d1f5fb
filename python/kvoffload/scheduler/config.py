"""`OffloadConfig`: the connector's settings, read from vLLM's `kv_connector_extra_config`."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvoffload.errors import ConfigError, NotSupportedError
from kvoffload.sizes import size_value
from kvoffload.store import MAX_SLOTS, POLICY_NAMES

logger = logging.getLogger(__name__)

_KNOWN_KEYS = frozenset(
    {
        "tokens_per_block",
        "block_size",
        "blocks_per_chunk",
        "cpu_bytes_to_use",
        "offload_prompt_only",
        "eviction_policy",
    }
)
# Keys vLLM's OffloadingConnector itself reads from the same dict: not ours, not unknown either.
_VLLM_KEYS = frozenset({"spec_name", "spec_module_path"})


def _int(d: Mapping[str, Any], key: str, minimum: int) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if type(v) is not int or v < minimum:
        raise ConfigError(
            f"{key}={v!r} ({type(v).__name__}) is invalid: expected an int >= {minimum}"
        )
    return v


@dataclass(frozen=True)
class OffloadConfig:
    """Where chunks go and how many: see the configuration table of the docs' vLLM guide.

    `tokens_per_block` is the engine's GPU block size; a chunk (the unit stored and loaded) is
    `blocks_per_chunk` consecutive GPU blocks.
    """

    tokens_per_block: int
    blocks_per_chunk: int
    cpu_bytes_to_use: int
    offload_prompt_only: bool = True
    eviction_policy: str = "lru"

    def __post_init__(self) -> None:
        for name in ("tokens_per_block", "blocks_per_chunk", "cpu_bytes_to_use"):
            if _int({name: getattr(self, name)}, name, 1) is None:
                raise ConfigError(f"{name} is required: an int >= 1")
        if type(self.offload_prompt_only) is not bool:
            raise ConfigError(
                f"offload_prompt_only={self.offload_prompt_only!r} "
                f"({type(self.offload_prompt_only).__name__}) is invalid: expected true or false"
            )
        if self.eviction_policy not in POLICY_NAMES:
            raise ConfigError(
                f"eviction_policy={self.eviction_policy!r} is invalid: "
                f"expected one of {', '.join(POLICY_NAMES)}"
            )

    @property
    def tokens_per_chunk(self) -> int:
        return self.tokens_per_block * self.blocks_per_chunk

    def num_slots(self, bytes_per_chunk: int) -> int:
        """CPU-tier slots that `cpu_bytes_to_use` holds for chunks of `bytes_per_chunk` bytes
        (summed over all workers, as `cpu_bytes_to_use` is)."""
        if type(bytes_per_chunk) is not int or bytes_per_chunk < 1:
            raise ConfigError(
                f"bytes_per_chunk={bytes_per_chunk!r} is invalid: expected an int >= 1"
            )
        n = self.cpu_bytes_to_use // bytes_per_chunk
        if n > MAX_SLOTS:
            raise ConfigError(
                f"cpu_bytes_to_use={self.cpu_bytes_to_use} makes {n} chunks of {bytes_per_chunk} "
                f"bytes; at most {MAX_SLOTS} are supported: use larger chunks (block_size)"
            )
        if n < 1:
            raise ConfigError(
                f"cpu_bytes_to_use={self.cpu_bytes_to_use} holds no chunk: one chunk takes "
                f"{bytes_per_chunk} bytes; give at least that much"
            )
        return n

    @classmethod
    def from_dict(cls, extra_config: Mapping[str, Any], *, num_kv_groups: int = 1) -> OffloadConfig:
        """Reads `kv_connector_extra_config` (plus `tokens_per_block`, which the engine adds).

        Raises `ConfigError` naming the key for a wrong type or value, and `NotSupportedError` for
        several KV groups (hybrid models). Unknown keys are logged once and ignored.
        """
        if not isinstance(extra_config, Mapping):
            raise ConfigError(
                f"kv_connector_extra_config must be a dict, got {type(extra_config).__name__}"
            )
        if num_kv_groups != 1:
            raise NotSupportedError(
                f"{num_kv_groups} KV cache groups (a hybrid model): kvoffload supports exactly "
                "one attention group for now"
            )
        unknown = sorted(set(extra_config) - _KNOWN_KEYS - _VLLM_KEYS)
        if unknown:
            logger.warning(
                "kvoffload ignores unknown kv_connector_extra_config keys: %s", ", ".join(unknown)
            )
        tokens_per_block = _int(extra_config, "tokens_per_block", 1)
        if tokens_per_block is None:
            raise ConfigError("tokens_per_block is required (the engine's GPU block size)")
        cpu_bytes = size_value("cpu_bytes_to_use", extra_config.get("cpu_bytes_to_use"))
        if isinstance(cpu_bytes, float) and cpu_bytes.is_integer():
            cpu_bytes = int(cpu_bytes)  # JSON configs often say 1e10
        cpu_bytes = _int({"cpu_bytes_to_use": cpu_bytes}, "cpu_bytes_to_use", 1)
        if cpu_bytes is None:
            raise ConfigError(
                "cpu_bytes_to_use is required: the CPU memory (bytes, total over all workers) "
                "for offloaded KV"
            )
        blocks_per_chunk = _blocks_per_chunk(extra_config, tokens_per_block)
        return cls(
            tokens_per_block=tokens_per_block,
            blocks_per_chunk=blocks_per_chunk,
            cpu_bytes_to_use=cpu_bytes,
            offload_prompt_only=extra_config.get("offload_prompt_only", True),
            eviction_policy=extra_config.get("eviction_policy", "lru"),
        )


def _blocks_per_chunk(d: Mapping[str, Any], tokens_per_block: int) -> int:
    block_size = _int(d, "block_size", 1)
    blocks_per_chunk = _int(d, "blocks_per_chunk", 1)
    if block_size is not None and blocks_per_chunk is not None:
        raise ConfigError(
            f"block_size={block_size} and blocks_per_chunk={blocks_per_chunk} are both set: "
            "give one (block_size = tokens per chunk, blocks_per_chunk = GPU blocks per chunk)"
        )
    if block_size is None:
        return blocks_per_chunk or 1
    if block_size % tokens_per_block:
        raise ConfigError(
            f"block_size={block_size} is invalid: expected a multiple of the GPU block size "
            f"tokens_per_block={tokens_per_block}"
        )
    return block_size // tokens_per_block
