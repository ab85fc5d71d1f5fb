"""`DiskTier` inside vLLM 0.33's own tiering (`OffloadingConnector` + `TieringOffloadingSpec`),
driven by vLLM's real scheduler on the CPU rig, on this machine's filesystem (and, chained behind
it, a real `redis-server`).

What engine 1 computed reaches its directory behind vLLM's CPU tier; engine 2 (another engine on
that directory, or a restarted one) loads it through promotion (disk -> CPU region -> "GPU"), and
the rig checks every loaded position byte for byte before each forward pass. 12-token chunks of
4-token blocks: a 60-token prompt is 5 full chunks.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from rig import Rig, prompt
from tiering_rig import make_tiering_rig, redis_tier_entry

from kvoffload import ConfigError
from kvoffload.vllm import DiskTier, RedisTier

PROMPT = prompt(7, 60)


def disk_entry(path: Path, **options: object) -> dict:
    return {
        "type": "DiskTier",
        "module_path": "kvoffload.vllm",
        "path": str(path),
        "capacity_bytes": 1 << 30,
        "namespace": "tiny-llama@test",
        **options,
    }


def engine(model_dir: str, path: Path, is_async: bool = False, **options: object) -> Rig:
    return scanned(make_tiering_rig(model_dir, [disk_entry(path, **options)], is_async=is_async))


def tiers(rig: Rig) -> list:
    return list(rig.connector.connector_scheduler.manager.secondary_tiers)


def scanned(rig: Rig) -> Rig:
    """Waits until each disk tier has indexed what its directory held at start-up (until then
    those chunks are misses: the scan runs beside the engine, never delaying a step)."""
    deadline = time.monotonic() + 10
    while not all(t.scanned for t in tiers(rig) if isinstance(t, DiskTier)):
        assert time.monotonic() < deadline, "the directory was never indexed"
        time.sleep(0.001)
    return rig


def settle(rig: Rig) -> None:
    """Lets the writes behind the CPU tier finish; the manager takes the results next step."""
    for tier in tiers(rig):
        tier.drain_jobs()


def serve(rig: Rig, rid: str, tokens: list[int]) -> int:
    rig.add(rid, tokens, 2)
    rig.run(max_steps=20_000)
    return rig.external_hits.get(rid, 0)


def files(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".tmp-")]


def test_engine_two_loads_what_engine_one_stored_in_one_directory(model_dir, tmp_path, is_async):
    one = engine(model_dir, tmp_path, is_async)
    assert serve(one, "a", PROMPT) == 0
    settle(one)
    assert len(files(tmp_path)) == 5
    two = engine(model_dir, tmp_path, is_async)
    assert serve(two, "b", PROMPT) == 60
    assert two.checked_positions["b"] >= 60  # every loaded position checked byte for byte
    (disk,) = tiers(two)
    assert isinstance(disk, DiskTier)
    assert disk.stats()["loaded_chunks"] == 5


def test_running_engines_sharing_a_directory_find_each_others_chunks(model_dir, tmp_path):
    # Both engines run from the start, with the shipped defaults: engine 2 asks right after
    # engine 1 stored, its next rescan 10 s away.
    one = engine(model_dir, tmp_path)
    two = engine(model_dir, tmp_path)
    serve(one, "a", PROMPT)
    settle(one)
    (disk,) = tiers(two)
    assert disk.stats()["chunks"] == 0  # nothing in its index yet
    assert serve(two, "b", PROMPT) == 60
    assert two.checked_positions["b"] >= 60
    assert disk.stats()["probe_hits"] == 5  # found by looking for the files, not a rescan


def test_a_rescan_takes_in_what_other_engines_wrote(model_dir, tmp_path):
    # What a rescan does beside the lookups' probes: engine 2's index (its capacity's
    # bookkeeping) takes in engine 1's chunks without anybody asking. Every 0.1 s here instead
    # of the default 10 s, so that the test does not wait.
    one = engine(model_dir, tmp_path, rescan_interval_s=0.1)
    two = engine(model_dir, tmp_path, rescan_interval_s=0.1)
    serve(one, "a", PROMPT)
    settle(one)
    (disk,) = tiers(two)
    deadline = time.monotonic() + 10
    while disk.stats()["chunks"] < 5:
        assert time.monotonic() < deadline, "engine 2 never found engine 1's chunks"
        time.sleep(0.02)
    assert serve(two, "b", PROMPT) == 60
    assert disk.stats()["probe_hits"] == 0


def test_a_restarted_engine_serves_what_the_last_one_stored(model_dir, tmp_path):
    prompts = [prompt(300 + i, 24 + 12 * (i % 4)) for i in range(8)]
    one = engine(model_dir, tmp_path)
    for i, p in enumerate(prompts):
        serve(one, f"a{i}", p)
    settle(one)
    for tier in tiers(one):
        tier.shutdown()
    restarted = engine(model_dir, tmp_path)
    hits = [serve(restarted, f"b{i}", p) for i, p in enumerate(prompts)]
    assert hits == [len(p) for p in prompts]


def test_damaged_files_are_recomputed_never_served(model_dir, tmp_path):
    one = engine(model_dir, tmp_path)
    serve(one, "a", PROMPT)
    settle(one)
    for f in files(tmp_path):
        raw = bytearray(f.read_bytes())
        raw[4096 + 10] ^= 0xFF  # one payload byte, past the header block
        f.write_bytes(bytes(raw))
    two = engine(model_dir, tmp_path)
    assert serve(two, "b", PROMPT) == 0  # chunk 0 failed its check: nothing loaded
    assert two.checked_positions["b"] >= 59
    (disk,) = tiers(two)
    assert disk.stats()["corrupt"] >= 1
    # The damaged file was removed; engine 2's own write replaced it: a third engine loads.
    settle(two)
    assert serve(engine(model_dir, tmp_path), "c", PROMPT) == 60


def test_capacity_bytes_holds_the_directory_to_its_size(model_dir, tmp_path):
    # A file: the 4 KiB header block, then a 12-token chunk of vLLM's CPU region for this model
    # (8 KiB: whole 4 KiB blocks already).
    chunk_file = 4096 + 8192
    one = engine(model_dir, tmp_path, capacity_bytes=7 * chunk_file)
    for i in range(4):
        serve(one, f"a{i}", prompt(50 + i, 36))  # 3 chunks each: 12 in all
    settle(one)
    (disk,) = tiers(one)
    assert disk.block_size_bytes == 8192
    assert len(files(tmp_path)) == 7
    assert disk.stats()["evicted"] == 12 - 7


def test_a_chain_promotes_from_the_disk_first_then_redis(model_dir, tmp_path, redis):
    def chained(path: Path) -> Rig:
        return scanned(make_tiering_rig(model_dir, [disk_entry(path), redis_tier_entry(redis.url)]))

    one = chained(tmp_path / "node-1")
    serve(one, "a", PROMPT)
    settle(one)
    assert len(files(tmp_path / "node-1")) == 5  # written to both tiers
    # Another node (its own empty disk) finds the prompt in Redis.
    other = chained(tmp_path / "node-2")
    assert serve(other, "b", PROMPT) == 60
    disk, shared = tiers(other)
    assert isinstance(disk, DiskTier) and isinstance(shared, RedisTier)
    assert (disk.stats()["loaded_chunks"], shared.stats()["loaded_chunks"]) == (0, 5)
    # A restart of node 1 finds it on its own disk, before Redis.
    again = chained(tmp_path / "node-1")
    assert serve(again, "c", PROMPT) == 60
    disk, shared = tiers(again)
    assert (disk.stats()["loaded_chunks"], shared.stats()["loaded_chunks"]) == (5, 0)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"capacity_bytes": None}, "capacity_bytes=None"),
        ({"direct_io": True}, "direct_io=True"),
        ({"locality": "NEAR"}, "locality='NEAR'"),
        ({"pathh": "/x"}, "unknown DiskTier key"),
    ],
)
def test_bad_entries_stop_start_up_naming_the_key(model_dir, tmp_path, options, match):
    with pytest.raises(ConfigError, match=match):
        engine(model_dir, tmp_path, **options)


def test_a_failing_disk_trips_the_breaker_and_the_engine_keeps_serving(model_dir, tmp_path):
    import shutil

    # A cool-down longer than the test, so the tier stays down once tripped.
    one = engine(model_dir, tmp_path, breaker_cooldown_s=600)
    serve(one, "a", PROMPT)
    settle(one)
    (disk,) = tiers(one)
    (namespace_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    # The tier's directory becomes a file: every write fails (ENOTDIR), a real I/O error.
    shutil.rmtree(namespace_dir)
    namespace_dir.write_bytes(b"not a directory")
    for i in range(3):
        serve(one, f"b{i}", prompt(500 + i, 36))
        settle(one)
    stats = disk.stats()
    assert stats["breaker_state"] == 1  # down after 3 failures in a row (the default)
    assert stats["store_failures"] == 3
    assert stats["denied"] >= 1  # the rest failed at once, with no I/O
    # vLLM took the tier's stats every step: the gauge's last value is the breaker's.
    name = "kvoffload:disk_tier_breaker_state"
    gauges = [r["data"][name] for r in one.connector_stats if name in r.get("data", {})]
    assert list(gauges[-1].values()) == [1]
    # The engine serves on, from its CPU tier (lookups of the disk miss at once: the Rust
    # tests check that).
    one.reset_gpu_prefix_cache()
    assert serve(one, "c", PROMPT) == 60
    assert one.checked_positions["c"] >= 60
    assert disk.stats()["load_failures"] == 0
