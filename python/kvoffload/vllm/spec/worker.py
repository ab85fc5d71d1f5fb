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

from kvoffload.errors import ConfigError
from kvoffload.transfer import JobPart, TransferEngine
from kvoffload.transfer.progress import PoolProgress
from kvoffload.vllm.pinning import Pinning


class KVOffloadWorker(OffloadingWorker):
    """Copies the chunks of vLLM's KV-cache groups between the tensors vLLM registers (block
    dimension leading, one per layer or one for all layers; CUDA, or CPU in tests) and a pinned
    pool of `num_slots` chunks.

    A slot is a chunk of every tensor any group uses. The groups of a hybrid model overlay each
    other on the same tensors (one layer of each group per tensor; a shorter group uses fewer),
    so that is one group's chunk, and a group's chunk fills its own tensors' part of its slot:
    as vLLM's CPU worker keeps one CPU array per tensor, indexed by the same CPU block ids.

    A job's GPU spec lists, group after group, the blocks of logical block indices
    `block_indices[g] ..` of its request: a first block inside a chunk skips that chunk's
    leading blocks, and a group may end inside its last chunk (vLLM's partial tails); its CPU
    spec lists each group's chunks in the same order, exactly as vLLM's CPU worker reads them."""

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
        groups = [{ref.tensor_idx for ref in refs} for refs in kv_caches.group_data_refs]
        used = sorted(set().union(*groups))
        # Named by vLLM's tensor index, to find each group's segments by.
        tensors = {str(i): kv_caches.tensors[i].tensor for i in used}
        self.blocks_per_chunk = blocks_per_chunk
        pinning = pinning or Pinning(in_background=False)
        try:
            self.engine = pinning.engine(
                kv_caches.tensors[used[0]].tensor.device,
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

        layout = self.engine.layout
        self._group_segments: list[list[int] | None] = []
        for tensor_ids in groups:
            segments = layout.segments_of(map(str, tensor_ids))
            self._group_segments.append(segments if tensor_ids != set(used) else None)

        self._progress = progress
        self._rank = rank
        self._publish()

    def _publish(self) -> None:
        if self._progress is not None:
            self._progress.publish(self._rank, self.engine.pool.usable_slots)

    def _parts(self, gpu: GPULoadStoreSpec, cpu: LoadStoreSpec) -> list[JobPart]:
        """One part per group, read as vLLM's CPU worker reads the specs: group `g` takes the
        next `group_sizes[g]` GPU blocks and the next `cdiv(skip + group_sizes[g], bpc)` CPU
        blocks, `skip = block_indices[g] % bpc` being its first block's place in its first
        chunk; an empty group takes neither."""
        sizes, indices = gpu.group_sizes, gpu.block_indices
        if len(sizes) != len(self._group_segments):
            raise ValueError(
                f"group_sizes={list(sizes)} has {len(sizes)} groups; this worker copies "
                f"{len(self._group_segments)}"
            )
        slots, bpc = _slots(cpu), self.blocks_per_chunk
        parts, block, slot = [], 0, 0
        for size, index, segments in zip(sizes, indices, self._group_segments, strict=True):
            skip = int(index) % bpc if size else 0
            num_slots = -(-(skip + size) // bpc)
            gpu_ids = gpu.block_ids[block : block + size]
            parts.append(JobPart(slots[slot : slot + num_slots], gpu_ids, skip, segments))
            block, slot = block + size, slot + num_slots
        if slot != len(slots):
            raise ValueError(
                f"the CPU spec lists {len(slots)} chunks, but group_sizes={list(sizes)} with "
                f"block_indices={list(indices)} place {slot}"
            )
        return parts

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        self.engine.submit_store_parts(job_id, self._parts(src_spec, dst_spec))
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        parts = self._parts(dst_spec, src_spec)
        self.engine.submit_load_parts(job_id, parts, expedited=expedited)
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
