"""A router fed by vLLM's ZMQ KV-event publisher predicts every request's hit through vLLM's own
`OffloadingConnector` too: with our `KVOffloadSpec` (our CPU tier), and with vLLM's tiering and
our `DiskTier` behind its CPU tier, `self_describing_kv_events` on (vLLM's own tracker then
snapshots the tokens; our manager and tier say what was stored and removed, and by which tier).
Evictions in every tier and a cache reset; see `tests/vllm/connector/test_router_events.py`.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from rig import make_rig, prompt
from router_rig import Fleet, publishing, workload
from tiering_rig import make_tiering_rig

from kvoffload import ConfigError
from kvoffload.tiers.disk import file_bytes

CHUNK_BYTES = 6144


def test_our_cpu_tier_in_vllms_connector(model_dir, tmp_path, kv_router):
    events, instance = publishing(tmp_path, "a")
    rig = make_rig(
        model_dir,
        connector="spec",
        extra={"self_describing_kv_events": True},
        kv_events=events,
        cpu_chunks=10,
        num_gpu_blocks=18,
    )
    kv_router.connect(instance)
    fleet = Fleet(kv_router, {"a": rig})
    fleet.replay(workload(1, ["a"], 50), "r")
    assert sum(p > 0 for _, p, _ in fleet.served) >= 20
    assert fleet.events("a", "BlockRemoved", "CPU")  # it evicted, and said so
    stored = fleet.events("a", "BlockStored", "CPU")
    assert all(len(e["block_hashes"]) == 3 and len(e["token_ids"]) == 12 for e in stored)
    # A cache reset with the connector's: the CPU tier's chunks are withdrawn, with the next
    # step's events (vLLM publishes a step's events, its GPU cache's reset too, as it ends).
    chunks = {e["block_hashes"][-1] for e in stored}
    assert rig.scheduler.reset_prefix_cache(reset_connector=True)
    fleet.replay([("a", prompt(999, 24))], "fresh")
    fleet.catch_up()
    cpu = kv_router.instances["a"].local[("CPU", None)]
    assert chunks and not chunks & set(cpu)  # vLLM's tracker forgot their tokens: last blocks
    fleet.replay(workload(2, ["a"], 20), "s")


def test_our_disk_tier_behind_vllms_cpu_tier(model_dir, tmp_path: Path, kv_router):
    events, instance = publishing(tmp_path, "a")
    entry = {
        "type": "DiskTier",
        "module_path": "kvoffload.vllm",
        "path": str(tmp_path / "disk"),
        "capacity_bytes": 20 * file_bytes(CHUNK_BYTES),
        "namespace": "tiny-llama@test",
        "enable_kv_events": True,
    }
    rig = make_tiering_rig(
        model_dir,
        [entry],
        extra={"self_describing_kv_events": True},
        kv_events=events,
        cpu_chunks=10,
        num_gpu_blocks=18,
    )
    (disk,) = rig.connector.connector_scheduler.manager.secondary_tiers
    deadline = time.monotonic() + 10
    while not disk.scanned:
        assert time.monotonic() < deadline, "the directory was never indexed"
        time.sleep(0.001)
    kv_router.connect(instance)
    fleet = Fleet(kv_router, {"a": rig})
    fleet.replay(workload(1, ["a"], 60), "r")
    removed = fleet.events("a", "BlockRemoved", "STORAGE")
    assert removed and {e["ownership"] for e in removed} == {disk.ownership}
    assert {e["locality"] for e in removed} == {"LOCAL"}
    assert kv_router.medium_blocks("a", "STORAGE", disk.ownership) <= 20 * 3


def test_a_bad_value_stops_start_up_here_too(model_dir):
    # vLLM reads the key with bool(): "false" would turn it on.
    with pytest.raises(ConfigError, match="self_describing_kv_events='false' is invalid"):
        make_rig(model_dir, connector="spec", extra={"self_describing_kv_events": "false"})


def test_the_option_without_vllms_kv_events_says_nothing_is_published(model_dir, caplog):
    make_rig(model_dir, extra={"self_describing_kv_events": True})
    assert "self_describing_kv_events is on but vLLM's KV events are off" in caplog.text
