"""The Redis kind: what the seams open on a `RedisTier` entry."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from kvoffload.tiers.kind import Report
from kvoffload.tiers.redis.canary import SeedCanary
from kvoffload.tiers.redis.client import RedisClient
from kvoffload.tiers.redis.config import RedisTierConfig
from kvoffload.tiers.redis.lookups import RedisLookups
from kvoffload.tiers.redis.nodes import NODE_COUNTERS, NODE_GAUGES, NodeReport

logger = logging.getLogger(__name__)


class SchedulerRedisLookups(RedisLookups):
    """The scheduler's lookups on a connection of their own, with the hash-seed canary."""

    def __init__(self, client: RedisClient) -> None:
        super().__init__(client)
        self._canary = SeedCanary(client, logger)
        self._nodes = NodeReport(client)

    def start(self, none_hash: bytes) -> None:
        self._canary.start(none_hash)

    def note_workers_down(self, down: bool) -> None:
        """Nothing to note: the lookup connection has a breaker of its own."""

    def take_report(self) -> dict[str, dict[str, int]]:
        return self._nodes.take()

    def close(self) -> None:
        self._canary.join()
        self._client.close()


class RedisKind:
    name = "RedisTier"
    locality = "REMOTE"
    sees_evictions = False  # the server evicts on its own
    report = Report(
        "redis_nodes",
        "kvoffload_redis_node_",
        "node",
        NODE_COUNTERS,
        NODE_GAUGES,
        renamed_from=("kvoffload_remote_node_",),
    )

    def parse(self, entry: Mapping[str, Any]) -> RedisTierConfig:
        return RedisTierConfig.from_dict(entry)

    def check_shards(
        self, config: RedisTierConfig, num_shards: int, chunk_bytes: int
    ) -> str | None:
        return None

    def open_lookups(
        self, config: RedisTierConfig, digests: Sequence[bytes], chunk_bytes: int, num_shards: int
    ) -> SchedulerRedisLookups:
        # A chunk counts only when every rank's shard is there: one evicted on any rank is a
        # miss here, not a promotion that fails on that rank and is recomputed.
        client = RedisClient(
            config, digests[0], chunk_bytes, connections=1, lookup_digests=list(digests)
        )
        if client.startup_error is not None:
            logger.warning(
                "kvoffload: Redis tier %s is unreachable (%s): the engine serves from the "
                "other tiers and retries in the background",
                config.where,
                client.startup_error,
            )
        return SchedulerRedisLookups(client)

    def open_data_path(
        self, config: RedisTierConfig, digest: bytes, chunk_bytes: int, num_shards: int
    ) -> RedisClient:
        client = RedisClient(config, digest, chunk_bytes)
        if client.startup_error is not None:
            logger.warning(
                "kvoffload: Redis tier %s is unreachable from this worker (%s): it serves from "
                "the other tiers and retries in the background",
                config.where,
                client.startup_error,
            )
        return client

    def reporter(self, paths: Sequence[RedisClient]) -> NodeReport:
        return NodeReport(*paths)


KIND = RedisKind()
