"""`--verify-data`: the transfer engine in CPU mode moves real bytes for every job.

Each GPU block is a 64-byte page standing in for its KV: the block's prefix hash, twice. A
computed block gets its page when computed; stores and loads copy pages through the engine's
CPU pool; a loaded block must then hold its own page, so a chunk stored under the wrong key, a
slot overwritten while in use or a copy to the wrong block shows up as a mismatch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvoffload.scheduler.jobs import LoadJob, StoreJob
from kvoffload.simulate.instance import DataCheck

PAGE_BYTES = 64


def _pages(hashes: Sequence[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(h + h for h in hashes), dtype=np.uint8).reshape(-1, PAGE_BYTES)


class TransferDataCheck(DataCheck):
    def __init__(self, gpu_blocks: int, num_slots: int, blocks_per_chunk: int) -> None:
        import torch

        from kvoffload.transfer import TransferEngine

        self._torch = torch
        self.cache = torch.zeros(gpu_blocks, PAGE_BYTES, dtype=torch.uint8)
        self.engine = TransferEngine(
            self.cache, num_slots=num_slots, blocks_per_chunk=blocks_per_chunk
        )
        self.blocks_per_chunk = blocks_per_chunk

    def write(self, block_ids: Sequence[int], hashes: Sequence[bytes]) -> None:
        self.cache[list(block_ids)] = self._torch.from_numpy(_pages(hashes).copy())

    def store(self, job: StoreJob) -> None:
        self.engine.submit_store(job.job_id, job.gpu_block_ids, job.slots)
        self._drain()

    def load(self, job: LoadJob) -> None:
        self.engine.submit_load(job.job_id, job.slots, job.gpu_block_ids, job.skip_leading_blocks)
        self._drain()

    def check_load(self, job: LoadJob, hashes: Sequence[bytes]) -> int:
        first = job.first_chunk * self.blocks_per_chunk + job.skip_leading_blocks
        want = _pages(hashes[first : first + len(job.gpu_block_ids)])
        got = self.cache[job.gpu_block_ids.tolist()].numpy()
        return int((got != want).any(axis=1).sum())

    def _drain(self) -> None:
        # CPU mode copies at submit; a copy that raised reports a failed job.
        for result in self.engine.get_finished():
            if not result.success:
                raise RuntimeError(f"transfer job {result.job_id} failed in CPU mode")

    def close(self) -> None:
        self.engine.close()
