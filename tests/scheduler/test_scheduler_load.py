"""Lookups and loads: max_load_tokens, unaligned local prefixes, pending keys, preemption,
failures and the flush list."""

import numpy as np
import pytest

from kvoffload.scheduler import RequestUpdate
from sched_driver import Engine, block_hashes, make_scheduler

FIRST = list(range(1, 101))
# Shares its first 40 tokens with FIRST, then diverges: chunk 3 (tokens 36..47) is new.
SECOND = FIRST[:40] + [1000 + i for i in range(60)]


@pytest.fixture(params=[0, 1], ids=["same-step", "one-step-late"])
def lag(request):
    return request.param


def after_first(lag, **extra):
    """A scheduler whose first request stored 3 chunks (36 prompt tokens)."""
    sched, store = make_scheduler(**extra)
    eng = Engine(sched, lag)
    first = eng.run("first", FIRST, num_prompt_tokens=36, kv_tokens=40)
    assert first.stored_offsets == set(range(9))
    store.looked_up.clear()
    return sched, store, eng


@pytest.mark.parametrize(
    ("cap", "hit", "offsets"),
    [
        (None, 36, list(range(9))),
        (0, 0, []),
        (11, 0, []),
        (24, 24, list(range(6))),
        (30, 24, list(range(6))),
        ("24", 36, list(range(9))),
        (24.5, 36, list(range(9))),
        (-1, 36, list(range(9))),
        (True, 36, list(range(9))),
    ],
)
def test_max_load_tokens(lag, cap, hit, offsets):
    sched, store, eng = after_first(lag)
    params = None if cap is None else {"max_load_tokens": cap}
    second = eng.run("second", SECOND, num_prompt_tokens=52, kv_tokens=53, params=params)
    assert second.lookup == hit
    assert second.loaded_offsets == offsets
    if cap in (0, 11):
        assert store.looked_up == []  # less than a chunk allowed: the store is not even asked
    # The second request's own stores are unaffected by the load cap: its new chunk 3 is stored
    # (and with no load, chunks 0..2 are offered again but are already there).
    assert 9 in second.stored_offsets and second.stored_offsets <= set(range(12))
    assert {k for j in second.store_jobs for k in j.keys} == {block_hashes(SECOND)[11] + bytes(4)}
    assert sched.stats().hit_tokens == hit


def test_local_prefix_on_chunk_boundary_loads_only_the_next_chunk(lag):
    _, store, eng = after_first(lag)
    r = eng.run("second", SECOND, 52, 53, {"max_load_tokens": 12}, num_local_tokens=12)
    assert r.lookup == 12
    assert r.loaded_offsets == [3, 4, 5]
    assert r.load.skip_leading_blocks == 0
    assert store.looked_up == [store.looked_up[0]] and len(store.looked_up[0]) == 1


def test_unaligned_local_prefix_skips_the_blocks_already_on_gpu(lag):
    _, _, eng = after_first(lag)
    r = eng.run("second", SECOND, 52, 53, num_local_tokens=4)
    assert r.lookup == 32
    assert r.load.first_chunk == 0 and len(r.load.slots) == 3
    assert r.load.skip_leading_blocks == 1
    assert r.loaded_offsets == list(range(1, 9))
    assert r.load.num_tokens == 32


def test_pending_key_in_hit_range_means_retry_next_step():
    sched, _ = make_scheduler()
    eng = Engine(sched, lag=1)
    eng.start("first", FIRST, 36)
    hashes = block_hashes(FIRST[:37])
    (job,) = sched.plan_step([RequestUpdate("first", 36, 37, (), hashes)]).store_jobs
    sched.add_request("second", 52)
    assert sched.lookup("second", 0, 52, block_hashes(SECOND[:52])) is None
    assert sched.stats().deferred_lookups == 1
    sched.complete_job(job.job_id, True)
    assert sched.lookup("second", 0, 52, block_hashes(SECOND[:52])) == 36


def test_lookup_repeats_without_pinning():
    sched, store, _ = after_first(0)
    sched.add_request("second", 52)
    for _ in range(3):
        assert sched.lookup("second", 0, 52, block_hashes(SECOND[:52])) == 36
    assert store.stats().pinned == 0
    load = sched.on_allocated("second", list(range(13)), 36)
    assert store.stats().pinned == 3
    sched.complete_job(load.job_id, True)
    assert store.stats().pinned == 0
    assert sched.stats().chunks_loaded == 3


def test_on_allocated_rejects_tokens_the_lookup_did_not_offer():
    sched, _, _ = after_first(0)
    sched.add_request("second", 52)
    assert sched.lookup("second", 0, 52, block_hashes(SECOND[:52])) == 36
    with pytest.raises(ValueError, match="num_external_tokens=24"):
        sched.on_allocated("second", list(range(13)), 24)


def test_reallocated_source_block_is_flushed():
    sched, _ = make_scheduler()
    eng = Engine(sched, lag=1)
    _, table = eng.start("a", FIRST, 36)
    (job,) = sched.plan_step([RequestUpdate("a", 36, 37, (), block_hashes(FIRST[:37]))]).store_jobs
    assert sched.plan_step([], reallocated_block_ids=[table[-1] + 1, 5]).flush_job_ids == []
    assert sched.plan_step([], reallocated_block_ids=[table[4]]).flush_job_ids == [job.job_id]


def test_preempted_request_with_jobs_in_flight_defers_its_lookup():
    sched, _ = make_scheduler()
    eng = Engine(sched, lag=1)
    eng.start("a", FIRST, 36)
    hashes = block_hashes(FIRST[:37])
    (job,) = sched.plan_step([RequestUpdate("a", 36, 37, (), hashes)]).store_jobs
    assert sched.preempt_request("a") == [job.job_id]
    assert sched.lookup("a", 0, 37, hashes) is None
    sched.complete_job(job.job_id, True)
    # Re-admitted: its own chunks are now a hit, and they are offered again from chunk 0.
    assert sched.lookup("a", 0, 37, hashes) == 36
    load = sched.on_allocated("a", list(range(10)), 36)
    assert list(load.gpu_block_ids) == list(range(9))


def test_failed_store_drops_its_keys():
    sched, store = make_scheduler()
    eng = Engine(sched, lag=1)
    eng.start("a", FIRST, 36)
    (job,) = sched.plan_step([RequestUpdate("a", 36, 37, (), block_hashes(FIRST[:37]))]).store_jobs
    result = sched.complete_job(job.job_id, False)
    assert (result.kind, result.success, result.request_released) == ("store", False, False)
    assert store.stats().ready == 0 and store.stats().used_slots == 0
    sched.add_request("b", 52)
    assert sched.lookup("b", 0, 52, block_hashes(SECOND[:52])) == 0
    assert sched.stats().store_failures == 1


def test_failed_load_reports_blocks_to_recompute():
    sched, store, _ = after_first(0)
    sched.add_request("second", 52)
    assert sched.lookup("second", 0, 52, block_hashes(SECOND[:52])) == 36
    load = sched.on_allocated("second", [500 + i for i in range(13)], 36)
    result = sched.complete_job(load.job_id, False)
    assert result.kind == "load" and not result.success
    np.testing.assert_array_equal(result.failed_gpu_block_ids, np.arange(500, 509))
    assert store.stats().pinned == 0
    assert store.stats().ready == 3  # the CPU copy is still good
    assert sched.stats().load_failures == 1
    # The engine restarts the request; it computes everything itself instead of looping on a
    # copy that may keep failing. Other requests still load.
    assert sched.lookup("second", 0, 52, block_hashes(SECOND[:52])) == 0
    sched.add_request("third", 52)
    assert sched.lookup("third", 0, 52, block_hashes(SECOND[:52])) == 36


def test_finished_request_holds_blocks_until_its_stores_complete():
    sched, _ = make_scheduler()
    eng = Engine(sched, lag=1)
    eng.start("a", FIRST, 36)
    fin = sched.finish_request("a", RequestUpdate("a", 36, 37, (), block_hashes(FIRST[:37])))
    assert fin.hold_blocks and len(fin.store_jobs) == 1
    assert sched.has_request("a")
    result = sched.complete_job(fin.store_jobs[0].job_id, True)
    assert result.request_released and not sched.has_request("a")


def test_arc_counts_loads_as_reuse_but_not_the_finish_refresh():
    _, store, eng = after_first(0, eviction_policy="arc")
    keys = [h + bytes(4) for h in block_hashes(SECOND)[2:12:3]]  # chunks 0..3 of SECOND
    # The first request's chunks were stored once: its finish only refreshed their order.
    assert store.recency_order() == [keys[2::-1], []]
    eng.run("second", SECOND, 52, 53)
    # Loaded by the second request: a real reuse, so ARC's frequent list; its own new chunk 3
    # stays in the recent list. Earlier chunks of a prefix end up most recent.
    assert store.recency_order() == [[keys[3]], keys[2::-1]]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda s: s.lookup("r", -1, 52, []), "num_local_tokens=-1 is invalid"),
        (lambda s: s.lookup("r", 0, True, []), "num_tokens=True is invalid"),
        (lambda s: s.on_allocated("r", [], -5), "num_external_tokens=-5 is invalid"),
        (lambda s: s.plan_step([RequestUpdate("r", -1, 1)]), "num_computed_tokens=-1"),
        (lambda s: s.lookup("nope", 0, 1, []), "request_id='nope' is not tracked"),
        (lambda s: s.complete_job(99, True), "job_id=99 is not in flight"),
        (lambda s: s.add_request("r", 1), "request_id='r' is already tracked"),
        (lambda s: s.add_request("q", "12"), "num_prompt_tokens='12' is invalid"),
    ],
)
def test_bad_arguments_name_the_parameter(call, match):
    sched, store = make_scheduler()
    sched.add_request("r", 52)
    before = store.stats()
    with pytest.raises(ValueError, match=match):
        call(sched)
    assert store.stats() == before
