"""`ChunkTier`: what our secondary tiers for vLLM's tiering share. vLLM hands each a view of its
whole CPU region (a chunk id is a row of `block_size_bytes`); store and load jobs move those rows
on a Rust data path, and their per-key statuses become vLLM's `JobResult`s and KV events."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvoffload.errors import ConfigError
from kvoffload.tiers import (
    CORRUPT,
    EXISTS,
    FAILED,
    OK,
    DataPath,
    TierConfig,
    TierIdentity,
    TierKind,
)
from kvoffload.tiers.announced import Announced
from kvoffload.tiers.identity import ownership
from kvoffload.vllm.compat import TIER_LABEL

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

logger = logging.getLogger(__name__)
# At most one warning per this many seconds about failed jobs: a tier that is down fails every
# job.
_WARN_EVERY_S = 10.0
# A drain gives up on jobs still out after this many rounds of `_drain_timeout` (a hung mount):
# they are reported failed, so shutdown never hangs.
_DRAIN_ROUNDS = 3


class ChunkTier(SecondaryTierManager):
    """Jobs of vLLM's tiering on `self._client`, for the entry of one kind of tier (`kind`);
    subclasses open the client (under `self._digest`) and say how keys are looked up and what a
    key that did not load means (`_missed`)."""

    medium: ClassVar[Medium] = Medium.STORAGE
    kind: ClassVar[TierKind]

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **entry: Any,
    ) -> None:
        self.config: TierConfig = self.kind.parse(entry)
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = _locality(entry.get("locality", self.kind.locality))
        self._base = primary_kv_view
        self._digest = identity_of(
            offloading_spec, self.config.namespace, self.block_size_bytes
        ).digest()
        self._jobs: dict[int, tuple[TransferJob, float]] = {}
        self._pending: list[JobResult] = []
        self._events: list[OffloadingEvent] | None = None
        if self.config.enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events:
            self._events = []
        self.ownership = ownership(self.kind.name, self.config.where, self._digest)
        """The tier's name in its KV events (one per tier of a chain, one per shared tier)."""
        self._announced: Announced[OffloadKey] = Announced(
            self.locality == Locality.LOCAL and self.kind.sees_evictions
        )
        self._warned_at = -_WARN_EVERY_S
        self._failed_since_warning = 0
        self._open()

    _client: DataPath

    def _open(self) -> None:
        """Opens `self._client` (and whatever else the kind needs) under `self._digest`."""
        raise NotImplementedError

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
            self._refused(job, exc)
            self._pending.append(JobResult(job_id=job.job_id, success=False))
            return
        self._jobs[rust_job] = (job, time.monotonic())

    def _refused(self, job: TransferJob, exc: Exception) -> None:
        """A job the data path refused: never silently."""
        logger.error("%s job %d refused: %s", self._describe(), job.job_id, exc)

    def _warn_failures(self, completions: list[tuple[int, bytes]], now: float) -> None:
        self._failed_since_warning += sum(
            any(s in (CORRUPT, FAILED) for s in statuses) for _, statuses in completions
        )
        if self._failed_since_warning and now - self._warned_at >= _WARN_EVERY_S:
            logger.warning(
                "%s: %d job(s) failed or found corrupt values (recomputed, never served); "
                "latest reason: %s",
                self._describe(),
                self._failed_since_warning,
                self._client.last_error,
            )
            self._warned_at, self._failed_since_warning = now, 0

    def get_finished_jobs(self) -> Iterable[JobResult]:
        self._collect(self._client.poll())
        # Drained every step, events or not (the data path keeps them until asked).
        evicted = [OffloadKey(k) for k in self._client.take_evicted()]
        if evicted and self._events is not None:
            writing = (
                (rust_job, job.keys)
                for rust_job, (job, _) in self._jobs.items()
                if not job.is_promotion
            )
            self._announce(self._announced.evicted(evicted, writing), removed=True)
        done, self._pending = self._pending, []
        return done

    def drain_jobs(self) -> None:
        for _ in range(_DRAIN_ROUNDS):
            if not self._jobs:
                return
            self._collect(self._client.drain(self._drain_timeout()))
        if self._jobs:
            logger.error(
                "%s: %d job(s) did not end in %d drains of %.0f s; reported failed",
                self._describe(),
                len(self._jobs),
                _DRAIN_ROUNDS,
                self._drain_timeout(),
            )
            for rust_job, (job, _) in self._jobs.items():
                self._announced.take_gone(rust_job)
                self._pending.append(JobResult(job_id=job.job_id, success=False))
            self._jobs.clear()

    def _drain_timeout(self) -> float:
        return self.config.drain_timeout_s

    def _describe(self) -> str:
        """The tier in log lines."""
        return f"{type(self).__name__} {self.config.where}"

    def _collect(self, completions: list[tuple[int, bytes]]) -> None:
        now = time.monotonic()
        self._warn_failures(completions, now)
        for rust_job, statuses in completions:
            entry = self._jobs.pop(rust_job, None)
            if entry is None:
                continue
            job, started = entry
            keys = list(job.keys)
            if job.is_promotion:
                self._pending.append(self._load_result(job, keys, statuses, now - started))
            else:
                gone = self._announced.take_gone(rust_job)
                self._pending.append(self._store_result(job, keys, statuses, now - started, gone))

    def _load_result(
        self, job: TransferJob, keys: list[OffloadKey], statuses: bytes, took: float
    ) -> JobResult:
        loaded = [k for k, s in zip(keys, statuses, strict=True) if s == OK]
        if self._announced.tracked:
            self._event(loaded, removed=False)  # found here: an earlier engine's, or withdrawn
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
        self._missed(failed)
        self._event(failed, removed=True)
        return JobResult(
            job.job_id,
            False,
            successful_keys=loaded,
            transfer_time=took,
            transfer_bytes=len(loaded) * self.block_size_bytes,
        )

    def _missed(self, keys: list[OffloadKey]) -> None:
        """`keys` did not load: look them up as misses from now on."""
        raise NotImplementedError

    def _store_result(
        self,
        job: TransferJob,
        keys: list[OffloadKey],
        statuses: bytes,
        took: float,
        gone: set[OffloadKey],
    ) -> JobResult:
        """`gone`: its keys this tier evicted before the job was collected."""
        stored = sum(s in (OK, EXISTS) for s in statuses)
        success = stored == len(keys)
        if success:
            self._event([k for k in keys if k not in gone] if gone else keys, removed=False)
        return JobResult(
            job.job_id, success, transfer_time=took, transfer_bytes=stored * self.block_size_bytes
        )

    def _event(self, keys: list[OffloadKey], *, removed: bool) -> None:
        """Each chunk announced and withdrawn as `Announced` says."""
        if self._events is None or not keys:
            return
        announced = self._announced
        self._announce(announced.removed(keys) if removed else announced.stored(keys), removed)

    def _announce(self, keys: list[OffloadKey], removed: bool) -> None:
        if self._events is None or not keys:
            return
        self._events.append(
            OffloadingEvent(
                keys=keys,
                medium=self.medium,
                removed=removed,
                locality=self.locality,
                ownership=self.ownership,
                # vLLM's tracker keeps a chunk's tokens until its removal only where one comes.
                removal_expected=self._announced.tracked,
            )
        )

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events is None:
            return ()
        # An open breaker withdraws what the tier announced; they come back as they are stored
        # or found again.
        self._announce(self._announced.breaker(self._client.state == "down"), removed=True)
        events, self._events = self._events, []
        return events

    # --- per request -----------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        pass


def metric_definitions(
    prefix: str,
    counters: Mapping[str, str],
    gauges: Mapping[str, str],
    labels: tuple[str, ...] = (TIER_LABEL,),
) -> dict[str, OffloadingMetricMetadata]:
    """vLLM's definitions of `counters` and `gauges` (name -> help text) under `prefix`."""
    metrics: dict[str, OffloadingMetricMetadata] = {
        prefix + name: OffloadingCounterMetadata(documentation=doc, labelnames=labels)
        for name, doc in counters.items()
    }
    for name, doc in gauges.items():
        metrics[prefix + name] = OffloadingGaugeMetadata(documentation=doc, labelnames=labels)
    return metrics


def add_report(
    stats: OffloadingConnectorStats,
    prefix: str,
    report: Mapping[str, int],
    gauges: Mapping[str, str],
    labels: tuple[str, ...],
) -> None:
    """One place's report (counter increments and gauges) into `stats`, under `prefix`."""
    for name, value in report.items():
        if name in gauges:
            stats.set_gauge(prefix + name, value, labels)
        elif value:
            stats.increase_counter(prefix + name, value, labels)


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
