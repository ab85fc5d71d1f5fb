"""On a hybrid model (sliding-window or chunked-local beside full attention, vLLM's hybrid
KV-cache manager on; also with EAGLE draft layers),
both our seams decide as vLLM's own OffloadingConnector (CPU spec, `lru`) does: the same trace
through vLLM's real scheduler gives the same tokens loaded per request, the same keys loaded,
and the same keys stored (so the same chunks per group), while the tier fills and evicts; ours
check every byte each group's attention reads."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from rig import NoCopyWorker, Rig, make_rig

TPB = 16


def conversations(seed: int) -> list[tuple[str, list[int]]]:
    """12 requests: 3 conversations of 4 turns, each turn the last one's prompt plus a new
    message, so a turn hits the chunks (and sliding-window tail) its predecessor stored."""
    rng = random.Random(seed)
    out = []
    for c in range(3):
        tokens = [rng.randrange(100, 900) for _ in range(rng.randint(40, 120))]
        for turn in range(4):
            out.append((f"c{c}t{turn}", list(tokens)))
            tokens += [rng.randrange(100, 900) for _ in range(rng.randint(20, 80))]
    rng.shuffle(out)
    # Earlier turns first, so that later ones can hit what they stored.
    out.sort(key=lambda r: int(r[0][-1]))
    return out


def run(
    model_dir, connector, is_async, requests, *, geometry="full+swa", gpu_blocks=48, batch=256, **kw
):
    rig = make_rig(
        model_dir,
        connector=connector,
        is_async=is_async,
        vllm_worker=NoCopyWorker,
        tokens_per_block=TPB,
        max_num_batched_tokens=batch,
        max_num_seqs=4,
        num_gpu_blocks=gpu_blocks,
        verify=connector != "vllm",
        geometry=geometry,
        **kw,
    )
    for rid, tokens in requests:
        rig.add(rid, tokens, 3)
    rig.run(max_steps=3000)
    return rig


def groups_of(keys: list[bytes]) -> Counter[int]:
    return Counter(int.from_bytes(k[-4:], "big") for k in keys)


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize(
    ("geometry", "gpu_blocks", "cpu_chunks", "chunk_tokens", "window"),
    [
        ("full+swa", 48, 200, 16, 40),
        ("full+swa", 48, 60, 16, 100),
        ("full+swa", 48, 16, 64, 48),
        # Chunked-local attention (Llama 4) beside full attention.
        ("full+local", 48, 200, 16, 64),
        ("full+local", 48, 60, 16, 128),
        # Two EAGLE groups (draft layers beside the full-attention ones): volatile last chunks.
        ("full+swa+draft", 72, 200, 16, 40),
        ("full+swa+draft", 72, 60, 16, 100),
    ],
)
def test_same_loads_and_stores_as_vllm(
    model_dir, seam, is_async, seed, geometry, gpu_blocks, cpu_chunks, chunk_tokens, window
):
    requests = conversations(seed)
    kw = {
        "geometry": geometry,
        "gpu_blocks": gpu_blocks,
        "cpu_chunks": cpu_chunks,
        "chunk_tokens": chunk_tokens,
        "window": window,
    }
    theirs = run(model_dir, "vllm", is_async, requests, **kw)
    ours = run(model_dir, seam, is_async, requests, **kw)
    same_decisions(theirs, ours, geometry, cpu_chunks)


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize(
    ("gpu_blocks", "cpu_chunks", "chunk_tokens"), [(40, 200, 16), (40, 40, 16), (32, 12, 64)]
)
def test_same_loads_and_stores_as_vllm_with_mamba_states(
    model_dir, seam, is_async, seed, gpu_blocks, cpu_chunks, chunk_tokens
):
    """Mamba ("align" mode) beside full attention. Prefill steps of 64 tokens end on chunk
    boundaries, where vLLM hands the state over: those are the states stored and hit."""
    requests = conversations(seed)
    kw = {
        "geometry": "full+mamba",
        "gpu_blocks": gpu_blocks,
        "cpu_chunks": cpu_chunks,
        "chunk_tokens": chunk_tokens,
        "batch": 64,
    }
    theirs = run(model_dir, "vllm", is_async, requests, **kw)
    ours = run(model_dir, seam, is_async, requests, **kw)
    same_decisions(theirs, ours, "full+mamba", cpu_chunks)


def same_decisions(theirs: Rig, ours: Rig, geometry: str, cpu_chunks: int) -> None:
    assert sum(theirs.external_hits.values()) > 0  # the trace loads from the CPU tier
    assert groups_of(theirs.stored_keys)[0] > 0  # and stores window-group chunks
    if geometry != "full+local":  # a hit on an attention-chunk boundary reads no local chunk
        assert groups_of([k for keys in theirs.loaded_keys.values() for k in keys])[0] > 0
    assert ours.external_hits == theirs.external_hits
    assert Counter(ours.stored_keys) == Counter(theirs.stored_keys)
    assert {r: sorted(k) for r, k in ours.loaded_keys.items()} == {
        r: sorted(k) for r, k in theirs.loaded_keys.items()
    }
    assert ours.outputs == theirs.outputs
    if cpu_chunks <= 60:
        assert ours.cpu_store().stats().evictions > 0
