"""Fixtures shared by every test folder."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from redis_server import RedisCluster, RedisServer, redis_cluster, redis_server


@pytest.fixture(scope="module")
def _module_redis() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


@pytest.fixture
def redis(_module_redis: RedisServer) -> RedisServer:
    """An empty `redis-server` (loopback, free port, no persistence), one per test module:
    flushed before each test, and restarted or thawed if the test before stopped or froze it.
    A test that needs other options starts its own (`redis_server(...)`)."""
    return _module_redis.empty()


@pytest.fixture(scope="module")
def _module_redis_tls() -> Iterator[RedisServer]:
    with redis_server(tls=True) as server:
        yield server


@pytest.fixture
def redis_tls(_module_redis_tls: RedisServer) -> RedisServer:
    """`redis` with a TLS port (server certificate for 127.0.0.1 and localhost, signed by
    `ca.crt`; no client certificate required) beside its plain one."""
    return _module_redis_tls.empty()


@pytest.fixture
def cluster() -> Iterator[RedisCluster]:
    """A local Redis Cluster of its own (3 primaries, 3 replicas) for each test."""
    with redis_cluster() as c:
        yield c
