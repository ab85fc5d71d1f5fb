"""The connector's worker half: the scheduler's jobs run on a `TransferEngine` over the KV caches
vLLM registers; results go back through the worker metadata and vLLM's finished sets."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from kvoffload.errors import ConfigError
from kvoffload.scheduler import LoadJob, StoreJob
from kvoffload.tiers import DataPath, ShardIO, TierKind
from kvoffload.tiers.kind import Reporter
from kvoffload.transfer import JobPart, TransferEngine
from kvoffload.vllm.connector.metadata import (
    KVOffloadHandshakeMetadata,
    KVOffloadMetadata,
    KVOffloadWorkerMetadata,
)
from kvoffload.vllm.connector.settings import ConnectorSettings
from kvoffload.vllm.connector.stats import KVOffloadStats, add_reports

logger = logging.getLogger(__name__)


def block_dim_of(tensor: torch.Tensor, num_blocks: int) -> int:
    """The dimension of a per-layer KV tensor that indexes GPU blocks: 0 for vLLM's standard
    `[num_blocks, ...]` layouts, 1 for the older `[2, num_blocks, ...]`."""
    for dim in (0, 1):
        if tensor.dim() > dim and tensor.shape[dim] == num_blocks:
            return dim
    raise ValueError(
        f"a KV cache tensor of shape {tuple(tensor.shape)} has no dimension of num_blocks="
        f"{num_blocks} at 0 or 1; kvoffload cannot tell its block layout"
    )


def _page_view(name: str, state: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The pages of Mamba layer `name` (`state`: vLLM's `[num_blocks, ...]` view of its state) in
    the shape and strides of attention layer view `like`: vLLM pads every page to one size."""
    stride = state.stride(0) * state.element_size()
    like_stride = like.stride(0) * like.element_size()
    if stride != like_stride or state.shape[0] != like.shape[0]:
        raise ConfigError(
            f"kvoffload: Mamba layer {name} has {state.shape[0]} blocks {stride} bytes apart, the "
            f"attention layers {like.shape[0]} blocks {like_stride} bytes apart; vLLM's hybrid "
            "layout gives both one page size"
        )
    offset = state.storage_offset() * state.element_size()
    if offset % like.element_size():
        raise ConfigError(f"kvoffload: Mamba layer {name} starts inside an attention element")
    view = torch.empty(0, dtype=like.dtype, device=state.device)
    view.set_(state.untyped_storage(), offset // like.element_size(), like.shape, like.stride())
    return view


def worker_rank() -> int:
    """This worker's place in its engine's PP x PCP x TP grid, as vLLM orders its ranks (0
    outside a distributed run): every worker of the engine has its own."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():  # type: ignore[no-untyped-call]
        return 0
    tp = ps.get_tensor_model_parallel_world_size()
    try:
        pcp = ps.get_pcp_group()
        pcp_rank, pcp_size = pcp.rank_in_group, pcp.world_size
    except AssertionError:  # no prefill context parallel group in this run
        pcp_rank, pcp_size = 0, 1
    pp_rank = ps.get_pp_group().rank_in_group
    return (pp_rank * pcp_size + pcp_rank) * tp + ps.get_tensor_model_parallel_rank()


class WorkerSide:
    def __init__(self, settings: ConnectorSettings) -> None:
        self.settings = settings
        self.engine: TransferEngine | None = None
        self._jobs: dict[int, LoadJob | StoreJob] = {}
        """Submitted and not yet reported."""
        self._deferred: list[StoreJob] = []
        """Stores of the current step, submitted when the next one starts."""
        self._held: set[str] = set()
        self._results: dict[int, tuple[int, bool]] = {}
        self._recving: set[str] = set()
        self._load_errors: set[int] = set()
        self.tiers: list[ShardIO] = []
        """This worker's shard of every chunk in each secondary tier, in chain order."""
        self._reporters: list[tuple[TierKind, Reporter]] = []
        """Per kind of secondary tier, the report of this worker's data paths."""
        self._down: dict[int, bool] = {}
        """Each secondary tier's breaker as last reported to the scheduler (down or not)."""
        self._promoted: dict[int, tuple[int, bytes]] = {}
        self._cascaded: dict[int, tuple[int, int, bytes]] = {}
        self.rank = 0
        self._reported_usable = -1
        self._segments: list[list[int] | None] = []
        """Per KV-cache group, the layout segments of its layers (None: all of them)."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        unique = self._unique_pages(kv_caches)
        first = next(iter(unique.values()))
        try:
            self.engine = self.settings.pinning.engine(
                first.device,
                lambda **pool: TransferEngine(
                    unique,
                    num_slots=self.settings.num_slots,
                    blocks_per_chunk=self.settings.config.blocks_per_chunk,
                    block_dim=block_dim_of(first, num_blocks),
                    **pool,
                ),
            )
        except (RuntimeError, MemoryError) as exc:
            raise ConfigError(
                f"cpu_bytes_to_use={self.settings.config.cpu_bytes_to_use}: this worker could not "
                f"allocate its CPU pool of {self.settings.num_slots} chunks ({exc})"
            ) from exc
        if self.engine.layout.block_bytes != self.settings.worker_block_bytes:
            logger.warning(
                "kvoffload: the registered KV caches hold %d bytes per GPU block, vLLM's config "
                "says %d; the CPU pool is sized from the caches (%d slots of %d bytes)",
                self.engine.layout.block_bytes,
                self.settings.worker_block_bytes,
                self.settings.num_slots,
                self.engine.chunk_bytes,
            )
        self._segments = self._group_segments(self.engine, kv_caches)
        self.rank = worker_rank()
        if self.settings.tiers:
            self._connect(self.engine)

    def _unique_pages(self, kv_caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One tensor per memory region, attention layers first (the order of a CPU slot's
        segments): layers that share one (KV sharing, and the layers of a hybrid model's groups)
        are copied once, through an attention layer's view. A Mamba layer's view covers only its
        state, not the padded page: one alone in its region is viewed as an attention layer is."""
        states = {
            name
            for group, layers in zip(self.settings.groups, self.settings.group_layers, strict=True)
            if group.kind == "mamba"
            for name in layers
        }
        attention = [(n, t) for n, t in kv_caches.items() if n not in states]
        unique: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, tensor in attention + [(n, t) for n, t in kv_caches.items() if n in states]:
            if tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
            if name in states:  # settings refuse a model without attention layers
                tensor = _page_view(name, tensor, attention[0][1])
            unique[name] = tensor
        return unique

    def _group_segments(
        self, engine: TransferEngine, kv_caches: dict[str, torch.Tensor]
    ) -> list[list[int] | None]:
        """With the hybrid KV-cache manager each layer of a group shares its memory with one
        layer of every other group; a group with fewer layers uses only some of the tensors."""
        if not self.settings.hybrid:
            return []
        everything = list(range(engine.layout.num_segments))
        out: list[list[int] | None] = []
        for layers in self.settings.group_layers:
            segments = engine.layout.segments_of_tensors(kv_caches[name] for name in layers)
            out.append(None if segments == everything else segments)
        return out

    def _connect(self, engine: TransferEngine) -> None:
        """This worker's shard of every chunk in each secondary tier, under its shard's digest."""
        settings = self.settings
        if engine.chunk_bytes != settings.chunk_bytes:
            # Replicas (and this engine's scheduler) key chunks by vLLM's config: a shard of
            # another size would never match theirs.
            raise ConfigError(
                f"secondary_tiers: this worker's chunks are {engine.chunk_bytes} bytes, vLLM's "
                f"config says {settings.chunk_bytes}; the secondary tiers need them to agree"
            )
        pool = engine.pool
        by_kind: dict[str, tuple[TierKind, list[DataPath]]] = {}
        try:
            for tier in settings.tiers:
                client = tier.kind.open_data_path(
                    tier.config,
                    tier.shard_digest(settings.shard_of(self.rank)),
                    engine.chunk_bytes,
                    settings.num_shards,
                )
                by_kind.setdefault(tier.kind.name, (tier.kind, []))[1].append(client)
                self.tiers.append(ShardIO(client, pool.buffer.numpy(), pool.slot_offsets))
        except BaseException:
            self._close_tiers()  # those opened before the one that failed
            raise
        self._reporters = [
            (kind, kind.reporter(paths)) for kind, paths in by_kind.values() if kind.report
        ]

    def handle_preemptions(self, meta: KVOffloadMetadata) -> None:
        """The first hook of every step, before its forward pass: submits the last step's stores,
        waits for the jobs whose blocks this step may overwrite, and takes this step's stores.

        A store is submitted at the start of the step after the one that computed its KV (it then
        waits on the compute stream, so it reads only what that forward pass wrote), not at the
        end of that step: the copies would compete with the transfer of its sampled tokens
        (vLLM's connector defers them the same way). They are taken here, not in
        `wait_for_save`, so that this step's results, which vLLM may collect before
        `wait_for_save` (speculative decoding), already count them as in flight."""
        self._held.update(meta.held_request_ids)
        self._start_tier_jobs(meta)
        deferred, self._deferred = self._deferred, list(meta.stores)
        for job in deferred:
            self._submit(job)
        if meta.flush_job_ids:
            self._engine().wait(meta.flush_job_ids)

    def _start_tier_jobs(self, meta: KVOffloadMetadata) -> None:
        if not (meta.promotions or meta.cascades):
            return
        if not self.tiers:
            raise RuntimeError("kvoffload: secondary-tier jobs reached a worker without tiers")
        for job in meta.promotions:
            self.tiers[job.tier].promote(job.job_id, job.keys.to_list(), job.slots)
        if not self.settings.writes_shard(self.rank):
            return  # another TP rank writes the shard this one holds too
        for job in meta.cascades:
            self.tiers[job.tier].cascade(job.job_id, job.keys.to_list(), job.slots)

    def start_loads(self, meta: KVOffloadMetadata) -> None:
        for job in meta.loads:
            self._submit(job)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        for result in self._engine().get_finished():
            self._record(self._jobs.pop(result.job_id), result.success)
        for tier in self.tiers:
            promoted, cascaded = tier.take_done()
            for job_id, ok in promoted.items():
                self._promoted[job_id] = (1, ok)
            for job_id, (written, in_tier) in cascaded.items():
                self._cascaded[job_id] = (1, written, in_tier)
        busy = {job.request_id for job in (*self._jobs.values(), *self._deferred)}
        sending = {rid for rid in self._held if rid not in busy}
        self._held -= sending
        recving, self._recving = self._recving, set()
        return sending or None, recving or None

    def get_stats(self) -> KVOffloadStats | None:
        """What each place of each secondary tier (a Redis node, a disk's directory) did for this
        worker since the last report (the other counters are the scheduler's)."""
        data: dict[str, Any] = {}
        add_reports(data, ((kind, reporter.take()) for kind, reporter in self._reporters))
        return KVOffloadStats(data=data) if data else None

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def handshake(self) -> KVOffloadHandshakeMetadata | None:
        """What this worker has ready once its KV caches are registered (None before)."""
        if self.engine is None:
            return None
        return KVOffloadHandshakeMetadata(self.rank, self.engine.pool.usable_slots)

    def take_worker_meta(self) -> KVOffloadWorkerMetadata | None:
        usable = {} if self.engine is None else {self.rank: self.engine.pool.usable_slots}
        # Every step while the pool grows (a report is never resent otherwise), then once more.
        growing = self.engine is not None and self.engine.pool.growing
        grew = growing or usable.get(self.rank, -1) != self._reported_usable
        down = self._breakers_moved()
        # After this step's completions were taken: a write's eviction is never reported before
        # the write itself could be.
        evicted = {i: keys for i, io in enumerate(self.tiers) if (keys := io.client.take_evicted())}
        if not (self._results or self._promoted or self._cascaded or grew or down or evicted):
            return None
        if grew:
            self._reported_usable = usable[self.rank]
        meta = KVOffloadWorkerMetadata(
            self._results, self._promoted, self._cascaded, usable if grew else {}, down, evicted
        )
        self._results, self._promoted, self._cascaded = {}, {}, {}
        return meta

    def _breakers_moved(self) -> dict[tuple[int, int], bool]:
        """`(rank, tier) -> down` for each secondary tier whose breaker opened or closed since
        the last report."""
        moved = {}
        for i, io in enumerate(self.tiers):
            down = io.client.state == "down"
            if self._down.get(i, False) != down:
                self._down[i] = down
                moved[(self.rank, i)] = down
        return moved

    def shutdown(self) -> None:
        # Writes read the pool: they end (by their deadlines) before the pool is released.
        self._close_tiers()
        if self.engine is not None:
            self.engine.close()

    def _close_tiers(self) -> None:
        # zip stops at the tiers opened (all but those after one that failed to open).
        for io, tier in zip(self.tiers, self.settings.tiers, strict=False):
            io.close(tier.config.drain_timeout_s)
        self.tiers = []

    def _engine(self) -> TransferEngine:
        if self.engine is None:
            raise RuntimeError("kvoffload: register_kv_caches has not been called on this worker")
        return self.engine

    def _submit(self, job: LoadJob | StoreJob) -> None:
        engine = self._engine()
        try:
            if job.parts:
                parts = self._parts(job)
                if isinstance(job, LoadJob):
                    engine.submit_load_parts(job.job_id, parts)
                else:
                    engine.submit_store_parts(job.job_id, parts)
            elif isinstance(job, LoadJob):
                engine.submit_load(
                    job.job_id, job.slots, job.gpu_block_ids, job.skip_leading_blocks
                )
            else:
                engine.submit_store(job.job_id, job.gpu_block_ids, job.slots)
        except Exception:
            # Reported as failed with the next results: a store is dropped, a load recomputed.
            logger.exception(
                "kvoffload: job %d of request %s was refused", job.job_id, job.request_id
            )
            self._record(job, ok=False)
            return
        self._jobs[job.job_id] = job

    def _parts(self, job: LoadJob | StoreJob) -> list[JobPart]:
        parts = []
        slot, block = 0, 0
        for part in job.parts:
            parts.append(
                JobPart(
                    job.slots[slot : slot + part.num_slots],
                    job.gpu_block_ids[block : block + part.num_blocks],
                    part.skip_leading_blocks,
                    self._segments[part.group],
                )
            )
            slot += part.num_slots
            block += part.num_blocks
        return parts

    def _record(self, job: LoadJob | StoreJob, ok: bool) -> None:
        self._results[job.job_id] = (1, ok)
        if isinstance(job, LoadJob):
            self._recving.add(job.request_id)
            if not ok:
                self._load_errors.update(np.asarray(job.gpu_block_ids).tolist())
