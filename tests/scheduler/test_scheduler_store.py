"""Store planning: offload_prompt_only and max_offload_tokens, with exact GPU block offsets."""

import logging

import pytest

from kvoffload.scheduler import OffloadConfig, OffloadScheduler, RequestUpdate
from sched_driver import Engine, block_hashes, make_scheduler

TOKENS = list(range(1, 201))


@pytest.fixture(params=[0, 1], ids=["same-step", "one-step-late"])
def lag(request):
    return request.param


def distinct_offered(store):
    return {k for batch in store.offered for k in batch}


def test_prompt_only_stores_only_prompt_chunks(lag):
    sched, store = make_scheduler()
    r = Engine(sched, lag).run("a", TOKENS, num_prompt_tokens=24, kv_tokens=72)
    assert r.stored_offsets == set(range(6))
    assert len(distinct_offered(store)) == 2
    assert sched.stats().chunks_stored == 2


def test_partial_prompt_chunk_is_never_stored(lag):
    sched, store = make_scheduler()
    r = Engine(sched, lag).run("a", TOKENS, num_prompt_tokens=30, kv_tokens=72)
    assert r.stored_offsets == set(range(6))
    assert len(distinct_offered(store)) == 2


def test_decode_chunks_stored_when_prompt_only_is_off(lag):
    sched, store = make_scheduler(offload_prompt_only=False)
    r = Engine(sched, lag).run("a", TOKENS, num_prompt_tokens=24, kv_tokens=72)
    assert r.stored_offsets == set(range(18))
    assert len(distinct_offered(store)) == 6
    assert sched.stats().bytes_stored == 6 * 1000


@pytest.mark.parametrize(
    ("cap", "expected", "warns"),
    [
        (None, set(range(9)), False),
        ("24", set(range(9)), True),
        (24.5, set(range(9)), True),
        (-1, set(range(9)), True),
        (True, set(range(9)), True),
        (0, set(), False),
        (24, set(range(6)), False),
        (25, set(range(6)), False),
    ],
)
def test_max_offload_tokens(lag, caplog, cap, expected, warns):
    sched, store = make_scheduler(offload_prompt_only=False)
    params = None if cap is None else {"max_offload_tokens": cap}
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        r = Engine(sched, lag).run("req-7", TOKENS, 36, kv_tokens=37, params=params)
    assert r.stored_offsets == expected
    warnings = [
        rec.getMessage() for rec in caplog.records if "max_offload_tokens" in rec.getMessage()
    ]
    if warns:
        assert len(warnings) == 1
        assert "req-7" in warnings[0]
        assert repr(cap) in warnings[0]
        assert type(cap).__name__ in warnings[0]
        assert sched.stats().ignored_params == {"max_offload_tokens": 1}
    else:
        assert warnings == []
        assert sched.stats().ignored_params == {}
    # Lookups happen whatever the cap: the request had 3 complete chunks to look for.
    assert sched.stats().lookups == 1
    if cap == 0:
        assert store.offered == []


def test_full_tier_refuses_and_offers_same_chunks_again():
    sched, store = make_scheduler(num_slots=2, offload_prompt_only=False)
    eng = Engine(sched, lag=1)  # jobs stay in flight for a step: the two slots stay pending
    eng.start("a", TOKENS, 36)
    hashes = block_hashes(TOKENS[:37])
    table_update = RequestUpdate("a", 24, 37, (), hashes)
    plan = sched.plan_step([table_update])
    assert [list(j.chunk_indices) for j in plan.store_jobs] == [[0, 1]]
    # Chunk 2 needs a third slot while chunks 0 and 1 are still pending: refused.
    plan = sched.plan_step([RequestUpdate("a", 36, 37, (), hashes)])
    assert plan.store_jobs == []
    assert sched.stats().store_refusals == 1
    refused = store.offered[-1]
    # The request (3 chunks) is longer than the tier (2 slots), so it offers all its chunks and
    # the same ones again. Completed, 0 and 1 are its own head: protected, not evicted for 2.
    for job_id in sched.jobs_in_flight:
        sched.complete_job(job_id, True)
    plan = sched.plan_step([RequestUpdate("a", 36, 37, (), hashes)])
    assert store.offered[-1] == refused
    assert plan.store_jobs == []
    assert sched.stats().store_refusals == 2
    assert store.stats().ready == 2 and store.stats().evictions == 0


def test_an_offer_bigger_than_the_tier_stores_its_head():
    # 4 slots, a 6-chunk prompt: the whole offer can never fit, so its first 4 chunks go in
    # (vLLM would refuse it every step and never store anything).
    sched = OffloadScheduler.create(OffloadConfig(16, 1, 4 * 1024), bytes_per_chunk=1024)
    hashes = [bytes([i]) * 32 for i in range(6)]
    sched.add_request("a", 96)
    assert sched.lookup("a", 0, 96, hashes) == 0
    sched.on_allocated("a", list(range(6)))
    (job,) = sched.plan_step([RequestUpdate("a", 96, 96, (), hashes)]).store_jobs
    assert job.chunk_indices.tolist() == [0, 1, 2, 3]
    assert job.gpu_block_ids.tolist() == [0, 1, 2, 3]
    sched.complete_job(job.job_id, True)
    # The rest is given up, not offered again.
    assert sched.plan_step([RequestUpdate("a", 97, 97, (), hashes)]).store_jobs == []
    sched.finish_request("a")
    # A later request with the same prompt loads the head: 4 chunks.
    sched.add_request("b", 96)
    assert sched.lookup("b", 0, 96, hashes) == 64
    assert sched.stats().store_refusals == 0


def test_a_request_longer_than_the_tier_keeps_its_stored_head():
    # 4 slots. The prompt is computed in two pieces: 3 chunks, then 5 more. The second offer
    # (chunks 3..7) can never fit with the head (0..2) resident, so the request offers all 8:
    # the head is protected and only chunk 3 fits; nothing of the head is evicted.
    sched = OffloadScheduler.create(OffloadConfig(16, 1, 4 * 1024), bytes_per_chunk=1024)
    hashes = [bytes([i]) * 32 for i in range(8)]
    sched.add_request("a", 128)
    assert sched.lookup("a", 0, 128, hashes) == 0
    sched.on_allocated("a", list(range(8)))
    (job,) = sched.plan_step([RequestUpdate("a", 48, 48, (), hashes)]).store_jobs
    assert job.chunk_indices.tolist() == [0, 1, 2]
    sched.complete_job(job.job_id, True)
    (job,) = sched.plan_step([RequestUpdate("a", 128, 128, (), hashes)]).store_jobs
    assert job.chunk_indices.tolist() == [3]
    assert job.gpu_block_ids.tolist() == [3]
    sched.complete_job(job.job_id, True)
    sched.finish_request("a")
    assert sched.store.stats().evictions == 0
    sched.add_request("b", 128)
    assert sched.lookup("b", 0, 128, hashes) == 64


def test_a_growing_tier_keeps_a_long_prompts_head_as_a_full_one_does():
    """Only 4 of 64 slots are usable yet: a 6-chunk prompt stored in two steps keeps chunks 0-3
    (what a later request hits), not its tail."""
    from kvoffload import CpuStore
    from kvoffload.scheduler import OffloadConfig, OffloadScheduler, RequestUpdate
    from sched_driver import block_hashes

    config = OffloadConfig.from_dict(
        {"tokens_per_block": 4, "blocks_per_chunk": 3, "cpu_bytes_to_use": 1 << 20}
    )
    sched = OffloadScheduler(config, CpuStore(64, usable_slots=4))
    tokens = list(range(100, 172))
    hashes = block_hashes(tokens)
    sched.add_request("r", len(tokens))
    sched.on_allocated("r", list(range(18)), 0)
    for computed in (36, 72):
        for job in sched.plan_step([RequestUpdate("r", computed, 72, (), hashes)]).store_jobs:
            sched.complete_job(job.job_id, True)
    keys = sched._requests["r"].keys
    assert sched.store.lookup_prefix(keys.view(0, 6)).hits == 4
