"""A router fed by vLLM's own ZMQ KV-event publisher predicts every request's hit exactly.

vLLM 0.33's real scheduler publishes each step's events (its GPU prefix cache's and
`KVOffloadConnector`'s, with `self_describing_kv_events`) over ZMQ; `kv_router.KVRouter`
subscribes as llm-d's indexer and Dynamo's router do, and before each request predicts the tokens
the engine will find (GPU prefix cache, or the chunks its tiers hold between them). The engine then
runs it, and the hit vLLM reports (local + external, its prefill stats) must equal the prediction:
over CPU-tier and disk evictions, damaged files, a disk going down and a cache reset, with two
engines sharing a Redis tier. Shipped defaults throughout, except the sizes that make tiers
evict within a short replay, and a breaker cool-down longer than the test where a disk is broken.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from rig import Rig, make_rig, prompt
from router_rig import Fleet, publishing, workload

from kv_router import Instance
from kvoffload.tiers.disk import file_bytes

CHUNK_BYTES = 6144  # the rig's chunk: 3 blocks x 2 layers x 1 KiB
NAMESPACE = "tiny-llama@test"


def disk(path: Path, chunks: int, **options: object) -> dict:
    return {
        "type": "DiskTier",
        "path": str(path),
        "capacity_bytes": chunks * file_bytes(CHUNK_BYTES),
        "namespace": NAMESPACE,
        **options,
    }


def engine(
    model_dir: str, where: Path, name: str, *tiers: dict, **rig: Any
) -> tuple[Rig, Instance]:
    """Our connector with `self_describing_kv_events`, publishing on ZMQ."""
    events, instance = publishing(where, name)
    extra: dict[str, Any] = {"self_describing_kv_events": True}
    if tiers:
        extra["secondary_tiers"] = list(tiers)
    r = make_rig(model_dir, extra=extra, kv_events=events, **rig)
    deadline = time.monotonic() + 10  # the disk's start-up scan runs beside the engine
    while not all(getattr(t, "scanned", True) for t in r.connector._sched().tier_lookups):
        assert time.monotonic() < deadline, "the directory was never indexed"
        time.sleep(0.001)
    return r, instance


def test_cpu_and_disk_evictions_every_prediction_is_the_hit(model_dir, tmp_path, kv_router):
    # A CPU tier of 10 chunks and a disk of 20 behind it (the 14 prompts are 38 chunks), and a
    # GPU cache of 18 blocks: every tier evicts.
    rig, a = engine(
        model_dir,
        tmp_path,
        "a",
        disk(tmp_path / "disk", 20),
        cpu_chunks=10,
        num_gpu_blocks=18,
    )
    kv_router.connect(a)
    fleet = Fleet(kv_router, {"a": rig})
    fleet.replay(workload(1, ["a"], 60), "r")
    hits = [p for _, p, _ in fleet.served]
    stats = rig.connector._sched().scheduler.stats()
    # The replay reached every source: hits of every size, chunks promoted from the disk, and
    # evictions withdrawn from both tiers.
    assert sum(h > 0 for h in hits) >= 20 and max(hits) >= 48
    assert stats.secondary_chunks_promoted >= 5
    assert fleet.events("a", "BlockRemoved", "CPU")
    disk_removed = fleet.events("a", "BlockRemoved", "STORAGE")
    assert disk_removed and all(e["locality"] == "LOCAL" for e in disk_removed)
    # Each chunk announced once per tier while it is there, as its 3 blocks with their tokens.
    stored = fleet.events("a", "BlockStored", "STORAGE")
    assert all(len(e["block_hashes"]) == 3 and len(e["token_ids"]) == 12 for e in stored)
    ownership = stored[0]["ownership"]
    assert ownership.startswith("DiskTier:")
    assert kv_router.medium_blocks("a", "STORAGE", ownership) <= 20 * 3

    # A cache reset (vLLM's /reset_prefix_cache with the connector): the CPU tier's chunks are
    # withdrawn with the next step's events (vLLM publishes a step's events as it ends), the
    # disk's stay.
    on_disk = kv_router.medium_blocks("a", "STORAGE", ownership)
    assert rig.scheduler.reset_prefix_cache(reset_connector=True)
    fleet.replay([("a", prompt(999, 24))], "fresh")
    fleet.catch_up()
    assert kv_router.medium_blocks("a", "CPU") == 6  # the fresh prompt's 2 chunks
    assert kv_router.medium_blocks("a", "STORAGE", ownership) >= on_disk
    fleet.replay(workload(2, ["a"], 20), "s")


def test_two_engines_sharing_redis_through_damage_and_a_disk_going_down(
    model_dir, tmp_path, redis, kv_router
):
    """Engines a and b, each a CPU tier and a disk of its own, then the Redis tier both reach:
    what a wrote b finds there, and a's damaged and lost disk files are found and withdrawn."""
    rigs, shared = {}, None
    for name in ("a", "b"):
        rig, inst = engine(
            model_dir,
            tmp_path,
            name,
            # A cool-down longer than the test: a's broken disk stays down.
            disk(tmp_path / f"disk-{name}", 8, breaker_cooldown_s=600),
            {"type": "RedisTier", "url": redis.url, "namespace": NAMESPACE},
            cpu_chunks=6,
            num_gpu_blocks=18,
        )
        shared = rig.connector._sched().settings.tiers[1].ownership
        rigs[name] = rig
        kv_router.connect(Instance(name, inst.endpoint, inst.replay_endpoint, frozenset({shared})))
    fleet = Fleet(kv_router, rigs)
    fleet.replay(workload(3, ["a", "b"], 40), "r")
    # b found chunks only a wrote (and the reverse): the router pooled the shared tier.
    assert sum(p for n, p, _ in fleet.served if n == "b") > 0
    to_redis = [e for e in fleet.events("a", "BlockStored", "STORAGE") if e["ownership"] == shared]
    assert to_redis and {e["locality"] for e in to_redis} == {"REMOTE"}

    # Damage: every file on a's disk is overwritten. The loads that find it fail (never served);
    # the chunks come from Redis instead, and a withdraws them from its disk.
    files = [p for p in (tmp_path / "disk-a").rglob("*") if p.is_file()]
    assert files
    for p in files:
        p.write_bytes(b"\0" * p.stat().st_size)
    before = len(fleet.events("a", "BlockRemoved", "STORAGE"))
    fleet.replay(workload(4, ["a"], 12), "d")
    assert len(fleet.events("a", "BlockRemoved", "STORAGE")) > before

    # The disk goes down (its directory is gone, a file in its place): its breaker opens, all
    # of a's disk blocks are withdrawn, and Redis serves.
    (namespace_dir,) = [p for p in (tmp_path / "disk-a").iterdir() if p.is_dir()]
    shutil.rmtree(namespace_dir)
    namespace_dir.write_bytes(b"not a directory")
    fleet.replay(workload(5, ["a", "b"], 24), "x")
    assert rigs["a"].connector._sched().tier_lookups[0].down
    disk_a = rigs["a"].connector._sched().settings.tiers[0].ownership
    assert kv_router.medium_blocks("a", "STORAGE", disk_a) == 0
    assert len(fleet.served) == 76

    # Redis evicts on its own (here every chunk is deleted), unseen: the router still counts
    # those chunks for every replica. A request that wants one finds it gone at its lookup and
    # loads less than predicted (what a shared tier cannot promise); its engine withdraws the
    # first chunk it found gone for every replica, recomputes and writes them back.
    for key in redis.keys():
        if b"canary" not in key:
            redis.command("DEL", key)
    a = rigs["a"]
    assert a.scheduler.reset_prefix_cache(reset_connector=True)  # a's CPU tier: empty
    fleet.replay([("a", prompt(998, 12))], "fresh")
    tokens = workload(5, ["a"], 1)[0][1]
    predicted, reported = fleet.serve("a", "gone", tokens)
    assert predicted >= 24 and reported < predicted
    # Three passes over 16 requests: a router's over-counting of what Redis lost shrinks as
    # requests find the chunks gone (withdrawn) or write them back (true again), to nothing.
    later = workload(6, ["a", "b"], 16)
    over = []
    for tag in "yzw":
        over.append(0)
        for i, (name, tokens) in enumerate(later):
            predicted, reported = fleet.serve(name, f"{tag}{i}", tokens)
            assert reported <= predicted  # never a hit the router did not expect
            over[-1] += reported < predicted
    assert over[0] > over[1] > over[2] == 0, over


@pytest.mark.parametrize("as_ints", ["0", "1"])
def test_block_hashes_are_converted_as_vllm_converts_them(monkeypatch, as_ints):
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

    from kvoffload.vllm.connector.events import hash_converter

    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", as_ints)
    h = BlockHash(bytes(range(32)))
    assert hash_converter()(h) == maybe_convert_block_hash(h)


def test_a_hybrid_models_full_group_is_described_and_its_window_group_is_not(model_dir):
    """As vLLM's connector does: a sliding-window chunk alone is no prefix a router can match."""
    from vllm.distributed.kv_events import BlockStored

    rig = make_rig(
        model_dir,
        geometry="full+swa",
        enable_events=True,
        extra={"self_describing_kv_events": True},
    )
    published: list[Any] = []
    rig.scheduler.kv_event_publisher.publish = published.append
    tokens = prompt(7, 48)
    rig.add("a", tokens, 2)
    rig.run()
    stored = [e for b in published for e in b.events if isinstance(e, BlockStored)]
    full = [e for e in stored if e.medium == "CPU" and e.group_idx == 1]
    window = [e for e in stored if e.medium == "CPU" and e.group_idx == 0]
    assert [e.token_ids for e in full] == [tokens[i : i + 12] for i in range(0, 48, 12)]
    assert {(len(e.block_hashes), e.block_size, e.kv_cache_spec_kind) for e in full} == {
        (3, 4, "full_attention")
    }
    assert window and all(e.token_ids == [] and e.block_size == 0 for e in window)
    assert {(e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in window} == {
        ("sliding_window", 20)
    }
