"""The first requests after start-up, with the shipped defaults (`pin_in_background` on for
`KVOffloadConnector`): each worker waits for its pool's first piece in `register_kv_caches` and
reports it in vLLM's handshake, so the very first step already stores into the CPU tier. The rig's
pool (64 chunks of 6 KiB) is one piece: whole before the first step, so every run stores and loads
exactly as one pinned up front (`pin_in_background: false`) does, on vLLM's real scheduler.

"a" (48 tokens: 4 chunks) is served in step 1; the GPU prefix cache is emptied; "b" asks for the
same prompt and 12 more tokens, and loads "a"'s 48 from the CPU tier, every byte checked by the
rig before its forward pass.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import pytest
from rig import Rig, make_rig, prompt
from test_connector_shared_tier import chunk_keys, serve
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata

from kvoffload.transfer import CpuPool
from kvoffload.transfer import engine as engine_module
from kvoffload.vllm.connector.metadata import KVOffloadHandshakeMetadata
from pool_gate import Gate, until

UP_FRONT = {"pin_in_background": False}

# (seam, extra): our connector with its defaults; KVOffloadSpec opted in to background pinning
# (off by default there, see spec.py), and with its default.
SEAMS = [
    pytest.param("kvoffload", {}, id="connector"),
    pytest.param("spec", {"pin_in_background": True}, id="spec-background"),
    pytest.param("spec", {}, id="spec-default"),
]
# (geometry, "a"'s prompt, b's extra tokens, chunks planned in step 1, b's hit), the hits being
# vLLM's own connector's on the same requests: a sliding window of 20 keeps the last 2 of the
# window group's 4 chunks; a Mamba model keeps its state after the 60 tokens step 1 computes.
SCENARIOS = [
    pytest.param("full", 48, 12, 4, 48, id="full"),
    pytest.param("full+swa", 48, 12, 4 + 2, 36, id="full+swa"),
    pytest.param("full+mamba", 61, 0, 5 + 1, 60, id="full+mamba"),
]


def store_chunks_per_step(rig: Rig) -> list[int]:
    """Chunks each step's metadata sent to be stored, whichever seam."""
    out = []
    for meta in rig.metas:
        if hasattr(meta, "stores"):
            out.append(sum(len(job.slots) for job in meta.stores))
        else:
            out.append(sum(len(job.dst_spec.block_ids) for job in meta.store_jobs.values()))
    return out


def first_two(
    model_dir: str, seam: str, is_async: bool, geometry: str, n: int, extra_b: int, extra: dict
) -> Rig:
    rig = make_rig(model_dir, connector=seam, is_async=is_async, geometry=geometry, extra=extra)
    try:
        rig.add("a", prompt(1, n), 2)
        rig.run()
        rig.reset_gpu_prefix_cache()
        rig.add("b", prompt(1, n) + prompt(2, extra_b), 2)
        rig.run()
    finally:
        if seam == "spec":
            rig.worker.connector_worker.worker.shutdown()  # rank 0 removes its progress file
    return rig


def fingerprint(rig: Rig) -> tuple[Any, ...]:
    """What a run stored and loaded, step by step."""
    loads = [
        (job.request_id, job.first_chunk, job.skip_leading_blocks, job.num_tokens)
        for job in rig.loads
    ]
    return (store_chunks_per_step(rig), rig.stored_keys, loads, rig.external_hits, rig.outputs)


@pytest.mark.parametrize(("geometry", "n", "extra_b", "first_step", "hit"), SCENARIOS)
@pytest.mark.parametrize(("seam", "extra"), SEAMS)
def test_the_first_step_stores_and_the_next_request_loads(
    model_dir, seam, extra, is_async, geometry, n, extra_b, first_step, hit
):
    rig = first_two(model_dir, seam, is_async, geometry, n, extra_b, extra)
    store = rig.cpu_store()
    assert store.usable_slots == store.num_slots
    assert store_chunks_per_step(rig)[0] == first_step  # "a"'s, planned in the very first step
    assert rig.external_hits == {"a": 0, "b": hit}
    assert len(rig.loads) == 1
    assert rig.checked_positions["b"] >= hit  # loaded positions checked before b's forward pass
    up_front = first_two(model_dir, seam, is_async, geometry, n, extra_b, UP_FRONT)
    assert fingerprint(rig) == fingerprint(up_front)


def test_the_same_first_requests_give_the_same_stores_and_hits_on_every_run(model_dir, is_async):
    """Five engines started afresh, each served the same requests from its first step: four
    arrive at once (two share a prefix), then two ask again. Every run matches the others and
    the one pinned up front."""

    def run(extra: dict) -> tuple[Any, ...]:
        rig = make_rig(model_dir, is_async=is_async, extra=extra)
        for i, tokens in enumerate(
            [prompt(1, 30), prompt(1, 24) + prompt(3, 14), prompt(2, 20), prompt(4, 13)]
        ):
            rig.add(f"r{i}", tokens, 3)
        rig.run()
        rig.reset_gpu_prefix_cache()
        rig.add("again0", prompt(1, 30) + prompt(5, 5), 2)
        rig.add("again2", prompt(2, 20), 2)
        rig.run()
        return fingerprint(rig)

    reference = run(UP_FRONT)
    runs = [run({}) for _ in range(5)]
    assert all(r == reference for r in runs)
    hits = reference[3]
    assert (hits["again0"], hits["again2"]) == (24, 12)  # r0's 2 chunks, r2's 1 (20 tokens)


def test_a_replicas_first_prompt_reaches_the_shared_tier(model_dir, redis, is_async):
    """With the defaults, what engine 1's first forward pass computed goes on to Redis, and
    engine 2's first request loads it (promoted into its CPU tier, then loaded, every byte
    checked). A request first waits, a step or more, for Redis to answer its lookup, as with a
    pool pinned up front."""

    def engine(namespace: str, extra: dict) -> Rig:
        tier = {"type": "RedisTier", "url": redis.url, "namespace": namespace}
        return make_rig(model_dir, is_async=is_async, extra={"secondary_tiers": [tier], **extra})

    runs = []
    for namespace, extra in (("first-step", {}), ("up-front", UP_FRONT)):
        one = engine(namespace, extra)
        assert serve(one, "a", prompt(7, 60)) == 0
        first = next(i for i, scheduled in enumerate(one.scheduled) if scheduled)
        assert one.scheduled[first] == {"a": 60}
        assert store_chunks_per_step(one)[first] == 5  # planned by a's first forward pass
        two = engine(namespace, extra)
        assert serve(two, "b", prompt(7, 60) + prompt(8, 10)) == 60
        assert two.checked_positions["b"] == 70
        # Not the steps themselves: how many a promotion waits for Redis is the network's.
        runs.append([(rig.loads, rig.external_hits, rig.outputs) for rig in (one, two)])
    assert len(chunk_keys(redis)) == 2 * 5  # each namespace's
    assert runs[0] == runs[1]


def test_a_first_piece_not_ready_in_time_starts_an_empty_tier_that_grows(
    model_dir, monkeypatch, caplog
):
    """`register_kv_caches` waits for the first piece at most about a second: a pool whose first
    piece is held back starts empty (served from the GPU alone, one warning), then grows
    through the step outputs."""
    gate = Gate()
    monkeypatch.setattr(engine_module, "CpuPool", functools.partial(CpuPool, before_piece=gate))
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        rig = make_rig(model_dir)
    assert "first piece is not ready after 1.0 s" in caplog.text
    assert rig.cpu_store().usable_slots == 0
    rig.add("a", prompt(1, 48), 2)
    rig.run()
    assert store_chunks_per_step(rig) == [0] * len(rig.metas)
    gate.open(0)
    until(lambda: rig.engine().pool.usable_slots == 64, "the pool never became ready")
    rig.add("c", prompt(2, 48), 2)
    rig.run()
    assert rig.cpu_store().usable_slots == 64
    assert sum(store_chunks_per_step(rig)) == 4


class Sibling:
    """Another sub-connector of a MultiConnector, with its own handshake (as NIXL's) or none."""

    def __init__(self, metadata: object) -> None:
        self.metadata = metadata

    def get_handshake_metadata(self) -> object:
        return self.metadata


@pytest.mark.parametrize(
    ("siblings", "pp_size", "ours"),
    [
        ([Sibling(None)], 1, True),  # vLLM's OffloadingConnector beside ours: it ignores ours
        ([Sibling(KVConnectorHandshakeMetadata())], 1, False),  # NIXL's must reach NIXL
        ([Sibling(None)], 2, False),  # vLLM's default hook refuses pp_rank > 0
    ],
)
def test_inside_a_multi_connector_the_handshake_is_left_to_others_it_would_break(
    model_dir, monkeypatch, siblings, pp_size, ours
):
    """vLLM's MultiConnector hands the first sub-connector's handshake to all of them."""
    rig = make_rig(model_dir)
    connector = rig.worker
    assert isinstance(connector.get_handshake_metadata(), KVOffloadHandshakeMetadata)  # alone
    multi = type("MultiConnector", (), {"_connectors": [connector, *siblings]})()
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", multi)
    monkeypatch.setattr(connector, "_pp_size", pp_size)
    metadata = connector.get_handshake_metadata()
    assert isinstance(metadata, KVOffloadHandshakeMetadata) is ours
    if ours:
        assert (metadata.rank, metadata.usable_slots) == (0, 64)
    else:
        assert metadata is None


def test_two_of_ours_in_one_multi_connector_do_not_ask_each_other_forever(model_dir, monkeypatch):
    """Each asks its siblings for a handshake, and a sibling of ours asks back: the one asked
    again answers none, and the tiers grow from the first step's results."""
    one, two = make_rig(model_dir).worker, make_rig(model_dir).worker
    multi = type("MultiConnector", (), {"_connectors": [one, two]})()
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", multi)
    assert one.get_handshake_metadata() is None  # two has one (asked by one, one said none)
    assert two.get_handshake_metadata() is None
