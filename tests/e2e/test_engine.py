"""kvoffload inside a real vLLM engine (the CPU build): real forward passes, vLLM's own model
runner calling the connector, a real attention kernel reading the KV we loaded.

Every scenario runs the prompts, resets the device prefix cache and runs them again (or starts a
second engine on the same tier). Every pass must give the greedy token ids of an engine with no
connector and no prefix caching. In the pass after the reset every hit comes from kvoffload: the
tier's count of hit tokens equals vLLM's external prefix-cache hits, and (in-process engines) every
KV block a load wrote equals, byte for byte, the block computed for the same hash.

vLLM's own tiering (`TieringOffloadingSpec`, where `DiskTier` and `RedisTier` also plug in) does
not start on the CPU build: its CPU tier refuses a non-CUDA platform. Those tiers are run here
behind `KVOffloadConnector`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from configs import ours, spec

from conftest import BLOCK_BYTES, BLOCK_SIZE, RunEngine
from redis_server import RedisServer

SMALL_BATCH = 256  # max_num_batched_tokens: the long prompts prefill over 2 to 6 steps


SEAMS = pytest.mark.parametrize(
    "connector", [ours, spec], ids=["KVOffloadConnector", "KVOffloadSpec"]
)


def ours_seam(counters: dict[str, float]) -> bool:
    """Whether the pass ran `KVOffloadConnector` (its series are registered at start-up, all of
    them); else vLLM's `OffloadingConnector` with `KVOffloadSpec`."""
    return "vllm:kvoffload_lookups" in counters


def tier_hit_tokens(counters: dict[str, float]) -> float:
    """Tokens the tier served, as the seam counts them: ours counts hit tokens; vLLM's
    connector the bytes it loaded (whole GPU blocks of the one-group model; its series appears
    with the first load)."""
    if ours_seam(counters):
        return counters["vllm:kvoffload_hit_tokens"]
    return counters.get("vllm:kv_offload_load_bytes", 0.0) / BLOCK_BYTES * BLOCK_SIZE


def whole_chunks(prompts: list[list[int]], chunk_tokens: int) -> list[int]:
    """What a warm tier gives each prompt: its whole chunks (vLLM computes at least the last
    token, which a prompt of whole chunks has in its last chunk, reloaded and recomputed)."""
    return [len(p) // chunk_tokens * chunk_tokens for p in prompts]


def check_pass(
    result_pass: dict[str, Any],
    reference: list[list[int]],
    expected_cached: list[int] | None,
    *,
    one_group: bool = True,
) -> dict[str, float]:
    assert result_pass["tokens"] == reference, "greedy output differs from recompute"
    counters: dict[str, float] = result_pass["counters"]
    external = counters["vllm:external_prefix_cache_hits"]
    local = counters["vllm:prefix_cache_hits"]
    assert sum(result_pass["cached"]) == external + local
    if one_group or ours_seam(counters):
        assert tier_hit_tokens(counters) == external
    if expected_cached is not None:
        assert result_pass["cached"] == expected_cached
    return counters


def check_kv(result: dict[str, Any], external: float) -> None:
    kv = result["kv"]
    assert kv["missing"] == 0, kv
    assert kv["same_block"] == 0, kv
    assert kv["mismatched"] == 0, kv
    assert kv["compared"] * BLOCK_SIZE >= external > 0, kv


@SEAMS
@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_cpu_tier(
    run_engine: RunEngine,
    prompts: list[list[int]],
    reference: list[list[int]],
    connector: Any,
    blocks_per_chunk: int,
) -> None:
    result = run_engine(
        prompts,
        kv_transfer_config=connector(blocks_per_chunk=blocks_per_chunk),
        compare_kv=True,
        max_num_batched_tokens=SMALL_BATCH,
        async_scheduling=False,
    )
    first, second = result["passes"]
    check_pass(first, reference, None)
    cached = whole_chunks(prompts, blocks_per_chunk * BLOCK_SIZE)
    counters = check_pass(second, reference, cached)
    # Shared prefixes hit the device cache in the first pass; after the reset only the tier.
    assert (
        counters["vllm:external_prefix_cache_hits"]
        >= sum(cached) - counters["vllm:prefix_cache_hits"]
    )
    # Exactly one block written by a load per external hit block: none loaded twice.
    assert result["kv"]["compared"] * BLOCK_SIZE == counters["vllm:external_prefix_cache_hits"]
    check_kv(result, counters["vllm:external_prefix_cache_hits"])


@SEAMS
def test_async_scheduling(
    run_engine: RunEngine, prompts: list[list[int]], reference: list[list[int]], connector: Any
) -> None:
    result = run_engine(
        prompts,
        kv_transfer_config=connector(),
        compare_kv=True,
        max_num_batched_tokens=SMALL_BATCH,
        async_scheduling=True,
    )
    first, second = result["passes"]
    check_pass(first, reference, None)
    counters = check_pass(second, reference, whole_chunks(prompts, BLOCK_SIZE))
    check_kv(result, counters["vllm:external_prefix_cache_hits"])


@SEAMS
def test_multiprocess_engine(
    run_engine: RunEngine, prompts: list[list[int]], reference: list[list[int]], connector: Any
) -> None:
    """The engine core in a process of its own, as `LLM` starts it by default (and the server
    always): the connector's scheduler side runs there, its stats cross to the front end."""
    result = run_engine(
        prompts,
        kv_transfer_config=connector(),
        multiprocess=True,
        max_num_batched_tokens=SMALL_BATCH,
    )
    first, second = result["passes"]
    check_pass(first, reference, None)
    check_pass(second, reference, whole_chunks(prompts, BLOCK_SIZE))


@SEAMS
def test_tensor_parallel(
    run_engine: RunEngine, prompts: list[list[int]], reference: list[list[int]], connector: Any
) -> None:
    """Two workers, each copying its half of the KV heads."""
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    result = run_engine(
        prompts,
        kv_transfer_config=connector(),
        multiprocess=True,
        tensor_parallel_size=2,
        max_num_batched_tokens=SMALL_BATCH,
        # vLLM's CPU workers each bind to a NUMA node of their own unless told which cores to
        # take; this machine has one node.
        env={
            "VLLM_CPU_OMP_THREADS_BIND": "|".join(
                ",".join(map(str, part)) for part in (cores[:half], cores[half:] or cores[:half])
            )
        },
    )
    first, second = result["passes"]
    check_pass(first, reference, None)
    counters = check_pass(second, reference, whole_chunks(prompts, BLOCK_SIZE))
    if connector is ours:  # summed over the two workers
        assert (
            counters["vllm:kvoffload_bytes_loaded"]
            == counters["vllm:kvoffload_hit_tokens"] / BLOCK_SIZE * BLOCK_BYTES
        )


def disk(path: Path) -> dict[str, Any]:
    return {"type": "DiskTier", "path": str(path), "capacity_bytes": 1 << 30, "namespace": "e2e"}


def shared(redis: RedisServer) -> dict[str, Any]:
    return {"type": "RedisTier", "url": redis.url, "namespace": "e2e"}


@pytest.mark.parametrize("tiers", ["disk", "redis", "disk+redis"])
def test_secondary_tier_second_engine(
    run_engine: RunEngine,
    prompts: list[list[int]],
    reference: list[list[int]],
    redis: RedisServer,
    tmp_path: Path,
    tiers: str,
) -> None:
    """One engine stores and exits; a second starts with an empty CPU tier and serves the
    prompts from the tier behind it: a restart warm from its disk, a replica finding what
    another wrote to Redis, and in the chain a node with an empty disk served by Redis."""

    def chain(disk_path: Path) -> list[dict[str, Any]]:
        return [disk(disk_path) if t == "disk" else shared(redis) for t in tiers.split("+")]

    dump = tmp_path / "computed.pkl"
    first = run_engine(
        prompts,
        kv_transfer_config=ours(secondary_tiers=chain(tmp_path / "disk")),
        passes=1,
        dump_kv=dump,
        compare_kv=True,
    )
    stored = check_pass(first["passes"][0], reference, None)
    # Every chunk the CPU tier took is written on to each tier of the chain.
    assert stored["vllm:kvoffload_chunks_stored"] > 0
    assert stored["vllm:kvoffload_secondary_shards_written"] == stored[
        "vllm:kvoffload_chunks_stored"
    ] * len(tiers.split("+"))
    # The chain's second node has a disk of its own, empty: what it finds is Redis's.
    second_disk = tmp_path / ("disk" if tiers == "disk" else "other-disk")
    second = run_engine(
        prompts,
        kv_transfer_config=ours(secondary_tiers=chain(second_disk)),
        passes=1,
        kv_reference=dump,
    )
    cached = whole_chunks(prompts, BLOCK_SIZE)
    counters = check_pass(second["passes"][0], reference, cached)
    # Nothing was in its CPU tier: every hit block was promoted from the tier behind.
    assert (
        counters["vllm:kvoffload_secondary_chunks_promoted"]
        == counters["vllm:kvoffload_chunks_loaded"]
    )
    assert counters["vllm:kvoffload_secondary_chunks_promoted"] > 0
    check_kv(second, counters["vllm:external_prefix_cache_hits"])


def test_the_connector_by_name_alone(
    run_engine: RunEngine, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """`"kv_connector": "KVOffloadConnector"` with no module path: the engine loads our plugin
    (the package's `vllm.general_plugins` entry point) at start-up and finds it."""
    config = ours()
    del config["kv_connector_module_path"]
    short = prompts[6:]
    result = run_engine(short, kv_transfer_config=config)
    first, second = result["passes"]
    check_pass(first, reference[6:], None)
    counters = check_pass(second, reference[6:], whole_chunks(short, BLOCK_SIZE))
    assert counters["vllm:kvoffload_hit_tokens"] == sum(whole_chunks(short, BLOCK_SIZE)) > 0


@SEAMS
def test_tier_smaller_than_a_prompt(
    run_engine: RunEngine, prompts: list[list[int]], reference: list[list[int]], connector: Any
) -> None:
    """A 1,500-token prompt (46 whole blocks) and a tier of 32 slots, prefilled in one step."""
    big = [prompts[4]]
    result = run_engine(
        big, kv_transfer_config=connector(cpu_bytes_to_use=32 * BLOCK_BYTES), compare_kv=True
    )
    first, second = result["passes"]
    check_pass(first, reference[4:5], None)
    counters = check_pass(second, reference[4:5], None)
    if connector is ours:
        # The prompt's head fills the tier: the first 32 blocks are stored and loaded.
        assert counters["vllm:kvoffload_hit_tokens"] == 32 * BLOCK_SIZE
        check_kv(result, counters["vllm:external_prefix_cache_hits"])
    else:
        # vLLM's OffloadingConnector offers the prompt's 46 blocks as one store, which the
        # manager refuses whole when it cannot take them all (as vLLM's own CPU manager does).
        assert counters["vllm:external_prefix_cache_hits"] == 0


@SEAMS
def test_hybrid_sliding_window(
    run_engine: RunEngine,
    prompts: list[list[int]],
    hybrid_model: Path,
    hybrid_reference: list[list[int]],
    connector: Any,
) -> None:
    """Gemma 3 layers: sliding-window (128 tokens) then full attention, two KV-cache groups; a
    load writes the full layers' blocks and the window's last blocks."""
    result = run_engine(
        prompts,
        model_path=hybrid_model,
        kv_transfer_config=connector(),
        compare_kv=True,
        max_num_batched_tokens=SMALL_BATCH,
    )
    first, second = result["passes"]
    check_pass(first, hybrid_reference, None, one_group=False)
    counters = check_pass(second, hybrid_reference, None, one_group=False)
    external = counters["vllm:external_prefix_cache_hits"]
    check_kv(result, external)
    # Blocks of both groups were loaded: more blocks than the full-attention group's alone.
    loaded_blocks = result["kv"]["compared"]
    assert loaded_blocks * BLOCK_SIZE > external
    if connector is spec:
        # A group's block holds one of the two layers.
        assert counters["vllm:kv_offload_load_bytes"] == loaded_blocks * BLOCK_BYTES // 2
