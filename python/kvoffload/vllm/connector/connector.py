"""`KVOffloadConnector`: vLLM's KV-connector interface over kvoffload's scheduler and engine.

vLLM builds one instance in the scheduler process (role SCHEDULER: `OffloadScheduler` and the
Rust CPU-tier store) and one per worker (role WORKER: a `TransferEngine` over that worker's KV
caches). Loads are asynchronous (the request waits until its load is reported); stores start after
the forward pass that computed their KV and are reported through the worker metadata.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_transfer_state import (
    get_kv_transfer_group,
    has_kv_transfer_group,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvoffload.vllm.connector.metadata import KVOffloadMetadata
from kvoffload.vllm.connector.scheduler_side import SchedulerSide
from kvoffload.vllm.connector.settings import ConnectorSettings
from kvoffload.vllm.connector.stats import KVOffloadPromMetrics, KVOffloadStats
from kvoffload.vllm.connector.worker_side import WorkerSide
from kvoffload.vllm.logs import log_beside_vllm

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class KVOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        log_beside_vllm()
        settings = ConnectorSettings.from_vllm(vllm_config, kv_cache_config)
        self._num_gpu_blocks = kv_cache_config.num_blocks
        self._pp_size = vllm_config.parallel_config.pipeline_parallel_size
        self._asking_siblings = False
        self._scheduler_side = (
            SchedulerSide(settings) if role == KVConnectorRole.SCHEDULER else None
        )
        self._worker_side = WorkerSide(settings) if role == KVConnectorRole.WORKER else None

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a store dropped by preemption is only a future miss.
        return False

    # --- scheduler side ------------------------------------------------------------------------

    def _sched(self) -> SchedulerSide:
        assert self._scheduler_side is not None, "a scheduler hook was called on a worker"
        return self._scheduler_side

    def on_new_request(self, request: Request) -> None:
        self._sched().on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request), None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # With the hybrid KV-cache manager: holds every group's blocks while stores read them.
        return self._sched().request_finished(request), None

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._sched().take_events()

    def reset_cache(self) -> bool:
        return self._sched().reset_cache()

    def has_pending_push_work(self) -> bool:
        return self._sched().has_pending_push_work()

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self._sched().on_handshake(metadata.values())

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        # Every pipeline stage pins a pool of its own: all of them count (vLLM's default
        # refuses pp_rank > 0, for P/D connectors).
        self._sched().on_handshake(metadata.values())

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        # The counters live on the scheduler side (workers report jobs through their results);
        # a worker reports what each place of each secondary tier (a Redis node, a directory) did.
        if self._scheduler_side is not None:
            return self._scheduler_side.get_stats()
        return None if self._worker_side is None else self._worker_side.get_stats()

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KVOffloadStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVOffloadPromMetrics:
        return KVOffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # --- worker side ---------------------------------------------------------------------------

    def _worker(self) -> WorkerSide:
        assert self._worker_side is not None, "a worker hook was called on the scheduler"
        return self._worker_side

    def _meta(self) -> KVOffloadMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVOffloadMetadata)
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register_kv_caches(kv_caches, self._num_gpu_blocks)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        # Asked by vLLM after register_kv_caches, for the scheduler's connector before the
        # first step (vLLM 0.33's EngineCore._set_kv_connector_handshake_metadata).
        if self._worker_side is None or self._asking_siblings or not self._handshake_is_ours():
            return None  # asked again while asking the siblings (a nested MultiConnector): none
        return self._worker_side.handshake()

    def _handshake_is_ours(self) -> bool:
        """Whether our metadata may be the handshake. Inside a MultiConnector vLLM hands the
        first handshake a sub-connector has to every sub-connector: one with its own (NIXL's)
        refuses any other, and vLLM's default hook refuses any from a pipeline stage past the
        first. The tier then grows from the first step's results instead."""
        top = get_kv_transfer_group() if has_kv_transfer_group() else self
        if top is self:
            return True
        siblings = [c for c in getattr(top, "_connectors", ()) if c is not self]
        self._asking_siblings = True
        try:
            alone = all(c.get_handshake_metadata() is None for c in siblings)
        finally:
            self._asking_siblings = False
        if self._pp_size == 1 and alone:
            return True
        logger.info(
            "kvoffload: inside %s the CPU tier is reported with the first step's results, not "
            "vLLM's handshake: the first step stores nothing",
            type(top).__name__,
        )
        return False

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, KVOffloadMetadata)
        self._worker().handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker().start_loads(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return

    def wait_for_save(self) -> None:
        # The step's stores were taken by handle_preemptions and start with the next step.
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker().get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker().take_worker_meta()

    def shutdown(self) -> None:
        if self._worker_side is not None:
            self._worker_side.shutdown()
        if self._scheduler_side is not None:
            self._scheduler_side.shutdown()
