"""`KVOffloadSpec`: our manager and copy worker inside vLLM's own `OffloadingConnector`.

`--kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
"kv_connector_extra_config": {"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.vllm",
"cpu_bytes_to_use": ...}}'`
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from kvoffload.errors import ConfigError, NotSupportedError
from kvoffload.scheduler import OffloadConfig
from kvoffload.transfer.progress import PoolProgress
from kvoffload.vllm.compat import cpu_config_info, cpu_config_info_keys
from kvoffload.vllm.connector.settings import self_describing_events
from kvoffload.vllm.logs import log_beside_vllm
from kvoffload.vllm.pinning import Pinning
from kvoffload.vllm.spec.manager import KVOffloadManager
from kvoffload.vllm.spec.worker import KVOffloadWorker

logger = logging.getLogger(__name__)

_OURS = ("cpu_bytes_to_use", "eviction_policy", "offload_prompt_only")
# Read by vLLM's OffloadingConnector itself (or meaningful only with store_threshold).
_VLLM = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "block_size",
        "blocks_per_chunk",
        "sync_load_budget_bytes",
        "self_describing_kv_events",
        "canonical_layout",
        "store_threshold",
        "max_tracker_size",
        "cache_policy_module_path",
    }
)
_OTHER_SPEC = "vLLM's own CPU spec (remove spec_name and spec_module_path)"


class KVOffloadSpec(OffloadingSpec):
    """Built by vLLM from `kv_connector_extra_config`: the same keys as vLLM's CPU spec with the
    same meaning (`cpu_bytes_to_use` required, total over all workers; `eviction_policy` `lru` or
    `arc`; `offload_prompt_only`; `block_size` or `blocks_per_chunk`). A bad value stops start-up
    with a `ConfigError` naming the key. The tier holds `cpu_bytes_to_use // chunk bytes` chunks:
    vLLM's CPU spec rounds each chunk up to a 4 KiB page first, so with chunks that are not whole
    pages this tier holds a few more."""

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        # The CPU tier's gauges and allocation histogram, as vLLM's CPU spec publishes them.
        defs = CPUOffloadingSpec.build_metric_definitions({})
        defs.pop(CPUOffloadingMetrics.STORES_SKIPPED, None)
        return defs

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        return cpu_config_info_keys()

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        log_beside_vllm()
        extra = dict(config.extra_config)
        if self.blocks_per_chunk < 1:  # vLLM turns block_size=0 into 0 blocks per chunk
            given = {k: extra[k] for k in ("block_size", "blocks_per_chunk") if k in extra}
            raise ConfigError(
                f"{', '.join(f'{k}={v!r}' for k, v in given.items())} is invalid: a chunk "
                f"is a positive multiple of the GPU block size ({config.groups[0].tokens_per_block}"
                " tokens)"
            )
        _check_unsupported(extra, config)
        # vLLM reads it with bool(): "false" would turn it on.
        self_describing_events(extra, config)
        # Off by default here: the workers' progress reaches the manager through a file on this
        # host, so every worker must run beside the scheduler (no multi-node, no
        # external_launcher) under an engine_id of its own.
        self.pinning = Pinning.from_extra(extra, background_default=False)
        unknown = sorted(set(extra) - set(_OURS) - _VLLM)
        if unknown:
            logger.warning(
                "KVOffloadSpec ignores unknown kv_connector_extra_config keys: %s",
                ", ".join(unknown),
            )
        self.settings = OffloadConfig.from_dict(
            {
                **{k: extra[k] for k in _OURS if k in extra},
                "tokens_per_block": config.groups[0].tokens_per_block,
                "blocks_per_chunk": self.blocks_per_chunk,
            }
        )
        world_size = config.parallel.world_size
        # The bytes of one GPU block id over the whole KV allocation: a hybrid model's groups
        # overlay each other there, so this is not a sum over groups, and it is the worker's
        # slot (one chunk of every tensor) unless groups that are not offloaded use more
        # tensors, which only leaves part of cpu_bytes_to_use unused. (vLLM's fallback with no
        # KV-cache tensors sums over groups: an overcount, never an overspend.)
        block_bytes = config.worker_kv_bytes_per_block
        if block_bytes <= 0:
            raise NotSupportedError(
                "vLLM reported no KV-cache bytes per GPU block: KVOffloadSpec has nothing to size "
                "its CPU tier by"
            )
        self.bytes_per_chunk = block_bytes * self.blocks_per_chunk * world_size
        self.num_chunks = self.settings.num_slots(self.bytes_per_chunk)
        self._manager: KVOffloadManager | None = None
        self._worker: KVOffloadWorker | None = None
        parallel = config.parallel
        # One file per engine (and data-parallel replica): its workers write, its manager reads.
        self._progress_name = f"{config.engine_id}-dp{parallel.data_parallel_index}"

    def _progress(self) -> PoolProgress | None:
        if not self.pinning.in_background:
            return None
        return PoolProgress(self._progress_name, self.config.parallel.world_size)

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = KVOffloadManager(
                self.num_chunks,
                self.settings.eviction_policy,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                num_kv_groups=len(self.config.groups),
                config_info=cpu_config_info(self.config, self.num_chunks, self.bytes_per_chunk),
                progress=self._progress(),
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = KVOffloadWorker(
                kv_caches,
                num_slots=self.num_chunks,
                blocks_per_chunk=self.blocks_per_chunk,
                cpu_bytes_to_use=self.settings.cpu_bytes_to_use,
                pinning=self.pinning,
                progress=self._progress(),
                rank=self.config.parallel.rank,
            )
        return self._worker


def _check_unsupported(extra: dict[str, Any], config: OffloadingConfig) -> None:
    threshold = extra.get("store_threshold", 0)
    try:
        filters = int(threshold) >= 2  # read as vLLM reads it: below 2 it filters nothing
    except (TypeError, ValueError):
        raise ConfigError(f"store_threshold={threshold!r} is invalid: expected an int") from None
    if filters:
        raise ConfigError(
            f"store_threshold={threshold!r} is not supported by KVOffloadSpec (every offered "
            f"chunk is stored); remove it, or use {_OTHER_SPEC}"
        )
    if extra.get("cache_policy_module_path") is not None:
        raise ConfigError(
            "cache_policy_module_path is not supported by KVOffloadSpec (its policies, lru and "
            f"arc, are in Rust); remove it, or use {_OTHER_SPEC}"
        )
    if extra.get("record_trace") is not None:
        # Refused, not ignored: an operator expecting a trace would find none, hours later.
        raise NotSupportedError(
            "record_trace is written by KVOffloadConnector only, not through vLLM's "
            'OffloadingConnector; use "kv_connector": "KVOffloadConnector", or remove it'
        )
    if config.canonical_layout:
        raise NotSupportedError(
            f"canonical_layout is not supported by KVOffloadSpec; remove it, or use {_OTHER_SPEC}"
        )
