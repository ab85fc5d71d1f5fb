"""`NodeReport`: what each node of the shared tier (a cluster's primaries, or the one server) did
since the last report, for per-node metrics."""

from __future__ import annotations

from kvoffload.remote.client import RemoteClient

NODE_COUNTERS = ("bytes_written", "bytes_read", "failures")
"""Monotonic per-node counters of `RemoteClient.node_stats`; `resting` is the gauge beside them."""


class NodeReport:
    """Per-node increments of `clients`' counters since the last `take` (summed over them), and
    `resting` (1 if any of them leaves the node alone now)."""

    def __init__(self, *clients: RemoteClient) -> None:
        self._clients = clients
        self._seen: dict[str, dict[str, int]] = {}

    def take(self) -> dict[str, dict[str, int]]:
        """`node -> {counter: increment, ..., "resting": 0 or 1}` for each node whose counters
        moved or whose `resting` changed since the last call."""
        now: dict[str, dict[str, int]] = {}
        for client in self._clients:
            for node, stats in client.node_stats().items():
                total = now.setdefault(node, dict.fromkeys((*NODE_COUNTERS, "resting"), 0))
                for name in NODE_COUNTERS:
                    total[name] += stats[name]
                total["resting"] = max(total["resting"], stats["resting"])
        out: dict[str, dict[str, int]] = {}
        for node, total in now.items():
            before = self._seen.get(node)
            if before is None:
                before = dict.fromkeys((*NODE_COUNTERS, "resting"), 0)
            delta = {name: total[name] - before[name] for name in NODE_COUNTERS}
            if any(delta.values()) or total["resting"] != before["resting"]:
                out[node] = {**delta, "resting": total["resting"]}
        self._seen = now
        return out
