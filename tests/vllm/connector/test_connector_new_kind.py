"""A third kind of secondary tier is its own folder and one registry line: the test-only
`MemoryTier` (`memory_kind.py`), registered here and named by no kvoffload module, serves
`KVOffloadConnector` as the built-in kinds do, alone or chained behind a disk, driven by vLLM
0.33's real scheduler on the CPU rig (which checks every loaded position byte for byte).
12-token chunks of 4-token blocks: a 60-token prompt is 5 chunks."""

from __future__ import annotations

import memory_kind
import pytest
from rig import Rig, make_rig, prompt

from kvoffload import ConfigError
from kvoffload.tiers import registry

PROMPT = prompt(11, 60)
NAMESPACE = "tiny-llama@test"


@pytest.fixture
def memory_tier(monkeypatch):
    """`MemoryTier` registered for the test only (and an empty store per test)."""
    monkeypatch.setattr(registry, "_KINDS", dict(registry._KINDS))
    registry.register(memory_kind.KIND)
    monkeypatch.setattr(memory_kind, "TIERS", {})
    return {"type": "MemoryTier", "name": "m", "namespace": NAMESPACE}


def test_register_refuses_a_kind_it_cannot_use(monkeypatch):
    monkeypatch.setattr(registry, "_KINDS", dict(registry._KINDS))

    class Half:
        name, locality, report = "HalfTier", "LOCAL", None

        def parse(self, entry):
            return entry

    with pytest.raises(
        TypeError, match=r"lacks sees_evictions, check_shards, open_lookups, open_data_path, rep"
    ):
        registry.register(Half())
    with pytest.raises(ValueError, match="'RedisTier' is registered already"):
        registry.register(type("Twin", (memory_kind.MemoryKind,), {"name": "RedisTier"})())
    registry.register(memory_kind.KIND)
    with pytest.raises(ValueError, match="'MemoryTier' is registered already"):
        registry.register(memory_kind.KIND)
    assert registry.names() == ["RedisTier", "DiskTier", "MemoryTier"]


def serve(rig: Rig, rid: str, tokens: list[int]) -> int:
    rig.add(rid, tokens, 2)
    rig.run(max_steps=50_000)
    return rig.external_hits.get(rid, 0)


def stats(rig: Rig):
    return rig.connector._sched().scheduler.stats()


def test_an_unregistered_type_is_refused_with_the_registered_ones(model_dir):
    entry = {"type": "MemoryTier", "name": "m", "namespace": NAMESPACE}
    with pytest.raises(ConfigError) as err:
        make_rig(model_dir, extra={"secondary_tiers": [entry]})
    assert str(err.value) == (
        "secondary_tiers[0] type='MemoryTier' is invalid; allowed: 'RedisTier', 'DiskTier'"
    )


def test_a_registered_kind_checks_its_entries(model_dir, memory_tier):
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]: unknown MemoryTier key\(s\)"):
        make_rig(model_dir, extra={"secondary_tiers": [{**memory_tier, "colour": "red"}]})


def test_engine_two_promotes_what_engine_one_wrote_on(model_dir, memory_tier, is_async):
    one = make_rig(model_dir, is_async=is_async, extra={"secondary_tiers": [memory_tier]})
    assert serve(one, "a", PROMPT) == 0
    assert len(memory_kind.TIERS["m"]) == 5
    assert stats(one).secondary_shards_written == 5
    two = make_rig(model_dir, is_async=is_async, extra={"secondary_tiers": [memory_tier]})
    assert serve(two, "b", PROMPT) == 60
    assert two.checked_positions["b"] >= 60
    s = stats(two)
    assert (s.secondary_chunks_promoted, s.secondary_chunks_failed) == (5, 0)
    two.connector.shutdown()
    assert two.connector._sched().tier_lookups[0].closed


def test_a_chunk_gone_before_its_promotion_is_recomputed(model_dir, memory_tier):
    one = make_rig(model_dir, extra={"secondary_tiers": [memory_tier]})
    serve(one, "a", PROMPT)
    two = make_rig(model_dir, extra={"secondary_tiers": [memory_tier]})
    # The lookup finds all 5 chunks; the third (engine one wrote them in order) is gone when the
    # worker loads them: the two before it load, the rest is recomputed.
    lookups = two.connector._sched().tier_lookups[0]
    real_flush = lookups.flush
    lost: list[bytes] = []

    def flush_then_lose_one() -> None:
        real_flush()
        if lookups.asked and not lost:
            lost.append(list(memory_kind.TIERS["m"])[2])
            del memory_kind.TIERS["m"][lost[0]]

    lookups.flush = flush_then_lose_one
    assert serve(two, "b", PROMPT) == 24
    assert two.outputs["b"] == one.outputs["a"]
    s = stats(two)
    assert (s.secondary_chunks_promoted, s.secondary_chunks_failed) == (4, 1)
    # The recomputed chunk is written back, and is no longer a miss of this tier.
    assert s.secondary_shards_written == 1
    assert lost[0] in memory_kind.TIERS["m"]
    assert lookups.missed == set()


def test_chained_behind_a_disk_every_tier_is_written(model_dir, memory_tier, tmp_path):
    disk = {
        "type": "DiskTier",
        "path": str(tmp_path),
        "capacity_bytes": 1 << 30,
        "namespace": NAMESPACE,
    }
    one = make_rig(model_dir, extra={"secondary_tiers": [disk, memory_tier]})
    serve(one, "a", PROMPT)
    assert stats(one).secondary_shards_written == 10  # 5 chunks to each tier
    assert len(memory_kind.TIERS["m"]) == 5
    # An engine without that disk finds the prompt in the memory tier.
    two = make_rig(model_dir, extra={"secondary_tiers": [memory_tier]})
    assert serve(two, "b", PROMPT) == 60
    assert two.checked_positions["b"] >= 60
