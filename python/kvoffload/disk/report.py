"""`DiskReport`: what each disk tier's data path did since the last report, for metrics (the
counters every seam exports, and their gauges)."""

from __future__ import annotations

from kvoffload.disk.client import DiskClient

DISK_COUNTERS: dict[str, str] = {
    "corrupt": "Files that failed the length, header or CRC32C check (each removed, never served).",
    "stores_full": "Chunks not written because the filesystem was full.",
    "store_failures": "Chunks not written for any reason (a full filesystem among them).",
    "stores_dropped": "Chunks not written because max_store_bytes_in_flight was reached.",
    "load_missing": "Chunks a load found absent (evicted, or removed by another engine).",
    "evicted": "Chunks evicted to hold capacity_bytes.",
    "denied": "Chunks failed at once, with no I/O, while the breaker was open (a failing disk).",
}
"""The monotonic counters of `DiskClient.stats` that are exported, with their help texts."""
DISK_GAUGES: dict[str, str] = {
    "chunks": "Chunks the tier holds (its index; through KVOffloadConnector, the largest of the "
    "workers' shards).",
    "breaker_state": "The breaker: 0 up, 1 down (a failing disk), 2 half-open (a probe).",
}
"""The gauges of `DiskClient.stats` that are exported: reports of several sources (workers)
are merged by taking the largest."""


class DiskReport:
    """Per tier (its `path`), the increments of `clients`' counters since the last `take`, and
    their gauges now."""

    def __init__(self, *clients: DiskClient) -> None:
        self._clients = clients
        self._seen = [dict.fromkeys(DISK_COUNTERS, 0) for _ in clients]

    def take(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for client, seen in zip(self._clients, self._seen, strict=True):
            now = client.stats()
            report = out.setdefault(client.config.path, dict.fromkeys(DISK_COUNTERS, 0))
            for name in DISK_COUNTERS:
                report[name] += now[name] - seen[name]
                seen[name] = now[name]
            for name in DISK_GAUGES:
                report[name] = max(report.get(name, 0), now[name])
        return out
