"""The connector's counters as vLLM `KVConnectorStats` (logged by vLLM's stat loggers) and as
Prometheus counters (`vllm:kvoffload_*`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvoffload.scheduler import SchedulerStats
from kvoffload.tiers import Report, TierKind, registry, worst

# Prometheus name suffix and help text for each counter that is exported.
_COUNTERS: dict[str, str] = {
    "lookups": "Prefix lookups that reached the CPU tier",
    "hit_tokens": "Tokens loaded from the CPU tier instead of recomputed",
    "chunks_loaded": "Chunks copied CPU -> GPU",
    "bytes_loaded": "Bytes copied CPU -> GPU (all workers)",
    "load_failures": "Load jobs that failed (their tokens recomputed, or the request failed: "
    "kv_load_failure_policy)",
    "chunks_stored": "Chunks copied GPU -> CPU",
    "bytes_stored": "Bytes copied GPU -> CPU (all workers)",
    "store_failures": "Store jobs that failed (their chunks were dropped)",
    "store_refusals": "Store offers the full CPU tier could not take (retried next step)",
    "secondary_lookups": "Lookups that went on past the CPU tier to a secondary tier (one per tier "
    "asked)",
    "secondary_chunks_promoted": "Chunks promoted from a secondary tier into the CPU tier",
    "secondary_chunks_failed": "Promoted chunks not filled (absent, corrupt, server down): "
    "recomputed",
    "secondary_promotion_refusals": "Secondary-tier hits not promoted: no CPU-tier slot could take "
    "them",
    "secondary_shards_written": "Chunk shards (one per worker, or per pipeline stage on MLA) "
    "written on to the secondary tiers (once per tier)",
    "secondary_writes_dropped": "Chunk shards not written on (backpressure, server down, failure)",
    "ignored_params": "Invalid per-request kv_transfer_params values that were ignored",
    "trace_lines_dropped": "Finished requests record_trace did not write (its buffer was full or "
    "its file could not be written)",
}
RENAMED: dict[str, str] = {
    "remote_lookups": "secondary_lookups",
    "remote_chunks_promoted": "secondary_chunks_promoted",
    "remote_chunks_failed": "secondary_chunks_failed",
    "remote_promotion_refusals": "secondary_promotion_refusals",
    "remote_shards_written": "secondary_shards_written",
    "remote_writes_dropped": "secondary_writes_dropped",
}
"""Counters renamed for vLLM's word (a secondary tier, not "remote": a disk is one too), old ->
new: the old names are exported as well, with the same values, until the next release."""


# Gauges: the latest value counts, not a sum over the interval.
GAUGES: dict[str, str] = {
    "cpu_tier_usable_bytes": "CPU-tier bytes usable now (all workers; grows while the pool is "
    "pinned in the background)",
    "cpu_tier_ready_ratio": "Share of the CPU tier whose memory is ready (1 once fully pinned)",
}


def _reports() -> dict[str, Report]:
    """Each kind's per-place report (a Redis tier's nodes, a disk's directory) by its key in the
    stats: `where -> {counter: increment, gauge: value}`, counters summed over the workers,
    gauges their worse value."""
    return {k.report.key: k.report for k in registry.kinds() if k.report is not None}


def add_reports(
    data: dict[str, Any], reports: Iterable[tuple[TierKind, dict[str, dict[str, int]]]]
) -> None:
    """Merges each tier's per-place report (`where -> {name: value}`) into `data`, under its
    kind's key."""
    for kind, places in reports:
        if places and kind.report is not None:
            key = kind.report.key
            data[key] = _merge(data.get(key, {}), places, frozenset(kind.report.gauges))


def stats_delta(now: SchedulerStats, before: SchedulerStats) -> dict[str, int]:
    """Counter increments from `before` to `now`; `ignored_params` summed over its keys."""
    # The instances' own dicts: read every step, where a getattr per field showed.
    earlier = vars(before)
    out = {name: a - earlier[name] for name, a in vars(now).items() if type(a) is int}
    out["ignored_params"] = sum(now.ignored_params.values()) - sum(before.ignored_params.values())
    return out


@dataclass
class KVOffloadStats(KVConnectorStats):
    """`data` maps a `SchedulerStats` counter name to its increment over the interval, and a
    gauge (`GAUGES`) to its latest value."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVOffloadStats:
        reports = _reports()
        for key, value in other.data.items():
            if key in reports:
                gauges = frozenset(reports[key].gauges)
                self.data[key] = _merge(self.data.get(key, {}), value, gauges)
            else:
                self.data[key] = value if key in GAUGES else self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        # The per-tier reports are for Prometheus; the log line keeps the engine's totals.
        reports = _reports()
        return {k: v for k, v in self.data.items() if k not in reports}

    def is_empty(self) -> bool:
        return not any(self.data.values())


def _merge(
    mine: dict[str, dict[str, int]], other: dict[str, dict[str, int]], gauges: frozenset[str]
) -> dict[str, dict[str, int]]:
    """Two per-tier reports (`where -> {name: value}`) as one: the `gauges` by the worse value
    (`kvoffload.tiers.worst`), the counters summed."""
    out = {where: dict(v) for where, v in mine.items()}
    for where, v in other.items():
        into = out.setdefault(where, dict.fromkeys(v, 0))
        for name, n in v.items():
            into[name] = worst(name, into[name], n) if name in gauges else into[name] + n
    return out


class KVOffloadPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, list[dict[int, Any]]] = {}
        for name, doc in _COUNTERS.items():
            self._counters[name] = [self._per_engine(name, doc, labelnames, per_engine_labelvalues)]
        for old, new in RENAMED.items():
            doc = f"Deprecated: vllm:kvoffload_{new} (goes in the next release)"
            alias = self._per_engine(old, doc, labelnames, per_engine_labelvalues)
            self._counters[new].append(alias)
        self._reports = _reports()
        self._per_place_metrics = {
            key: self._per_place(report, labelnames) for key, report in self._reports.items()
        }
        self._labelvalues = per_engine_labelvalues
        self._gauges: dict[str, dict[int, Any]] = {}
        for name, doc in GAUGES.items():
            gauge = self._gauge_cls(
                name=f"vllm:kvoffload_{name}", documentation=doc, labelnames=labelnames
            )
            self._gauges[name] = {
                engine: gauge.labels(*values) for engine, values in per_engine_labelvalues.items()
            }

    def _per_engine(
        self,
        name: str,
        doc: str,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> dict[int, Any]:
        metric = self._counter_cls(
            name=f"vllm:kvoffload_{name}", documentation=doc, labelnames=labelnames
        )
        return {engine: metric.labels(*values) for engine, values in per_engine_labelvalues.items()}

    def _per_place(self, report: Report, labelnames: list[str]) -> dict[str, list[Any]]:
        """A kind's per-place metrics (under their deprecated names too), each with one more
        label: the place."""
        labels = [*labelnames, report.label]
        out: dict[str, list[Any]] = {}
        for prefix in (report.metric, *report.renamed_from):
            for cls, table in (
                (self._counter_cls, report.counters),
                (self._gauge_cls, report.gauges),
            ):
                for name, doc in table.items():
                    if prefix != report.metric:
                        doc = f"Deprecated: vllm:{report.metric}{name} (goes in the next release)"
                    metric = cls(name=f"vllm:{prefix}{name}", documentation=doc, labelnames=labels)
                    out.setdefault(name, []).append(metric)
        return out

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, metrics in self._per_place_metrics.items():
            gauges = self._reports[key].gauges
            for where, values in transfer_stats_data.get(key, {}).items():
                labels = [*self._labelvalues[engine_idx], where]
                for name, value in values.items():
                    for metric in metrics[name]:
                        # Bound even at 0: the series shows from the first report.
                        child = metric.labels(*labels)
                        if name in gauges:
                            child.set(value)
                        elif value:
                            child.inc(value)
        for name, value in transfer_stats_data.items():
            gauge = self._gauges.get(name)
            if gauge is not None:
                gauge[engine_idx].set(value)
                continue
            if value:
                for per_engine in self._counters.get(name, ()):
                    per_engine[engine_idx].inc(value)
