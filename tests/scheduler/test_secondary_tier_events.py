"""What a secondary tier announces for KV events (`SecondaryTier.take_events`), on a disk's real
lookups: each chunk once while the tier holds it; withdrawn when a worker evicts it (then a miss
at once), while the breaker is open (announced again when it closes), and never announced when
its write ended after a worker had already evicted it. The workers' side is played here."""

from __future__ import annotations

from pathlib import Path

from test_secondary_tier_chain import keys, lookups, stored

from kvoffload.scheduler import SchedulerStats
from kvoffload.scheduler.secondary_tier import SecondaryTier
from kvoffload.store import CpuStore


def written(tier: SecondaryTier, store: CpuStore, start: int, n: int, *, end: bool = True) -> int:
    """Stores `n` chunks in the CPU tier and writes them on; the write ends unless not `end`."""
    ks = keys(start, n)
    stored(store, ks)
    tier.stored(ks)
    (job,) = tier.take_jobs()[1]
    if end:
        tier.cascaded(job.job_id, 1, n, b"\x01" * n)
    return job.job_id


def events(tier: SecondaryTier) -> list[tuple[str, list[int]]]:
    return [(e.kind, [int.from_bytes(k[:4], "big") for k in e.keys]) for e in tier.take_events()]


def make(path: Path) -> tuple[SecondaryTier, CpuStore]:
    store = CpuStore(16, enable_events=True)
    tier = SecondaryTier(store, lookups(path), SchedulerStats(), world_size=1, locality="LOCAL")
    return tier, store


def test_each_chunk_is_announced_once_and_withdrawn_once(tmp_path):
    tier, store = make(tmp_path)
    written(tier, store, 0, 3)
    assert events(tier) == [("stored", [0, 1, 2])]
    # Gone from the CPU tier, stored there anew and written on again: announced already.
    store.reset()
    written(tier, store, 0, 1)
    assert events(tier) == []
    # A worker evicted chunks 1 and 7 (7 was never announced here): 1 is withdrawn, and gone
    # from the index (a probe looks for its file, which this test never wrote).
    tier.evicted([keys(1, 1).to_list()[0], keys(7, 1).to_list()[0]])
    assert events(tier) == [("removed", [1])]
    assert tier.lookups.lookup_prefix(keys(0, 3).view(0, 3), "r")[0] == 1


def test_an_open_breaker_withdraws_everything_and_a_closed_one_announces_it_again(tmp_path):
    tier, store = make(tmp_path)
    written(tier, store, 0, 2)
    tier.take_events()
    tier.lookups.note_workers_down(True)
    assert [(kind, sorted(ks)) for kind, ks in events(tier)] == [("removed", [0, 1])]
    # While it is down nothing is announced, though the tier's state is still followed.
    written(tier, store, 2, 1)
    tier.evicted([keys(0, 1).to_list()[0]])
    assert events(tier) == []
    tier.lookups.note_workers_down(False)
    assert [(kind, sorted(ks)) for kind, ks in events(tier)] == [("stored", [1, 2])]


def test_a_write_that_ends_after_its_chunk_was_evicted_is_not_announced(tmp_path):
    tier, store = make(tmp_path)
    job = written(tier, store, 0, 2, end=False)
    # The worker wrote chunk 0, evicted it for a later write, then reported the job.
    tier.evicted([keys(0, 1).to_list()[0]])
    tier.cascaded(job, 1, 2, b"\x01\x01")
    assert events(tier) == [("stored", [1])]


def test_events_are_off_unless_the_store_records_its_own(tmp_path):
    store = CpuStore(16)
    tier = SecondaryTier(store, lookups(tmp_path), SchedulerStats(), world_size=1)
    written(tier, store, 0, 2)
    tier.evicted([keys(0, 1).to_list()[0]])
    assert tier.take_events() == []
