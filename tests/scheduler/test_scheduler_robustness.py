"""A bad call raises and changes nothing; nothing already pinned or pending is lost by it."""

import logging
import pickle

import numpy as np
import pytest

from kvoffload import InvalidStateError
from kvoffload.scheduler import RequestUpdate
from sched_driver import Engine, block_hashes, make_scheduler

FIRST = list(range(1, 101))
SECOND = FIRST[:40] + [1000 + i for i in range(60)]


def scheduled(sched, rid, tokens, n, blocks):
    sched.add_request(rid, n)
    assert sched.lookup(rid, 0, n, block_hashes(tokens[:n])) == 0
    assert sched.on_allocated(rid, blocks) is None


def test_a_bad_update_in_a_batch_plans_nothing_and_a_retry_is_exact():
    sched, store = make_scheduler(offload_prompt_only=False)
    scheduled(sched, "a", FIRST, 24, list(range(100, 106)))
    scheduled(sched, "b", FIRST, 24, list(range(200, 206)))
    good = RequestUpdate("a", 36, 37, [106, 107, 108], block_hashes(FIRST[:37]))
    with pytest.raises(ValueError, match="num_computed_tokens=-3"):
        sched.plan_step([good, RequestUpdate("b", -3, 37)])
    assert sched.jobs_in_flight == [] and store.stats().pending == 0
    # The retry sees the table as it was: chunk 2 comes from blocks 106..108, once each.
    (job,) = sched.plan_step([good]).store_jobs
    assert list(job.gpu_block_ids) == list(range(100, 109))


@pytest.mark.parametrize("bad", [[1, None], [1, 8.7], ["8"], [3, -1], [True], [3, True]])
def test_bad_block_ids_are_refused_before_anything_is_pinned(bad):
    sched, store = make_scheduler()
    Engine(sched).run("first", FIRST, 36, 37)
    sched.add_request("second", 52)
    assert sched.lookup("second", 0, 52, block_hashes(SECOND[:52])) == 36
    with pytest.raises(ValueError, match=r"block_ids=.* is invalid: expected a sequence of ints"):
        sched.on_allocated("second", bad * 7, 36)
    assert store.stats().pinned == 0
    with pytest.raises(ValueError, match=r"new_block_ids=.* is invalid"):
        sched.plan_step([RequestUpdate("second", 12, 52, bad)])
    # Still offered: the right table works.
    assert sched.on_allocated("second", list(range(13)), 36).num_tokens == 36


def test_too_few_blocks_then_a_retry():
    sched, _ = make_scheduler()
    Engine(sched).run("first", FIRST, 36, 37)
    sched.add_request("second", 52)
    assert sched.lookup("second", 0, 52, block_hashes(SECOND[:52])) == 36
    with pytest.raises(ValueError, match=r"block_ids has 5 blocks .* needs 9"):
        sched.on_allocated("second", range(5), 36)
    assert list(sched.on_allocated("second", range(13), 36).gpu_block_ids) == list(range(9))


def test_a_hit_evicted_before_allocation_raises_with_nothing_pinned():
    sched, store = make_scheduler(num_slots=3)
    Engine(sched).run("first", FIRST, 36, 37)
    sched.add_request("second", 52)
    assert sched.lookup("second", 0, 52, block_hashes(SECOND[:52])) == 36
    # Against the documented order, another request's stores evict the chunks found.
    scheduled(sched, "other", [7] * 60, 36, list(range(500, 509)))
    sched.plan_step([RequestUpdate("other", 36, 37, (), block_hashes([7] * 37))])
    with pytest.raises(InvalidStateError, match="prepare_load"):
        sched.on_allocated("second", range(13), 36)
    assert store.stats().pinned == 0
    assert sched.on_allocated("second", range(13), 0) is None


def test_a_request_named_twice_in_one_step_is_refused():
    sched, _ = make_scheduler()
    scheduled(sched, "a", FIRST, 24, list(range(6)))
    u = RequestUpdate("a", 24, 25, (), block_hashes(FIRST[:25]))
    with pytest.raises(ValueError, match="updates name a request twice"):
        sched.plan_step([u, u])
    assert sched.jobs_in_flight == []


def test_finish_twice_and_update_after_finish():
    sched, _ = make_scheduler()
    scheduled(sched, "a", FIRST, 24, list(range(6)))
    assert not sched.finish_request("a").hold_blocks
    with pytest.raises(ValueError, match="request_id='a' is not tracked"):
        sched.finish_request("a")
    with pytest.raises(ValueError, match="request_id='a' is not tracked"):
        sched.plan_step([RequestUpdate("a", 24, 25)])


def test_flush_and_preemption_cover_loads_in_flight():
    sched, _ = make_scheduler()
    Engine(sched).run("first", FIRST, 36, 37)
    sched.add_request("second", 52)
    assert sched.lookup("second", 0, 52, block_hashes(SECOND[:52])) == 36
    load = sched.on_allocated("second", list(range(300, 313)), 36)
    assert sched.plan_step([], reallocated_block_ids=[304]).flush_job_ids == [load.job_id]
    assert sched.preempt_request("second") == [load.job_id]
    with pytest.raises(ValueError, match=r"reallocated_block_ids=.* is invalid"):
        sched.plan_step([], reallocated_block_ids=[-4])


def test_jobs_pickle_for_worker_processes():
    sched, _ = make_scheduler()
    first = Engine(sched, lag=1).run("first", FIRST, 36, 37)
    sched.add_request("second", 52)
    sched.lookup("second", 4, 52, block_hashes(SECOND[:52]))
    load = sched.on_allocated("second", list(range(13)), 32)
    for job in (first.store_jobs[0], load):
        copy = pickle.loads(pickle.dumps(job))
        assert copy.keys == job.keys and copy.job_id == job.job_id
        np.testing.assert_array_equal(copy.gpu_block_ids, job.gpu_block_ids)
        np.testing.assert_array_equal(copy.slots, job.slots)
    assert load.skip_leading_blocks == 1


@pytest.mark.parametrize("bad", ["24", 24.5, -1, True, 2**64])
def test_invalid_max_load_tokens_warns_once_and_counts(caplog, bad):
    sched, _ = make_scheduler()
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        sched.add_request("req-9", 52, {"max_load_tokens": bad, "max_offload_tokens": 12})
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1
    assert "req-9" in msgs[0] and repr(bad) in msgs[0] and type(bad).__name__ in msgs[0]
    assert sched.stats().ignored_params == {"max_load_tokens": 1}
    # The request runs uncapped (2**64 would overflow the core's token arithmetic).
    assert sched.lookup("req-9", 0, 52, block_hashes(FIRST[:52])) == 0


def test_impossible_token_counts_are_refused_naming_them():
    sched, _ = make_scheduler()
    scheduled(sched, "a", FIRST, 24, list(range(6)))
    with pytest.raises(ValueError, match=r"num_computed_tokens=30 for request 'a' is more than"):
        sched.plan_step([RequestUpdate("a", 30, 24)])
    with pytest.raises(ValueError, match=r"offered; allowed: 0 \(it offered nothing\)"):
        sched.on_allocated("a", list(range(6)), 16)
    with pytest.raises(ValueError, match=r"\[-1, 2, 3, 4, 5, \.\.\. and 95 more\] is invalid"):
        sched.plan_step([RequestUpdate("a", 24, 24, [-1, *range(2, 101)])])


@pytest.mark.parametrize("bad", ["abc", 12, ["max_load_tokens", 1]])
def test_kv_transfer_params_that_are_not_a_mapping_are_ignored(caplog, bad):
    sched, _ = make_scheduler()
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        sched.add_request("req-3", 24, bad)
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "req-3" in msgs[0] and "not a mapping" in msgs[0]
    assert sched.stats().ignored_params == {"kv_transfer_params": 1}
    # The request runs uncapped: its two prompt chunks are offered.
    assert sched.lookup("req-3", 0, 24, block_hashes(FIRST[:24])) == 0
    sched.on_allocated("req-3", list(range(6)))
    plan = sched.plan_step([RequestUpdate("req-3", 24, 24)])
    assert [list(j.chunk_indices) for j in plan.store_jobs] == [[0, 1]]


def test_finish_of_a_preempted_request_holds_no_blocks():
    sched, _ = make_scheduler()
    scheduled(sched, "a", FIRST, 24, list(range(6)))
    (job,) = sched.plan_step([RequestUpdate("a", 24, 25)]).store_jobs
    assert sched.preempt_request("a") == [job.job_id]
    fin = sched.finish_request("a")
    assert fin.store_jobs == [] and not fin.hold_blocks
    assert sched.complete_job(job.job_id, True).request_released


def test_updates_may_be_any_iterable():
    sched, _ = make_scheduler()
    scheduled(sched, "a", FIRST, 24, list(range(6)))
    u = RequestUpdate("a", 24, 25, (), block_hashes(FIRST[:25]))
    with pytest.raises(ValueError, match="updates name a request twice"):
        sched.plan_step(x for x in (u, u))
    assert len(sched.plan_step(x for x in (u,)).store_jobs) == 1
