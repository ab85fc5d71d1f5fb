"""`RedisTier`: a shared Redis/Valkey tier for vLLM's `TieringOffloadingSpec`.

vLLM loads it by module path from a `secondary_tiers` entry (`"type": "RedisTier",
"module_path": "kvoffload.vllm"`). Chunks move between vLLM's CPU region (the primary tier's
memoryview) and Redis on the Rust data path: straight from and into that memory, on background
threads, without the GIL. Every call here runs on the scheduler thread and only submits or polls.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.core import kv_cache_utils
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
)

from kvoffload.tiers.redis import (
    KIND,
    NODE_COUNTERS,
    NODE_GAUGES,
    NodeReport,
    RedisClient,
    RedisLookups,
    RedisTierConfig,
    SeedCanary,
)
from kvoffload.vllm.compat import TIER_LABEL
from kvoffload.vllm.tiering.chunk_tier import ChunkTier, add_report, metric_definitions

logger = logging.getLogger(__name__)

# Counters of the Rust data path exported as Prometheus counters (name -> help text).
_COUNTERS = {
    "corrupt": "Values that failed the header or CRC32C check (each one deleted, never served).",
    "timeouts": "Jobs that missed their deadline.",
    "reconnects": "Connections re-established after a failure.",
    "stores_dropped": "Chunks not written: backpressure or the tier was down.",
    "load_missing": "Chunks a load found absent (evicted after the lookup, or a hole).",
}
_METRIC = "kvoffload:redis_tier_"
# Per node (a cluster's primaries, or the one server), labelled `node="host:port"`.
_NODE_METRIC = "kvoffload:redis_tier_node_"
# The encoding of the data path's own `breaker_state` stat.
_BREAKER_STATES = {"up": 0, "down": 1, "half-open": 2}
# Gauges of the data path's stats, not counters: never summed over the two clients.
_NOT_SUMMED = frozenset({"jobs_in_flight", "store_bytes_in_flight", "breaker_state"})
_BREAKER = {"breaker_state": "The Redis tier's circuit breaker: 0 up, 1 down, 2 half-open."}


class RedisTier(ChunkTier):
    """A `SecondaryTierManager` on Redis 7 / Valkey 8; the docs' Shared tier page documents
    every key. Faults degrade to CPU-only: lookups miss, stores drop, loads fail and recompute."""

    kind = KIND
    _client: RedisClient
    config: RedisTierConfig

    def _open(self) -> None:
        config, chunk_bytes = self.config, self.block_size_bytes
        self._client = RedisClient(config, self._digest, chunk_bytes)
        # Lookups have a connection of their own: one never queues behind a 64-chunk load.
        self._lookup_client = RedisClient(config, self._digest, chunk_bytes, connections=1)
        self._lookups = RedisLookups(self._lookup_client)
        self._nodes = NodeReport(self._client, self._lookup_client)
        self._touch_jobs: set[int] = set()
        self._reported = {name: 0 for name in _COUNTERS}
        self._canary = SeedCanary(self._client, logger)
        if self._client.startup_error is not None:
            logger.warning(
                "RedisTier %s is unreachable (%s): the engine serves without the Redis tier "
                "and retries in the background",
                config.masked_url,
                self._client.startup_error,
            )

    # --- lookups ---------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context.req_id)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        # EXISTS leaves Redis's LRU clock alone; TOUCH (sent for the keys found) keeps hot
        # prefixes ahead of allkeys-lru on the other replicas' behalf too.
        if self.config.touch_on_hit and keys:
            self._touch_jobs.add(self._client.lookup(list(keys)))

    # --- jobs ------------------------------------------------------------------------------

    def _drain_timeout(self) -> float:
        # Every job ends by its deadline (fixed part + bytes / min bandwidth), so this is bounded.
        total = sum(len(job.keys) for job, _ in self._jobs.values()) * self.block_size_bytes
        return self.config.job_timeout_s + total / (self.config.min_bandwidth_mb_s * 1e6) + 1.0

    def _collect(self, completions: list[tuple[int, bytes]]) -> None:
        # TOUCH jobs (lookups of the keys a hit found) end here: vLLM knows nothing of them.
        self._touch_jobs.difference_update(job for job, _ in completions)
        super()._collect(completions)

    def _missed(self, keys: list[OffloadKey]) -> None:
        self._lookups.mark_miss(keys)

    def has_pending_work(self) -> bool:
        return bool(self._jobs) or self._lookups.in_flight() > 0

    # --- per request and per step ----------------------------------------------------------

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()
        # vLLM builds the tiers before it sets NONE_HASH: the canary waits for the first step.
        none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
        if none_hash is not None:
            self._canary.start(bytes(none_hash))

    # --- metrics and lifetime --------------------------------------------------------------

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        node_labels = (TIER_LABEL, "node")
        return metric_definitions(_METRIC, _COUNTERS, _BREAKER) | metric_definitions(
            _NODE_METRIC, NODE_COUNTERS, NODE_GAUGES, node_labels
        )

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = OffloadingConnectorStats()
        now = self.stats()
        label = (self.tier_type,)
        for name in _COUNTERS:
            delta = now[name] - self._reported[name]
            if delta:
                stats.increase_counter(_METRIC + name, delta, label)
                self._reported[name] = now[name]
        stats.set_gauge(_METRIC + "breaker_state", _BREAKER_STATES[self.state], label)
        for node, moved in self._nodes.take().items():
            add_report(stats, _NODE_METRIC, moved, NODE_GAUGES, (self.tier_type, node))
        return stats

    @property
    def state(self) -> str:
        """The worse circuit breaker of the data and lookup connections: "up", "half-open" or
        "down"."""
        states = {self._client.state, self._lookup_client.state}
        return next(s for s in ("down", "half-open", "up") if s in states)

    def stats(self) -> dict[str, int]:
        """The data path's counters, summed over the data and lookup connections (the gauges:
        the data connections' only)."""
        data, lookups = self._client.stats(), self._lookup_client.stats()
        return {k: v if k in _NOT_SUMMED else v + lookups.get(k, 0) for k, v in data.items()}

    def shutdown(self) -> None:
        self._canary.join()
        self.drain_jobs()
        self._client.close()
        self._lookup_client.close()
