"""KVOffloadConnector decides as vLLM's own OffloadingConnector (CPU spec, `lru`) does: the same
trace through vLLM's real scheduler with each gives the same tokens loaded per request and the
same chunks stored, while the CPU tier fills up and evicts."""

from __future__ import annotations

import random

import pytest
from rig import NoCopyWorker, make_rig, stored_chunks

TPB = 16


def trace(seed: int) -> list[tuple[str, list[int]]]:
    """12 requests of 300-700 tokens over 3 shared prefixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 900) for _ in range(rng.randint(150, 350))] for _ in range(3)]
    return [
        (
            f"r{i}",
            prefixes[rng.randrange(3)]
            + [rng.randrange(100, 900) for _ in range(rng.randint(150, 350))],
        )
        for i in range(12)
    ]


def run(model_dir, connector, is_async, requests, **kw):
    kw.setdefault("num_gpu_blocks", 48)  # 768 tokens: prefixes fall out of the GPU cache
    rig = make_rig(
        model_dir,
        connector=connector,
        is_async=is_async,
        vllm_worker=NoCopyWorker,
        tokens_per_block=TPB,
        max_num_batched_tokens=512,
        max_num_seqs=4,
        verify=connector == "kvoffload",
        **kw,
    )
    for rid, tokens in requests:
        rig.add(rid, tokens, 3)
    rig.run(max_steps=2000)
    return rig


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize(("cpu_chunks", "chunk_tokens"), [(120, 16), (60, 16), (40, 64)])
def test_same_loads_and_stores_as_vllm(model_dir, is_async, seed, cpu_chunks, chunk_tokens):
    requests = trace(seed)
    theirs = run(
        model_dir, "vllm", is_async, requests, cpu_chunks=cpu_chunks, chunk_tokens=chunk_tokens
    )
    ours = run(
        model_dir, "kvoffload", is_async, requests, cpu_chunks=cpu_chunks, chunk_tokens=chunk_tokens
    )
    assert sum(theirs.external_hits.values()) > 0  # the trace does load from the CPU tier
    store = ours.connector._sched().scheduler.store.stats()
    assert store.evictions > 0  # and the tier fills up
    assert ours.external_hits == theirs.external_hits
    assert stored_chunks(ours) == stored_chunks(theirs)
    assert ours.outputs == theirs.outputs
