"""`RedisTier` inside vLLM 0.33's own tiering (`OffloadingConnector` + `TieringOffloadingSpec`),
driven by vLLM's real scheduler on the CPU rig, against a real `redis-server`.

Two engines (each with its own CPU tier) share one server: what engine 1 computed, engine 2 loads
through promotion (Redis -> CPU region -> "GPU"), and the rig checks every loaded position byte for
byte before each forward pass. 12-token chunks, 4-token GPU blocks: a 60-token prompt is 5 full
chunks, all of which vLLM loads (60 tokens) when they are offloaded, from its CPU tier or ours.
"""

from __future__ import annotations

import logging
import time

import pytest
from prom_recorder import Recorder
from rig import Rig, prompt
from tiering_rig import make_tiering_rig, redis_tier, redis_tier_entry

from kvoffload import ConfigError
from redis_server import RedisServer, free_port, redis_server

PROMPT = prompt(7, 60)


def engine(model_dir: str, url: str, is_async: bool = False, **entry_options: object) -> Rig:
    return make_tiering_rig(model_dir, [redis_tier_entry(url, **entry_options)], is_async=is_async)


def settle(rig: Rig) -> None:
    """Lets the cascade (CPU -> Redis) of what the engine stored finish; the engine's manager
    takes the results at its next step."""
    redis_tier(rig).drain_jobs()


def serve(rig: Rig, rid: str, tokens: list[int], max_tokens: int = 2) -> int:
    """Runs one request to completion; returns the tokens vLLM says the connector loaded."""
    rig.add(rid, tokens, max_tokens)
    rig.run(max_steps=20_000)
    return rig.external_hits.get(rid, 0)


def until_probing(rig: Rig) -> None:
    """Waits out the breaker's cool-down (the next job then probes the server)."""
    deadline = time.monotonic() + 30
    while redis_tier(rig).state == "down":
        assert time.monotonic() < deadline, "the breaker never left 'down'"
        time.sleep(0.05)


def record(tier: object, method: str) -> list:
    """Wraps `tier.method` to keep what each call returned."""
    calls: list = []
    inner = getattr(tier, method)

    def wrapper(*args: object) -> object:
        out = inner(*args)
        out = list(out) if method == "take_events" else out
        calls.append(out)
        return out

    setattr(tier, method, wrapper)
    return calls


def chunk_keys(server: RedisServer) -> list[bytes]:
    return [k for k in server.keys() if k.endswith(b":h") and b"canary" not in k]


def test_engine_two_loads_what_engine_one_computed(model_dir, redis, is_async):
    one = engine(model_dir, redis.url, is_async)
    assert serve(one, "a", PROMPT) == 0
    settle(one)
    assert len(chunk_keys(redis)) == 5  # every full prompt chunk reached the shared tier

    two = engine(model_dir, redis.url, is_async)
    assert serve(two, "b", PROMPT) == 60
    assert two.checked_positions["b"] >= 60  # the loaded positions were checked byte for byte
    assert redis_tier(two).stats()["corrupt"] == 0
    # The same hit as engine 1's own CPU tier gives it for the same prompt.
    one.reset_gpu_prefix_cache()
    assert serve(one, "a2", PROMPT) == 60


def test_engines_share_a_tls_server(model_dir, redis_tls, is_async):
    ca = {"tls_ca_file": redis_tls.cert("ca.crt")}
    one = engine(model_dir, redis_tls.tls_url, is_async, **ca)
    assert serve(one, "a", PROMPT) == 0
    settle(one)
    assert len(chunk_keys(redis_tls)) == 5  # over TLS, read back here on the plain port
    two = engine(model_dir, redis_tls.tls_url, is_async, **ca)
    assert serve(two, "b", PROMPT) == 60
    assert two.checked_positions["b"] >= 60
    assert redis_tier(two).stats()["loaded_chunks"] == 5


def test_engines_share_a_cluster(model_dir, cluster, is_async):
    one = engine(model_dir, cluster.url, is_async)
    assert serve(one, "a", PROMPT) == 0
    settle(one)
    assert len(chunk_keys(cluster)) == 5
    # (That keys spread over the primaries is checked with 48 chunks in test_cluster.py: 5
    # land on one primary alone about once in 80 runs.)
    two = engine(model_dir, cluster.url, is_async)
    assert serve(two, "b", PROMPT) == 60
    assert two.checked_positions["b"] >= 60
    assert redis_tier(two).stats()["loaded_chunks"] == 5


def node_metrics(rig: Rig, reported: list) -> dict[str, dict[str, float]]:
    """What vLLM's own `OffloadPromMetrics` exported per node from the tier's reports:
    `metric suffix -> {node: value}`."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadPromMetrics,
    )

    types = Recorder.reset()
    prom = OffloadPromMetrics(rig.vllm_config, types, ["engine"], {0: ["0"]})
    for stats in reported:
        prom.observe(stats.data)
    prefix = "kvoffload:redis_tier_node_"
    return {
        name[len(prefix) :]: {labels[-1]: v for labels, v in m.values.items()}
        for name, m in Recorder.made.items()
        if name.startswith(prefix)
    }


def test_per_node_metrics_name_each_primary_of_a_cluster(model_dir, cluster):
    one = engine(model_dir, cluster.url)
    reported = record(redis_tier(one), "get_stats")
    serve(one, "a", PROMPT)
    settle(one)
    serve(one, "b", prompt(3, 8))  # later steps report the finished cascade
    metrics = node_metrics(one, reported)
    primaries = {f"127.0.0.1:{n.port}" for n in cluster.primaries()}
    written = metrics["bytes_written"]
    assert set(written) <= primaries and written  # 5 chunks: on one to three primaries
    assert sum(written.values()) == 5 * redis_tier(one).block_size_bytes
    assert metrics["failures"] == {}
    assert metrics["resting"] == dict.fromkeys(written, 0)  # set beside what a node moved


def test_a_tls_certificate_that_does_not_verify_stops_start_up(model_dir, redis_tls):
    with pytest.raises(ConfigError, match="not signed by a CA of tls_ca_file"):
        engine(model_dir, redis_tls.tls_url, tls_ca_file=redis_tls.cert("other-ca.crt"))


def test_engine_two_hits_every_chunk_engine_one_stored(model_dir, redis):
    prompts = [prompt(300 + i, 24 + 12 * (i % 4)) for i in range(16)]  # 2 to 5 chunks each
    one = engine(model_dir, redis.url)
    for i, p in enumerate(prompts):
        serve(one, f"a{i}", p)
    settle(one)
    stored = len(chunk_keys(redis))
    assert stored == sum(len(p) // 12 for p in prompts) == 56
    two = engine(model_dir, redis.url)
    hits = [serve(two, f"b{i}", p) for i, p in enumerate(prompts)]
    assert hits == [len(p) for p in prompts]  # every chunk, every prompt: 672 tokens
    assert redis_tier(two).stats()["loaded_chunks"] == stored


def test_a_restarted_engine_loads_from_the_shared_tier(model_dir, redis):
    one = engine(model_dir, redis.url)
    serve(one, "a", PROMPT)
    settle(one)
    one.connector.shutdown()  # the replica goes away; its CPU tier with it

    restarted = engine(model_dir, redis.url)
    assert serve(restarted, "a-again", PROMPT) == 60


@pytest.mark.parametrize(
    "field,value", [("namespace", "tiny-llama@other-weights"), ("block_size", 8)]
)
def test_replicas_with_another_identity_share_nothing(model_dir, redis, field, value):
    one = engine(model_dir, redis.url)
    serve(one, "a", PROMPT)
    settle(one)
    if field == "namespace":
        other = engine(model_dir, redis.url, namespace=value)
    else:
        other = make_tiering_rig(model_dir, [redis_tier_entry(redis.url)], chunk_tokens=value)
    assert serve(other, "b", PROMPT) == 0


def test_tiers_built_before_none_hash_exists_check_the_seed_at_the_first_step(
    model_dir, redis, monkeypatch
):
    from vllm.v1.core import kv_cache_utils

    none_hash = kv_cache_utils.NONE_HASH
    monkeypatch.delattr(kv_cache_utils, "NONE_HASH")  # as in vLLM's EngineCore: set later
    rig = engine(model_dir, redis.url)
    assert not [k for k in redis.keys() if b"canary" in k]
    monkeypatch.setattr(kv_cache_utils, "NONE_HASH", none_hash, raising=False)
    serve(rig, "a", PROMPT)
    redis_tier(rig).shutdown()  # joins the canary's thread
    (canary,) = [k for k in redis.keys() if b"canary" in k]
    assert redis.command("GET", canary) == bytes(none_hash)


def test_a_replica_with_another_hash_seed_is_warned(model_dir, redis, caplog):
    one = engine(model_dir, redis.url)
    serve(one, "a", PROMPT)
    redis_tier(one).shutdown()
    (canary,) = [k for k in redis.keys() if b"canary" in k]
    redis.command("SET", canary, b"another-seed")  # what a replica with another seed wrote
    two = engine(model_dir, redis.url)
    with caplog.at_level(logging.WARNING, logger="kvoffload.vllm.tiering.redis"):
        serve(two, "b", prompt(2, 8))
        redis_tier(two).shutdown()
    assert "different seed" in caplog.text and "PYTHONHASHSEED" in caplog.text


def test_a_full_server_does_not_stop_start_up(model_dir):
    with redis_server("--maxmemory", "1200000", "--maxmemory-policy", "noeviction") as server:
        i = 0
        while server.command("SET", f"fill{i}", b"x" * 4096) == b"OK":
            i += 1
        rig = engine(model_dir, server.url)  # the canary's SET is refused (OOM): a warning
        assert serve(rig, "a", PROMPT) == 0
        redis_tier(rig).shutdown()


def test_server_absent_at_start_up_warns_and_serves(model_dir, caplog):
    url = f"redis://127.0.0.1:{free_port()}/0"
    with caplog.at_level(logging.WARNING, logger="kvoffload.vllm.tiering.redis"):
        rig = engine(model_dir, url, connect_timeout_s=0.2)
    assert "unreachable" in caplog.text
    assert serve(rig, "a", PROMPT) == 0
    assert rig.outputs["a"]  # the engine served from the GPU alone
    settle(rig)


def test_server_killed_before_a_load_recomputes_and_recovers(model_dir, redis):
    one = engine(model_dir, redis.url, breaker_cooldown_s=0.2)
    serve(one, "a", PROMPT)
    settle(one)

    two = engine(model_dir, redis.url, breaker_cooldown_s=0.2)
    tier = redis_tier(two)
    submit_load = tier.submit_load

    def kill_then_load(job):
        redis.stop()
        submit_load(job)

    tier.submit_load = kill_then_load
    reported = record(tier, "get_stats")
    assert serve(two, "b", PROMPT) == 0  # the promotion failed: everything recomputed, and checked
    assert two.checked_positions["b"] >= 60
    tier.submit_load = submit_load
    node = f"127.0.0.1:{redis.port}"
    metrics = node_metrics(two, reported)
    assert metrics["failures"][node] >= 1
    assert metrics["bytes_read"].get(node, 0) == 0

    redis.start()  # same port, empty (no persistence)
    until_probing(two)
    fresh = prompt(8, 60)
    serve(two, "c", fresh)
    settle(two)
    assert len(chunk_keys(redis)) == 5  # stores reach the restarted server again
    three = engine(model_dir, redis.url)
    assert serve(three, "d", fresh) == 60


def test_frozen_server_fails_jobs_by_their_deadline_and_recovers(model_dir, redis):
    options = {"job_timeout_s": 0.3, "breaker_cooldown_s": 0.3}
    one = engine(model_dir, redis.url, **options)
    serve(one, "a", PROMPT)
    settle(one)

    two = engine(model_dir, redis.url, **options)
    redis.freeze()
    try:
        assert serve(two, "b", PROMPT) == 0  # lookups time out: a miss, computed
        redis_tier(two).drain_jobs()  # returns: every job ended by its deadline
        assert redis_tier(two).stats()["timeouts"] >= 1
    finally:
        redis.thaw()
    until_probing(two)
    fresh = prompt(9, 60)
    serve(two, "c", fresh)  # engine 2 writes to the shared tier again...
    settle(two)
    three = engine(model_dir, redis.url, **options)
    assert serve(three, "d", fresh) == 60  # ...and what it wrote is served


def test_corrupt_value_is_a_miss_and_deleted(model_dir, redis, caplog):
    one = engine(model_dir, redis.url)
    serve(one, "a", PROMPT)
    settle(one)
    keys = chunk_keys(redis)
    # Flip one payload byte of every stored chunk (past the 64-byte header).
    for key in keys:
        redis.command("SETRANGE", key, 100, b"\xff")

    two = engine(model_dir, redis.url)
    reported = record(redis_tier(two), "get_stats")  # what vLLM's stats logger receives
    with caplog.at_level(logging.WARNING, logger="kvoffload.vllm.tiering.redis"):
        assert serve(two, "b", PROMPT) == 0  # nothing wrong served: computed and checked
    assert "found corrupt values" in caplog.text and "checksum mismatch" in caplog.text
    assert two.checked_positions["b"] >= 60
    assert redis_tier(two).stats()["corrupt"] == 5
    corrupt = [s.data["data"].get("kvoffload:redis_tier_corrupt") for s in reported]
    assert sum(c[("RedisTier",)] for c in corrupt if c) == 5
    # Each bad value was deleted, so engine 2's own store of the prompt replaced it (SET NX would
    # have kept a bad one): a third engine loads good KV.
    settle(two)
    three = engine(model_dir, redis.url)
    assert serve(three, "c", PROMPT) == 60


def test_noeviction_store_failures_do_not_stop_the_engine(model_dir):
    with redis_server("--maxmemory", "1500000", "--maxmemory-policy", "noeviction") as server:
        rig = engine(model_dir, server.url)
        for i in range(12):
            serve(rig, f"r{i}", prompt(100 + i, 60))
        settle(rig)
        assert redis_tier(rig).stats()["store_failures"] >= 1
        assert all(rig.outputs[f"r{i}"] for i in range(12))


def test_allkeys_lru_holes_end_the_prefix(model_dir):
    with redis_server("--maxmemory", "1500000", "--maxmemory-policy", "allkeys-lru") as server:
        one = engine(model_dir, server.url)
        prompts = [prompt(200 + i, 60) for i in range(16)]
        for i, p in enumerate(prompts):
            serve(one, f"r{i}", p)
        settle(one)
        two = engine(model_dir, server.url)
        hits = [serve(two, f"s{i}", p) for i, p in enumerate(prompts)]
        assert all(h % 12 == 0 and h <= 60 for h in hits)  # whole-chunk prefixes, all checked
        assert redis_tier(two).stats()["corrupt"] == 0


def test_stores_reaching_redis_are_kv_events(model_dir, redis):
    rig = make_tiering_rig(
        model_dir, [redis_tier_entry(redis.url, enable_kv_events=True)], enable_events=True
    )
    taken = record(redis_tier(rig), "take_events")  # what vLLM publishes, step by step
    serve(rig, "a", PROMPT)
    settle(rig)
    serve(rig, "b", prompt(1, 8))  # later steps take the finished cascade and publish it
    events = [e for batch in taken for e in batch]
    assert sum(len(e.keys) for e in events) == 5
    assert all(e.medium.value == "STORAGE" and not e.removed for e in events)


def test_chunks_that_fail_to_load_are_removal_events(model_dir, redis):
    one = engine(model_dir, redis.url)
    serve(one, "a", PROMPT)
    settle(one)
    for key in chunk_keys(redis):
        redis.command("SETRANGE", key, 100, b"\xff")  # found, then refused by its checksum
    two = make_tiering_rig(
        model_dir, [redis_tier_entry(redis.url, enable_kv_events=True)], enable_events=True
    )
    taken = record(redis_tier(two), "take_events")
    assert serve(two, "b", PROMPT) == 0
    removed = [e for batch in taken for e in batch if e.removed]
    assert sum(len(e.keys) for e in removed) == 5
    assert all(e.medium.value == "STORAGE" and e.locality.value == "REMOTE" for e in removed)


def test_wrong_password_stops_start_up(model_dir):
    with redis_server(password="right") as server:
        bad = f"redis://:wrong@127.0.0.1:{server.port}/0"
        with pytest.raises(ConfigError, match="url="):
            engine(model_dir, bad)
        good = engine(model_dir, server.url)
        assert serve(good, "a", PROMPT) == 0


@pytest.mark.parametrize(
    "entry,match",
    [
        ({"namespace": "x"}, "url="),
        ({"url": "redis://127.0.0.1:1/0"}, "namespace="),
        ({"url": "http://127.0.0.1:1", "namespace": "x"}, "unknown scheme"),
        ({"url": "redis://127.0.0.1:1/0", "namespace": "x", "conections": 2}, "conections"),
        ({"url": "redis://127.0.0.1:1/0", "namespace": "x", "connections": 0}, "connections=0"),
        ({"url": "redis://127.0.0.1:1/0", "namespace": "x", "ttl_s": -1}, "ttl_s=-1"),
        ({"url": "redis://127.0.0.1:1/0", "namespace": "x", "locality": "near"}, "locality="),
    ],
)
def test_bad_entries_stop_start_up_naming_the_key(model_dir, entry, match):
    tier = {"type": "RedisTier", "module_path": "kvoffload.vllm", **entry}
    with pytest.raises(ConfigError, match=match):
        make_tiering_rig(model_dir, [tier])
