"""`RedisTier`: a shared Redis/Valkey tier for vLLM 0.33's `TieringOffloadingSpec`.

vLLM loads it by module path from a `secondary_tiers` entry (`"type": "RedisTier",
"module_path": "kvoffload.vllm"`). Chunks move between vLLM's CPU region (the primary tier's
memoryview) and Redis on the Rust data path: straight from and into that memory, on background
threads, without the GIL. Every call here runs on the scheduler thread and only submits or polls.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.core import kv_cache_utils
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import (
    TIER_LABEL,
    JobResult,
    SecondaryTierManager,
    TransferJob,
)

from kvoffload.errors import ConfigError
from kvoffload.remote import (
    CORRUPT,
    EXISTS,
    FAILED,
    NODE_COUNTERS,
    NODE_GAUGES,
    OK,
    NodeReport,
    RemoteClient,
    RemoteLookups,
    RemoteTierConfig,
    SeedCanary,
    TierIdentity,
)

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

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
# At most one warning per this many seconds about failed jobs: a down server fails every job.
_WARN_EVERY_S = 10.0
# The encoding of the data path's own `breaker_state` stat.
_BREAKER_STATES = {"up": 0, "down": 1, "half-open": 2}
# Gauges of the data path's stats, not counters: never summed over the two clients.
_GAUGES = frozenset({"jobs_in_flight", "store_bytes_in_flight", "breaker_state"})


class RedisTier(SecondaryTierManager):
    """A `SecondaryTierManager` on Redis 7 / Valkey 8; see `docs/shared-tier.md` for
    every key. Faults degrade to CPU-only: lookups miss, stores drop, loads fail and recompute."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **entry: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        config = RemoteTierConfig.from_dict(entry)
        self.config = config
        self.locality = _locality(entry.get("locality", Locality.REMOTE.value))
        chunk_bytes = self.block_size_bytes
        digest = identity_of(offloading_spec, config.namespace, chunk_bytes).digest()
        self._client = RemoteClient(config, digest, chunk_bytes)
        # Lookups have a connection of their own: one never queues behind a 64-chunk load.
        self._lookup_client = RemoteClient(config, digest, chunk_bytes, connections=1)
        self._lookups = RemoteLookups(self._lookup_client)
        self._nodes = NodeReport(self._client, self._lookup_client)
        # The view is the whole CPU region: a chunk id is a row of `chunk_bytes`.
        self._base = primary_kv_view
        self._jobs: dict[int, tuple[TransferJob, float]] = {}
        self._touch_jobs: set[int] = set()
        self._pending: list[JobResult] = []
        self._events: list[OffloadingEvent] | None = None
        if config.enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events:
            self._events = []
        self._reported = {name: 0 for name in _COUNTERS}
        self._canary = SeedCanary(self._client, logger)
        self._warned_at = -_WARN_EVERY_S
        self._failed_since_warning = 0
        if self._client.startup_error is not None:
            logger.warning(
                "RedisTier %s is unreachable (%s): the engine serves without the shared tier "
                "and retries in the background",
                self.config.masked_url,
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

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self._client.store)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self._client.load)

    def _submit(self, job: TransferJob, submit: Any) -> None:
        offsets = (job.chunk_ids.astype(np.int64) * self.block_size_bytes).tolist()
        try:
            rust_job = submit(list(job.keys), self._base, offsets)
        except (ValueError, TypeError) as exc:  # a slot outside the region: never silently
            logger.error("RedisTier job %d refused: %s", job.job_id, exc)
            self._pending.append(JobResult(job_id=job.job_id, success=False))
            return
        self._jobs[rust_job] = (job, time.monotonic())

    def get_finished_jobs(self) -> Iterable[JobResult]:
        self._collect(self._client.poll())
        done, self._pending = self._pending, []
        return done

    def drain_jobs(self) -> None:
        # Every job ends by its deadline (fixed part + bytes / min bandwidth), so this is bounded.
        while self._jobs:
            self._collect(self._client.drain(self._drain_timeout()))

    def _drain_timeout(self) -> float:
        total = sum(len(job.keys) for job, _ in self._jobs.values()) * self.block_size_bytes
        return self.config.job_timeout_s + total / (self.config.min_bandwidth_mb_s * 1e6) + 1.0

    def _collect(self, completions: list[tuple[int, bytes]]) -> None:
        now = time.monotonic()
        self._warn_failures(completions, now)
        for rust_job, statuses in completions:
            if rust_job in self._touch_jobs:
                self._touch_jobs.discard(rust_job)
                continue
            entry = self._jobs.pop(rust_job, None)
            if entry is None:
                continue
            job, started = entry
            keys = list(job.keys)
            if job.is_promotion:
                self._pending.append(self._load_result(job, keys, statuses, now - started))
            else:
                self._pending.append(self._store_result(job, keys, statuses, now - started))

    def _warn_failures(self, completions: list[tuple[int, bytes]], now: float) -> None:
        self._failed_since_warning += sum(
            any(s in (CORRUPT, FAILED) for s in statuses) for _, statuses in completions
        )
        if self._failed_since_warning and now - self._warned_at >= _WARN_EVERY_S:
            logger.warning(
                "RedisTier %s: %d job(s) failed or found corrupt values (recomputed, never "
                "served); latest reason: %s",
                self.config.masked_url,
                self._failed_since_warning,
                self._client.last_error,
            )
            self._warned_at, self._failed_since_warning = now, 0

    def _load_result(
        self, job: TransferJob, keys: list[OffloadKey], statuses: bytes, took: float
    ) -> JobResult:
        loaded = [k for k, s in zip(keys, statuses, strict=True) if s == OK]
        if len(loaded) == len(keys):
            return JobResult(
                job.job_id,
                True,
                transfer_time=took,
                transfer_bytes=len(keys) * self.block_size_bytes,
            )
        # A key that did not load is a miss for this tier from now on (vLLM's livelock guard):
        # the request recomputes it, and what did arrive is kept.
        failed = [k for k, s in zip(keys, statuses, strict=True) if s != OK]
        self._lookups.mark_miss(failed)
        if self._events is not None:
            self._events.append(
                OffloadingEvent(
                    keys=failed, medium=self.medium, removed=True, locality=self.locality
                )
            )
        return JobResult(
            job.job_id,
            False,
            successful_keys=loaded,
            transfer_time=took,
            transfer_bytes=len(loaded) * self.block_size_bytes,
        )

    def _store_result(
        self, job: TransferJob, keys: list[OffloadKey], statuses: bytes, took: float
    ) -> JobResult:
        stored = sum(s in (OK, EXISTS) for s in statuses)
        success = stored == len(keys)
        if success and self._events is not None:
            self._events.append(
                OffloadingEvent(
                    keys=keys, medium=self.medium, removed=False, locality=self.locality
                )
            )
        return JobResult(
            job.job_id, success, transfer_time=took, transfer_bytes=stored * self.block_size_bytes
        )

    def has_pending_work(self) -> bool:
        return bool(self._jobs) or self._lookups.in_flight() > 0

    # --- per request and per step ----------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()
        # vLLM builds the tiers before it sets NONE_HASH: the canary waits for the first step.
        none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
        if none_hash is not None:
            self._canary.start(bytes(none_hash))

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events:
            events, self._events = self._events, []
            return events
        return ()

    # --- metrics and lifetime --------------------------------------------------------------

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        labels = (TIER_LABEL,)
        metrics: dict[str, OffloadingMetricMetadata] = {
            _METRIC + name: OffloadingCounterMetadata(documentation=doc, labelnames=labels)
            for name, doc in _COUNTERS.items()
        }
        metrics[_METRIC + "breaker_state"] = OffloadingGaugeMetadata(
            documentation="The shared tier's circuit breaker: 0 up, 1 down, 2 half-open.",
            labelnames=labels,
        )
        node_labels = (TIER_LABEL, "node")
        for name, doc in NODE_COUNTERS.items():
            metrics[_NODE_METRIC + name] = OffloadingCounterMetadata(
                documentation=doc, labelnames=node_labels
            )
        for name, doc in NODE_GAUGES.items():
            metrics[_NODE_METRIC + name] = OffloadingGaugeMetadata(
                documentation=doc, labelnames=node_labels
            )
        return metrics

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
            labels = (self.tier_type, node)
            for name in NODE_COUNTERS:
                if moved[name]:
                    stats.increase_counter(_NODE_METRIC + name, moved[name], labels)
            for name in NODE_GAUGES:
                stats.set_gauge(_NODE_METRIC + name, moved[name], labels)
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
        return {k: v if k in _GAUGES else v + lookups.get(k, 0) for k, v in data.items()}

    def shutdown(self) -> None:
        self._canary.join()
        self.drain_jobs()
        self._client.close()
        self._lookup_client.close()


def _locality(value: object) -> Locality:
    try:
        return Locality(value)
    except ValueError:
        raise ConfigError(
            f"secondary tier locality={value!r} is invalid: expected one of "
            f"{', '.join(repr(m.value) for m in Locality)}"
        ) from None


def identity_of(spec: OffloadingSpec, namespace: str, chunk_bytes: int) -> TierIdentity:
    """What vLLM's tiering region bytes depend on beyond the block hash (its CPU region lays a
    chunk out as every worker's page for every group and layer, so rank is not part of it)."""
    config = spec.config
    parallel = config.parallel
    layers = tuple(name for group in config.groups for name in group.layer_names)
    layout = f"vllm-tiering/{config.kv_cache_layout or 'default'}"
    if config.canonical_layout:
        layout += "/canonical"
    return TierIdentity(
        namespace=namespace,
        model=config.model.name,
        kv_dtype=str(config.model.dtype),
        tokens_per_block=config.groups[0].tokens_per_block,
        blocks_per_chunk=config.cache.blocks_per_chunk,
        layers=layers,
        tp_size=parallel.tp_size,
        pp_size=parallel.pp_size,
        rank=0,
        bytes_per_chunk=chunk_bytes,
        layout=layout,
    )
