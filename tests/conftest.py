"""Fixtures shared by every test folder."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from redis_server import RedisCluster, RedisServer, redis_cluster, redis_server


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    """A fresh `redis-server` of its own for each test (loopback, free port, no persistence)."""
    with redis_server() as server:
        yield server


@pytest.fixture
def redis_tls() -> Iterator[RedisServer]:
    """A fresh `redis-server` with a TLS port (server certificate for 127.0.0.1 and localhost,
    signed by `ca.crt`; no client certificate required) beside its plain one."""
    with redis_server(tls=True) as server:
        yield server


@pytest.fixture
def cluster() -> Iterator[RedisCluster]:
    """A local Redis Cluster of its own (3 primaries, 3 replicas) for each test."""
    with redis_cluster() as c:
        yield c
