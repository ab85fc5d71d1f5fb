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

import random
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from rig import TPB, TPC, Rig, make_rig, prompt
from vllm.config import KVEventsConfig
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import hash_block_tokens, maybe_convert_block_hash

from kv_router import Instance, KVRouter, router
from kvoffload.tiers.disk import file_bytes

CHUNK_BYTES = 6144  # the rig's chunk: 3 blocks x 2 layers x 1 KiB
NAMESPACE = "tiny-llama@test"

_known: dict[Any, bytes] = {}
"""Event-form block hash -> vLLM's hash bytes, for every block the tests hashed."""


def hash_tokens(parent: Any, tokens: list[int]) -> Any:
    """vLLM's block hash of `tokens` after `parent` (both as the events carry them)."""
    h = hash_block_tokens(sha256, None if parent is None else _known[parent], tokens)
    _known[maybe_convert_block_hash(h)] = h
    return maybe_convert_block_hash(h)


def block_hashes(tokens: list[int]) -> list[Any]:
    out, parent = [], None
    for i in range(len(tokens) // TPB):
        parent = hash_tokens(parent, tokens[i * TPB : (i + 1) * TPB])
        out.append(parent)
    return out


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
    """An engine publishing on ZMQ (ipc sockets under `where`), and how a router reaches it."""
    endpoint, replay = f"ipc://{where}/{name}.pub", f"ipc://{where}/{name}.replay"
    extra: dict[str, Any] = {"self_describing_kv_events": True}
    if tiers:
        extra["secondary_tiers"] = list(tiers)
    events = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, replay_endpoint=replay
    )
    r = make_rig(model_dir, extra=extra, kv_events=events, **rig)
    deadline = time.monotonic() + 10  # the disk's start-up scan runs beside the engine
    while not all(getattr(t, "scanned", True) for t in r.connector._sched().tier_lookups):
        assert time.monotonic() < deadline, "the directory was never indexed"
        time.sleep(0.001)
    return r, Instance(name, endpoint, replay)


def published(rig: Rig) -> int:
    """The newest batch the engine's publisher has sent."""
    publisher = rig.scheduler.kv_event_publisher
    publisher._event_queue.join()
    return publisher._buffer[-1][0] if publisher._buffer else -1


class Fleet:
    def __init__(self, kv: KVRouter, engines: dict[str, Rig]) -> None:
        self.kv, self.engines = kv, engines
        self.served: list[tuple[str, int, int]] = []
        """(engine, predicted, reported) per request."""

    def serve(self, name: str, rid: str, tokens: list[int]) -> tuple[int, int]:
        rig = self.engines[name]
        for n, r in self.engines.items():
            self.kv.catch_up(n, published(r))
        predicted = self.kv.predict(name, block_hashes(tokens), len(tokens))
        rig.add(rid, tokens, 2)
        rig.run(max_steps=50_000)
        reported = rig.local_hits.get(rid, 0) + rig.external_hits.get(rid, 0)
        assert rig.checked_positions[rid] >= reported  # what it loaded was checked
        self.served.append((name, predicted, reported))
        return predicted, reported

    def replay(self, requests: list[tuple[str, list[int]]], tag: str) -> None:
        for i, (name, tokens) in enumerate(requests):
            predicted, reported = self.serve(name, f"{tag}{i}", tokens)
            assert predicted == reported, (tag, i, name, predicted, reported)

    def events(self, name: str, kind: str, medium: str) -> list[dict[str, Any]]:
        for n, r in self.engines.items():
            self.kv.catch_up(n, published(r))
        return [
            e
            for n, e in self.kv.events
            if n == name and e["type"] == kind and e.get("medium") == medium
        ]


def workload(seed: int, names: list[str], n: int) -> list[tuple[str, list[int]]]:
    """`n` requests over 14 prompts of 5 families (a 24-token head, 12 to 36 tokens after it)."""
    heads = [prompt(500 + f, 24) for f in range(5)]
    prompts = [heads[i % 5] + prompt(600 + i, 12 * (1 + i % 3)) for i in range(14)]
    rng = random.Random(seed)
    return [(rng.choice(names), rng.choice(prompts)) for _ in range(n)]


@pytest.fixture
def fleet_router():
    with router(TPB, TPC, hash_tokens) as kv:
        yield kv


def test_cpu_and_disk_evictions_every_prediction_is_the_hit(model_dir, tmp_path, fleet_router):
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
    fleet_router.connect(a)
    fleet = Fleet(fleet_router, {"a": rig})
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
    assert fleet_router.medium_blocks("a", "STORAGE", ownership) <= 20 * 3

    # A cache reset (vLLM's /reset_prefix_cache with the connector): the CPU tier's chunks are
    # withdrawn, the disk's stay.
    assert rig.scheduler.reset_prefix_cache(reset_connector=True)
    fleet.replay(workload(2, ["a"], 20), "s")
    assert fleet_router.medium_blocks("a", "CPU") <= 10 * 3


def test_two_engines_sharing_redis_through_damage_and_a_disk_going_down(
    model_dir, tmp_path, redis, fleet_router
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
        fleet_router.connect(
            Instance(name, inst.endpoint, inst.replay_endpoint, frozenset({shared}))
        )
    fleet = Fleet(fleet_router, rigs)
    fleet.replay(workload(3, ["a", "b"], 40), "r")
    # b found chunks only a wrote (and the reverse): the router pooled the shared tier.
    assert sum(p for n, p, _ in fleet.served if n == "b") > 0
    assert all(
        e["locality"] == "REMOTE" and e["ownership"] == shared
        for e in fleet.events("a", "BlockStored", "STORAGE")
        if e["ownership"] == shared
    )

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
    assert fleet_router.medium_blocks("a", "STORAGE", disk_a) == 0
    assert len(fleet.served) == 76
