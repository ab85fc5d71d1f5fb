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
from rig import NUM_LAYERS, NoCopyWorker, Rig, make_rig


class RegionCopyWorker(NoCopyWorker):
    def __init__(self, holder: dict[str, Rig], bpc: int) -> None:
        super().__init__(None, None)
        self._holder = holder
        self._bpc = bpc

    def _page(self, block: int, layer: int) -> np.ndarray:
        caches = list(self._holder["rig"].kv_caches.values())
        return caches[layer][block].view(torch.uint8).reshape(-1).numpy()

    def _copy(self, gpu_spec: Any, cpu_spec: Any, to_region: bool) -> None:
        """Every GPU block of a job, each at its place in its chunk's row of the region."""
        manager = self._holder["rig"].connector.connector_scheduler.manager
        region = np.asarray(manager.primary_tier.get_kv_memoryview())
        (first,) = gpu_spec.block_indices
        skip = first % self._bpc
        for i, block in enumerate(gpu_spec.block_ids):
            row = int(cpu_spec.block_ids[(skip + i) // self._bpc])
            j = (skip + i) % self._bpc
            for layer in range(NUM_LAYERS):
                page = self._page(int(block), layer)
                at = slice(
                    (j * NUM_LAYERS + layer) * page.size, (j * NUM_LAYERS + layer + 1) * page.size
                )
                if to_region:
                    region[row, at] = page
                else:
                    page[:] = region[row, at]

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        self._copy(src_spec, dst_spec, to_region=True)
        return super().submit_store(job_id, src_spec, dst_spec)

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
    ) -> bool:
        self._copy(dst_spec, src_spec, to_region=False)
        return super().submit_load(job_id, src_spec, dst_spec, expedited)


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
