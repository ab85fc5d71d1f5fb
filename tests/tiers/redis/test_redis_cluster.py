"""`RedisClient` against a local Redis Cluster (3 primaries, 3 replicas of Debian's
`redis-server`): chunks spread over the primaries and come back byte for byte; the `cluster` key
and the cluster's own rules are checked at start-up."""

from __future__ import annotations

import numpy as np
import pytest
from test_redis_client import CHUNK, IDENTITY, client, finish, keys, pool

from kvoffload import ConfigError
from kvoffload.tiers import EXISTS, MISSING, OK
from kvoffload.tiers.redis import RedisTierConfig


def test_chunks_spread_over_the_primaries_byte_for_byte(cluster):
    c = client(cluster.url)  # cluster: "auto", one seed
    src = pool(48, 1)
    ks = keys(48)
    offsets = [i * CHUNK for i in range(48)]
    assert finish(c, c.store(ks, src, offsets)) == bytes([OK]) * 48
    per_primary = [len(n.keys()) for n in cluster.primaries()]
    assert sum(per_primary) == 96 and min(per_primary) > 0, per_primary  # body + header each
    assert finish(c, c.lookup(ks + keys(2, salt=9))) == bytes([OK]) * 48 + bytes([MISSING]) * 2
    dst = np.zeros_like(src)
    assert finish(c, c.load(ks, dst, offsets)) == bytes([OK]) * 48
    assert np.array_equal(dst, src)
    assert finish(c, c.store(ks, src, offsets)) == bytes([EXISTS]) * 48
    c.close()


@pytest.mark.parametrize(
    "options,match",
    [
        ({"url_tail": "/3"}, "database 3"),
        ({"cluster": False, "second_seed": True}, "cluster=false"),
    ],
)
def test_settings_a_cluster_cannot_take_stop_start_up(cluster, options, match):
    url = cluster.url + options.get("url_tail", "")
    if options.get("second_seed"):
        url += f",127.0.0.1:{cluster.nodes[1].port}"
    extra = {"cluster": options["cluster"]} if "cluster" in options else {}
    with pytest.raises(ConfigError, match=match):
        client(url, **extra)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_the_cluster_key_takes_auto_true_or_false(value):
    with pytest.raises(ConfigError, match=r'cluster=.*expected "auto"'):
        RedisTierConfig.from_dict(
            {"url": "redis://h:1", "namespace": IDENTITY.namespace, "cluster": value}
        )
