"""`DiskReport`: what each disk tier's data path did since the last report, for metrics (the
counters every seam exports, and their gauges)."""

from __future__ import annotations

from kvoffload.tiers.disk.client import DiskClient
from kvoffload.tiers.kind import worst

DISK_COUNTERS: dict[str, str] = {
    "corrupt": "Files that failed the length, header or CRC32C check (each removed, never served).",
    "stores_full": "Chunks not written because the filesystem was full (the one that found it "
    "full, and those dropped without I/O until it had room).",
    "stores_read_only": "Chunks not written because the directory refuses writes (read-only, no "
    "permission, or read_only: true).",
    "store_failures": "Chunks whose write was tried and failed (a full or read-only filesystem "
    "among them).",
    "stores_dropped": "Chunks not written because max_store_bytes_in_flight was reached.",
    "load_missing": "Chunks a load found absent (evicted, or removed by another engine).",
    "evicted": "Chunks evicted to hold capacity_bytes.",
    "denied": "Chunks failed at once, with no I/O, while the breaker was open (a failing disk).",
    "symlinks": "Symlinks met in the tier's directory: never followed, read, written or removed "
    "through (the chunk is a miss).",
}
"""The monotonic counters of `DiskClient.stats` that are exported, with their help texts."""
DISK_GAUGES: dict[str, str] = {
    "chunks": "Chunks the tier holds (its index; through KVOffloadConnector, the largest of the "
    "workers' shards).",
    "breaker_state": "The breaker: 0 up, 1 down (a failing disk), 2 half-open (a probe).",
}
"""The gauges of `DiskClient.stats` that are exported: reports of several sources (workers)
are merged by taking the worst (`kvoffload.tiers.kind.worst`)."""


class DiskReport:
    """Per tier (its `path`), the increments of `clients`' counters since the last `take`, and
    their gauges now; only tiers where something moved (a step with nothing to say sends
    nothing)."""

    def __init__(self, *clients: DiskClient) -> None:
        self._clients = clients
        self._seen: list[dict[str, int]] = [{} for _ in clients]

    def take(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for client, seen in zip(self._clients, self._seen, strict=True):
            now = client.stats()
            moved = {n: now[n] - seen.get(n, 0) for n in DISK_COUNTERS}
            if not any(moved.values()) and all(seen.get(n) == now[n] for n in DISK_GAUGES):
                continue
            seen.update({n: now[n] for n in (*DISK_COUNTERS, *DISK_GAUGES)})
            report = out.get(client.config.path)
            if report is None:
                out[client.config.path] = {**moved, **{n: now[n] for n in DISK_GAUGES}}
                continue
            for name, n in moved.items():
                report[name] += n
            for name in DISK_GAUGES:
                report[name] = worst(name, report[name], now[name])
        return out
