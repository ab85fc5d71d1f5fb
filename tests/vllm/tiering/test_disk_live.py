"""The disk tier when it counts, through both seams (`KVOffloadConnector`'s `secondary_tiers`, and
vLLM's `TieringOffloadingSpec`), on vLLM 0.33's real scheduler and this machine's filesystems,
with the shipped defaults (a rescan every 10 s: no test waits for one):

- engines running at once on one directory load what the other stored the step before (a lookup
  the index cannot answer looks for the files on the I/O threads), also in a chain whose Redis
  was killed;
- an engine started on a full filesystem (a tmpfs the test mounts) serves what is on it, drops
  its stores while full and writes again once files are removed;
- a read-only mount (a bind mount the test makes read-only) serves, with or without
  `read_only: true`, and never retries writes in a loop.

The rig checks every loaded position byte for byte before each forward pass. 12-token chunks of
4-token blocks: a 60-token prompt is 5 chunks.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from rig import Rig, make_rig, prompt
from tiering_rig import make_tiering_rig

from kvoffload.vllm import DiskTier
from mounts import fill, read_only, tmpfs
from redis_server import RedisServer

PROMPT, OTHER, THIRD = prompt(7, 60), prompt(8, 60), prompt(9, 60)
NAMESPACE = "tiny-llama@test"


@pytest.fixture(params=["connector", "tiering"])
def disk_seam(request: pytest.FixtureRequest) -> str:
    """`KVOffloadConnector` with `secondary_tiers`, or vLLM's own tiering."""
    return str(request.param)


def disk(path: Path, **options: object) -> dict:
    return {
        "type": "DiskTier",
        "module_path": "kvoffload.vllm",
        "path": str(path),
        "capacity_bytes": 1 << 30,
        "namespace": NAMESPACE,
        **options,
    }


def redis_tier(server: RedisServer) -> dict:
    return {
        "type": "RedisTier",
        "module_path": "kvoffload.vllm",
        "url": server.url,
        "namespace": NAMESPACE,
    }


def engine(seam: str, model_dir: str, *tiers: dict, is_async: bool = False) -> Rig:
    """An engine as an operator starts it: its first request comes at once (no wait for the
    start-up scan of the directory)."""
    if seam == "tiering":
        return make_tiering_rig(model_dir, list(tiers), is_async=is_async)
    return make_rig(model_dir, is_async=is_async, extra={"secondary_tiers": list(tiers)})


def serve(rig: Rig, rid: str, tokens: list[int]) -> int:
    """Runs one request to completion, and until the writes behind the CPU tier have ended;
    returns the tokens vLLM says the connector loaded."""
    rig.add(rid, tokens, 2)
    rig.run(max_steps=50_000)
    for tier in _tiering(rig):
        tier.drain_jobs()
    return rig.external_hits.get(rid, 0)


def _tiering(rig: Rig) -> list:
    scheduler = getattr(rig.connector, "connector_scheduler", None)
    return [] if scheduler is None else list(scheduler.manager.secondary_tiers)


def disk_stats(seam: str, rig: Rig) -> dict[str, int]:
    """The counters of the data path that reads and writes the disk (the worker's, through our
    connector; the tier's, inside vLLM's tiering)."""
    if seam == "tiering":
        (tier, *_) = _tiering(rig)
        assert isinstance(tier, DiskTier)
        return tier.stats()
    return rig.worker._worker().tiers[0].client.stats()


def lookup_stats(seam: str, rig: Rig) -> dict[str, int]:
    """The counters of the handle that answers the scheduler's lookups (its probes among them)."""
    if seam == "tiering":
        return disk_stats(seam, rig)
    (lookups, *_) = rig.connector._sched().tier_lookups
    return lookups._client.stats()


def running(seam: str, rig: Rig) -> Rig:
    """Waits until the engine's start-up scan of the directory is done: it has been running a
    while, and what others write from now on it learns of only by looking (or a rescan)."""
    deadline = time.monotonic() + 10
    disks = (
        [t for t in _tiering(rig) if isinstance(t, DiskTier)]
        if seam == "tiering"
        else rig.connector._sched().tier_lookups
    )
    while not all(getattr(d, "scanned", True) for d in disks):
        assert time.monotonic() < deadline, "the directory was never indexed"
        time.sleep(0.001)
    return rig


def files(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".tmp-")]


def test_running_engines_load_what_the_other_stored_the_step_before(
    model_dir, tmp_path, disk_seam, is_async
):
    one = running(disk_seam, engine(disk_seam, model_dir, disk(tmp_path), is_async=is_async))
    two = running(disk_seam, engine(disk_seam, model_dir, disk(tmp_path), is_async=is_async))
    assert serve(one, "a", PROMPT) == 0
    assert serve(two, "b", PROMPT) == 60
    assert two.checked_positions["b"] >= 60
    assert serve(two, "c", OTHER) == 0
    assert serve(one, "d", OTHER) == 60
    assert one.checked_positions["d"] >= 60
    assert disk_stats(disk_seam, one)["loaded_chunks"] == 5
    # Found by looking for the files, not by a rescan (10 s away).
    assert lookup_stats(disk_seam, one)["probe_hits"] == 5
    assert lookup_stats(disk_seam, two)["probe_hits"] == 5
    assert len(files(tmp_path)) == 10


def test_in_a_chain_whose_redis_was_killed_the_shared_disk_still_serves(
    model_dir, tmp_path, disk_seam, redis
):
    chain = (disk(tmp_path), redis_tier(redis))
    one = running(disk_seam, engine(disk_seam, model_dir, *chain))
    two = running(disk_seam, engine(disk_seam, model_dir, *chain))
    redis.stop()
    assert serve(one, "a", PROMPT) == 0
    assert serve(two, "b", PROMPT) == 60
    assert two.checked_positions["b"] >= 60
    assert disk_stats(disk_seam, two)["loaded_chunks"] == 5
    assert lookup_stats(disk_seam, two)["probe_hits"] == 5


def test_an_engine_started_on_a_full_filesystem_serves_it_and_writes_once_there_is_room(
    model_dir, tmp_path, disk_seam
):
    with tmpfs(tmp_path / "fs", "256k") as fs:
        path = fs / "tier"
        serve(engine(disk_seam, model_dir, disk(path)), "a", PROMPT)
        assert len(files(path)) == 5
        filler = fill(fs)
        rig = engine(disk_seam, model_dir, disk(path))  # a restart on the full filesystem
        assert serve(rig, "b", PROMPT) == 60
        assert rig.checked_positions["b"] >= 60
        # Its stores are dropped while it is full (one tried per I/O thread at most, the rest
        # without I/O) and counted; a full filesystem is no failing disk.
        assert serve(rig, "c", OTHER) == 0
        s = disk_stats(disk_seam, rig)
        assert (s["stores_full"], s["stored_chunks"], s["breaker_state"]) == (5, 0, 0)
        assert 1 <= s["store_failures"] <= 5
        assert len(files(path)) == 5
        # Files removed: the next prompt's stores are written, and another engine loads them.
        filler.unlink()
        assert serve(rig, "d", THIRD) == 0
        assert disk_stats(disk_seam, rig)["stored_chunks"] == 5
        assert serve(engine(disk_seam, model_dir, disk(path)), "e", THIRD) == 60


@pytest.mark.parametrize("said", [False, True], ids=["detected", "read_only"])
def test_a_read_only_mount_serves_and_never_retries_writes_in_a_loop(
    model_dir, tmp_path, disk_seam, said
):
    src = tmp_path / "src"
    writer = engine(disk_seam, model_dir, disk(src))
    serve(writer, "a", PROMPT)
    with read_only(src, tmp_path / "ro") as ro:
        options = {"read_only": True} if said else {}
        rig = engine(disk_seam, model_dir, disk(ro, **options))
        assert serve(rig, "b", PROMPT) == 60
        assert rig.checked_positions["b"] >= 60
        for i, p in enumerate([OTHER, prompt(10, 60), prompt(11, 60)]):
            assert serve(rig, f"c{i}", p) == 0
        s = disk_stats(disk_seam, rig)
        # 15 chunks not written: at most one try per I/O thread before the first refusal
        # closed the gate for 30 s (none with read_only: true), and no breaker tripped.
        assert s["breaker_state"] == 0 and s["stored_chunks"] == 0
        if said and disk_seam == "connector":
            assert (s["store_failures"], s["stores_read_only"]) == (0, 0)  # never sent
        elif said:
            assert (s["store_failures"], s["stores_read_only"]) == (0, 15)
        else:
            assert 1 <= s["store_failures"] <= 5 and s["stores_read_only"] == 15
        assert len(files(src)) == 5
        # What a writer adds to the directory meanwhile is found at the next lookup.
        serve(writer, "d", THIRD)
        assert serve(rig, "e", THIRD) == 60
        assert rig.checked_positions["e"] >= 60
