"""The scheduler's jobs driven through the transfer engine (CPU mode): what one request stored
is loaded byte for byte into another request's blocks, skipping the block it already has."""

import torch

from kvoffload.scheduler import RequestUpdate
from kvoffload.transfer import TransferEngine
from sched_driver import BPC, TPB, block_hashes, make_scheduler

FIRST = list(range(1, 101))
SECOND = FIRST[:40] + [1000 + i for i in range(60)]
NUM_BLOCKS = 64


def run_jobs(sched, engine, stores=(), load=None):
    for job in stores:
        engine.submit_store(job.job_id, job.gpu_block_ids, job.slots)
    if load is not None:
        engine.submit_load(load.job_id, load.slots, load.gpu_block_ids, load.skip_leading_blocks)
    for result in engine.get_finished():
        assert result.success
        sched.complete_job(result.job_id, result.success)


def test_stored_prefix_loads_back_into_another_request():
    torch.manual_seed(0)
    # Cross-layer layout: one page per block (2 layers x K/V x TPB tokens x 8 dims).
    cache = torch.randn(NUM_BLOCKS, 2, 2, TPB, 8) + 3.0
    sched, store = make_scheduler(num_slots=16)
    engine = TransferEngine(cache, num_slots=store.num_slots, blocks_per_chunk=BPC)

    # Request A (36-token prompt) in blocks 0..9 stores its 3 chunks.
    sched.add_request("a", 36)
    assert sched.lookup("a", 0, 36, block_hashes(FIRST[:36])) == 0
    sched.on_allocated("a", list(range(10)))
    plan = sched.plan_step([RequestUpdate("a", 36, 37, (), block_hashes(FIRST[:37]))])
    run_jobs(sched, engine, stores=plan.store_jobs)
    sched.finish_request("a")
    a_kv = cache[:9].clone()

    # A's blocks are reused by others; request B, sharing 40 tokens, gets blocks 20..32 and
    # already has block 20 (its 4-token local prefix). Its content is a marker here (really the
    # same KV as A's block 0), so a load that wrote it would show.
    cache[:40] = torch.randn(40, 2, 2, TPB, 8) - 3.0
    before = cache.clone()
    sched.add_request("b", 52)
    assert sched.lookup("b", 4, 52, block_hashes(SECOND[:52])) == 32
    load = sched.on_allocated("b", list(range(20, 33)), 32)
    run_jobs(sched, engine, load=load)

    assert torch.equal(cache[21:29], a_kv[1:9])  # chunks 0..2 minus the block B had
    untouched = [i for i in range(NUM_BLOCKS) if not 21 <= i < 29]
    assert torch.equal(cache[untouched], before[untouched])
    assert sched.stats().chunks_loaded == 3 and store.stats().pinned == 0
    engine.close()
