"""Fixtures shared by every test folder."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from redis_server import RedisServer, redis_server


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    """A fresh `redis-server` of its own for each test (loopback, free port, no persistence)."""
    with redis_server() as server:
        yield server
