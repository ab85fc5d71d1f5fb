"""vLLM's `OffloadingConnector` + `TieringOffloadingSpec` + our `RedisTier`, on the CPU rig.

vLLM's CPU copy worker needs CUDA, so `RegionCopyWorker` stands in for it: it copies whole GPU
blocks between the rig's CPU KV tensors and vLLM's CPU region (the primary tier's memoryview, the
same bytes RedisTier reads and writes). Both engines of a test use it, so a chunk's layout in the
region (block after block, layer after layer) is the same on both sides of Redis.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from rig import NUM_LAYERS, Rig, make_rig
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult


class RegionCopyWorker(OffloadingWorker):
    def __init__(self, holder: dict[str, Rig], bpc: int) -> None:
        self._holder = holder
        self._bpc = bpc
        self._done: list[TransferResult] = []

    def _region(self) -> np.ndarray:
        manager = self._holder["rig"].connector.connector_scheduler.manager
        return np.asarray(manager.primary_tier.get_kv_memoryview())

    def _page(self, block: int, layer: int) -> np.ndarray:
        caches = list(self._holder["rig"].kv_caches.values())
        return caches[layer][block].view(torch.uint8).reshape(-1).numpy()

    def _spans(self, chunk_ids: Any, block_ids: Any, first: int) -> list[tuple[int, int, int]]:
        """(GPU block, region row, block within the chunk) for each GPU block of a job."""
        skip = first % self._bpc
        return [
            (int(b), int(chunk_ids[(skip + i) // self._bpc]), (skip + i) % self._bpc)
            for i, b in enumerate(block_ids)
        ]

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        region = self._region()
        (first,) = src_spec.block_indices
        for block, row, j in self._spans(dst_spec.block_ids, src_spec.block_ids, first):
            for layer in range(NUM_LAYERS):
                page = self._page(block, layer)
                start = (j * NUM_LAYERS + layer) * page.size
                region[row, start : start + page.size] = page
        self._done.append(TransferResult(job_id, True, 0, 0.0))
        return True

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
    ) -> bool:
        region = self._region()
        (first,) = dst_spec.block_indices
        for block, row, j in self._spans(src_spec.block_ids, dst_spec.block_ids, first):
            for layer in range(NUM_LAYERS):
                page = self._page(block, layer)
                start = (j * NUM_LAYERS + layer) * page.size
                page[:] = region[row, start : start + page.size]
        self._done.append(TransferResult(job_id, True, 0, 0.0))
        return True

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return


def redis_tier_entry(url: str, namespace: str = "tiny-llama@test", **options: Any) -> dict:
    return {
        "type": "RedisTier",
        "module_path": "kvoffload.vllm",
        "url": url,
        "namespace": namespace,
        **options,
    }


def make_tiering_rig(model_dir: str, tiers: list[dict], **kw: Any) -> Rig:
    """A rig whose connector is vLLM's, with vLLM's CPU primary tier and `tiers` behind it."""
    holder: dict[str, Rig] = {}
    extra = {"spec_name": "TieringOffloadingSpec", "secondary_tiers": tiers, **kw.pop("extra", {})}
    bpc = kw.get("chunk_tokens", 12) // kw.get("tokens_per_block", 4)
    rig = make_rig(
        model_dir,
        connector="vllm",
        extra=extra,
        vllm_worker=lambda canonical, spec: RegionCopyWorker(holder, bpc),
        **kw,
    )
    holder["rig"] = rig
    return rig


def redis_tier(rig: Rig) -> Any:
    (tier,) = rig.connector.connector_scheduler.manager.secondary_tiers
    return tier
