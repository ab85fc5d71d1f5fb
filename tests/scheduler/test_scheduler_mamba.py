"""`OffloadScheduler` with a Mamba group ("align" mode, group 0) beside full attention (group 1),
driven directly: 4-token blocks, 12-token chunks. The engine hands over the blocks that hold the
state at a boundary (`StateBlock`); a state on a chunk boundary is stored under that chunk's key,
into the last block of its slot. A 36-token prompt whose state after 24 tokens is handed over
stores 3 full-attention chunks and that state; a repeat hits 24 tokens (the hit stops a token
short of the prompt, on a chunk, where a state is)."""

from __future__ import annotations

import numpy as np
import pytest

from kvoffload.scheduler import (
    GroupSlice,
    KVGroup,
    OffloadConfig,
    OffloadScheduler,
    RequestUpdate,
    StateBlock,
)

GROUPS = (KVGroup("mamba"), KVGroup())
HASHES = [bytes([i + 1]) * 32 for i in range(9)]
FULL_TABLE = list(range(1, 10))


def scheduler(slots: int = 100, **kw) -> OffloadScheduler:
    config = OffloadConfig(tokens_per_block=4, blocks_per_chunk=3, cpu_bytes_to_use=64 * slots)
    return OffloadScheduler.create(config, 64, groups=GROUPS, **kw)


def prefill(s: OffloadScheduler, rid: str = "a", *states: StateBlock) -> list:
    """`rid` computes a 36-token prompt in one step; the engine hands over `states`."""
    s.add_request(rid, 36)
    assert s.lookup(rid, 0, 36, HASHES) == 0
    s.on_allocated(rid, [[0] * 8 + [40], FULL_TABLE])
    return s.plan_step([RequestUpdate(rid, 36, 36, block_hashes=HASHES)], (), states).store_jobs


def test_a_state_on_a_chunk_is_stored_first_into_the_last_block_of_its_slot():
    s = scheduler()
    state_job, table_job = prefill(s, "a", StateBlock("a", 0, 21, 24))
    assert state_job.parts == (GroupSlice(0, 1, 1, 2),)
    assert state_job.gpu_block_ids.tolist() == [21]
    assert state_job.chunk_indices.tolist() == [1]
    # Nothing is stored from the Mamba table: only the full-attention chunks.
    assert table_job.parts == (GroupSlice(1, 3, 9),)
    assert table_job.gpu_block_ids.tolist() == FULL_TABLE


def test_a_repeat_hits_the_chunk_whose_state_is_stored():
    s = scheduler()
    for job in prefill(s, "a", StateBlock("a", 0, 21, 24)):
        s.complete_job(job.job_id, True)
    s.finish_request("a")
    s.add_request("b", 36)
    # 35 rounds down to 24, where the state is; nothing at 36 (no state) is asked.
    assert s.lookup("b", 0, 36, HASHES) == 24
    load = s.on_allocated("b", [[0] * 5 + [50, 0, 0, 0], [61, 62, 63, 64, 65, 66, 0, 0, 0]], 24)
    assert load is not None
    assert load.parts == (GroupSlice(0, 1, 1, 2), GroupSlice(1, 2, 6, 0))
    assert load.gpu_block_ids.tolist() == [50, 61, 62, 63, 64, 65, 66]


def test_without_a_state_nothing_is_hit():
    s = scheduler()
    for job in prefill(s):
        s.complete_job(job.job_id, True)
    s.add_request("b", 36)
    assert s.lookup("b", 0, 36, HASHES) == 0


@pytest.mark.parametrize(
    ("state", "why"),
    [
        (StateBlock("a", 0, 21, 20), "not on a chunk"),
        (StateBlock("a", 0, 0, 24), "the null block"),
        (StateBlock("a", 0, 21, 0), "no tokens"),
        (StateBlock("a", 0, 21, 48), "past the request's tokens"),
    ],
)
def test_states_a_hit_cannot_use_are_not_stored(state, why):
    s = scheduler()
    (table_job,) = prefill(s, "a", state)
    assert table_job.parts == (GroupSlice(1, 3, 9),), why


def test_max_offload_tokens_caps_the_states_too():
    s = scheduler()
    s.add_request("a", 36, {"max_offload_tokens": 12})
    s.lookup("a", 0, 36, HASHES)
    s.on_allocated("a", [[0] * 8 + [40], FULL_TABLE])
    plan = s.plan_step(
        [RequestUpdate("a", 36, 36, block_hashes=HASHES)],
        (),
        [StateBlock("a", 0, 21, 24), StateBlock("a", 0, 22, 12)],
    )
    state_job, table_job = plan.store_jobs
    assert state_job.chunk_indices.tolist() == [0]
    assert table_job.parts == (GroupSlice(1, 1, 3),)


def test_a_state_the_tier_refuses_is_given_up():
    """One slot, which a's state (still being stored) holds: c's state is refused and counted;
    a hand-off is offered once (as in vLLM), so nothing stores it later."""
    s = scheduler(slots=1)
    (state_job,) = prefill(s, "a", StateBlock("a", 0, 21, 24))
    assert state_job.chunk_indices.tolist() == [1]
    refusals = s.stats().store_refusals
    s.add_request("c", 36)
    s.lookup("c", 0, 36, [bytes([99]) * 32, *HASHES[1:]])
    s.on_allocated("c", [[0] * 8 + [41], [71, 72, 73, 74, 75, 76, 77, 78, 79]])
    plan = s.plan_step(
        [RequestUpdate("c", 36, 36, block_hashes=[bytes([99]) * 32, *HASHES[1:]])],
        (),
        [StateBlock("c", 0, 22, 12)],
    )
    assert plan.store_jobs == []
    assert s.stats().store_refusals == refusals + 2  # the state, then c's table chunks
    s.complete_job(state_job.job_id, True)
    assert s.plan_step([RequestUpdate("c", 37, 37)]).store_jobs == []
    assert s.stats().store_refusals == refusals + 3  # c's table chunks again, not its state


def test_a_state_block_handed_out_again_flushes_its_store():
    s = scheduler()
    state_job, _ = prefill(s, "a", StateBlock("a", 0, 21, 24))
    s.add_request("c", 12)
    s.lookup("c", 0, 12, [bytes([98]) * 32] * 3)
    s.on_allocated("c", [[21, 0, 0], [81, 82, 83]])
    plan = s.plan_step([], [21, 81, 82, 83])
    # The table's blocks are held by "a"; the state block is the one the engine frees early.
    assert plan.flush_job_ids == [state_job.job_id]


@pytest.mark.parametrize(
    ("state", "match"),
    [
        (("a", 0, 21, 24), "state_blocks holds .* expected StateBlock items"),
        (StateBlock("zz", 0, 21, 24), "state_blocks names request_id='zz', which is not tracked"),
        (
            StateBlock("a", 1, 21, 24),
            r"group=1 of request 'a' is invalid; allowed: the index of a mamba group \(0\)",
        ),
        (StateBlock("a", 2, 21, 24), "group=2 of request 'a' is invalid"),
        (StateBlock("a", False, 21, 24), "group=False of request 'a' is invalid"),
        (StateBlock("a", 0, -1, 24), r"StateBlock block_id=\[-1\] is invalid"),
        (StateBlock("a", 0, 2**63, 24), r"StateBlock block_id=\[9223372036854775808\] is invalid"),
        (StateBlock("a", 0, True, 24), r"StateBlock block_id=\[True\] is invalid"),
        (StateBlock("a", 0, 21, -12), "StateBlock num_tokens=-12 is invalid"),
    ],
)
def test_bad_state_blocks_are_refused_and_change_nothing(state, match):
    s = scheduler()
    s.add_request("a", 36)
    s.lookup("a", 0, 36, HASHES)
    s.on_allocated("a", [[0] * 8 + [40], FULL_TABLE])
    update = RequestUpdate("a", 36, 36, block_hashes=HASHES)
    good = StateBlock("a", 0, 22, 12)
    with pytest.raises(ValueError, match=match):
        # A good hand-off before the bad one changes nothing either.
        s.plan_step([update], (), [good, state])
    assert s.jobs_in_flight == []
    # The same step with good input plans as if nothing had been asked.
    state_job, _ = s.plan_step([update], (), [StateBlock("a", 0, 21, 24)]).store_jobs
    assert state_job.chunk_indices.tolist() == [1]


def test_numpy_ints_are_taken():
    s = scheduler()
    (state_job, _) = prefill(s, "a", StateBlock("a", np.int64(0), np.int32(21), np.int64(24)))
    assert state_job.parts == (GroupSlice(0, 1, 1, 2),)
    assert state_job.gpu_block_ids.tolist() == [21]


def test_a_model_without_mamba_groups_refuses_state_blocks():
    config = OffloadConfig(tokens_per_block=4, blocks_per_chunk=3, cpu_bytes_to_use=6400)
    s = OffloadScheduler.create(config, 64, groups=(KVGroup("sliding", 8), KVGroup()))
    s.add_request("a", 36)
    with pytest.raises(ValueError, match="this model has none"):
        s.plan_step([], (), [StateBlock("a", 0, 21, 24)])
