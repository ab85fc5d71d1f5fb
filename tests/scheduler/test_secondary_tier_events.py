"""What a secondary tier announces for KV events (`SecondaryTier.take_events`), on a disk's real
lookups: each chunk once while the tier holds it; withdrawn when a worker evicts it (then a miss
at once), while the breaker is open (announced again when it closes), and never announced when
its write ended after a worker had already evicted it. The workers' side is played here."""

from __future__ import annotations

from pathlib import Path

from test_secondary_tier_chain import answered, keys, lookups, stored

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


def test_an_open_breaker_withdraws_everything_and_a_promotion_announces_it_again(tmp_path):
    tier, store = make(tmp_path)
    written(tier, store, 0, 2)
    tier.take_events()
    tier.lookups.note_workers_down(True)
    assert [(kind, sorted(ks)) for kind, ks in events(tier)] == [("removed", [0, 1])]
    # While it is down nothing is announced; closing announces nothing either (what the tier
    # still holds is not known until looked at).
    written(tier, store, 2, 1)
    assert events(tier) == []
    tier.lookups.note_workers_down(False)
    assert events(tier) == []
    # A promotion finds chunks 0 and 1 there: announced again.
    store.reset()
    ks = keys(0, 2)
    assert tier.promote("r", ks, 0, 0, 2, 0)
    (job,) = tier.take_jobs()[0]
    tier.promoted(job.job_id, 1, b"\x01\x01")
    assert events(tier) == [("stored", [0, 1])]


def test_a_write_that_ends_after_its_chunk_was_evicted_is_not_announced(tmp_path):
    tier, store = make(tmp_path)
    job = written(tier, store, 0, 2, end=False)
    # The worker wrote chunk 0, evicted it for a later write, then reported the job.
    tier.evicted([keys(0, 1).to_list()[0]])
    tier.cascaded(job, 1, 2, b"\x01\x01")
    assert events(tier) == [("stored", [1])]


def test_a_chunk_evicted_while_other_writes_are_out_is_announced_when_written_again(tmp_path):
    tier, store = make(tmp_path)
    written(tier, store, 0, 2)
    other = written(tier, store, 2, 1, end=False)  # chunk 2's write is still out
    tier.evicted([keys(0, 1).to_list()[0]])
    assert events(tier) == [("stored", [0, 1]), ("removed", [0])]
    # Chunk 0, recomputed, is written again while chunk 2's write is still out.
    store.reset()
    again = written(tier, store, 0, 1, end=False)
    tier.cascaded(other, 1, 1, b"\x01")
    tier.cascaded(again, 1, 1, b"\x01")
    assert events(tier) == [("stored", [2]), ("stored", [0])]
    assert tier.lookups.lookup_prefix(keys(0, 1).view(0, 1), "r") == (1, False)


def test_a_tier_whose_evictions_go_unseen_keeps_nothing(tmp_path):
    """A shared tier (REMOTE): every write announced, every failed load withdrawn, and no
    per-chunk state kept for either."""
    store = CpuStore(16, enable_events=True)
    tier = SecondaryTier(store, lookups(tmp_path), SchedulerStats(), world_size=1)
    written(tier, store, 0, 2)
    store.reset()
    written(tier, store, 0, 1)
    assert events(tier) == [("stored", [0, 1]), ("stored", [0])]
    assert not tier._announced._keys
    tier.lookups.note_workers_down(True)
    assert events(tier) == []  # one replica's breaker is not the shared tier's state


def test_events_are_off_unless_the_store_records_its_own(tmp_path):
    store = CpuStore(16)
    tier = SecondaryTier(store, lookups(tmp_path), SchedulerStats(), world_size=1)
    written(tier, store, 0, 2)
    tier.evicted([keys(0, 1).to_list()[0]])
    assert tier.take_events() == []


def test_a_shared_tier_lookup_that_finds_a_chunk_gone_withdraws_it_once(tmp_path):
    """Another replica may have announced it, and the tier evicts unseen."""
    store = CpuStore(16, enable_events=True)
    tier = SecondaryTier(store, lookups(tmp_path), SchedulerStats(), world_size=1)
    ks = keys(0, 3)
    tier.lookups.mark_stored(ks.to_list()[:1])  # chunk 0 there; 1 and 2 are not
    assert tier.promote("r", ks, 0, 0, 3, 0)  # chunk 0 promoted; a probe looks for chunk 1
    tier.take_jobs()  # the step's end: the probe goes out
    answered(tier.lookups)
    assert events(tier) == []  # not known to be gone until the probe has answered
    tier.promote("r", ks, 0, 1, 3, 0)
    tier.promote("r", ks, 0, 1, 3, 0)  # asked again: said once
    assert events(tier) == [("removed", [1])]
