"""`TransferEngine`: asynchronous copies of whole chunks between a GPU KV cache and a `CpuPool`."""

from __future__ import annotations

import logging
import math
import operator
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import ModuleType, TracebackType
from typing import NamedTuple

import numpy.typing as npt
import torch

from kvoffload.errors import InvalidStateError
from kvoffload.transfer.layout import KVCacheLayout, KVCaches
from kvoffload.transfer.plan import (
    COPY_PATHS,
    CopyPath,
    CopyPlan,
    Geometry,
    JobPart,
    Part,
    check_job,
    check_parts,
    merge_plans,
    plan_copies,
    staging_copies,
)
from kvoffload.transfer.pool import CpuPool

logger = logging.getLogger(__name__)


class TransferResult(NamedTuple):
    job_id: int
    success: bool
    num_bytes: int
    """Bytes the job copies (per part: its GPU blocks times the pages of its segments); also for
    a failed job."""
    seconds: float
    """Time the copies took on the copy stream (CPU mode: on the host)."""


@dataclass
class _Job:
    seq: int
    job_id: int
    num_bytes: int
    success: bool = True
    seconds: float = 0.0
    start: torch.cuda.Event | None = None
    end: torch.cuda.Event | None = None
    """None once the job is known to be finished (always so in CPU mode)."""


@dataclass
class _Direction:
    store: bool
    stream: torch.cuda.Stream | None
    staging: torch.Tensor | None
    """`[staging_chunks, segments, blocks_per_chunk, page_units]`, used only on `stream`;
    allocated when first needed."""
    queue: deque[_Job] = field(default_factory=deque)


class TransferEngine:
    """Moves chunks between the GPU KV cache (`kv_caches`, see `KVCacheLayout`) and its own pool
    of `num_slots` chunk-sized CPU slots (`pool`), asynchronously and in order.

    A job copies whole chunks: `slots[c]` holds GPU blocks `c * blocks_per_chunk ..` of the job's
    block list. With `skip_leading_blocks = s`, the first `s` blocks of the first chunk are not
    copied (for a load: they are already on the GPU, because the local prefix cache ends inside
    that chunk), so `gpu_block_ids` lists the remaining `len(slots) * blocks_per_chunk - s` blocks
    and `gpu_block_ids[j]` is block `s + j` of the job. A store with a skip leaves the first
    slot's pages of its first `s` blocks as they were. Likewise a job may end inside its last
    chunk (vLLM's partial tails): it then lists fewer blocks, at least one per slot, and the last
    slot's remaining pages are not copied either way.

    A job may also be made of parts (`submit_store_parts`, `submit_load_parts`): one job id, one
    result, each part a job of the contract above that copies only some segments of the layout
    (vLLM's hybrid models: each KV-cache group's blocks live in the tensors of its layers, and
    its chunks have their own skip and tail). A store may not write a slot twice across parts,
    a load not the same segment of a GPU block.

    Each direction has one CUDA stream (expedited loads a third one), so jobs of one direction
    finish in submission order. A job
    first makes its stream wait for the work queued so far on the compute stream
    (`compute_stream`, or `torch.cuda.current_stream()` at submit): a store then reads only KV
    the forward pass has finished writing, and a load never overwrites blocks still being read.
    Completion is polled with events; the compute stream is never synchronized. With CPU tensors
    as the cache (CPU mode) the same calls copy synchronously and make no CUDA call.

    `copy_path` (fixed at construction) picks how copies are issued, see `COPY_PATHS`.
    `staging_bytes` bounds each direction's GPU staging buffer for the batched path (it holds at
    least one chunk); `pin_piece_bytes` is the size of the pieces the pool is pinned in, and with
    `pin_in_background` they are prepared on a thread while the engine already runs: only slots
    below `pool.usable_slots` may then be used (see `CpuPool`); `numa_node` binds the pool's
    memory to a NUMA node. The engine
    is not thread-safe: call it from one thread. Copies run under `torch.inference_mode()`, so an
    engine made inside it (as vLLM's workers make their caches) works outside it, and the reverse.
    """

    def __init__(
        self,
        kv_caches: KVCacheLayout | KVCaches,
        *,
        num_slots: int,
        blocks_per_chunk: int,
        block_dim: int | None = None,
        copy_path: CopyPath = "auto",
        compute_stream: torch.cuda.Stream | None = None,
        staging_bytes: int = 128 << 20,
        min_direct_copy_bytes: int = 1 << 20,
        pin_piece_bytes: int = 1 << 30,
        pin_in_background: bool = False,
        numa_node: int | None = None,
    ) -> None:
        if isinstance(kv_caches, KVCacheLayout):
            if block_dim is not None:
                raise ValueError(f"block_dim={block_dim!r} given with a KVCacheLayout; omit it")
            layout = kv_caches
        else:
            layout = KVCacheLayout(kv_caches, block_dim=block_dim)
        for name, value, low in (
            ("blocks_per_chunk", blocks_per_chunk, 1),
            ("staging_bytes", staging_bytes, 1),
            ("min_direct_copy_bytes", min_direct_copy_bytes, 0),
        ):
            if type(value) is not int or value < low:
                raise ValueError(f"{name}={value!r} is invalid; allowed: an int >= {low}")
        if copy_path not in COPY_PATHS:
            raise ValueError(
                f"copy_path={copy_path!r} is invalid; allowed: {', '.join(COPY_PATHS)}"
            )
        self.is_cuda = layout.device.type == "cuda"
        if compute_stream is not None and not self.is_cuda:
            raise ValueError("compute_stream was given but kv_caches are CPU tensors (CPU mode)")
        self.layout = layout
        self.blocks_per_chunk = blocks_per_chunk
        self.copy_path: CopyPath = copy_path
        # On the CPU a copy costs no launch, and gathering through a staging buffer only adds a
        # pass over the bytes: `auto` copies runs directly there.
        self._path: CopyPath = "direct" if copy_path == "auto" and not self.is_cuda else copy_path
        self._kernel: ModuleType | None = None
        if copy_path == "kernel":
            from kvoffload.transfer import kernel

            if not self.is_cuda and not kernel.interpreted():
                raise ValueError(
                    "copy_path='kernel' needs CUDA tensors, or TRITON_INTERPRET=1 in CPU mode"
                )
            self._kernel = kernel
            self._path = "direct"  # its runs, copied by the kernel
        self.chunk_bytes = layout.chunk_bytes(blocks_per_chunk)
        self.pool = CpuPool(
            num_slots,
            self.chunk_bytes,
            pin_device=layout.device if self.is_cuda else None,
            piece_bytes=pin_piece_bytes,
            background=pin_in_background,
            numa_node=numa_node,
        )
        unit = layout.unit_bytes
        self._geom = Geometry(
            blocks_per_chunk=blocks_per_chunk,
            num_blocks=layout.num_blocks,
            num_slots=num_slots,
            page=layout.page_units,
            strides=tuple(seg.stride(0) for seg in layout.segments),
            slots_per_piece=self.pool.slots_per_piece,
            piece_stride=self.pool.piece_stride // unit,
            staging_chunks=max(1, staging_bytes // self.chunk_bytes),
            min_direct_run=math.ceil(min_direct_copy_bytes / unit),
        )
        self._pool_units = self.pool.buffer.view(layout.unit)
        # One flat view per segment from its block 0, to slice runs out of.
        self._flat_segments = [
            seg.as_strided(((layout.num_blocks - 1) * seg.stride(0) + layout.page_units,), (1,))
            for seg in layout.segments
        ]
        self._compute_stream = compute_stream
        # Stores, loads, and expedited loads (waited for within the step: they do not queue
        # behind regular loads).
        self._dirs = tuple(self._new_direction(store) for store in (True, False, False))
        # Dropped without close(): copies still in flight must finish before the pool (freed
        # after this engine) is unpinned under them.
        streams = [d.stream for d in self._dirs if d.stream is not None]
        self._finalizer = weakref.finalize(self, _synchronize, streams)
        self._in_flight: set[int] = set()
        self._seq = 0
        self._closed = False

    def _new_direction(self, store: bool) -> _Direction:
        stream = None
        if self.is_cuda:
            stream = torch.cuda.Stream(self.layout.device)  # type: ignore[no-untyped-call]
        return _Direction(store, stream, None)

    def _staging(self, d: _Direction) -> torch.Tensor:
        """The direction's staging buffer, allocated at its first batched job (on its stream, so
        the caching allocator orders reuse after it): an engine that never needs it, or does
        only later, does not hold GPU memory the serving engine's own sizing did not see."""
        if d.staging is None:
            g = self._geom
            shape = (g.staging_chunks, len(g.strides), g.blocks_per_chunk, g.page)
            d.staging = torch.empty(shape, dtype=self.layout.unit, device=self.layout.device)
        return d.staging

    def submit_store(
        self,
        job_id: int,
        gpu_block_ids: npt.ArrayLike,
        slots: npt.ArrayLike,
        skip_leading_blocks: int = 0,
    ) -> None:
        """Starts copying GPU blocks to slots (GPU -> CPU); see the class docstring for the
        argument contract. Raises `ValueError`/`TypeError` and copies nothing when an argument is
        invalid (ids out of range, lengths inconsistent, a slot repeated, `job_id` in flight)."""
        part = JobPart(slots, gpu_block_ids, skip_leading_blocks)
        self._submit(self._dirs[0], job_id, lambda: [check_job(self._geom, part, True)])

    def submit_load(
        self,
        job_id: int,
        slots: npt.ArrayLike,
        gpu_block_ids: npt.ArrayLike,
        skip_leading_blocks: int = 0,
        *,
        expedited: bool = False,
    ) -> None:
        """Starts copying slots to GPU blocks (CPU -> GPU); like `submit_store`, with a GPU block
        repeated being the invalid case. An `expedited` load runs on a stream of its own, so it
        does not wait for the regular loads queued before it."""
        part = JobPart(slots, gpu_block_ids, skip_leading_blocks)
        d = self._load_dir(expedited)
        self._submit(d, job_id, lambda: [check_job(self._geom, part, False)])

    def submit_store_parts(self, job_id: int, parts: Sequence[JobPart]) -> None:
        """Starts a store of several parts, copied as one job (see the class docstring); raises
        and copies nothing when any part is invalid, naming it (`parts[1].slots[0]=...`)."""
        self._submit(self._dirs[0], job_id, lambda: check_parts(self._geom, parts, True))

    def submit_load_parts(
        self, job_id: int, parts: Sequence[JobPart], *, expedited: bool = False
    ) -> None:
        """Starts a load of several parts, copied as one job; like `submit_store_parts`."""
        d = self._load_dir(expedited)
        self._submit(d, job_id, lambda: check_parts(self._geom, parts, False))

    def _load_dir(self, expedited: bool) -> _Direction:
        return self._dirs[2 if expedited else 1]

    def get_finished(self) -> list[TransferResult]:
        """Results of the jobs finished since the last call, in submission order (jobs of one
        direction always finish in submission order). Never blocks. A job whose copies raised
        reports `success=False`."""
        done: list[_Job] = []
        for d in self._dirs:
            while d.queue and self._finished(d.queue[0]):
                done.append(d.queue.popleft())
        done.sort(key=lambda job: job.seq)
        results = []
        for job in done:
            if job.success and job.start is not None and job.end is not None:
                job.seconds = job.start.elapsed_time(job.end) / 1e3
            self._in_flight.discard(job.job_id)
            results.append(TransferResult(job.job_id, job.success, job.num_bytes, job.seconds))
        return results

    def wait(self, job_ids: Iterable[int]) -> None:
        """Blocks until the listed jobs have finished (ids not in flight are ignored); their
        results still come from `get_finished`. Only the host waits, on the jobs' own events."""
        wanted = set(job_ids)
        for d in self._dirs:
            for job in d.queue:
                if job.job_id in wanted and job.end is not None:
                    try:
                        job.end.synchronize()
                    except Exception:
                        logger.exception("transfer job %d failed while waiting", job.job_id)
                        job.success = False
                        job.end = None

    def close(self) -> None:
        """Waits for all jobs, then unpins the pool. Unreported results stay available from
        `get_finished`; new jobs are refused."""
        if self._closed:
            return
        self.wait(self._in_flight)
        self._closed = True
        self.pool.close()
        for d in self._dirs:
            d.staging = None

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _submit(self, d: _Direction, job_id: int, check: Callable[[], list[Part]]) -> None:
        """`check` validates the parts once the engine and `job_id` are known to be usable."""
        if self._closed:
            raise InvalidStateError("the transfer engine is closed")
        if isinstance(job_id, bool):
            raise TypeError(f"job_id must be an int, got {job_id!r}")
        try:
            job_id = operator.index(job_id)
        except TypeError:
            raise TypeError(f"job_id must be an int, got {job_id!r}") from None
        if job_id in self._in_flight:
            raise ValueError(
                f"job_id={job_id} is already in use: its result has not been reported by "
                f"get_finished yet"
            )
        parts = check()
        usable = self.pool.usable_slots
        for part in parts:
            if usable < self.pool.num_slots and part.slots.size and part.slots.max() >= usable:
                # Its memory is still being pinned: a copy there would see pageable memory.
                raise ValueError(
                    f"slots={part.slots.tolist()} reach past the {usable} slots ready so far "
                    f"(of {self.pool.num_slots}); allowed: slots below {usable}"
                )
        g = self._geom
        path = self._path
        plan = merge_plans(
            [plan_copies(g.select(p.segments), p.slots, p.gpu_ids, p.skip, path) for p in parts]
        )
        pages = sum(len(p.gpu_ids) * len(g.select(p.segments).selected) for p in parts)
        job = _Job(self._seq, job_id, pages * self.layout.page_bytes)
        self._seq += 1
        if d.stream is None:
            started = time.perf_counter()
            try:
                with torch.inference_mode():
                    self._execute(plan, d)
            except Exception:
                self._fail(job, d)
            job.seconds = time.perf_counter() - started
        else:
            compute = self._compute_stream
            if compute is None:
                compute = torch.cuda.current_stream(self.layout.device)
            job.start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            job.end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            try:
                d.stream.wait_stream(compute)
                job.start.record(d.stream)
                with torch.cuda.stream(d.stream), torch.inference_mode():
                    self._execute(plan, d)
            except Exception:
                self._fail(job, d)
            try:
                # Recorded also after a failure, so the job is reported only once the copies it
                # did enqueue are done (a failed load's blocks get recomputed after that).
                job.end.record(d.stream)
            except Exception:
                self._fail(job, d)
                job.end = None
        d.queue.append(job)
        self._in_flight.add(job_id)

    @staticmethod
    def _fail(job: _Job, d: _Direction) -> None:
        logger.exception("transfer job %d (%s) failed", job.job_id, "store" if d.store else "load")
        job.success = False

    def _execute(self, plan: CopyPlan, d: _Direction) -> None:
        pool = self._pool_units
        if self._kernel is not None:
            unit = pool.element_size()
            gpu_at = [self._flat_segments[r.segment].data_ptr() + r.gpu * unit for r in plan.runs]
            pool_at = [pool.data_ptr() + r.cpu * unit for r in plan.runs]
            src, dst = (gpu_at, pool_at) if d.store else (pool_at, gpu_at)
            lengths = [r.length for r in plan.runs]
            self._kernel.copy_runs(src, dst, lengths, pool.dtype, self.layout.device)
            return
        for segment, gpu, cpu, length in plan.runs:
            dev = self._flat_segments[segment][gpu : gpu + length]
            host = pool[cpu : cpu + length]
            if d.store:
                host.copy_(dev, non_blocking=True)
            else:
                dev.copy_(host, non_blocking=True)
        if not plan.batches:
            return
        staging = self._staging(d)
        # From pinned memory, so that the upload neither blocks nor waits for the stream.
        ids = torch.tensor(plan.chunk_gpu_ids, pin_memory=self.is_cuda)
        if self.is_cuda:
            ids = ids.to(self.layout.device, non_blocking=True)
        flat = staging.view(-1)
        segments = self.layout.segments
        for batch in plan.batches:
            index = ids[batch.first : batch.first + batch.count]
            chunks = staging[: batch.count]
            selected = self._geom.select(batch.segments).selected
            if d.store:
                for k in selected:
                    chunks[:, k] = segments[k][index]
            for staged, offset, length in staging_copies(self._geom, batch):
                dev = flat[staged : staged + length]
                host = pool[offset : offset + length]
                if d.store:
                    host.copy_(dev, non_blocking=True)
                else:
                    dev.copy_(host, non_blocking=True)
            if not d.store:
                for k in selected:
                    segments[k][index] = chunks[:, k]

    @staticmethod
    def _finished(job: _Job) -> bool:
        if job.end is None:
            return True
        try:
            return bool(job.end.query())  # type: ignore[no-untyped-call]
        except Exception:
            logger.exception("transfer job %d failed on the device", job.job_id)
            job.success = False
            job.end = None
            return True

    def __repr__(self) -> str:
        return (
            f"TransferEngine({self.layout!r}, {self.pool!r}, blocks_per_chunk="
            f"{self.blocks_per_chunk}, copy_path={self.copy_path!r})"
        )


def _synchronize(streams: list[torch.cuda.Stream]) -> None:
    for stream in streams:
        stream.synchronize()
