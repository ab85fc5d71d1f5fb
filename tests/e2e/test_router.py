"""A router on a real engine's KV events: vLLM's ZMQ publisher, our connector's self-describing
events for its CPU tier and a disk behind it (chunks of two blocks: a router must round a match
down to whole chunks), and before each request a prediction of the tokens it finds, which must be
what vLLM then reports. A GPU cache of 80 blocks, a CPU tier of 40 chunks and a disk of 60 for
prompts of 185 blocks: every tier evicts as the requests come."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from configs import ours, spec

from conftest import BLOCK_BYTES, BLOCK_SIZE, RunEngine

CHUNK = 2 * BLOCK_SIZE
FILE_BYTES = 4096 + 2 * BLOCK_BYTES  # a chunk's file: its header block, then the chunk


def events(where: Path) -> dict[str, Any]:
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{where}/engine.pub",
        "replay_endpoint": f"ipc://{where}/engine.replay",
    }


@pytest.mark.parametrize("seam", ["KVOffloadConnector", "KVOffloadSpec"])
def test_a_router_on_the_engines_events_predicts_every_hit(
    run_engine: RunEngine, prompts: list[list[int]], tmp_path: Path, seam: str
) -> None:
    extra: dict[str, Any] = {
        "cpu_bytes_to_use": 40 * 2 * BLOCK_BYTES,
        "block_size": CHUNK,
        "self_describing_kv_events": True,
    }
    if seam == "KVOffloadConnector":
        disk = {"type": "DiskTier", "path": str(tmp_path / "disk"), "namespace": "e2e"}
        disk["capacity_bytes"] = 60 * FILE_BYTES
        config = ours(**extra, secondary_tiers=[disk])
    else:
        config = spec(**extra)
    order = random.Random(7).choices(range(len(prompts)), k=24)
    result = run_engine(
        prompts,
        kv_transfer_config=config,
        routed=order,
        num_gpu_blocks_override=80,
        max_model_len=2048,  # what 80 blocks hold
        kv_events_config=events(tmp_path),
    )
    pairs = [tuple(p) for p in result["routed"]]
    assert all(p == r for p, r in pairs), pairs
    # Hits past what the GPU cache could hold: a prompt's whole chunks from the tiers.
    assert sum(r > 0 for _, r in pairs) >= 10
    assert max(r for _, r in pairs) >= 1000
