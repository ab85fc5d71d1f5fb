"""`KVOffloadConnector` with a disk tier, alone or chained with a shared Redis tier
(`secondary_tiers`: CPU -> disk -> Redis), driven by vLLM 0.33's real scheduler on the CPU rig, on
this machine's filesystem and a real `redis-server`.

What engine 1 computed is written on behind its CPU tier to every tier of its chain; engine 2
(another engine on the directory, a restarted one, or one whose disk lacks part of a prompt)
promotes it from the first tier that has it, and the rig checks every loaded position byte for
byte before each forward pass. 12-token chunks of 4-token blocks: a 60-token prompt is 5 chunks.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from rig import Rig, make_rig, prompt

from kvoffload import ConfigError
from kvoffload.tiers.disk import KIND as DISK
from kvoffload.tiers.disk import file_bytes
from mounts import tmpfs
from redis_server import RedisServer

DISKS = DISK.report.key

PROMPT = prompt(7, 60)
NAMESPACE = "tiny-llama@test"


def disk(path: Path, **options: object) -> dict:
    return {
        "type": "DiskTier",
        "path": str(path),
        "capacity_bytes": 1 << 30,
        "namespace": NAMESPACE,
        **options,
    }


def redis_tier(server: RedisServer) -> dict:
    return {"type": "RedisTier", "url": server.url, "namespace": NAMESPACE}


def engine(model_dir: str, *tiers: dict, is_async: bool = False, tp: int = 1) -> Rig:
    """An engine whose disk lookups have indexed what their directories held at start-up (until
    then those chunks are misses: the scan runs beside the engine, never delaying a step)."""
    rig = make_rig(model_dir, is_async=is_async, extra={"secondary_tiers": list(tiers)}, tp=tp)
    deadline = time.monotonic() + 10
    while not all(getattr(t, "scanned", True) for t in rig.connector._sched().tier_lookups):
        assert time.monotonic() < deadline, "the directory was never indexed"
        time.sleep(0.001)
    return rig


def serve(rig: Rig, rid: str, tokens: list[int], params: dict | None = None) -> int:
    """Runs one request to completion, and the engine until its tiers' jobs have ended; returns
    the tokens vLLM says the connector loaded."""
    rig.add(rid, tokens, 2, params)
    rig.run(max_steps=50_000)
    return rig.external_hits.get(rid, 0)


def stats(rig: Rig):
    return rig.connector._sched().scheduler.stats()


def tier_stats(rig: Rig, tier: int) -> dict[str, int]:
    """The data path's counters of one tier of the chain, on the (one) worker."""
    return rig.worker._worker().tiers[tier].client.stats()


def files(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".tmp-")]


def test_engine_two_loads_what_engine_one_stored_in_one_directory(model_dir, tmp_path, is_async):
    one = engine(model_dir, disk(tmp_path), is_async=is_async)
    assert serve(one, "a", PROMPT) == 0
    assert len(files(tmp_path)) == 5
    assert stats(one).secondary_shards_written == 5
    two = engine(model_dir, disk(tmp_path), is_async=is_async)
    assert serve(two, "b", PROMPT) == 60
    assert two.checked_positions["b"] >= 60
    s = stats(two)
    assert (s.secondary_chunks_promoted, s.secondary_chunks_failed) == (5, 0)
    assert tier_stats(two, 0)["loaded_chunks"] == 5


def test_an_engine_loads_its_own_chunks_back_once_its_cpu_tier_dropped_them(model_dir, tmp_path):
    # The scheduler's lookups learn of their workers' writes as they end, not at the next rescan
    # (10 s by default): a chunk evicted from the CPU tier a moment later is a disk hit.
    rig = engine(model_dir, disk(tmp_path))
    serve(rig, "a", PROMPT)
    rig.cpu_store().reset()
    rig.reset_gpu_prefix_cache()
    assert serve(rig, "b", PROMPT) == 60
    assert rig.checked_positions["b"] >= 60


def test_a_restarted_engine_serves_what_the_last_one_stored(model_dir, tmp_path):
    prompts = [prompt(300 + i, 24 + 12 * (i % 4)) for i in range(8)]
    one = engine(model_dir, disk(tmp_path))
    for i, p in enumerate(prompts):
        serve(one, f"a{i}", p)
    one.connector.shutdown()
    restarted = engine(model_dir, disk(tmp_path))
    hits = [serve(restarted, f"b{i}", p) for i, p in enumerate(prompts)]
    assert hits == [len(p) for p in prompts]
    assert all(restarted.checked_positions[f"b{i}"] >= len(p) for i, p in enumerate(prompts))


def test_a_chain_writes_every_tier_and_promotes_from_the_first_that_has_it(
    model_dir, tmp_path, redis, is_async
):
    a, b = tmp_path / "a", tmp_path / "b"
    one = engine(model_dir, disk(a), redis_tier(redis), is_async=is_async)
    assert serve(one, "a", PROMPT) == 0
    assert len(files(a)) == 5
    assert stats(one).secondary_shards_written == 10  # 5 chunks to each tier
    # Its disk has the prompt: Redis is never asked.
    same_disk = engine(model_dir, disk(a), redis_tier(redis), is_async=is_async)
    assert serve(same_disk, "b", PROMPT) == 60
    assert same_disk.checked_positions["b"] >= 60
    assert tier_stats(same_disk, 0)["loaded_chunks"] == 5
    assert same_disk.connector._sched().tier_lookups[1]._client.stats()["lookup_keys"] == 0
    # An empty disk: the whole prompt comes from Redis, and is written to that disk on its way
    # up: a restart of that node finds it there, without asking Redis.
    other_disk = engine(model_dir, disk(b), redis_tier(redis), is_async=is_async)
    assert serve(other_disk, "c", PROMPT) == 60
    assert other_disk.checked_positions["c"] >= 60
    assert tier_stats(other_disk, 1)["loaded_chunks"] == 5
    assert stats(other_disk).secondary_chunks_promoted == 5
    assert len(files(b)) == 5
    assert stats(other_disk).secondary_shards_written == 5  # to the disk; Redis had them
    assert serve(engine(model_dir, disk(b), is_async=is_async), "d", PROMPT) == 60


def test_max_load_tokens_caps_a_prompt_split_over_three_tiers(model_dir, tmp_path, redis):
    """Chunk 0 in the CPU tier, chunk 1 on the disk only, chunks 2-4 in Redis only:
    `max_load_tokens` 36 loads chunks 0-2 from three tiers and recomputes 3 and 4."""
    shared = engine(model_dir, redis_tier(redis))
    serve(shared, "r", PROMPT)  # chunks 0-4 in Redis
    local = engine(model_dir, disk(tmp_path))
    serve(local, "d", PROMPT[:24])  # chunks 0-1 on the disk
    rig = engine(model_dir, disk(tmp_path), redis_tier(redis))
    serve(rig, "c", PROMPT[:12])  # chunk 0 in its CPU tier (promoted from the disk)
    rig.reset_gpu_prefix_cache()
    before = [tier_stats(rig, t)["loaded_chunks"] for t in (0, 1)]
    assert serve(rig, "x", PROMPT, {"max_load_tokens": 36}) == 36
    assert rig.checked_positions["x"] >= 36
    after = [tier_stats(rig, t)["loaded_chunks"] for t in (0, 1)]
    assert [n - b for n, b in zip(after, before, strict=True)] == [1, 1]  # chunks 1 and 2
    # Chunks 3 and 4 were recomputed and stored: the next request finds all five in the CPU
    # tier, and asks no other.
    rig.reset_gpu_prefix_cache()
    assert serve(rig, "y", PROMPT) == 60
    assert rig.checked_positions["y"] >= 60
    assert [tier_stats(rig, t)["loaded_chunks"] for t in (0, 1)] == after


def test_kv_load_tiers_picks_tiers_of_the_chain_by_locality(model_dir, tmp_path, redis):
    one = engine(model_dir, disk(tmp_path / "a"), redis_tier(redis))
    serve(one, "a", PROMPT)
    # Its own disk is empty: LOCAL alone finds nothing, REMOTE finds Redis.
    two = engine(model_dir, disk(tmp_path / "b"), redis_tier(redis))
    assert serve(two, "b", PROMPT, {"kv_load_tiers": [{"locality": "LOCAL"}]}) == 0
    two.reset_gpu_prefix_cache()
    assert serve(two, "c", PROMPT, {"kv_load_tiers": [{"locality": "REMOTE"}]}) == 60
    assert two.checked_positions["c"] >= 60


def test_damaged_files_are_recomputed_never_served(model_dir, tmp_path):
    serve(engine(model_dir, disk(tmp_path)), "a", PROMPT)
    for f in files(tmp_path):
        raw = bytearray(f.read_bytes())
        raw[4096 + 10] ^= 0xFF  # one payload byte, past the header block
        f.write_bytes(bytes(raw))
    two = engine(model_dir, disk(tmp_path))
    assert serve(two, "b", PROMPT) == 0  # chunk 0 failed its check: nothing loaded
    assert two.checked_positions["b"] >= 59
    assert tier_stats(two, 0)["corrupt"] >= 1
    assert stats(two).secondary_chunks_failed >= 1
    # The worker reported it for the metrics (vllm:kvoffload_disk_*{path=...}), as vLLM
    # collected it step by step.
    reports = [
        r[DISKS][str(tmp_path)] for r in two.connector_stats if str(tmp_path) in r.get(DISKS, {})
    ]
    assert sum(r["corrupt"] for r in reports) == tier_stats(two, 0)["corrupt"]
    assert reports[-1]["breaker_state"] == 0
    # The damaged files were removed and engine 2's own writes replaced them.
    assert serve(engine(model_dir, disk(tmp_path)), "c", PROMPT) == 60


def test_a_directory_removed_under_a_running_engine_costs_hits_not_service(model_dir, tmp_path):
    import shutil

    rig = engine(model_dir, disk(tmp_path / "tier"))
    serve(rig, "a", PROMPT)
    shutil.rmtree(tmp_path / "tier")
    rig.cpu_store().reset()
    rig.reset_gpu_prefix_cache()
    assert serve(rig, "b", PROMPT) == 0  # the index said yes, the files were gone: recomputed
    assert rig.checked_positions["b"] >= 59
    assert stats(rig).secondary_chunks_failed >= 1
    # The tier writes again (the directory is made anew) and serves the next request.
    rig.cpu_store().reset()
    rig.reset_gpu_prefix_cache()
    assert serve(rig, "c", PROMPT) == 60


@pytest.mark.parametrize(
    ("tiers", "match"),
    [
        ([{"type": "DiskTier", "capacity_bytes": 1 << 30, "namespace": "n"}], r"\[0\].*path="),
        ([{"type": "DiskTier", "path": "/tmp/x", "namespace": "n"}], "capacity_bytes="),
        (
            [{"type": "DiskTier", "path": "/tmp/x", "capacity_bytes": 1, "namespace": "n"}],
            r"\[0\] DiskTier capacity_bytes=1 holds no chunk: it is split over 1 shard",
        ),
        (
            [{"type": "RedisTier", "url": "redis://h:1/0", "namespace": "n"}, {"type": "Disk"}],
            r"secondary_tiers\[1\] type='Disk'",
        ),
        ([{"type": "DiskTier", "path": "/tmp/x", "capacity_bytes": 1 << 30}], "namespace="),
        (
            [
                {
                    "type": "DiskTier",
                    "path": "/tmp/x",
                    "capacity_bytes": 1 << 30,
                    "namespace": "n",
                    "direct_io": "maybe",
                }
            ],
            "direct_io='maybe'",
        ),
        (
            [
                {
                    "type": "DiskTier",
                    "path": "/tmp/x",
                    "capacity_bytes": 1 << 30,
                    "namespace": "n",
                    "enable_kv_events": True,
                }
            ],
            "'enable_kv_events' is read only by vLLM",
        ),
        ([disk(Path("/tmp/x"), breaker_failures=0)], r"\[0\]: DiskTier breaker_failures=0"),
        ([{"type": ["DiskTier"]}], r"\[0\] type=\['DiskTier'\] is invalid"),
        (
            [disk(Path("/tmp/x")), disk(Path("/tmp/x"))],
            r"secondary_tiers\[1\] is secondary_tiers\[0\]",
        ),
        ([disk(Path("/tmp/x"), breaker_cooldown_s="10")], "breaker_cooldown_s='10'"),
    ],
)
def test_bad_entries_stop_start_up_naming_the_key(model_dir, tiers, match):
    with pytest.raises(ConfigError, match=match):
        make_rig(model_dir, extra={"secondary_tiers": tiers})


def shard_dirs(rig: Rig, path: Path) -> list[Path]:
    """Each TP rank's directory (one per namespace digest), in rank order."""
    (tier,) = rig.connector._sched().settings.tiers
    return [path / f"kvo1-{tier.shard_digest(rank).hex()}" for rank in range(2)]


def test_tp2_ranks_each_keep_their_shard_and_a_lost_one_heals(model_dir, tmp_path, is_async):
    def tp_engine() -> Rig:
        return engine(model_dir, disk(tmp_path), is_async=is_async, tp=2)

    one = tp_engine()
    assert serve(one, "a", PROMPT) == 0
    ranks = shard_dirs(one, tmp_path)
    assert [len(files(d)) for d in ranks] == [5, 5]
    assert stats(one).secondary_shards_written == 10
    two = tp_engine()
    assert serve(two, "b", PROMPT) == 60
    # Each rank's values differ: a shard read by the wrong rank would fail the check.
    assert two.checked_positions["b"] >= 60
    # One rank's shard of every chunk is lost: the promotions fail on that rank, the chunks are
    # recomputed, and their stores write the lost shards again (the other rank's exist).
    for f in files(ranks[1]):
        f.unlink()
    three = tp_engine()
    assert serve(three, "c", PROMPT) == 0
    assert three.checked_positions["c"] >= 59
    assert stats(three).secondary_chunks_failed >= 1
    assert [len(files(d)) for d in ranks] == [5, 5]
    assert serve(tp_engine(), "d", PROMPT) == 60


def test_engines_sharing_a_directory_hold_its_capacity_together(model_dir, tmp_path):
    probe = engine(model_dir, disk(tmp_path / "probe"))
    chunk_file = file_bytes(probe.connector._sched().settings.chunk_bytes)
    # Rescans every 0.1 s (the default is 10 s) so that the test does not wait for them.
    entry = disk(tmp_path / "shared", capacity_bytes=6 * chunk_file, rescan_interval_s=0.1)
    one, two = engine(model_dir, entry), engine(model_dir, entry)
    # A replica with the shipped defaults, running since before the writes.
    defaults = engine(model_dir, disk(tmp_path / "shared", capacity_bytes=6 * chunk_file))
    for i in range(4):
        serve(one, f"a{i}", prompt(50 + i, 36))  # 3 chunks each: 12 from each engine
        serve(two, f"b{i}", prompt(70 + i, 36))
    # It asks right after the last write, before any rescan of its own: a hit.
    assert serve(defaults, "d", prompt(73, 36)) == 36
    assert defaults.checked_positions["d"] >= 36
    time.sleep(0.5)  # a few rescans: each engine sees the other's files, and evicts
    assert len(files(tmp_path / "shared")) <= 6 + 2  # within one chunk per engine
    # The most recent chunks are still there, and a restarted engine loads them.
    assert serve(engine(model_dir, entry), "c", prompt(73, 36)) == 36


def test_a_worker_shuts_down_before_its_caches_were_registered(model_dir, tmp_path):
    from kvoffload.vllm.connector.worker_side import WorkerSide

    settings = engine(model_dir, disk(tmp_path)).connector._sched().settings
    WorkerSide(settings).shutdown()  # no tier opened, no pool: nothing to close, no error


def test_a_failing_disk_costs_its_hits_and_redis_behind_it_still_serves(model_dir, tmp_path, redis):
    import shutil

    # A cool-down longer than the test, so the disk stays down once tripped.
    rig = engine(model_dir, disk(tmp_path, breaker_cooldown_s=600), redis_tier(redis))
    other = prompt(8, 60)
    serve(rig, "a", PROMPT)
    serve(rig, "a2", other)
    (namespace_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    # The tier's directory becomes a file: every read and write fails (ENOTDIR).
    shutil.rmtree(namespace_dir)
    namespace_dir.write_bytes(b"not a directory")
    rig.cpu_store().reset()
    rig.reset_gpu_prefix_cache()
    # The scheduler's index still lists the chunks: the disk's promotion fails on the worker
    # (never served wrong), the chunks become misses on the disk, and the request, still
    # waiting, finds them in Redis.
    assert serve(rig, "b", PROMPT) == 60
    assert rig.checked_positions["b"] >= 60
    assert stats(rig).secondary_chunks_failed == 5
    assert tier_stats(rig, 1)["loaded_chunks"] == 5
    disk_stats = tier_stats(rig, 0)
    assert disk_stats["breaker_state"] == 1  # down: 3 I/O failures in a row
    # 5 loads (at least 3 failed, then the breaker opened; the I/O threads admit some at once),
    # and the 5 chunks from Redis written back on their way up, failed at once.
    assert disk_stats["load_failures"] >= 3
    assert disk_stats["load_failures"] + disk_stats["denied"] == 5 + 5
    # The workers told the scheduler: its lookups skip the disk now. The other prompt, still in
    # the disk's index, comes straight from Redis, with no promotion that fails first.
    assert rig.connector._sched().tier_lookups[0].down
    rig.cpu_store().reset()
    rig.reset_gpu_prefix_cache()
    assert serve(rig, "c", other) == 60
    assert rig.checked_positions["c"] >= 60
    assert stats(rig).secondary_chunks_failed == 5
    assert tier_stats(rig, 1)["loaded_chunks"] == 10


@pytest.fixture
def small_fs(tmp_path):
    """A 64 KiB tmpfs mounted for the test (five chunk files of the test model fit): a real
    full filesystem."""
    with tmpfs(tmp_path / "small", "64k") as where:
        yield where


def test_a_full_filesystem_drops_the_disks_stores_and_the_chain_serves_on(
    model_dir, small_fs, redis
):
    rig = engine(model_dir, disk(small_fs), redis_tier(redis))
    prompts = [prompt(700 + i, 60) for i in range(3)]  # 15 chunks: three times what fits
    for i, p in enumerate(prompts):
        serve(rig, f"a{i}", p)
    disk_stats = tier_stats(rig, 0)
    assert disk_stats["stores_full"] >= 5  # ENOSPC: each such chunk dropped and counted
    assert disk_stats["stored_chunks"] + disk_stats["stores_full"] == 15
    assert disk_stats["breaker_state"] == 0  # a full filesystem is not a failing disk
    # Redis behind it took every chunk: an engine with an empty disk loads every prompt.
    other = engine(model_dir, disk(small_fs.parent / "empty"), redis_tier(redis))
    for i, p in enumerate(prompts):
        assert serve(other, f"b{i}", p) == 60
        assert other.checked_positions[f"b{i}"] >= 60
