"""The engine-agnostic scheduler with a chain of two disk tiers (`DiskLookups` on real
directories): the tiers share the CPU tier's write budget, a tier that is down is skipped, and a
lookup goes down the chain. The workers' side is played here: the test reports the writes."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from kvoffload.scheduler import SchedulerStats
from kvoffload.scheduler.secondary_tier import SecondaryTier
from kvoffload.store import CpuStore, KeyList
from kvoffload.tiers.disk import DiskLookups, DiskTierConfig

CHUNK = 16 * 1024
DIGEST = hashlib.blake2b(b"scheduler-chain", digest_size=16).digest()


def lookups(path: Path) -> DiskLookups:
    config = DiskTierConfig.from_dict(
        {"path": str(path), "capacity_bytes": 1 << 30, "namespace": "m@1"}
    )
    found = DiskLookups.open(config, DIGEST, CHUNK, config.capacity_bytes)
    deadline = time.monotonic() + 10
    while not found.scanned:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    return found


def keys(start: int, n: int) -> KeyList:
    return KeyList([i.to_bytes(4, "big") * 9 for i in range(start, start + n)])


def stored(store: CpuStore, ks: KeyList) -> None:
    plan = store.prepare_store(ks)
    assert plan is not None and len(plan.keys) == len(ks)
    store.complete_store(plan.keys)


def answered(found: DiskLookups) -> None:
    """Waits until the probes sent at the step's end (`take_jobs`) are answered."""
    deadline = time.monotonic() + 10
    while found.in_flight():
        assert time.monotonic() < deadline, "a probe was never answered"
        time.sleep(0.001)


def test_a_slow_tier_and_a_fast_one_never_hold_the_whole_cpu_tier(tmp_path):
    store = CpuStore(16)
    stats = SchedulerStats()
    ids = iter(range(1000))
    fast, slow = (
        SecondaryTier(
            store, lookups(tmp_path / name), stats, world_size=1, tier=i, job_ids=ids, share=2
        )
        for i, name in enumerate(("fast", "slow"))
    )
    assert fast.max_cascade_slots == slow.max_cascade_slots == 4  # a quarter each
    for start in range(0, 32, 2):
        ks = keys(start, 2)
        stored(store, ks)
        fast.stored(ks)
        slow.stored(ks)
        # The fast tier's writes end at once; the slow one's never do.
        promotions, cascades = fast.take_jobs()
        assert not promotions
        for job in cascades:
            fast.cascaded(job.job_id, 1, len(job.keys), b"\x01" * len(job.keys))
        slow.take_jobs()
    # The slow tier holds its 4 slots: the rest of the CPU tier still takes stores.
    assert store.stats().pinned == 4
    assert store.prepare_store(keys(100, 12)) is not None
    assert stats.secondary_writes_dropped > 0  # the slow tier's backlog overflowed


def test_a_lookup_goes_down_the_chain_and_skips_a_tier_that_is_down(tmp_path):
    store = CpuStore(16)
    stats = SchedulerStats()
    ids = iter(range(1000))
    first, second = (lookups(tmp_path / name) for name in ("first", "second"))
    tiers = [
        SecondaryTier(store, found, stats, world_size=1, tier=i, job_ids=ids, share=2)
        for i, found in enumerate((first, second))
    ]
    ks = keys(0, 4)
    first.mark_stored(ks.to_list()[:2])  # chunks 0, 1 on the first disk
    second.mark_stored(ks.to_list())  # all four on the second
    # Chunks 0, 1 from the first; its I/O threads look for the files of 2, 3 meanwhile (another
    # engine may have written them since its last rescan).
    assert tiers[0].promote("r", ks, 0, 0, 4, rank=0)
    (job,), _ = tiers[0].take_jobs()
    assert (job.tier, job.keys.to_list()) == (0, ks.to_list()[:2])
    answered(first)
    tiers[0].promoted(job.job_id, 1, b"\x01\x01")
    # None there: the next lookup goes on to the second.
    assert not tiers[0].promote("r", ks, 0, 2, 4, rank=0)
    assert tiers[1].promote("r", ks, 0, 2, 4, rank=0)
    (job,), _ = tiers[1].take_jobs()
    assert (job.tier, job.keys.to_list()) == (1, ks.to_list()[2:])
    # A disk that is down answers nothing (its workers said so), whatever its index holds.
    first.down = True
    assert not tiers[0].promote("s", keys(0, 4), 0, 0, 4, rank=0)
