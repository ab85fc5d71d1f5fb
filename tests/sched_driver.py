"""A GPU-less engine that drives OffloadScheduler the way vLLM's scheduler does, so tests can
assert exact GPU block offsets. Block ids of request `r` are `base(r) + offset`."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvoffload import CpuStore
from kvoffload.scheduler import (
    LoadJob,
    OffloadConfig,
    OffloadScheduler,
    RequestUpdate,
    StoreJob,
)

TPB = 4  # tokens per GPU block
BPC = 3  # GPU blocks per chunk
TPC = TPB * BPC


class SpyStore(CpuStore):
    """Records every key offered to prepare_store and every lookup batch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.offered: list[list[bytes]] = []
        self.looked_up: list[list[bytes]] = []

    def prepare_store(self, keys, **kwargs):  # type: ignore[no-untyped-def]
        self.offered.append(list(keys))
        return super().prepare_store(keys, **kwargs)

    def lookup_prefix(self, keys):  # type: ignore[no-untyped-def]
        self.looked_up.append(list(keys))
        return super().lookup_prefix(keys)


def block_hashes(tokens: list[int]) -> list[bytes]:
    """vLLM-style chained hashes of the complete blocks of `tokens` (32 bytes each)."""
    out: list[bytes] = []
    prev = b"\0" * 32
    for i in range(len(tokens) // TPB):
        block = tokens[i * TPB : (i + 1) * TPB]
        prev = hashlib.sha256(prev + bytes(str(block), "ascii")).digest()
        out.append(prev)
    return out


def make_scheduler(num_slots: int = 64, **extra: Any) -> tuple[OffloadScheduler, SpyStore]:
    config = OffloadConfig.from_dict(
        {"tokens_per_block": TPB, "blocks_per_chunk": BPC, "cpu_bytes_to_use": 1 << 20, **extra}
    )
    store = SpyStore(num_slots, config.eviction_policy)
    return OffloadScheduler(config, store, bytes_per_chunk=1000), store


@dataclass
class RunResult:
    lookup: int | None
    load: LoadJob | None
    store_jobs: list[StoreJob] = field(default_factory=list)

    @property
    def loaded_offsets(self) -> list[int]:
        return [] if self.load is None else [b % 1000 for b in self.load.gpu_block_ids]

    @property
    def stored_offsets(self) -> set[int]:
        return {int(b) % 1000 for j in self.store_jobs for b in j.gpu_block_ids}


class Engine:
    """Runs one request at a time: prefill in one step, then one decode token per step.

    `lag=1` is the "stores arrive one step late" variant: each step's update reaches
    `plan_step` one step later, and jobs complete one step after they were handed out.
    """

    def __init__(self, sched: OffloadScheduler, lag: int = 0) -> None:
        self.sched = sched
        self.lag = lag
        self.next_base = 0
        self._updates: list[RequestUpdate] = []
        self._handed: list[list[int]] = []

    def _hand_out(self, job_ids: list[int]) -> None:
        self._handed.append(job_ids)
        while len(self._handed) > self.lag:
            for jid in self._handed.pop(0):
                self.sched.complete_job(jid, True)

    def drain(self) -> None:
        for ids in self._handed:
            for jid in ids:
                self.sched.complete_job(jid, True)
        self._handed = []

    def _step(self, result: RunResult, update: RequestUpdate) -> None:
        self._updates.append(update)
        ready = self._updates[: max(0, len(self._updates) - self.lag)]
        self._updates = self._updates[len(ready) :]
        plan = self.sched.plan_step(ready)
        result.store_jobs += plan.store_jobs
        self._hand_out([j.job_id for j in plan.store_jobs])

    def start(
        self,
        request_id: str,
        tokens: list[int],
        num_prompt_tokens: int,
        params: Mapping[str, Any] | None = None,
        num_local_tokens: int = 0,
    ) -> tuple[RunResult, list[int]]:
        """Adds, looks up and schedules a request; returns its result so far and block table."""
        base = self.next_base = self.next_base + 1000
        self.sched.add_request(request_id, num_prompt_tokens, params)
        hashes = block_hashes(tokens[:num_prompt_tokens])
        hit = self.sched.lookup(request_id, num_local_tokens, num_prompt_tokens, hashes)
        table = [base + i for i in range(-(-num_prompt_tokens // TPB))]
        load = self.sched.on_allocated(request_id, table, hit or 0)
        self._hand_out([] if load is None else [load.job_id])
        return RunResult(hit, load), table

    def run(
        self,
        request_id: str,
        tokens: list[int],
        num_prompt_tokens: int,
        kv_tokens: int,
        params: Mapping[str, Any] | None = None,
        num_local_tokens: int = 0,
    ) -> RunResult:
        """Runs a request until KV exists for `kv_tokens` tokens, then finishes it and drains
        every job."""
        result, table = self.start(request_id, tokens, num_prompt_tokens, params, num_local_tokens)
        computed, num_tokens, new_blocks = num_prompt_tokens, num_prompt_tokens + 1, []
        while True:
            hashes = block_hashes(tokens[:num_tokens])
            self._step(result, RequestUpdate(request_id, computed, num_tokens, new_blocks, hashes))
            if computed >= kv_tokens:
                break
            computed, num_tokens, new_blocks = computed + 1, num_tokens + 1, []
            if -(-computed // TPB) > len(table):
                new_blocks = [table[0] + len(table)]
                table += new_blocks
        late, self._updates = self._updates, []
        plan = self.sched.plan_step(late[:-1])
        fin = self.sched.finish_request(request_id, late[-1] if late else None)
        jobs = plan.store_jobs + fin.store_jobs
        result.store_jobs += jobs
        self._hand_out([j.job_id for j in jobs])
        self.drain()
        return result
