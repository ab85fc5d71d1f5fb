"""`KVOffloadWorker`: vLLM's `OffloadingWorker` contract over our `TransferEngine`."""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvoffload.errors import ConfigError, NotSupportedError
from kvoffload.transfer import TransferEngine
from kvoffload.transfer.progress import PoolProgress
from kvoffload.vllm.pinning import Pinning


class KVOffloadWorker(OffloadingWorker):
    """Copies the chunks of one KV-cache group between the tensors vLLM registers (block
    dimension leading, one per layer or one for all layers; CUDA, or CPU in tests) and a pinned
    pool of `num_slots` chunks.

    A job's GPU spec lists the blocks of logical block indices `block_indices[0] ..` of its
    request: a first block inside a chunk skips that chunk's leading blocks, and a job may end
    inside its last chunk (vLLM's partial tails), exactly as vLLM's CPU worker places them."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        *,
        num_slots: int,
        blocks_per_chunk: int,
        cpu_bytes_to_use: int,
        pinning: Pinning | None = None,
        progress: PoolProgress | None = None,
        rank: int = 0,
    ) -> None:
        """With `progress`, the pool is prepared as `pinning` says and this worker (`rank`)
        publishes how much of it is ready, for the manager in the scheduler's process."""
        if len(kv_caches.group_data_refs) != 1:
            raise NotSupportedError(
                f"KVOffloadSpec copies one KV-cache group; this model has "
                f"{len(kv_caches.group_data_refs)}"
            )
        used = sorted({ref.tensor_idx for ref in kv_caches.group_data_refs[0]})
        tensors = [kv_caches.tensors[i].tensor for i in used]
        self.blocks_per_chunk = blocks_per_chunk
        pinning = pinning or Pinning(in_background=False)
        try:
            self.engine = pinning.engine(
                tensors[0].device,
                lambda **pool: TransferEngine(
                    tensors,
                    num_slots=num_slots,
                    blocks_per_chunk=blocks_per_chunk,
                    block_dim=0,
                    **pool,
                ),
            )
        except (RuntimeError, MemoryError) as exc:
            raise ConfigError(
                f"cpu_bytes_to_use={cpu_bytes_to_use}: this worker could not allocate its CPU "
                f"pool of {num_slots} chunks ({exc})"
            ) from exc

        self._progress = progress
        self._rank = rank
        self._publish()

    def _publish(self) -> None:
        if self._progress is not None:
            self._progress.publish(self._rank, self.engine.pool.usable_slots)

    def _placement(self, gpu: GPULoadStoreSpec) -> int:
        """Blocks to skip in the job's first chunk."""
        if not len(gpu.block_ids):  # an empty group places nothing (vLLM skips it)
            return 0
        (first,) = gpu.block_indices  # one group: the constructor refused more
        return int(first) % self.blocks_per_chunk

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        skip = self._placement(src_spec)
        self.engine.submit_store(job_id, src_spec.block_ids, _slots(dst_spec), skip)
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        skip = self._placement(dst_spec)
        self.engine.submit_load(
            job_id, _slots(src_spec), dst_spec.block_ids, skip, expedited=expedited
        )
        return True

    def get_finished(self) -> list[TransferResult]:
        self._publish()  # called every step: the manager sees the pool grow within a step
        return [
            TransferResult(r.job_id, r.success, r.num_bytes, r.seconds)
            for r in self.engine.get_finished()
        ]

    def wait(self, job_ids: set[int]) -> None:
        # Ids already reported are ignored: vLLM's async scheduling may ask again.
        self.engine.wait(job_ids)

    def shutdown(self) -> None:
        self.engine.close()
        if self._progress is not None:
            self._progress.close(unlink=self._rank == 0)


def _slots(spec: LoadStoreSpec) -> Any:
    block_ids = getattr(spec, "block_ids", None)
    if block_ids is None:
        raise TypeError(f"expected the manager's CPULoadStoreSpec, got {type(spec).__name__}")
    return block_ids
