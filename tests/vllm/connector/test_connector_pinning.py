"""`KVOffloadConnector` with `pin_in_background` (its default): the engine serves at once while
each worker prepares its CPU pool piece by piece, and the tier grows as pieces become ready, on
vLLM's real scheduler through the rig. Each piece waits on a gate the test opens (the injected
slow start-up); 64 slots in pieces of 16."""

from __future__ import annotations

import functools
import logging

import pytest
from rig import make_rig, prompt
from vllm.v1.outputs import KVConnectorOutput

from kvoffload import ConfigError
from kvoffload.transfer import CpuPool
from kvoffload.transfer import engine as engine_module
from kvoffload.vllm.connector.metadata import KVOffloadHandshakeMetadata, KVOffloadWorkerMetadata
from kvoffload.vllm.connector.scheduler_side import SchedulerSide
from kvoffload.vllm.connector.stats import KVOffloadStats
from pool_gate import Gate, until

CHUNK_BYTES = 6144  # the rig's 12-token chunk: 3 blocks x 2 layers x 1 KiB


def grown_rig(model_dir, monkeypatch, gate: Gate, **kw):
    monkeypatch.setattr(engine_module, "CpuPool", functools.partial(CpuPool, before_piece=gate))
    extra = {"pin_in_background": True, "pin_piece_bytes": 16 * CHUNK_BYTES}
    return make_rig(model_dir, extra=extra, **kw)


def serve(rig, rid: str, tokens: list[int]) -> int:
    rig.add(rid, tokens, 2)
    rig.run()
    return rig.external_hits.get(rid, 0)


def pool(rig) -> CpuPool:
    return rig.engine().pool


def test_the_engine_serves_before_any_piece_is_ready_then_grows_into_the_tier(
    model_dir, monkeypatch, is_async
):
    gate = Gate()
    rig = grown_rig(model_dir, monkeypatch, gate, is_async=is_async)
    store = rig.cpu_store()
    assert (store.usable_slots, pool(rig).usable_slots) == (0, 0)
    # Nothing is ready: requests are served from the GPU alone, nothing is stored or loaded.
    assert serve(rig, "a", prompt(7, 48)) == 0
    rig.reset_gpu_prefix_cache()
    assert serve(rig, "b", prompt(7, 48)) == 0
    assert rig.stores == [] and rig.loads == [] and store.stats().used_slots == 0
    assert rig.outputs["a"] and rig.outputs["b"]
    # The first piece: 16 slots, once the scheduler hears of it through a step's results.
    gate.open(0)
    until(lambda: pool(rig).usable_slots == 16, "the first piece never became ready")
    serve(rig, "c", prompt(8, 48))  # the step reports it; c's own chunks are stored
    assert store.usable_slots == 16
    rig.reset_gpu_prefix_cache()
    assert serve(rig, "d", prompt(8, 60)) == 48  # loaded from the tier, every byte checked
    assert rig.checked_positions["d"] >= 59
    assert all(s < 16 for s in store_slots(rig))
    gate.open(3)
    pool(rig).wait_ready(30)
    serve(rig, "e", prompt(9, 12))
    assert store.usable_slots == 64


def store_slots(rig) -> list[int]:
    return [int(s) for meta in rig.metas for job in meta.stores for s in job.slots]


def test_slots_of_pieces_not_ready_are_never_handed_out(model_dir, monkeypatch):
    gate = Gate()
    gate.open(0)
    rig = grown_rig(model_dir, monkeypatch, gate)
    until(lambda: pool(rig).usable_slots == 16, "the first piece")
    for i in range(8):  # 8 prompts of 4 chunks: 32 chunks through a 16-slot tier
        serve(rig, f"r{i}", prompt(20 + i, 48))
    assert rig.cpu_store().stats().evictions >= 16
    assert max(store_slots(rig)) == 15
    rig.cpu_store().check_invariants()


def test_a_piece_that_fails_leaves_a_smaller_working_tier(model_dir, monkeypatch, caplog):
    gate = Gate(fail=frozenset({2}))
    gate.open(10)
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        rig = grown_rig(model_dir, monkeypatch, gate)
        pool(rig).wait_ready(30)
    assert pool(rig).usable_slots == 32
    warnings = [r.getMessage() for r in caplog.records if "stops growing" in r.getMessage()]
    assert len(warnings) == 1 and "piece 2 of 4" in warnings[0]
    serve(rig, "a", prompt(3, 48))
    rig.reset_gpu_prefix_cache()
    assert serve(rig, "b", prompt(3, 60)) == 48
    assert rig.cpu_store().usable_slots == 32


def two_workers(rig) -> SchedulerSide:
    """The rig's scheduler half, rebuilt for two workers (TP 2)."""
    settings = rig.connector._sched().settings
    return SchedulerSide(type(settings)(**{**settings.__dict__, "world_size": 2}))


def test_a_slot_counts_only_once_every_worker_has_it(model_dir):
    """Two workers (TP 2), one slower: the scheduler uses what both have."""
    side = two_workers(make_rig(model_dir))
    store = side.scheduler.store

    def report(usable: dict[int, int] | KVOffloadWorkerMetadata) -> None:
        meta = usable if isinstance(usable, KVOffloadWorkerMetadata) else None
        meta = meta or KVOffloadWorkerMetadata(usable_slots=usable)
        side.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=meta))

    assert store.usable_slots == 0
    report({0: 48})  # rank 0 has 48 slots ready; rank 1 has not reported yet
    assert store.usable_slots == 0
    report({1: 16})
    assert store.usable_slots == 16
    both = KVOffloadWorkerMetadata(usable_slots={0: 64}).aggregate(
        KVOffloadWorkerMetadata(usable_slots={1: 32})
    )
    assert both.usable_slots == {0: 64, 1: 32}
    report(both)
    assert store.usable_slots == 32


def test_the_handshake_counts_a_slot_once_every_worker_has_it(model_dir):
    """vLLM hands the scheduler every worker's handshake at once, keyed by (pp_rank, tp_rank);
    the ranks inside count, and metadata of another connector is not read."""
    side = two_workers(make_rig(model_dir))
    store = side.scheduler.store
    assert store.num_slots == 32  # the rig's 64 chunks' bytes, each chunk now on two workers
    side.on_handshake([KVOffloadHandshakeMetadata(0, 24)])
    assert store.usable_slots == 0  # rank 1 has not reported
    side.on_handshake([KVOffloadHandshakeMetadata(0, 24), KVOffloadHandshakeMetadata(1, 8), 7])
    assert store.usable_slots == 8
    side.update_connector_output(
        KVConnectorOutput(kv_connector_worker_meta=KVOffloadWorkerMetadata(usable_slots={1: 32}))
    )
    assert store.usable_slots == 24  # growth after it comes from step outputs


def test_a_handshake_short_of_ranks_or_with_bad_ones_keeps_the_tier_empty_and_says_why(
    model_dir, caplog
):
    """PCP ranks without DCP share vLLM's (pp_rank, tp_rank) key: one of them is lost. A rank
    past the world size is another engine's; a count past the tier is capped."""
    side = two_workers(make_rig(model_dir))
    store = side.scheduler.store
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        side.on_handshake([KVOffloadHandshakeMetadata(0, 24), KVOffloadHandshakeMetadata(5, 30)])
        side.on_handshake([KVOffloadHandshakeMetadata(-1, 30), KVOffloadHandshakeMetadata(1, True)])
    assert store.usable_slots == 0
    messages = [r.getMessage() for r in caplog.records]
    assert sum("reported no CPU pool for workers [1]" in m for m in messages) == 2
    assert sum("reported rank=5, usable_slots=30" in m for m in messages) == 1  # once
    side.on_handshake([KVOffloadHandshakeMetadata(1, 10_000)])
    assert store.usable_slots == 24  # rank 1's count capped at the tier's 32 slots


def test_pipeline_stages_are_handed_over_too(model_dir):
    """vLLM's default hook refuses pp_rank > 0 (it is meant for P/D handshakes); ours takes every
    stage's pool."""
    rig = make_rig(model_dir)
    side = two_workers(rig)
    connector = rig.connector
    connector._scheduler_side = side
    connector.set_xfer_handshake_metadata_pp_aware(
        {(0, 0): KVOffloadHandshakeMetadata(0, 30), (1, 0): KVOffloadHandshakeMetadata(1, 20)}
    )
    assert side.scheduler.store.usable_slots == 20


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"pin_in_background": "yes"}, "pin_in_background='yes'"),
        ({"pin_piece_bytes": 0}, "pin_piece_bytes=0"),
        ({"pin_piece_bytes": 1.5}, "pin_piece_bytes=1.5"),
        ({"pin_piece_bytes": 1 << 40}, "pin_piece_bytes=1099511627776"),
    ],
)
def test_bad_pinning_options_stop_start_up_naming_the_key(model_dir, extra, match):
    with pytest.raises(ConfigError, match=match):
        make_rig(model_dir, extra=extra)


def test_numa_node_on_a_single_node_machine_is_accepted_and_logged(model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="kvoffload"):
        rig = make_rig(model_dir, extra={"pin_in_background": True, "numa_node": 0})
    assert "NUMA binding: 0 (configured)" in caplog.text
    assert pool(rig).numa_node == 0
    pool(rig).wait_ready(30)
    serve(rig, "a", prompt(3, 48))
    rig.reset_gpu_prefix_cache()
    assert serve(rig, "b", prompt(3, 60)) == 48


def test_numa_node_auto_in_cpu_mode_binds_nothing_and_says_why(model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="kvoffload"):
        rig = make_rig(model_dir, extra={"pin_in_background": True})
    assert "NUMA binding: None (none: the GPU's node is not known)" in caplog.text
    assert pool(rig).numa_node is None


@pytest.mark.parametrize(
    ("numa_node", "match", "error"),
    [
        ("yes", "numa_node='yes'", ConfigError),
        (-1, "numa_node=-1", ConfigError),
        (1000, "numa_node=1000 is invalid: this machine has no such node", ConfigError),
    ],
)
def test_a_bad_numa_node_stops_start_up_naming_it(model_dir, numa_node, match, error):
    with pytest.raises(error, match=match):
        make_rig(model_dir, extra={"numa_node": numa_node})


def test_the_usable_tier_is_a_gauge_that_grows(model_dir, monkeypatch):
    gate = Gate()
    rig = grown_rig(model_dir, monkeypatch, gate)
    side = rig.connector._sched()
    assert side.get_stats() is None  # nothing usable, nothing happened yet
    inner, seen = side.get_stats, []
    side.get_stats = lambda: seen.append(out := inner()) or out  # what vLLM's logger receives
    gate.open(1)
    until(lambda: pool(rig).usable_slots == 32, "two pieces")
    serve(rig, "a", prompt(3, 12))
    (stats,) = [s for s in seen if s is not None and "cpu_tier_usable_bytes" in s.data]
    assert stats.data["cpu_tier_usable_bytes"] == 32 * CHUNK_BYTES
    assert stats.data["cpu_tier_ready_ratio"] == 0.5
    # Gauges are not summed when vLLM folds intervals together.
    earlier = KVOffloadStats(data={"cpu_tier_usable_bytes": 16 * CHUNK_BYTES, "lookups": 1})
    folded = earlier.aggregate(stats).data
    assert folded["cpu_tier_usable_bytes"] == 32 * CHUNK_BYTES
    assert folded["lookups"] == 1 + stats.data["lookups"]
    gate.open(3)
    pool(rig).wait_ready(30)


def test_the_gpus_node_refused_by_the_kernel_is_a_warning_not_a_stop(
    model_dir, monkeypatch, caplog
):
    from kvoffload.vllm import pinning

    monkeypatch.setattr(pinning, "gpu_numa_node", lambda device: 5)  # no such node here
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        rig = make_rig(model_dir, extra={"pin_in_background": True})
    assert "not placed on the GPU's NUMA node 5" in caplog.text
    assert pool(rig).numa_node is None
    pool(rig).wait_ready(30)
    serve(rig, "a", prompt(3, 48))
    rig.reset_gpu_prefix_cache()
    assert serve(rig, "b", prompt(3, 60)) == 48


def test_a_configured_node_the_kernel_refuses_stops_start_up(model_dir, monkeypatch):
    from kvoffload.transfer import pool as pool_module

    monkeypatch.setattr(pool_module, "_SYS_MBIND", {})  # as on an architecture we cannot bind
    with pytest.raises(ConfigError, match="numa_node=0: binding memory is not supported"):
        make_rig(model_dir, extra={"numa_node": 0})


@pytest.mark.parametrize("value", ["none", None])
def test_numa_node_none_binds_nothing(model_dir, value, caplog):
    with caplog.at_level(logging.INFO, logger="kvoffload"):
        rig = make_rig(model_dir, extra={"numa_node": value})
    assert "NUMA binding: None (configured: none)" in caplog.text
    assert pool(rig).numa_node is None


def test_kvoffload_spec_inside_vllms_connector_grows_too(model_dir, monkeypatch):
    """`KVOffloadSpec`: vLLM's manager interface answers "cannot store now" for slots not ready;
    the workers publish their progress through a shared file the manager reads."""
    gate = Gate()
    rig = grown_rig(model_dir, monkeypatch, gate, connector="spec")  # opts in (off for the spec)
    manager = rig.connector.connector_scheduler.manager
    try:
        assert manager.store.usable_slots == 0
        assert serve(rig, "a", prompt(7, 48)) == 0
        assert rig.stores == [] and manager.store.stats().used_slots == 0
        gate.open(0)
        until(lambda: pool(rig).usable_slots == 16, "the first piece")
        serve(rig, "c", prompt(8, 48))
        assert manager.store.usable_slots == 16
        rig.reset_gpu_prefix_cache()
        assert serve(rig, "d", prompt(8, 60)) == 48  # loaded, every byte checked
        assert rig.checked_positions["d"] >= 59
    finally:
        gate.open(10)
        rig.worker.connector_worker.worker.shutdown()  # rank 0 removes the shared file


def test_kvoffload_spec_says_when_it_cannot_follow_the_workers(caplog):
    """A worker whose progress never reaches the manager's file (another host, another
    engine_id) leaves the tier empty: one error says why and what to set."""
    from kvoffload.transfer.progress import PoolProgress
    from kvoffload.vllm.spec.manager import KVOffloadManager

    progress = PoolProgress("spec-refusal-test", 2)
    progress.publish(0, 16)  # rank 1 runs elsewhere
    try:
        manager = KVOffloadManager(64, progress=progress)
        with caplog.at_level(logging.ERROR, logger="kvoffload"):
            manager._grow()
            manager._grow()
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "workers [1] report no progress" in errors[0]
        assert manager.store.usable_slots == 0
        progress.publish(1, 1000)  # another engine's larger pool under the same name
        manager._grow()
        assert manager.store.usable_slots == 16
        progress.publish(0, 1000)
        manager._grow()
        assert manager.store.usable_slots == 64  # capped at the tier's own size
        manager.shutdown()
    finally:
        progress.close(unlink=True)
