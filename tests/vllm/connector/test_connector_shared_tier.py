"""`KVOffloadConnector` with a shared Redis tier behind its CPU tier (`secondary_tiers`), driven by
vLLM 0.33's real scheduler on the CPU rig, against a real `redis-server`.

Two engines (each its own CPU tier, our Rust store and copy engine) share one server: what engine
1 computed reaches Redis behind its CPU tier (the cascade), and engine 2 promotes it (Redis -> its
CPU pool) and loads it as any CPU hit; the rig checks every loaded position byte for byte before
each forward pass. 12-token chunks of 4-token blocks: a 60-token prompt is 5 full chunks.
"""

from __future__ import annotations

import logging
import time

import pytest
from prom_recorder import Recorder
from rig import Rig, make_rig, prompt
from vllm.distributed.kv_events import BlockStored
from vllm.v1.request import RequestStatus

from kvoffload import ConfigError, NotSupportedError
from kvoffload.vllm import KVOffloadConnector
from redis_server import RedisCluster, RedisServer, free_port, redis_server

PROMPT = prompt(7, 60)
LONGER = PROMPT + prompt(8, 10)  # PROMPT's 5 chunks, then 10 tokens nobody has


def entry(url: str, **options: object) -> dict:
    return {"type": "RedisTier", "url": url, "namespace": "tiny-llama@test", **options}


def engine(model_dir: str, url: str, is_async: bool = False, **options: object) -> Rig:
    return make_rig(
        model_dir, is_async=is_async, extra={"secondary_tiers": [entry(url, **options)]}
    )


def serve(
    rig: Rig, rid: str, tokens: list[int], params: dict | None = None, **sampling: object
) -> int:
    """Runs one request to completion (and the engine until its shared-tier jobs have ended);
    returns the tokens vLLM says the connector loaded."""
    rig.add(rid, tokens, 2, params, **sampling)
    rig.run(max_steps=50_000)
    return rig.external_hits.get(rid, 0)


def stats(rig: Rig):
    return rig.connector._sched().scheduler.stats()


def store_counts(rig: Rig) -> tuple[int, int, int]:
    s = rig.cpu_store().stats()
    return s.ready, s.pending, s.pinned


def shard_io(rig: Rig):
    return rig.worker._worker().tiers[0]


def chunk_keys(server: RedisServer) -> list[bytes]:
    """One Redis key per stored chunk shard (a value is one key, or a `:b` body and its `:h`)."""
    return [k for k in server.keys() if not k.endswith(b":b") and b"canary" not in k]


def test_engines_share_a_tls_server(model_dir, redis_tls, is_async):
    ca = {"tls_ca_file": redis_tls.cert("ca.crt")}
    one = engine(model_dir, redis_tls.tls_url, is_async, **ca)
    assert serve(one, "a", PROMPT) == 0
    assert len(chunk_keys(redis_tls)) == 5  # over TLS, read back here on the plain port
    two = engine(model_dir, redis_tls.tls_url, is_async, **ca)
    assert serve(two, "b", PROMPT) == 60
    assert two.checked_positions["b"] >= 60
    s = stats(two)
    assert (s.secondary_chunks_promoted, s.secondary_chunks_failed) == (5, 0)


def test_engines_share_a_cluster(model_dir, cluster, is_async):
    one = engine(model_dir, cluster.url, is_async)
    assert serve(one, "a", PROMPT) == 0
    assert len(chunk_keys(cluster)) == 5
    # (That keys spread over the primaries is checked with 48 chunks in test_cluster.py: 5
    # land on one primary alone about once in 80 runs.)
    two = engine(model_dir, cluster.url, is_async)
    assert serve(two, "b", PROMPT) == 60
    assert two.checked_positions["b"] >= 60
    s = stats(two)
    assert (s.secondary_chunks_promoted, s.secondary_chunks_failed) == (5, 0)


def taken_over(cluster: RedisCluster, dead: RedisServer) -> None:
    """Waits until a replica has taken over from `dead`: three primaries again, every live node
    says the cluster is ok, and the seed's slot map no longer names `dead`."""
    live = [n for n in cluster.nodes if n is not dead]
    deadline = time.monotonic() + 30
    while True:
        primaries = [n for n in live if bytes(n.command("ROLE")[0]) == b"master"]
        ok = all(b"cluster_state:ok" in n.command("CLUSTER", "INFO") for n in live)
        slots = live[0].command("CLUSTER", "SLOTS")
        assert isinstance(slots, list)
        named = any(node[1] == dead.port for entry in slots for node in entry[2:])
        if len(primaries) == 3 and ok and not named:
            return
        assert time.monotonic() < deadline, "no replica took over"
        time.sleep(0.1)


def test_a_killed_primary_costs_its_chunks_and_the_engines_recover(model_dir, cluster):
    prompts = [prompt(400 + i, 48) for i in range(8)]  # 32 chunks over the 3 primaries
    one = engine(model_dir, cluster.url)
    for i, p in enumerate(prompts):
        serve(one, f"a{i}", p)
    for primary in cluster.primaries():
        assert primary.command("WAIT", 1, 5000) == 1  # replicated before the kill
    victim = next(n for n in cluster.primaries() if n is not cluster.nodes[0])  # not the seed
    victim.stop()  # SIGKILL
    two = engine(model_dir, cluster.url)
    slowest = 0.0
    for i, p in enumerate(prompts):
        two.add(f"b{i}", p, 2)
        while True:
            started = time.monotonic()
            busy = two.step_once()
            slowest = max(slowest, time.monotonic() - started)
            if not busy:
                break
    # Every loaded position was checked byte for byte; chunks on the dead primary were
    # recomputed (or found after the replica took over), the others loaded.
    assert all(two.checked_positions[f"b{i}"] >= 48 for i in range(8))
    assert 0 < stats(two).secondary_chunks_promoted
    assert slowest < 5.0  # a step waits at most a job's deadline (2 s + bytes), never hangs
    taken_over(cluster, victim)
    three = engine(model_dir, cluster.url)
    assert [serve(three, f"c{i}", p) for i, p in enumerate(prompts)] == [48] * 8


def test_plaintext_against_a_tls_port_stops_start_up(model_dir, redis_tls):
    plain_to_tls = f"redis://127.0.0.1:{redis_tls.tls_port}/0"
    with pytest.raises(ConfigError, match=r"it is a TLS port \(use rediss://"):
        engine(model_dir, plain_to_tls)


def test_engine_two_loads_what_engine_one_computed(model_dir, redis, is_async):
    one = engine(model_dir, redis.url, is_async)
    assert serve(one, "a", PROMPT) == 0
    assert len(chunk_keys(redis)) == 5  # every full chunk went on to the shared tier
    assert stats(one).secondary_shards_written == 5
    assert store_counts(one) == (5, 0, 0)  # nothing left pinned once the writes ended

    two = engine(model_dir, redis.url, is_async)
    assert serve(two, "b", PROMPT) == 60
    assert two.checked_positions["b"] >= 60  # every loaded position checked byte for byte
    s = stats(two)
    assert (s.secondary_chunks_promoted, s.secondary_chunks_failed) == (5, 0)
    assert s.chunks_loaded == 5  # promoted into the CPU tier, then loaded from it
    assert store_counts(two) == (5, 0, 0)
    # The same hit as engine 1's own CPU tier gives it.
    one.reset_gpu_prefix_cache()
    asked = stats(one).secondary_lookups
    assert serve(one, "a2", PROMPT) == 60
    assert stats(one).secondary_lookups == asked  # a whole CPU-tier hit never asks Redis


def tp_engine(model_dir: str, url: str, is_async: bool = False, **rig: object) -> Rig:
    return make_rig(
        model_dir, is_async=is_async, extra={"secondary_tiers": [entry(url)]}, tp=2, **rig
    )


def shard_keys(server: RedisServer, rig: Rig, shard: int) -> list[bytes]:
    """The Redis keys of one shard of every chunk (under that shard's namespace digest)."""
    digest = b"}" + rig.connector._sched().settings.tiers[0].shard_digest(shard) + b":"
    return [k for k in chunk_keys(server) if digest in k]


def test_tp2_ranks_each_write_and_load_their_own_shard(model_dir, redis, is_async):
    one = tp_engine(model_dir, redis.url, is_async)
    assert serve(one, "a", PROMPT) == 0
    assert len(shard_keys(redis, one, 0)) == len(shard_keys(redis, one, 1)) == 5
    assert len(chunk_keys(redis)) == 10
    assert stats(one).secondary_shards_written == 10
    two = tp_engine(model_dir, redis.url, is_async)
    assert serve(two, "b", PROMPT) == 60
    # Each rank's values differ: a shard read by the wrong rank would fail the check.
    assert two.checked_positions["b"] >= 60
    assert (stats(two).secondary_chunks_promoted, stats(two).secondary_chunks_failed) == (5, 0)


def test_a_rank_shard_evicted_is_a_miss_at_lookup_not_a_failed_promotion(model_dir, redis):
    one = tp_engine(model_dir, redis.url)
    serve(one, "a", PROMPT)
    (gone,) = [k for k in shard_keys(redis, one, 1) if one.stored_keys[3] in k]
    redis.command("DEL", gone)  # rank 1's shard of chunk 3: rank 0's is still there
    two = tp_engine(model_dir, redis.url)
    assert serve(two, "b", PROMPT) == 36  # chunks 0..2
    s = stats(two)
    assert (s.secondary_chunks_promoted, s.secondary_chunks_failed) == (3, 0)


def test_mla_writes_one_value_per_chunk_and_every_rank_loads_it(model_dir, redis, is_async):
    one = tp_engine(model_dir, redis.url, is_async, mla=True)
    settings = one.connector._sched().settings
    assert (settings.replicated, settings.num_shards) == (True, 1)
    assert serve(one, "a", PROMPT) == 0
    assert len(chunk_keys(redis)) == len(shard_keys(redis, one, 0)) == 5  # TP rank 0's only
    assert stats(one).secondary_shards_written == 5
    assert store_counts(one) == (5, 0, 0)  # the writes ended on one rank's report
    two = tp_engine(model_dir, redis.url, is_async, mla=True)
    assert serve(two, "b", PROMPT) == 60
    assert two.checked_positions["b"] >= 60  # on both ranks, from the one value
    assert (stats(two).secondary_chunks_promoted, stats(two).secondary_chunks_failed) == (5, 0)


def test_replicated_and_per_rank_values_never_meet(model_dir, redis):
    serve(tp_engine(model_dir, redis.url, mla=True), "a", PROMPT)
    # Same model name, same TP: a per-rank engine must not read the replicated layout.
    per_rank = tp_engine(model_dir, redis.url)
    assert serve(per_rank, "b", PROMPT) == 0
    assert stats(per_rank).secondary_chunks_promoted == 0


def test_per_node_metrics_sum_both_workers_over_each_primary(model_dir, cluster):
    one = tp_engine(model_dir, cluster.url)
    serve(one, "a", PROMPT)
    serve(one, "a-again", PROMPT)  # one more step: the last cascade's report arrives
    types = Recorder.reset()
    prom = KVOffloadConnector.build_prom_metrics(one.vllm_config, types, ["engine"], {0: ["0"]})
    for data in one.connector_stats:
        prom.observe(data)
    name = "vllm:kvoffload_redis_node_bytes_written"
    written = {labels[-1]: v for labels, v in Recorder.made[name].values.items()}
    assert set(written) <= {f"127.0.0.1:{n.port}" for n in cluster.primaries()} and written
    settings = one.connector._sched().settings
    shard = settings.worker_block_bytes * settings.config.blocks_per_chunk
    assert sum(written.values()) == 10 * shard  # 5 chunks, a shard from each of 2 workers
    assert Recorder.made["vllm:kvoffload_redis_node_failures"].values == {}


def test_kv_events_name_what_reached_the_shared_tier(model_dir, redis):
    one = make_rig(model_dir, extra={"secondary_tiers": [entry(redis.url)]}, enable_events=True)
    published = []
    one.scheduler.kv_event_publisher.publish = published.append
    serve(one, "a", PROMPT)
    serve(one, "a-again", PROMPT)  # one more step: the cascade's report arrives after "a" ends
    events = [e for batch in published for e in batch.events]
    cpu = [
        h
        for e in events
        if isinstance(e, BlockStored) and e.medium == "CPU"
        for h in e.block_hashes
    ]
    remote = [e for e in events if isinstance(e, BlockStored) and e.medium == "STORAGE"]
    assert {e.locality for e in remote} == {"REMOTE"}
    assert sorted(h for e in remote for h in e.block_hashes) == sorted(cpu) and len(cpu) == 5


def test_engine_two_hits_every_chunk_engine_one_stored(model_dir, redis):
    prompts = [prompt(300 + i, 24 + 12 * (i % 4)) for i in range(16)]  # 2 to 5 chunks each
    one = engine(model_dir, redis.url)
    for i, p in enumerate(prompts):
        serve(one, f"a{i}", p)
    assert len(chunk_keys(redis)) == sum(len(p) // 12 for p in prompts) == 56
    two = engine(model_dir, redis.url)
    hits = [serve(two, f"b{i}", p) for i, p in enumerate(prompts)]
    assert hits == [len(p) for p in prompts]  # 672 tokens, every one checked
    assert stats(two).secondary_chunks_promoted == 56


def split_engine(model_dir: str, url: str, is_async: bool) -> Rig:
    """Engine 1 put PROMPT's 5 chunks in Redis; engine 2 has chunk 0 in its own CPU tier."""
    serve(engine(model_dir, url, is_async), "a", PROMPT)
    two = engine(model_dir, url, is_async)
    assert serve(two, "head", PROMPT[:13]) == 12  # promotes chunk 0 (engine 1 wrote it)
    assert stats(two).secondary_chunks_promoted == 1
    two.reset_gpu_prefix_cache()
    return two


@pytest.mark.parametrize(
    ("cap", "loaded", "promoted"),
    [(None, 60, 4), (0, 0, 0), (13, 12, 0), (35, 24, 1), (36, 36, 2), (1000, 60, 4)],
)
def test_max_load_tokens_caps_both_tiers_together(
    model_dir, redis, is_async, cap, loaded, promoted
):
    two = split_engine(model_dir, redis.url, is_async)
    params = None if cap is None else {"max_load_tokens": cap}
    assert serve(two, "b", LONGER, params) == loaded
    load = two.load_of("b")
    assert (0 if load is None else load.num_tokens) == loaded
    assert two.checked_positions["b"] >= 70 - 1
    # Only the chunks inside the cap were promoted (chunk 0 was, by the set-up).
    assert stats(two).secondary_chunks_promoted == 1 + promoted


@pytest.mark.parametrize("max_offload_tokens", [0, 24])
def test_max_offload_tokens_caps_what_reaches_redis(model_dir, redis, max_offload_tokens):
    one = engine(model_dir, redis.url)
    serve(one, "a", PROMPT, {"max_offload_tokens": max_offload_tokens})
    assert len(chunk_keys(redis)) == max_offload_tokens // 12
    assert serve(engine(model_dir, redis.url), "b", PROMPT) == max_offload_tokens


def test_offload_prompt_only_holds_for_redis(model_dir, redis):
    one = engine(model_dir, redis.url)
    one.add("a", PROMPT[:24], 40)  # 24 prompt tokens, then 40 generated: only 2 chunks stored
    one.run(max_steps=50_000)
    assert len(chunk_keys(redis)) == 2


@pytest.mark.parametrize(
    ("tiers", "loaded"),
    [
        ([{"medium": "cpu"}], 12),
        ([], 12),
        ([{"locality": "LOCAL"}], 12),
        ([{"medium": "storage", "locality": "remote"}], 60),
        ([{"medium": "CPU"}, {"locality": "REMOTE"}], 60),
    ],
)
def test_kv_load_tiers_selects_the_shared_tier(model_dir, redis, tiers, loaded):
    two = split_engine(model_dir, redis.url, is_async=False)
    asked = stats(two).secondary_lookups
    assert serve(two, "b", LONGER, {"kv_load_tiers": tiers}) == loaded
    assert (stats(two).secondary_lookups > asked) == (loaded > 12)  # excluded: never asked


@pytest.mark.parametrize("bad", ["cpu", [{"medium": "tape"}], [3]])
def test_invalid_kv_load_tiers_is_ignored_with_one_warning(model_dir, redis, bad, caplog):
    two = split_engine(model_dir, redis.url, is_async=False)
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        assert serve(two, "b", LONGER, {"kv_load_tiers": bad}) == 60  # as vLLM: every tier
    assert sum("kv_load_tiers" in r.getMessage() for r in caplog.records) == 1
    assert stats(two).ignored_params == {"kv_load_tiers": 1}


def test_a_promotion_that_fails_halfway_loads_what_arrived(model_dir, redis, is_async):
    serve(engine(model_dir, redis.url, is_async), "a", PROMPT)
    two = engine(model_dir, redis.url, is_async)
    io = shard_io(two)
    promote = io.promote

    def lose_chunk_3(job_id, keys, slots):
        (gone,) = [k for k in redis.keys() if keys[3] in k and not k.endswith(b":b")]
        redis.command("DEL", gone)  # evicted between the lookup and the promotion
        io.promote = promote
        promote(job_id, keys, slots)

    io.promote = lose_chunk_3
    assert serve(two, "b", LONGER) == 36  # chunks 0..2 arrived: a whole-chunk prefix
    assert two.checked_positions["b"] >= 69
    s = stats(two)
    assert (s.secondary_chunks_promoted, s.secondary_chunks_failed) == (4, 1)
    assert store_counts(two)[1:] == (0, 0)


def test_an_abort_while_promoting_leaves_nothing_pending(model_dir, redis, is_async):
    serve(engine(model_dir, redis.url, is_async), "a", PROMPT)
    two = engine(model_dir, redis.url, is_async)
    aborted = []

    def abort_once_promoting(rig, so):
        meta = so.kv_connector_metadata
        if meta.promotions and not aborted:
            aborted.append(rig.step)
            rig.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)

    two.before_worker = abort_once_promoting
    two.add("b", LONGER, 2)
    two.run(max_steps=50_000)
    assert aborted and "b" not in two.external_hits
    assert store_counts(two) == (5, 0, 0)  # promoted, ready, unpinned: the next request hits
    two.before_worker = None
    asked = stats(two).secondary_lookups
    assert serve(two, "c", LONGER) == 60
    assert stats(two).secondary_chunks_promoted == 5
    assert stats(two).secondary_lookups == asked  # c found every chunk in the CPU tier


def test_no_secondary_tier_asks_nothing_remote(model_dir):
    rig = make_rig(model_dir)
    serve(rig, "a", PROMPT)
    assert rig.worker._worker().tiers == []
    assert rig.connector._sched().scheduler.secondary_tiers == ()
    assert stats(rig).secondary_lookups == 0


# --- faults -------------------------------------------------------------------------------------


def until_up(rig: Rig) -> None:
    """Waits out the breakers' cool-down (the next job then probes the server)."""
    clients = [rig.connector._sched().tier_lookups[0]._client, shard_io(rig).client]
    deadline = time.monotonic() + 30
    while any(c.state == "down" for c in clients):
        assert time.monotonic() < deadline, "a breaker never left 'down'"
        time.sleep(0.05)


def test_server_absent_at_start_up_warns_and_serves(model_dir, caplog):
    url = f"redis://127.0.0.1:{free_port()}/0"
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        rig = engine(model_dir, url, connect_timeout_s=0.2)
    assert "unreachable" in caplog.text
    assert serve(rig, "a", PROMPT) == 0
    assert rig.outputs["a"] and stats(rig).secondary_writes_dropped == 5
    rig.reset_gpu_prefix_cache()
    assert serve(rig, "b", PROMPT) == 60  # the CPU tier serves on


def test_server_killed_before_a_promotion_recomputes_and_recovers(model_dir, redis):
    options = {"breaker_cooldown_s": 0.2}
    serve(engine(model_dir, redis.url, **options), "a", PROMPT)
    two = engine(model_dir, redis.url, **options)
    io = shard_io(two)
    promote = io.promote

    def kill_then_promote(job_id, keys, slots):
        redis.stop()
        io.promote = promote
        promote(job_id, keys, slots)

    io.promote = kill_then_promote
    assert serve(two, "b", PROMPT) == 0  # the promotion failed: recomputed, and checked
    assert two.checked_positions["b"] >= 59
    assert stats(two).secondary_chunks_failed == 5
    assert store_counts(two)[1:] == (0, 0)
    two.reset_gpu_prefix_cache()
    assert serve(two, "b2", PROMPT) == 60  # engine 2's own CPU tier still serves

    redis.start()  # same port, empty (no persistence)
    until_up(two)
    fresh = prompt(8, 60)
    serve(two, "c", fresh)
    assert len(chunk_keys(redis)) == 5  # writes reach the restarted server again
    assert serve(engine(model_dir, redis.url), "d", fresh) == 60


def test_frozen_server_fails_by_deadlines_and_recovers(model_dir, redis):
    options = {"job_timeout_s": 0.3, "breaker_cooldown_s": 0.3}
    serve(engine(model_dir, redis.url, **options), "a", PROMPT)
    two = engine(model_dir, redis.url, **options)
    redis.freeze()
    try:
        assert serve(two, "b", PROMPT) == 0  # the lookup timed out: a miss, computed
        assert two.outputs["b"]
    finally:
        redis.thaw()
    until_up(two)
    fresh = prompt(9, 60)
    serve(two, "c", fresh)
    assert serve(engine(model_dir, redis.url, **options), "d", fresh) == 60


def test_corrupt_values_are_recomputed_and_replaced(model_dir, redis):
    serve(engine(model_dir, redis.url), "a", PROMPT)
    for key in chunk_keys(redis):
        redis.command("SETRANGE", key, 100, b"\xff")  # one payload byte, past the header
    two = engine(model_dir, redis.url)
    assert serve(two, "b", PROMPT) == 0  # nothing wrong served: computed and checked
    assert two.checked_positions["b"] >= 59
    assert stats(two).secondary_chunks_failed == 5
    assert shard_io(two).client.stats()["corrupt"] == 5
    # Each bad value was deleted, so engine 2's own cascade replaced it: a third engine loads it.
    assert serve(engine(model_dir, redis.url), "c", PROMPT) == 60


def test_a_full_server_drops_writes_never_gpu_stores(model_dir):
    with redis_server("--maxmemory", "1200000", "--maxmemory-policy", "noeviction") as server:
        rig = engine(model_dir, server.url)
        for i in range(12):
            serve(rig, f"r{i}", prompt(100 + i, 60))
        s = stats(rig)
        assert s.secondary_writes_dropped >= 1
        assert s.chunks_stored == 60 and s.store_failures == 0  # the CPU tier took every chunk
        assert all(rig.outputs[f"r{i}"] for i in range(12))


def test_writes_wait_while_half_the_cpu_tier_is_pinned_by_writes(model_dir, redis):
    tiers = [entry(redis.url, job_timeout_s=0.5)]
    rig = make_rig(model_dir, cpu_chunks=4, extra={"secondary_tiers": tiers})
    pinned: list[int] = []
    rig.before_worker = lambda r, so: pinned.append(r.cpu_store().stats().pinned)
    redis.freeze()  # writes hang until their deadline: their slots stay pinned meanwhile
    try:
        rig.add("a", prompt(1, 24), 2)
        rig.add("b", prompt(2, 24), 2)
        rig.run(max_steps=50_000)
    finally:
        redis.thaw()
    s = stats(rig)
    assert s.chunks_stored == 4 and s.store_failures == 0  # the CPU tier took every chunk
    assert max(pinned) == 2  # a's 2 chunks pinned by their write; b's waited their turn
    assert s.secondary_writes_dropped == 4  # then each write failed by its deadline
    assert store_counts(rig) == (4, 0, 0)


# --- configuration ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tiers", "match"),
    [
        ("redis://x", "secondary_tiers is a str"),
        ([], "secondary_tiers is an empty list"),
        ({"url": "redis://u:hunter2@h:1/0"}, "secondary_tiers is a dict"),
        ([entry(f"redis://127.0.0.1:{i}/0") for i in range(1, 6)], "has 5 entries"),
        (["redis://x"], "must be a dict"),
        ([{**entry("redis://127.0.0.1:1/0"), "type": "CPUTier"}], "type='CPUTier'"),
        ([{**entry("redis://127.0.0.1:1/0"), "module_path": "x.y"}], "module_path='x.y'"),
        ([{**entry("redis://127.0.0.1:1/0"), "backpressure": {}}], "'backpressure'"),
        ([{**entry("redis://127.0.0.1:1/0"), "locality": "near"}], "locality='near'"),
        ([{**entry("redis://127.0.0.1:1/0"), "conections": 2}], "conections"),
        ([{"type": "RedisTier", "url": "redis://127.0.0.1:1/0"}], "namespace="),
        ([entry("http://127.0.0.1:1")], "unknown scheme"),
    ],
)
def test_bad_secondary_tiers_stop_start_up_naming_the_key(model_dir, tiers, match):
    with pytest.raises(ConfigError, match=match) as raised:
        make_rig(model_dir, extra={"secondary_tiers": tiers})
    assert "hunter2" not in str(raised.value)  # a password never reaches a message


def test_context_parallelism_is_refused_with_a_shared_tier(model_dir, redis):
    from kvoffload.vllm.connector.settings import ConnectorSettings

    rig = engine(model_dir, redis.url)
    rig.vllm_config.parallel_config.decode_context_parallel_size = 2
    with pytest.raises(NotSupportedError, match="decode_context_parallel_size=2"):
        ConnectorSettings.from_vllm(rig.vllm_config, rig.scheduler.kv_cache_config)


def test_a_request_that_skips_the_prefix_cache_asks_nothing(model_dir, redis):
    serve(engine(model_dir, redis.url), "a", PROMPT)
    two = engine(model_dir, redis.url)
    assert serve(two, "b", PROMPT, None, prompt_logprobs=1) == 0  # vLLM skips reading for it
    s = stats(two)
    assert (s.secondary_lookups, s.secondary_promotions, s.lookups) == (0, 0, 0)


def test_a_tier_known_down_is_a_miss_without_waiting(model_dir):
    url = f"redis://127.0.0.1:{free_port()}/0"
    rig = engine(model_dir, url, connect_timeout_s=0.2, breaker_cooldown_s=600)
    assert rig.connector._sched().tier_lookups[0]._client.state == "down"
    serve(rig, "a", PROMPT)
    s = stats(rig)
    assert (s.secondary_lookups, s.deferred_lookups) == (0, 0)


def test_module_path_may_name_us(model_dir, redis):
    rig = make_rig(
        model_dir,
        extra={"secondary_tiers": [{**entry(redis.url), "module_path": "kvoffload.vllm"}]},
    )
    assert serve(rig, "a", PROMPT) == 0 and len(chunk_keys(redis)) == 5


def test_redis_tier_values_and_ours_never_meet(model_dir, redis):
    """vLLM's tiering region lays a chunk out otherwise than our pool: the namespace digests keep
    the two writers apart in one server and one namespace."""
    from tiering_rig import make_tiering_rig, redis_tier_entry

    serve(engine(model_dir, redis.url), "a", PROMPT)
    theirs = make_tiering_rig(model_dir, [redis_tier_entry(redis.url)])
    assert serve(theirs, "b", PROMPT) == 0


def test_a_request_preempted_after_its_promotion_reloads_from_the_cpu_tier(model_dir, redis):
    """Engine 2 has 16 usable GPU blocks: "a" and "b" (24-token prompts engine 1 wrote to Redis,
    40 output tokens each) are both promoted and loaded, then outgrow the GPU and one is
    preempted; readmitted, it loads its prompt again, now from engine 2's own CPU tier."""
    one = engine(model_dir, redis.url)
    for rid, seed in (("a", 1), ("b", 2)):
        serve(one, rid, prompt(seed, 24))
    two = make_rig(model_dir, num_gpu_blocks=17, extra={"secondary_tiers": [entry(redis.url)]})
    preempted: set[str] = set()
    two.before_worker = lambda rig, so: preempted.update(so.preempted_req_ids or ())
    two.add("a", prompt(1, 24), 40)
    two.add("b", prompt(2, 24), 40)
    two.run(max_steps=50_000)
    # The one whose promotion landed last runs last and is preempted: "b" or, by timing, "a".
    assert len(preempted) == 1
    (victim,) = preempted
    loads = [load.num_tokens for load in two.loads if load.request_id == victim]
    assert loads == [24, 24]  # promoted, loaded; after the preemption, loaded again
    assert stats(two).secondary_chunks_promoted == 4  # each chunk came from Redis once
    assert store_counts(two)[1:] == (0, 0)
    assert len(two.outputs[victim]) == 40 and two.checked_positions[victim] >= 62
