"""`NodeReport`: what each node of the Redis tier (a cluster's primaries, or the one server) did
since the last report, for per-node metrics."""

from __future__ import annotations

from kvoffload.tiers.redis.client import RedisClient

NODE_COUNTERS: dict[str, str] = {
    "bytes_written": "Bytes this node of the Redis tier stored (chunks new to it)",
    "bytes_read": "Bytes loaded from this node of the Redis tier",
    "failures": "Failures on this node: jobs, or their part here, whose connection failed "
    "(connect, I/O, timeout, protocol error), and error replies (OOM, READONLY, CLUSTERDOWN, ...)",
}
"""The monotonic per-node counters of `RedisClient.node_stats`, with their help texts."""
NODE_GAUGES: dict[str, str] = {
    "resting": "1 while this node of the Redis tier is left alone after a failure (for "
    "breaker_cooldown_s; the one server: while the breaker is open), else 0",
}


class NodeReport:
    """Per-node increments of `clients`' counters since the last `take` (summed over them), and
    `resting` (1 if any of them leaves the node alone now)."""

    def __init__(self, *clients: RedisClient) -> None:
        self._clients = clients
        self._seen: dict[str, dict[str, int]] = {}

    def take(self) -> dict[str, dict[str, int]]:
        """`node -> {counter: increment, ..., "resting": 0 or 1}` for each node whose counters
        moved, whose `resting` changed, or that rests: reports of several sources (the workers)
        are merged by taking the largest `resting`, so a node resting for one of them is
        reported resting by it in every report until it is not."""
        names = (*NODE_COUNTERS, *NODE_GAUGES)
        now: dict[str, dict[str, int]] = {}
        for client in self._clients:
            for node, stats in client.node_stats().items():
                total = now.setdefault(node, dict.fromkeys(names, 0))
                for name in NODE_COUNTERS:
                    total[name] += stats[name]
                total["resting"] = max(total["resting"], stats["resting"])
        out: dict[str, dict[str, int]] = {}
        for node, total in now.items():
            before = self._seen.get(node) or dict.fromkeys(names, 0)
            delta = {name: total[name] - before[name] for name in NODE_COUNTERS}
            if any(delta.values()) or total["resting"] or before["resting"]:
                out[node] = {**delta, "resting": total["resting"]}
        self._seen = now
        return out
