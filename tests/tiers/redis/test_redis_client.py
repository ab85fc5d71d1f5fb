"""`RedisClient` against a real `redis-server`: many chunks byte for byte, straight from and
into one buffer; namespaces kept apart field by field; bad input refused before any I/O."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from kvoffload import ConfigError
from kvoffload.tiers import CORRUPT, DROPPED, EXISTS, FAILED, MISSING, OK, TierIdentity
from kvoffload.tiers.redis import RedisClient, RedisTierConfig
from redis_server import free_port

CHUNK = 64 * 1024
IDENTITY = TierIdentity(
    namespace="llama-3.1-8b@rev1",
    model="meta-llama/Llama-3.1-8B",
    kv_dtype="bfloat16",
    tokens_per_block=16,
    blocks_per_chunk=4,
    layers=("l0", "l1"),
    tp_size=1,
    pp_size=1,
    rank=0,
    bytes_per_chunk=CHUNK,
    layout="test",
)


def client(url: str, identity: TierIdentity = IDENTITY, **options: object) -> RedisClient:
    config = RedisTierConfig.from_dict({"url": url, "namespace": identity.namespace, **options})
    return RedisClient(config, identity.digest(), CHUNK)


def finish(c: RedisClient, job: int, timeout: float = 10.0) -> bytes:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for done, statuses in c.wait(0.5):
            if done == job:
                return statuses
    raise AssertionError(f"job {job} did not finish in {timeout} s")


def keys(n: int, salt: int = 0) -> list[bytes]:
    return [bytes([salt]) * 28 + i.to_bytes(4, "big") for i in range(n)]


def pool(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, CHUNK), dtype=np.uint8)


def test_many_chunks_round_trip_byte_for_byte(redis):
    c = client(redis.url)
    src = pool(64, 1)
    ks = keys(64)
    assert finish(c, c.store(ks, src, [i * CHUNK for i in range(64)])) == bytes([OK]) * 64
    assert finish(c, c.lookup(ks + keys(2, salt=9))) == bytes([OK]) * 64 + bytes([MISSING]) * 2
    dst = np.zeros_like(src)
    # Loaded into other slots, in reverse order: offsets are honoured per chunk.
    statuses = finish(c, c.load(ks, dst, [(63 - i) * CHUNK for i in range(64)]))
    assert statuses == bytes([OK]) * 64
    assert np.array_equal(dst[::-1], src)
    stats = c.stats()
    assert stats["bytes_written"] >= 64 * CHUNK and stats["bytes_read"] >= 64 * CHUNK
    c.close()


def test_second_writer_of_a_key_finds_it_stored(redis):
    a, b = client(redis.url), client(redis.url)
    first, second = pool(1, 2), pool(1, 3)
    ja = a.store(keys(1), first, [0])
    jb = b.store(keys(1), second, [0])
    results = sorted([finish(a, ja), finish(b, jb)])
    assert results == [bytes([OK]), bytes([EXISTS])]
    dst = np.zeros_like(first)
    assert finish(a, a.load(keys(1), dst, [0])) == bytes([OK])
    assert np.array_equal(dst, first) or np.array_equal(dst, second)  # one writer's, whole


@pytest.mark.parametrize(
    "field,value",
    [
        ("namespace", "llama-3.1-8b@rev2"),
        ("model", "meta-llama/Llama-3.1-70B"),
        ("kv_dtype", "fp8_e4m3"),
        ("tokens_per_block", 32),
        ("blocks_per_chunk", 2),
        ("layers", ("l0",)),
        ("tp_size", 2),
        ("pp_size", 2),
        ("rank", 1),
        ("bytes_per_chunk", CHUNK // 2),
        ("layout", "other"),
    ],
)
def test_every_identity_field_separates_namespaces(redis, field, value):
    writer = client(redis.url)
    finish(writer, writer.store(keys(4), pool(4, 4), [i * CHUNK for i in range(4)]))
    other = dataclasses.replace(IDENTITY, **{field: value})
    assert other.digest() != IDENTITY.digest()
    reader = client(redis.url, other)
    assert finish(reader, reader.lookup(keys(4))) == bytes([MISSING]) * 4
    assert finish(reader, reader.load(keys(4), pool(4, 5), [i * CHUNK for i in range(4)])) == (
        bytes([MISSING]) * 4
    )


def test_a_chunk_counts_only_when_every_ranks_shard_is_there(redis):
    ranks = [dataclasses.replace(IDENTITY, tp_size=3, rank=r) for r in range(3)]
    digests = [r.digest() for r in ranks]
    ks = keys(4, salt=3)
    for r, identity in enumerate(ranks):
        writer = client(redis.url, identity)
        # Rank 2 lacks chunk 1's shard, rank 1 chunk 3's.
        mine = [k for i, k in enumerate(ks) if (r, i) not in ((2, 1), (1, 3))]
        job = writer.store(mine, pool(len(mine), r), [i * CHUNK for i in range(len(mine))])
        assert finish(writer, job) == bytes([OK]) * len(mine)
    config = RedisTierConfig.from_dict({"url": redis.url, "namespace": IDENTITY.namespace})
    every_rank = RedisClient(config, digests[0], CHUNK, lookup_digests=digests)
    assert finish(every_rank, every_rank.lookup(ks)) == bytes([OK, MISSING, OK, MISSING])
    rank_0 = client(redis.url, ranks[0])
    assert finish(rank_0, rank_0.lookup(ks)) == bytes([OK]) * 4
    with pytest.raises(ConfigError, match="a lookup namespace has 3 bytes"):
        RedisClient(config, digests[0], CHUNK, lookup_digests=[b"abc"])


def test_a_flipped_byte_is_corrupt_and_deleted(redis):
    c = client(redis.url)
    src = pool(2, 6)
    finish(c, c.store(keys(2), src, [0, CHUNK]))
    (h0, *_) = [k for k in redis.keys() if k.endswith(b":h")]
    redis.command(
        "SETRANGE",
        h0,
        64 + 5,
        b"\x00" if redis.command("GETRANGE", h0, 69, 69) != b"\x00" else b"\x01",
    )
    dst = np.zeros_like(src)
    statuses = finish(c, c.load(keys(2), dst, [0, CHUNK]))
    assert sorted(statuses) == [OK, CORRUPT]
    assert c.stats()["corrupt"] == 1
    assert h0 not in redis.keys()


def test_absent_server_starts_down_and_fails_fast(redis):
    url = f"redis://127.0.0.1:{free_port()}/0"
    c = client(url, connect_timeout_s=0.1)
    assert c.startup_error is not None and c.state == "down"
    assert finish(c, c.lookup(keys(3))) == bytes([MISSING]) * 3
    assert finish(c, c.store(keys(1), pool(1, 7), [0])) == bytes([DROPPED])
    assert finish(c, c.load(keys(1), pool(1, 7), [0])) == bytes([FAILED])


def test_stores_beyond_the_in_flight_budget_are_dropped(redis):
    c = client(redis.url, max_store_bytes_in_flight=CHUNK, connections=1)
    buf = pool(2, 9)
    redis.freeze()
    try:
        first = c.store(keys(1), buf, [0])
        assert finish(c, c.store(keys(1, salt=1), buf, [CHUNK])) == bytes([DROPPED])
    finally:
        redis.thaw()
    assert finish(c, first) == bytes([OK])
    assert c.stats()["stores_dropped"] == 1


def test_bad_arguments_are_refused_before_any_io(redis):
    c = client(redis.url)
    buf = pool(2, 8)
    with pytest.raises(ValueError, match="offset"):
        c.store(keys(1), buf, [CHUNK + 1])  # runs past the end of the buffer
    with pytest.raises(ValueError):
        c.store(keys(2), buf, [0])  # one offset for two keys
    with pytest.raises(ValueError, match="writable"):
        c.load(keys(1), bytes(2 * CHUNK), [0])
    assert c.in_flight() == 0 and redis.keys() == []


@pytest.mark.parametrize(
    "entry,match",
    [
        ({"url": "redis://127.0.0.1:6379/0"}, "namespace="),
        ({"url": "", "namespace": "n"}, "url="),
        ({"url": "redis://127.0.0.1:6379/0", "namespace": "n", "connections": 65}, "connections"),
        (
            {"url": "redis://127.0.0.1:6379/0", "namespace": "n", "job_timeout_s": True},
            "job_timeout_s",
        ),
        ({"url": "redis://127.0.0.1:6379/0", "namespace": "n", "bogus": 1}, "bogus"),
    ],
)
def test_config_errors_name_the_key(entry, match):
    with pytest.raises(ConfigError, match=match):
        RedisTierConfig.from_dict(entry)


@pytest.mark.parametrize(
    "url,match",
    [
        ("tcp://x:1", "unknown scheme"),
        ("redis+tls://x:1", "unknown scheme"),
        ("redis://x:99999", "port"),
        ("redis://:secret@x:1/abc", "database"),
    ],
)
def test_bad_urls_stop_start_up_with_the_grammar(url, match):
    config = RedisTierConfig.from_dict({"url": url, "namespace": "n"})
    with pytest.raises(ConfigError, match=match) as err:
        RedisClient(config, IDENTITY.digest(), CHUNK)
    assert "secret" not in str(err.value)


@pytest.mark.parametrize(
    "url", ["redis://u:secret@h:1/0", "redis://u:p@secret@h:1/0", "unix:///s.sock?password=secret"]
)
def test_password_is_masked_in_messages(url):
    config = RedisTierConfig.from_dict({"url": url, "namespace": "n"})
    assert "secret" not in config.masked_url and "***" in config.masked_url
    assert "secret" not in repr(config) and config.masked_url in repr(config)


def test_an_acl_user_in_the_url_with_its_password_in_a_file_is_taken_without_a_warning(caplog):
    config = RedisTierConfig.from_dict(
        {"url": "rediss://kvoffload@h:6380", "namespace": "n", "password_file": "/run/pw"}
    )
    assert config.masked_url == "rediss://kvoffload@h:6380" and not caplog.records


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ({"password_file": "/run/pw", "password_env": "PW"}, "are both set; allowed: one of them"),
        ({"url": "redis://:secret@h:1", "password_file": "/run/pw"}, "the password in one place"),
        ({"password_file": ""}, "password_file=''"),
        ({"password_env": 5}, "password_env=5"),
    ],
)
def test_a_password_given_twice_or_badly_is_refused_naming_the_key(entry, match):
    with pytest.raises(ConfigError, match=match) as err:
        RedisTierConfig.from_dict({"url": "redis://h:1", "namespace": "n", **entry})
    assert "secret" not in str(err.value)
