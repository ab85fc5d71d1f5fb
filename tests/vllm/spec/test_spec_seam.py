"""KVOffloadSpec inside vLLM's own OffloadingConnector, on vLLM's real scheduler: start-up errors,
vLLM's block fencing (`jobs_to_flush`) over our worker, sync (expedited) loads, `arc`.

The seed controls, eviction, preemption, resets and readmission run through this seam in
test_connector_seeds.py and test_connector_lifecycle.py (`seam="spec"`). A failed transfer is not
a scenario here: vLLM 0.33's OffloadingConnector asserts that every transfer succeeded.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from rig import BLOCK_BYTES, BPC, Stall, expected_outputs, make_rig, prompt
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvoffload import ConfigError, NotSupportedError
from kvoffload.vllm import KVOffloadManager, KVOffloadSpec, KVOffloadWorker


def spec_of(rig) -> KVOffloadSpec:
    spec = rig.worker.connector_worker.spec
    assert isinstance(spec, KVOffloadSpec)
    return spec


def test_vllm_builds_our_manager_and_worker(model_dir):
    rig = make_rig(model_dir, connector="spec", cpu_chunks=40, extra={"eviction_policy": "arc"})
    manager = rig.connector.connector_scheduler.manager
    assert isinstance(manager, KVOffloadManager)
    assert (manager.store.num_slots, manager.store.eviction_policy) == (40, "arc")
    worker = rig.worker.connector_worker.worker
    assert isinstance(worker, KVOffloadWorker)
    # One slot holds a chunk of every layer: 3 GPU blocks of 2 layers.
    assert worker.engine.chunk_bytes == BPC * BLOCK_BYTES
    assert worker.engine.pool.num_slots == 40


@pytest.mark.parametrize(
    ("extra", "error", "match"),
    [
        ({"cpu_bytes_to_use": None}, ConfigError, "cpu_bytes_to_use is required"),
        (
            {"cpu_bytes_to_use": "1e9"},
            ConfigError,
            r"cpu_bytes_to_use='1e9' is invalid: expected an",
        ),
        ({"eviction_policy": "fifo"}, ConfigError, "eviction_policy='fifo' is invalid"),
        ({"offload_prompt_only": "no"}, ConfigError, "offload_prompt_only='no'"),
        ({"cpu_bytes_to_use": 100}, ConfigError, "cpu_bytes_to_use=100 holds no chunk"),
        ({"store_threshold": 2}, ConfigError, "store_threshold=2 is not supported"),
        ({"store_threshold": "x"}, ConfigError, "store_threshold='x' is invalid: expected an int"),
        ({"block_size": 0}, ConfigError, r"block_size=0 is invalid: a chunk is a positive"),
        ({"cache_policy_module_path": "x.y"}, ConfigError, "cache_policy_module_path is not"),
        ({"canonical_layout": True}, NotSupportedError, "canonical_layout is not supported"),
        ({"record_trace": "t.jsonl"}, NotSupportedError, "record_trace is written by KVOffload"),
    ],
)
def test_bad_config_stops_start_up_naming_the_key(model_dir, extra, error, match):
    with pytest.raises(error, match=match):
        make_rig(model_dir, connector="spec", extra=extra)


def test_vllm_cpu_spec_keys_that_change_nothing_are_accepted(model_dir):
    extra = {"store_threshold": "1", "max_tracker_size": 10, "cache_policy_module_path": None}
    rig = make_rig(model_dir, connector="spec", extra=extra)
    assert spec_of(rig).num_chunks == 64


def test_a_hybrid_model_gets_the_tier_of_its_bytes_per_block(model_dir):
    config = spec_of(make_rig(model_dir, connector="spec")).config
    two_groups = KVOffloadSpec(dataclasses.replace(config, groups=config.groups * 2))
    # vLLM's bytes per block are those of the allocation the groups overlay: not summed.
    assert two_groups.num_chunks == 64


def test_the_worker_copies_each_group_in_its_own_tensors():
    """vLLM's hybrid layout: 3 tensors, group 0 has a layer in each, the shorter group 1 in the
    first two. Blocks per chunk 3: group 0's 2 blocks from logical block 4 skip 1 block of their
    one chunk; group 1's 3 blocks from logical block 1 fill the last 2 of one chunk and 1 of the
    next. The CPU spec lists group 0's chunk, then group 1's two, as vLLM's CPU worker reads it."""
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randint(1, 127, (24, 64), dtype=torch.int8, generator=gen) for _ in range(3)]
    group_tensors = [(0, 1, 2), (0, 1)]
    refs = [[CanonicalKVCacheRef(i, 64) for i in ids] for ids in group_tensors]
    caches = CanonicalKVCaches([CanonicalKVCacheTensor(t, 64) for t in tensors], refs)
    worker = KVOffloadWorker(caches, num_slots=8, blocks_per_chunk=3, cpu_bytes_to_use=1 << 20)
    src, dst, cpu = [10, 11, 3, 4, 5], [20, 21, 13, 14, 15], CPULoadStoreSpec([5, 0, 3])
    placed = {  # (slot, block in its chunk): (GPU block stored, its group)
        (5, 1): (10, 0), (5, 2): (11, 0),
        (0, 1): (3, 1), (0, 2): (4, 1), (3, 0): (5, 1),
    }  # fmt: skip
    before = [t.clone() for t in tensors]

    assert worker.submit_store(1, GPULoadStoreSpec(src, [2, 3], [4, 1]), cpu)
    worker.wait({1})
    for t in tensors:
        t.zero_()
    assert worker.submit_load(2, cpu, GPULoadStoreSpec(dst, [2, 3], [4, 1]))
    worker.wait({2})

    job_bytes = (2 * 3 + 3 * 2) * 64  # per group: its blocks times its tensors' pages
    results = [(r.job_id, r.success, r.transfer_size) for r in worker.get_finished()]
    assert results == [(1, True, job_bytes), (2, True, job_bytes)]
    pool = torch.stack([worker.engine.pool.slot(s).view(torch.int8) for s in range(8)])
    want_pool = torch.zeros(8, 3, 3, 64, dtype=torch.int8)  # [slot, tensor, block, page]
    want_gpu = [torch.zeros_like(t) for t in tensors]
    moved = dict(zip(src, dst, strict=True))
    for (slot, index), (block, group) in placed.items():
        for i in group_tensors[group]:
            want_pool[slot, i, index] = before[i][block]
            want_gpu[i][moved[block]] = before[i][block]
    assert torch.equal(pool.view(8, 3, 3, 64), want_pool)
    for t, want in zip(tensors, want_gpu, strict=True):
        assert torch.equal(t, want)
    worker.shutdown()


def test_tier_is_split_over_workers(model_dir):
    config = spec_of(make_rig(model_dir, connector="spec", cpu_chunks=40)).config
    tp2 = dataclasses.replace(
        config, parallel=dataclasses.replace(config.parallel, world_size=2, tp_size=2)
    )
    # cpu_bytes_to_use is the total over all workers: each copies its shard of every chunk.
    assert KVOffloadSpec(tp2).num_chunks == 20


def test_reused_block_is_fenced_until_the_store_ran(model_dir, is_async):
    """ "a" finishes with its last chunk's store in flight (results held back); vLLM frees its
    blocks at once and hands them to "b", fencing the reuse with `jobs_to_flush`: our worker must
    have copied a's chunk before b's forward pass overwrites it (a third request loads it)."""
    rig = make_rig(
        model_dir,
        is_async=is_async,
        connector="spec",
        num_gpu_blocks=9,  # 8 usable: a takes 7, b needs 8
        extra={"offload_prompt_only": False},
    )
    stall = Stall(rig)
    seen: dict[str, object] = {}

    def watch(rig, so):
        meta = so.kv_connector_metadata
        if "b" in so.num_scheduled_tokens and "b_step" not in seen:
            seen["b_step"] = rig.step
            seen["flush"] = rig.flushed_job_ids(meta)
        if "b_step" in seen and rig.step > seen["b_step"] + 1:
            stall.on = False

    rig.before_worker = watch
    rig.add("a", prompt(1, 20), 5)
    rig.add("b", prompt(2, 28), 1)
    rig.run()
    a_stores = {s.job_id for s in rig.stores if s.request_id == "a"}
    assert seen["flush"] & a_stores  # b's first step waited for a's stores
    assert rig.offsets_stored("a") == set(range(2 * BPC))
    assert rig.outputs["b"] == expected_outputs(prompt(2, 28), 1)
    rig.reset_gpu_prefix_cache()
    rig.add("c", prompt(1, 20) + rig.outputs["a"][:4] + [5, 6], 1)
    rig.run()
    assert rig.load_of("c").num_tokens == 24  # byte for byte, checked by the rig


def test_sync_loads_run_expedited_before_the_forward_pass(model_dir, is_async):
    rig = make_rig(
        model_dir,
        is_async=is_async,
        connector="spec",
        extra={"sync_load_budget_bytes": 1 << 30},
    )
    rig.add("a", prompt(7, 48), 2)
    rig.run()
    rig.reset_gpu_prefix_cache()
    expedited = []
    engine = rig.engine()
    submit = engine.submit_load_parts

    def spy(*args, **kwargs):
        expedited.append(kwargs.get("expedited"))
        return submit(*args, **kwargs)

    engine.submit_load_parts = spy
    rig.add("b", prompt(7, 48) + prompt(8, 10), 3)
    rig.run()
    assert expedited == [True]
    assert rig.load_of("b").num_tokens == 48
    assert rig.checked_positions["b"] >= 58  # loaded bytes were in place before b's forward


@pytest.mark.parametrize(("policy", "a3_loads"), [("lru", 24), ("arc", 36)])
def test_arc_keeps_a_reused_prefix_that_lru_evicts(model_dir, is_async, policy, a3_loads):
    """A tier of 4 chunks: a's 3 chunks are used again by a2, then b and c store one chunk each.
    c's chunk needs room: LRU evicts a's tail (b is newer), ARC the once-used b."""
    rig = make_rig(
        model_dir,
        is_async=is_async,
        connector="spec",
        cpu_chunks=4,
        extra={"eviction_policy": policy},
    )
    rig.add("a", prompt(1, 36), 1)
    rig.run()
    rig.reset_gpu_prefix_cache()
    rig.add("a2", [*prompt(1, 36), 4], 1)
    rig.run()
    for rid, seed in (("b", 2), ("c", 3)):
        rig.add(rid, prompt(seed, 14), 1)
        rig.run()
    rig.reset_gpu_prefix_cache()
    rig.add("a3", [*prompt(1, 36), 9], 1)
    rig.run()
    assert rig.load_of("a2").num_tokens == 36
    assert rig.load_of("a3").num_tokens == a3_loads
    assert rig.outputs["a3"] == expected_outputs([*prompt(1, 36), 9], 1)
