"""Requests through vLLM's real scheduler when things get tight: a small CPU tier that evicts,
stores still in flight when a request finishes or is preempted, a failed load, a reset, KV
events. Tests taking `seam` run through both seams (KVOffloadConnector, and KVOffloadSpec in
vLLM's OffloadingConnector); the others check what only our connector does."""

from __future__ import annotations

import pytest
from rig import BLOCK_BYTES, BPC, Stall, expected_outputs, make_rig, prompt
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash


def sched_stats(rig):
    return rig.connector._sched().scheduler.stats()


def test_small_tier_evicts_least_recent_and_hits_stay_exact(model_dir, is_async, seam):
    rig = make_rig(model_dir, is_async=is_async, connector=seam, cpu_chunks=3, enable_events=True)
    published = []
    rig.scheduler.kv_event_publisher.publish = published.append
    a = rig.add("a", prompt(1, 36), 1)
    rig.run()
    rig.add("b", prompt(2, 36), 1)  # three new chunks: all of a's are evicted
    rig.run()
    store = rig.cpu_store().stats()
    assert (store.num_slots, store.ready, store.evictions) == (3, 3, 3)
    rig.reset_gpu_prefix_cache()
    rig.add("a2", prompt(1, 40), 1)
    rig.add("b2", prompt(2, 40), 1)
    rig.run()
    assert rig.load_of("a2") is None
    assert rig.load_of("b2").num_tokens == 36
    assert rig.outputs["b2"] == expected_outputs(prompt(2, 40), 1)

    events = [e for batch in published for e in batch.events]
    stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU"]
    # A chunk's key is the hash of its last GPU block.
    a_keys = [maybe_convert_block_hash(a.block_hashes[i]) for i in (2, 5, 8)]
    first_stored = [h for e in stored for h in e.block_hashes][:3]
    if seam == "spec":  # vLLM's connector completes a store's keys as a set, in any order
        first_stored, a_keys = sorted(first_stored), sorted(a_keys)
    assert first_stored == a_keys
    stored_hashes = [h for e in stored for h in e.block_hashes]
    removed_hashes = [h for e in removed for h in e.block_hashes]
    assert sorted(removed_hashes[:3]) == sorted(a_keys)  # b's stores evicted all of a
    # Every later store past the 3 slots evicted one chunk (a2 stores its prompt again).
    assert len(removed_hashes) == len(stored_hashes) - 3
    assert all(e.group_idx == 0 for e in stored + removed)


def test_finished_request_keeps_its_blocks_until_its_store_is_done(model_dir, is_async):
    """The last step of "a" computes its second chunk and finishes it: that store is still in
    flight when "a" finishes, so vLLM must not hand a's blocks to "b" (which needs every block)
    before the workers report "a" in finished_sending."""
    rig = make_rig(
        model_dir,
        is_async=is_async,
        num_gpu_blocks=9,  # 8 usable: a takes 7, b needs 8
        extra={"offload_prompt_only": False},
    )
    stall = Stall(rig)
    released = {}

    def watch(rig, so):
        if "a" in so.finished_req_ids:
            released["a_finished_at"] = rig.step
        if released.get("a_finished_at") and rig.step >= released["a_finished_at"] + 2:
            stall.on = False

    rig.before_worker = watch
    rig.add("a", prompt(1, 20), 5)
    rig.add("b", prompt(2, 28), 1)
    rig.run()
    (sent_step, sent), *_ = rig.finished_sending
    assert sent == {"a"}
    assert sent_step >= released["a_finished_at"] + 2
    first_b = min(i for i, s in enumerate(rig.scheduled, 1) if "b" in s)
    assert first_b > sent_step  # b got a's blocks only once a's store was done
    assert rig.offsets_stored("a") == set(range(2 * BPC))
    assert rig.outputs["b"] == expected_outputs(prompt(2, 28), 1)
    # a's last chunk went to the CPU tier intact: a third request loads it.
    rig.reset_gpu_prefix_cache()
    rig.add("c", prompt(1, 20) + rig.outputs["a"][:4] + [5, 6], 1)
    rig.run()
    assert rig.load_of("c").num_tokens == 24


@pytest.mark.parametrize("spec_decode_order", [False, True])
def test_a_final_store_holds_the_blocks_until_it_ran(model_dir, spec_decode_order):
    """A tier of 2 chunks kept full by stores in flight (results held back until step
    `release`) refuses a's offers while it runs, so a's last chunks are stored only when it
    has finished: in the metadata that also lists "a" in held_request_ids. The workers must not
    report "a" (vLLM would free its blocks) before that store ran, also when vLLM collects
    results before wait_for_save (speculative decoding)."""
    finals = 0
    for release in range(2, 9):
        rig = make_rig(
            model_dir, cpu_chunks=2, num_gpu_blocks=17, extra={"offload_prompt_only": False}
        )
        rig.spec_decode_order = spec_decode_order
        stall = Stall(rig)
        seen = {}

        def watch(rig, so, release=release, stall=stall, seen=seen):
            meta = so.kv_connector_metadata
            stall.on = rig.step < release
            if "a" in meta.held_request_ids:
                seen["held_step"] = rig.step
                seen["final"] = [j for j in meta.stores if j.request_id == "a"]

        rig.before_worker = watch
        rig.add("x", prompt(3, 24), 30)
        rig.add("a", prompt(1, 20), 5)
        rig.run()
        sent_at = {rid: step for step, ids in rig.finished_sending for rid in ids}
        assert "held_step" in seen and "a" in sent_at
        if seen["final"]:
            finals += 1
            assert sent_at["a"] > seen["held_step"]
    assert finals  # some release step left a final store


def test_readmitted_in_the_preempting_step_keeps_its_new_blocks(model_dir, is_async, seam):
    """vLLM's reset of running requests preempts "b" and readmits it in the same schedule; its
    later stores must copy the blocks of its new table (a third request loads them)."""
    rig = make_rig(
        model_dir, is_async=is_async, connector=seam, extra={"offload_prompt_only": False}
    )
    rig.add("b", prompt(2, 24), 40, {"max_load_tokens": 0})
    for _ in range(4):
        so = rig.scheduler.schedule()
        rig._apply(so, rig._execute(so))
    assert rig.scheduler.reset_prefix_cache(reset_running_requests=True)
    rig.run()
    assert any(rig.scheduled[i].get("b") for i in range(4, len(rig.scheduled)))
    rig.reset_gpu_prefix_cache()
    rig.add("c", rig.tokens["b"][:60], 1)
    rig.run()
    assert rig.load_of("c").num_tokens == 60  # and the rig checked every loaded byte


def test_reset_cache_mid_run_stores_running_requests_again(model_dir, is_async, seam):
    rig = make_rig(model_dir, is_async=is_async, connector=seam)
    rig.add("a", prompt(3, 48), 20)
    for _ in range(3):
        so = rig.scheduler.schedule()
        rig._apply(so, rig._execute(so))
    assert rig.scheduler.reset_connector_cache()  # the CPU tier only: "a" keeps running
    rig.run()
    rig.reset_gpu_prefix_cache()
    rig.add("b", [*prompt(3, 48), 5], 1)
    rig.run()
    assert rig.load_of("b").num_tokens == 48  # a offered its prompt again after the reset


def test_preempted_request_flushes_its_stores_and_reloads_on_readmission(model_dir, is_async, seam):
    """16 usable GPU blocks; "a" and "b" (24-token prompts, 40 output tokens) outgrow them and
    "b" is preempted while its prompt store is in flight (the worker's results are held back
    until "a" finishes): the preemption step flushes that store, b's lookups are deferred while
    it is in flight, and once readmitted b loads its prompt from the CPU tier (a's decode has
    overwritten b's blocks in the GPU prefix cache)."""
    rig = make_rig(model_dir, is_async=is_async, connector=seam, num_gpu_blocks=17)
    stall = Stall(rig)
    seen = {}

    def watch(rig, so):
        if so.preempted_req_ids and "preempted" not in seen:
            seen["preempted"] = set(so.preempted_req_ids)
            seen["flush"] = rig.flushed_job_ids(so.kv_connector_metadata)
        if "a" in so.finished_req_ids:
            stall.on = False

    rig.before_worker = watch
    rig.add("a", prompt(1, 24), 40)
    rig.add("b", prompt(2, 24), 40)
    rig.run()
    assert seen["preempted"] == {"b"}
    (b_store,) = [s.job_id for s in rig.stores if s.request_id == "b"]
    assert b_store in seen["flush"]
    if seam == "kvoffload":  # ours flushes only b's store, and defers b's lookups meanwhile
        assert seen["flush"] == {b_store}
        assert sched_stats(rig).deferred_lookups > 0
    load = rig.load_of("b")
    assert (load.num_tokens, load.first_chunk, load.skip_leading_blocks) == (24, 0, 0)
    for rid, seed in (("a", 1), ("b", 2)):
        assert rig.outputs[rid] == expected_outputs(prompt(seed, 24), 40)


def test_failed_load_is_recomputed(model_dir, is_async):
    rig = make_rig(model_dir, is_async=is_async)
    rig.add("a", prompt(4, 36), 2)
    rig.run()
    rig.reset_gpu_prefix_cache()
    engine = rig.worker._worker().engine

    def broken(*args, **kwargs):
        raise RuntimeError("injected copy failure")

    engine.submit_load = broken
    rig.add("b", [*prompt(4, 36), 7, 8, 9], 3)
    rig.run()
    stats = sched_stats(rig)
    assert (stats.load_jobs, stats.load_failures, stats.chunks_loaded) == (1, 1, 0)
    # The rig checked b's positions before computing on them: they were recomputed, not read
    # as zeros from the failed load.
    assert rig.checked_positions["b"] >= 39
    assert rig.outputs["b"] == expected_outputs([*prompt(4, 36), 7, 8, 9], 3)
    store = rig.connector._sched().scheduler.store.stats()
    assert store.pinned == 0


def test_reset_cache_drops_the_cpu_tier(model_dir, is_async, seam):
    rig = make_rig(model_dir, is_async=is_async, connector=seam)
    rig.add("a", prompt(5, 36), 1)
    rig.run()
    assert rig.scheduler.reset_prefix_cache(reset_connector=True)
    rig.kv_caches["model.layers.0.self_attn.attn"].zero_()
    rig.add("b", [*prompt(5, 36), 1, 2], 1)
    rig.run()
    assert rig.load_of("b") is None
    assert rig.cpu_store().stats().ready == 3  # b stored them again


def test_stats_reach_vllm_and_prometheus(model_dir, is_async):
    rig = make_rig(model_dir, is_async=is_async)
    rig.add("a", prompt(6, 24), 1)
    rig.run()
    rig.reset_gpu_prefix_cache()
    rig.add("b", [*prompt(6, 24), 3], 1)
    rig.run()
    stats = sched_stats(rig)
    assert (stats.chunks_stored, stats.chunks_loaded, stats.hit_tokens) == (2, 2, 24)
    assert stats.bytes_loaded == 2 * BPC * BLOCK_BYTES
    # Each get_kv_connector_stats call reports the increments since the previous one.
    assert rig.connector.get_kv_connector_stats() is None


def test_jobs_in_flight_keep_the_engine_stepping(model_dir, is_async):
    rig = make_rig(model_dir, is_async=is_async)
    stall = Stall(rig)
    rig.add("a", prompt(7, 24), 2)
    with pytest.raises(AssertionError, match="still running"):
        rig.run(max_steps=20)
    assert rig.connector.has_pending_push_work() and rig.scheduler.has_requests()
    stall.on = False
    rig.run()
    assert not rig.connector.has_pending_push_work()
    assert sched_stats(rig).chunks_stored == 2
