"""`RedisLookups` against a real server: None until the step's batch answers, one verdict per
key shared by the requests asking, misses after a failed load, nothing left behind."""

from __future__ import annotations

import time

import numpy as np
from test_redis_client import CHUNK, client, finish, keys

from kvoffload.tiers.redis import RedisLookups


def answered(lookups: RedisLookups, key: bytes, request: str) -> bool:
    """Steps (lookup, flush) until the key's verdict is known."""
    deadline = time.monotonic() + 30
    while (found := lookups.lookup(key, request)) is None:
        assert time.monotonic() < deadline, "the lookup never answered"
        lookups.flush()
        time.sleep(0.001)
    return found


def test_verdicts_arrive_by_batch_and_are_shared(redis):
    writer = client(redis.url)
    ks = keys(3)
    finish(writer, writer.store(ks[:2], np.zeros((2, CHUNK), np.uint8), [0, CHUNK]))
    lookups = RedisLookups(client(redis.url, connections=1))
    assert [lookups.lookup(k, "r1") for k in ks] == [None, None, None]  # queued, not sent
    assert lookups.in_flight() == 0
    lookups.flush()  # the step's three keys in one job
    assert lookups.in_flight() == 1
    assert [answered(lookups, k, "r1") for k in ks] == [True, True, False]
    assert lookups.in_flight() == 0
    # A second request reuses the verdicts: no new job.
    assert [lookups.lookup(k, "r2") for k in ks] == [True, True, False]
    lookups.flush()
    assert lookups.in_flight() == 0


def test_a_failed_load_turns_a_hit_into_a_miss_also_for_later_requests(redis):
    writer = client(redis.url)
    (k,) = keys(1)
    finish(writer, writer.store([k], np.zeros((1, CHUNK), np.uint8), [0]))
    lookups = RedisLookups(client(redis.url, connections=1))
    assert answered(lookups, k, "r1") is True
    lookups.mark_miss([k])
    assert lookups.lookup(k, "r2") is False  # every request asking now sees the miss
    lookups.cleanup("r1")
    lookups.cleanup("r2")
    assert len(lookups) == 0
    # Nobody holds the old verdict, yet a new request sees the miss at once, asking nothing:
    # the negative cache keeps it for 30 s (its expiry is tested in the Rust crate).
    assert lookups.lookup(k, "r3") is False
    lookups.flush()
    assert lookups.in_flight() == 0


def test_a_request_finishing_mid_check_leaves_nothing_behind(redis):
    lookups = RedisLookups(client(redis.url, connections=1))
    ks = keys(4, salt=7)
    for k in ks:
        lookups.lookup(k, "gone")
    lookups.flush()
    lookups.cleanup("gone")  # before the answer lands
    deadline = time.monotonic() + 30
    while lookups.in_flight():
        assert time.monotonic() < deadline
        lookups.flush()
        time.sleep(0.001)
    assert len(lookups) == 0  # nothing left behind
