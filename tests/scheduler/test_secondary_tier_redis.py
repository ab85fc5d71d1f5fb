"""`SecondaryTier` (the scheduler's half of a Redis tier), engine-agnostic: a real `RedisLookups`
over a real `RedisClient` against a real `redis-server`, a real `CpuStore`, and (unless a test
says otherwise) two workers, simulated by reporting each promotion and cascade twice, one worker
each time."""

from __future__ import annotations

import hashlib
import time

import numpy as np

from kvoffload.scheduler.secondary_tier import SecondaryTier
from kvoffload.scheduler.stats import SchedulerStats
from kvoffload.store import CpuStore, KeyList, KeyStatus
from kvoffload.tiers import OK
from kvoffload.tiers.redis import RedisClient, RedisLookups, RedisTierConfig

CHUNK = 4096
DIGEST = hashlib.blake2b(b"shared-tier-test", digest_size=16).digest()
ABSENT, PENDING, READY = KeyStatus.ABSENT, KeyStatus.PENDING, KeyStatus.READY


def remote_client(url: str) -> RedisClient:
    config = RedisTierConfig.from_dict({"url": url, "namespace": "shared-tier-test"})
    return RedisClient(config, DIGEST, CHUNK, connections=1)


def chunk_keys(n: int, salt: int) -> KeyList:
    return KeyList([bytes([salt]) * 28 + i.to_bytes(4, "big") for i in range(n)])


def put_remote(url: str, keys: list[bytes]) -> None:
    """Writes `keys` (one chunk each) to the server and waits for the store to complete."""
    writer = remote_client(url)
    buffer = np.zeros(len(keys) * CHUNK, dtype=np.uint8)
    job = writer.store(keys, buffer, [i * CHUNK for i in range(len(keys))])
    deadline = time.monotonic() + 30
    statuses = None
    while statuses is None:
        assert time.monotonic() < deadline, "the store never completed"
        statuses = dict(writer.wait(0.5)).get(job)
    assert statuses == bytes([OK]) * len(keys)
    writer.drain(5)
    writer.close()


def make_tier(
    url: str, num_slots: int, world_size: int = 2, events: bool = False, **options: object
):
    store = CpuStore(num_slots, enable_events=events)
    stats = SchedulerStats()
    lookups = RedisLookups(remote_client(url))
    tier = SecondaryTier(store, lookups, stats, world_size=world_size, **options)
    return tier, store, stats, lookups


def fill(store: CpuStore, keys, rank: int | None = None) -> np.ndarray:
    """Stores `keys` in the CPU tier (ready); returns their slots."""
    plan = store.prepare_store(keys, rank=rank)
    assert plan is not None and len(plan.keys) == len(keys)
    store.complete_store(plan.keys)
    return plan.slots.copy()


def step_until_answered(tier: SecondaryTier, *args):
    """Asks `tier.promote(*args)` once per simulated scheduler step (each step ends with
    `take_jobs`, which sends the step's lookups) until a promotion comes out or the remote tier
    says it adds nothing. Returns (last verdict, promotions, steps)."""
    deadline = time.monotonic() + 30
    steps = 0
    while True:
        assert time.monotonic() < deadline, "the remote tier never answered"
        verdict = tier.promote(*args)
        steps += 1
        promotions, cascades = tier.take_jobs()
        assert cascades == []
        if promotions or verdict is False:
            return verdict, promotions, steps
        assert verdict is True  # an answer is still out
        time.sleep(0.002)


def statuses(store: CpuStore, keys) -> list[int]:
    return store.lookup(keys).tolist()


# --- promote --------------------------------------------------------------------------------------


def test_promote_waits_for_answers_then_reserves_the_leading_run_of_hits(redis):
    ks = chunk_keys(8, salt=1)
    k = ks.to_list()
    put_remote(redis.url, [k[2], k[3], k[4], k[6]])  # k5 misses; k6 is past the miss
    tier, store, stats, lookups = make_tier(redis.url, num_slots=16)
    rank = store.new_rank()
    prefix_slots = fill(store, ks.view(0, 2), rank=rank)

    # The first ask: every verdict is pending, nothing is reserved, the keys are only queued.
    assert tier.promote("r", ks, 0, 2, 8, rank) is True
    assert statuses(store, ks) == [READY, READY] + [ABSENT] * 6
    assert lookups.in_flight() == 0
    assert tier.take_jobs() == ([], [])  # the step's lookups go out as one job
    assert lookups.in_flight() == 1

    verdict, promotions, steps = step_until_answered(tier, "r", ks, 0, 2, 8, rank)
    assert verdict is True  # a promotion started: ask again once it has landed
    (job,) = promotions
    assert job.keys.to_list() == k[2:5]
    assert len(job.slots) == 3 and len(set(job.slots.tolist())) == 3
    assert not set(job.slots.tolist()) & set(prefix_slots.tolist())
    assert statuses(store, ks) == [READY, READY, PENDING, PENDING, PENDING] + [ABSENT] * 3
    assert store.stats().pending == 3
    assert stats.secondary_promotions == 1
    assert stats.secondary_promotion_refusals == 0
    assert stats.secondary_lookups == 1 + steps
    # k6 is on the server but after the first miss: not promoted, nor is any job left over.
    assert tier.take_jobs() == ([], [])


def test_promotion_never_evicts_the_cpu_prefix_it_extends(redis):
    ks = chunk_keys(5, salt=2)
    k = ks.to_list()
    other = chunk_keys(1, salt=3)
    put_remote(redis.url, k[2:5])
    # 5 slots: the prefix (k0, k1, first in line for eviction) and another request's key are
    # resident, 2 are free; promoting k2..k4 needs 3, so exactly one resident key must go.
    tier, store, _, _ = make_tier(redis.url, num_slots=5)
    rank = store.new_rank()
    prefix_slots = fill(store, ks.view(0, 2), rank=rank)
    (other_slot,) = fill(store, other, rank=store.new_rank()).tolist()
    assert store.stats().evictions == 0

    verdict, (job,), _ = step_until_answered(tier, "r", ks, 0, 2, 5, rank)
    assert verdict is True
    assert job.keys.to_list() == k[2:5]
    assert statuses(store, ks) == [READY, READY, PENDING, PENDING, PENDING]
    assert statuses(store, other) == [ABSENT]  # the other request's key made room
    assert store.stats().evictions == 1
    assert other_slot in job.slots.tolist()
    assert not set(job.slots.tolist()) & set(prefix_slots.tolist())
    store.check_invariants()


def test_promote_reports_no_gain_when_the_first_key_misses(redis):
    ks = chunk_keys(3, salt=4)
    put_remote(redis.url, ks.to_list()[1:])  # k1 and k2 are there, k0 is not
    tier, store, stats, _ = make_tier(redis.url, num_slots=8)
    verdict, promotions, _ = step_until_answered(tier, "r", ks, 0, 0, 3, store.new_rank())
    assert verdict is False and promotions == []
    assert statuses(store, ks) == [ABSENT] * 3
    assert stats.secondary_promotions == 0 and stats.secondary_promotion_refusals == 0


def test_promote_is_refused_when_every_slot_is_pending_or_pinned(redis):
    ks = chunk_keys(3, salt=5)
    put_remote(redis.url, ks.to_list())
    tier, store, stats, _ = make_tier(redis.url, num_slots=4)
    busy = chunk_keys(4, salt=6)
    assert store.prepare_store(busy.view(0, 2)) is not None  # 2 slots pending, never completed
    fill(store, busy.view(2, 4))
    store.prepare_load(busy.view(2, 4))  # 2 slots pinned by a load
    rank = store.new_rank()

    # Only k0 asked: while it is out the answer is "ask again", with no refusal counted.
    assert tier.promote("r", ks, 0, 0, 1, rank) is True
    assert stats.secondary_promotion_refusals == 0
    verdict, promotions, _ = step_until_answered(tier, "r", ks, 0, 0, 1, rank)
    assert verdict is False  # a hit, but no slot to give it, and nothing else pending
    assert promotions == []
    assert stats.secondary_promotion_refusals == 1

    # k0 answered, k1 and k2 newly asked: still refused, but an answer is out, so ask again.
    assert tier.promote("r", ks, 0, 0, 3, rank) is True
    assert stats.secondary_promotion_refusals == 2
    assert stats.secondary_promotions == 0
    assert tier.take_jobs() == ([], [])
    assert statuses(store, ks) == [ABSENT] * 3
    assert store.stats().pending == 2 and store.stats().pinned == 2


# --- promoted -------------------------------------------------------------------------------------


def promotion(redis, ks: KeyList, start: int, num_slots: int = 16):
    """A tier whose CPU store has `ks[:start]` and a promotion of the rest, handed out."""
    put_remote(redis.url, ks.to_list()[start:])
    tier, store, stats, lookups = make_tier(redis.url, num_slots=num_slots)
    rank = store.new_rank()
    if start:
        fill(store, ks.view(0, start), rank=rank)
    verdict, (job,), _ = step_until_answered(tier, "r", ks, 0, start, len(ks), rank)
    assert verdict is True
    assert job.keys.to_list() == ks.to_list()[start:]
    return tier, store, stats, lookups, job, rank


def test_a_promotion_ends_after_both_workers_report(redis):
    ks = chunk_keys(4, salt=7)
    k = ks.to_list()
    tier, store, stats, lookups, job, rank = promotion(redis, ks, start=1)
    assert statuses(store, ks) == [READY, PENDING, PENDING, PENDING]

    tier.promoted(job.job_id, 1, bytes([1, 0, 1]))  # worker 0 could not fill k2
    assert statuses(store, ks) == [READY, PENDING, PENDING, PENDING]
    assert tier.has_work
    assert stats.secondary_chunks_promoted == 0 and stats.secondary_chunks_failed == 0

    tier.promoted(job.job_id, 1, bytes([1, 1, 0]))  # worker 1 could not fill k3
    assert statuses(store, ks) == [READY, READY, ABSENT, ABSENT]
    assert store.stats().pending == 0 and store.stats().ready == 2
    assert stats.secondary_chunks_promoted == 1
    assert stats.secondary_chunks_failed == 2
    assert not tier.has_work

    # The failed keys are on the server, yet they count as misses now: nothing more to promote.
    assert [lookups.lookup(key, "r") for key in k[1:]] == [True, False, False]
    assert tier.promote("r", ks, 0, 2, 4, rank) is False
    assert tier.take_jobs() == ([], [])
    assert statuses(store, ks) == [READY, READY, ABSENT, ABSENT]
    assert stats.secondary_promotions == 1
    assert stats.secondary_promotion_refusals == 0
    # Nor for a later request (the negative cache), which asks the server nothing about them.
    lookups.cleanup("r")
    assert tier.promote("r2", ks, 0, 2, 4, rank) is False
    assert tier.take_jobs() == ([], [])
    assert lookups.in_flight() == 0


def test_a_promotion_both_workers_filled_is_ready_and_loadable(redis):
    ks = chunk_keys(3, salt=8)
    tier, store, stats, _, job, _ = promotion(redis, ks, start=0)
    tier.promoted(job.job_id, 1, bytes([1, 1, 1]))
    tier.promoted(job.job_id, 1, bytes([1, 1, 1]))
    assert statuses(store, ks) == [READY] * 3
    assert store.lookup_prefix(ks) == (3, False)
    assert store.prepare_load(ks).tolist() == job.slots.tolist()  # where the workers wrote
    assert stats.secondary_chunks_promoted == 3 and stats.secondary_chunks_failed == 0


def test_one_report_for_both_workers_ends_a_promotion(redis):
    ks = chunk_keys(2, salt=9)
    tier, store, stats, _, job, _ = promotion(redis, ks, start=0)
    tier.promoted(job.job_id, 2, bytes([0, 1]))  # already aggregated over both workers
    assert statuses(store, ks) == [ABSENT, READY]
    assert stats.secondary_chunks_promoted == 1 and stats.secondary_chunks_failed == 1
    assert not tier.has_work


def wrote(*in_tier: int) -> tuple[int, bytes]:
    """One writer's report of a cascade: shards written, and per key 1 if it is in the tier."""
    return sum(in_tier), bytes(in_tier)


# --- stored / cascaded ----------------------------------------------------------------------------


def test_a_completed_store_is_pinned_and_cascaded_until_both_workers_report(redis):
    tier, store, stats, _ = make_tier(redis.url, num_slots=8)
    ks = chunk_keys(3, salt=10)
    slots = fill(store, ks)
    assert tier.max_cascade_slots == 4  # half the CPU tier by default

    tier.stored(ks)
    assert store.stats().pinned == 3
    assert tier.has_work
    promotions, (job,) = tier.take_jobs()
    assert promotions == []
    assert job.keys.to_list() == ks.to_list()
    assert job.slots.tolist() == slots.tolist()
    assert tier.take_jobs() == ([], [])  # handed out once

    tier.cascaded(job.job_id, 1, *wrote(1, 1, 1))
    assert store.stats().pinned == 3
    assert tier.has_work
    tier.cascaded(job.job_id, 1, *wrote(1, 0, 0))
    assert store.stats().pinned == 0
    assert statuses(store, ks) == [READY] * 3
    assert stats.secondary_shards_written == 4
    assert stats.secondary_writes_dropped == 2
    assert not tier.has_work
    store.check_invariants()


def test_keys_no_longer_ready_at_their_turn_are_dropped_not_pinned(redis):
    # One worker: a chunk and its one shard count alike in secondary_writes_dropped (see the test
    # below for two).
    tier, store, stats, _ = make_tier(redis.url, num_slots=8, world_size=1)
    ks = chunk_keys(4, salt=11)
    fill(store, ks.view(0, 2))
    assert store.prepare_store(ks.view(2, 3)) is not None  # k2 pending, k3 absent
    tier.stored(ks)
    assert store.stats().pinned == 2
    _, (job,) = tier.take_jobs()
    assert job.keys.to_list() == ks.to_list()[:2]
    assert stats.secondary_writes_dropped == 2
    assert statuses(store, ks) == [READY, READY, PENDING, ABSENT]  # k2 is left pending


def test_past_max_cascade_slots_a_store_waits_its_turn_in_store_order(redis):
    tier, store, stats, _ = make_tier(redis.url, num_slots=8, max_cascade_slots=2)
    ks = chunk_keys(3, salt=12)
    fill(store, ks)
    tier.stored(ks)
    assert store.stats().pinned == 2  # the budget, no more
    _, (first,) = tier.take_jobs()
    assert first.keys.to_list() == ks.to_list()[:2]
    assert stats.secondary_writes_dropped == 0
    assert tier.take_jobs() == ([], [])  # k2 waits for a pin to end
    assert tier.has_work

    tier.cascaded(first.job_id, 1, *wrote(1, 1))
    assert store.stats().pinned == 2 and tier.take_jobs() == ([], [])
    tier.cascaded(first.job_id, 1, *wrote(1, 1))
    assert store.stats().pinned == 1
    _, (second,) = tier.take_jobs()
    assert second.keys.to_list() == ks.to_list()[2:]
    assert tier.has_work
    tier.cascaded(second.job_id, 1, *wrote(1))
    tier.cascaded(second.job_id, 1, *wrote(0))
    assert store.stats().pinned == 0
    assert stats.secondary_shards_written == 5 and stats.secondary_writes_dropped == 1
    assert not tier.has_work


def test_the_backlog_drops_its_oldest_keys_past_num_slots_and_evicted_ones_at_their_turn(redis):
    tier, store, stats, _ = make_tier(redis.url, num_slots=4, max_cascade_slots=1, world_size=1)
    a = chunk_keys(4, salt=13)
    b = chunk_keys(3, salt=14)
    fill(store, a)
    tier.stored(a)
    _, (job_a0,) = tier.take_jobs()
    assert job_a0.keys.to_list() == a.to_list()[:1]  # a1..a3 wait
    store.reset()  # a1..a3 leave the CPU tier; a0 stays until its write ends
    fill(store, b)
    tier.stored(b)  # 3 + 3 keys waiting, 4 kept: a1 and a2 are pushed out
    assert stats.secondary_writes_dropped == 2
    assert store.stats().used_slots == 4  # b0..b2, and a0's slot, held until its write ends

    tier.cascaded(job_a0.job_id, 1, *wrote(1))
    assert store.stats().used_slots == 3 and store.stats().pinned == 1  # a0 gone, b0 pinned
    assert stats.secondary_writes_dropped == 3  # a3's turn: it was evicted
    _, (job_b0,) = tier.take_jobs()
    assert job_b0.keys.to_list() == b.to_list()[:1]
    tier.cascaded(job_b0.job_id, 1, *wrote(1))
    _, (job_b1,) = tier.take_jobs()
    assert job_b1.keys.to_list() == b.to_list()[1:2]
    tier.cascaded(job_b1.job_id, 1, *wrote(1))
    _, (job_b2,) = tier.take_jobs()
    assert job_b2.keys.to_list() == b.to_list()[2:]
    assert tier.has_work
    tier.cascaded(job_b2.job_id, 1, *wrote(1))
    assert not tier.has_work
    assert stats.secondary_shards_written == 4 and stats.secondary_writes_dropped == 3
    assert store.stats().pinned == 0 and statuses(store, b) == [READY] * 3
    store.check_invariants()


def test_a_chunk_the_scheduler_drops_counts_one_shard_per_worker(redis):
    tier, store, stats, _ = make_tier(redis.url, num_slots=8, max_cascade_slots=1)
    ks = chunk_keys(2, salt=15)
    fill(store, ks)
    tier.stored(ks)  # k0 pinned, k1 waits
    _, (job,) = tier.take_jobs()
    store.reset()  # k1 leaves the CPU tier before its turn: neither worker will write it
    tier.cascaded(job.job_id, 1, *wrote(1))
    tier.cascaded(job.job_id, 1, *wrote(0))  # worker 1 did not write its shard of k0: 1 shard
    assert stats.secondary_shards_written == 1
    # Shards not written: k0's one, and both of k1's.
    assert stats.secondary_writes_dropped == 1 + 2


def test_with_one_writer_a_cascade_ends_on_its_report_and_counts_one_shard_per_chunk(redis):
    # TP=2 on MLA: both ranks hold the same bytes, rank 0 alone writes them.
    tier, store, stats, _ = make_tier(redis.url, num_slots=8, writers=1, max_cascade_slots=2)
    ks = chunk_keys(3, salt=16)
    fill(store, ks)
    tier.stored(ks)
    _, (job,) = tier.take_jobs()
    assert job.keys.to_list() == ks.to_list()[:2]  # k2 waits for the budget
    store.reset()  # k2 leaves the CPU tier before its turn: one shard is not written, not two
    tier.cascaded(job.job_id, 1, *wrote(1, 0))
    assert not tier.has_work and store.stats().pinned == 0
    assert (stats.secondary_shards_written, stats.secondary_writes_dropped) == (1, 1 + 1)


def test_events_name_chunks_every_writer_put_in_the_tier_and_promotions_that_failed(redis):
    ks = chunk_keys(4, salt=17)
    tier, store, _, _ = make_tier(redis.url, num_slots=8, events=True)
    fill(store, ks.view(0, 3))
    tier.stored(ks.view(0, 3))
    _, (job,) = tier.take_jobs()
    tier.cascaded(job.job_id, 1, *wrote(1, 1, 0))
    assert tier.take_events() == []  # the other writer has not reported
    tier.cascaded(job.job_id, 1, *wrote(0, 1, 0))
    (event,) = tier.take_events()
    assert (event.kind, event.keys) == ("stored", ks.to_list()[1:2])  # only k1 is whole there
    assert tier.take_events() == []

    put_remote(redis.url, ks.to_list()[3:])
    rank = store.new_rank()
    _, (promotion,), _ = step_until_answered(tier, "r", ks, 0, 3, 4, rank)
    tier.promoted(promotion.job_id, 2, bytes([0]))  # k3 evicted under the engine's feet
    (event,) = tier.take_events()
    assert (event.kind, event.keys) == ("removed", ks.to_list()[3:])


def test_without_events_the_tier_records_none(redis):
    tier, store, _, _ = make_tier(redis.url, num_slots=8)
    ks = chunk_keys(1, salt=18)
    fill(store, ks)
    tier.stored(ks)
    _, (job,) = tier.take_jobs()
    tier.cascaded(job.job_id, 2, *wrote(2))
    assert tier.take_events() == [] and not tier.has_work


# --- has_work ------------------------------------------------------------------------------------


def test_has_work_until_lookups_promotions_and_cascades_have_all_ended(redis):
    ks = chunk_keys(2, salt=14)
    put_remote(redis.url, ks.to_list())
    tier, store, _, lookups = make_tier(redis.url, num_slots=8)
    assert not tier.has_work
    rank = store.new_rank()

    tier.promote("r", ks, 0, 0, 2, rank)
    tier.take_jobs()
    assert lookups.in_flight() == 1
    assert tier.has_work  # a lookup is out
    _, (job,), _ = step_until_answered(tier, "r", ks, 0, 0, 2, rank)
    assert lookups.in_flight() == 0
    assert tier.has_work  # the promotion is open
    tier.promoted(job.job_id, 1, bytes([1, 1]))
    assert tier.has_work
    tier.promoted(job.job_id, 1, bytes([1, 1]))
    assert not tier.has_work

    tier.stored(ks)
    assert tier.has_work  # a cascade not yet handed out
    _, (cascade,) = tier.take_jobs()
    assert tier.has_work  # handed out, not yet ended
    tier.cascaded(cascade.job_id, 1, *wrote(1, 1))
    assert tier.has_work
    tier.cascaded(cascade.job_id, 1, *wrote(1, 1))
    assert not tier.has_work
    assert lookups.lookup(ks.to_list()[0], "r") is True
    tier.finish_request("r")  # its verdicts are dropped: a new request asks the server anew
    assert lookups.lookup(ks.to_list()[0], "r2") is None


def test_chunks_held_by_their_write_are_hit_while_another_load_is_in_flight(redis):
    """A cascade holds the chunks it writes, but that is not a load: a request that hits them
    while some other request's load is in flight is not sent to ask again."""
    from kvoffload.scheduler import OffloadConfig, OffloadScheduler, RequestUpdate, TierLink
    from sched_driver import TPB, block_hashes

    config = OffloadConfig.from_dict(
        {"tokens_per_block": TPB, "blocks_per_chunk": 3, "cpu_bytes_to_use": 1 << 20}
    )
    link = TierLink(RedisLookups(remote_client(redis.url)))
    sched = OffloadScheduler(config, CpuStore(16), secondary_tiers=[link], world_size=1)

    def stored(rid: str, tokens: list[int]) -> None:
        sched.add_request(rid, len(tokens))
        hashes = block_hashes(tokens)
        assert sched.lookup(rid, 0, len(tokens), hashes, read=False) == 0
        sched.on_allocated(rid, list(range(len(tokens) // TPB)), 0)
        plan = sched.plan_step([RequestUpdate(rid, len(tokens), len(tokens), (), hashes)])
        (job,) = plan.store_jobs
        sched.complete_job(job.job_id, True)

    x, a = list(range(100, 112)), list(range(200, 224))
    stored("x", x)
    stored("a", a)  # its 2 chunks are now held by their write to Redis (behind x's 1)
    assert sched.store.stats().pinned == 3
    sched.add_request("y", len(x) + 1)
    assert sched.lookup("y", 0, len(x) + 1, block_hashes([*x, 1])) == 12
    assert sched.on_allocated("y", list(range(4)), 12) is not None  # y's load is in flight
    sched.add_request("b", len(a) + 1)
    assert sched.lookup("b", 0, len(a) + 1, block_hashes([*a, 1])) == 24  # not None


def test_the_write_budget_follows_a_growing_tier(redis):
    store = CpuStore(64, usable_slots=8)
    tier = SecondaryTier(
        store, RedisLookups(remote_client(redis.url)), SchedulerStats(), world_size=1
    )
    assert tier.max_cascade_slots == 4  # half of what is usable, not of the 64 slots
    store.set_usable_slots(64)
    assert tier.max_cascade_slots == 32
