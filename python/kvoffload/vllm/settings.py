"""The connector's settings from vLLM's configs, computed the same way in the scheduler and in
every worker so that both agree on the number of CPU-tier slots."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvoffload.errors import ConfigError, NotSupportedError
from kvoffload.scheduler import OffloadConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True)
class ConnectorSettings:
    config: OffloadConfig
    world_size: int
    """Workers (tensor x pipeline parallel ranks); each copies its own shard of every chunk."""
    worker_block_bytes: int
    """Bytes of one GPU block on one worker, all layers."""
    num_slots: int
    enable_events: bool

    @property
    def bytes_per_chunk(self) -> int:
        """One chunk over all workers: what `cpu_bytes_to_use` is divided by."""
        return self.worker_block_bytes * self.config.blocks_per_chunk * self.world_size

    @classmethod
    def from_vllm(
        cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
    ) -> ConnectorSettings:
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None  # vLLM builds connectors only when it is set
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise NotSupportedError(
                f"KVOffloadConnector supports models with one KV-cache group; this one has "
                f"{len(groups)} (a hybrid model). Use vLLM's OffloadingConnector for it."
            )
        spec = groups[0].kv_cache_spec
        extra = dict(transfer.kv_connector_extra_config or {})
        if "tokens_per_block" in extra:
            raise ConfigError(
                "tokens_per_block comes from vLLM's --block-size; remove it from "
                "kv_connector_extra_config"
            )
        config = OffloadConfig.from_dict({**extra, "tokens_per_block": spec.block_size})
        if kv_cache_config.kv_cache_tensors and kv_cache_config.num_blocks:
            # Every KVCacheTensor places its layers in the same backing allocation, whose whole
            # size each of them carries (vLLM's OffloadingConnector reads it the same way).
            block_bytes = kv_cache_config.kv_cache_tensors[0].size // kv_cache_config.num_blocks
        else:
            block_bytes = spec.page_size_bytes * len(groups[0].layer_names)
        world_size = vllm_config.parallel_config.world_size
        bytes_per_chunk = block_bytes * config.blocks_per_chunk * world_size
        events = vllm_config.kv_events_config
        return cls(
            config=config,
            world_size=world_size,
            worker_block_bytes=block_bytes,
            num_slots=config.num_slots(bytes_per_chunk),
            enable_events=bool(events is not None and events.enable_kv_cache_events),
        )
