"""Validation of a transfer job and the list of copies that carries it out (numpy only).

All sizes and offsets here are in units of the layout's `unit` dtype. A slot holds its chunk
segment-major: segment 0's pages of the chunk's blocks in block order, then segment 1's, ... So
one segment's pages of consecutive GPU blocks are contiguous on both sides and merge into one copy.
A job is one or more parts (`JobPart`), each planned on its own; their copies make one plan.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import numpy.typing as npt

CopyPath = Literal["auto", "direct", "batched", "per_block", "kernel"]
COPY_PATHS: tuple[CopyPath, ...] = ("auto", "direct", "batched", "per_block", "kernel")
"""`direct`: one copy per run of blocks contiguous on both sides. `batched`: whole chunks are
gathered into (stores) or scattered from (loads) a GPU staging buffer with one index kernel per
segment, so the PCIe copies are whole runs of slots. `auto`: `direct` when its copies average at
least `min_direct_copy_bytes`, else `batched`. `per_block`: one copy per block and segment, the
baseline benchmarks compare against. `kernel`: the runs of `direct`, all in one Triton launch
that reads and writes the pinned pool through its mapped host addresses (see `kernel.py`)."""

Ids = npt.NDArray[np.int64]


class JobPart(NamedTuple):
    """One part of a job: `slots` and `gpu_block_ids` with the contract of a single-part job
    (see `TransferEngine`), copying only the pages of `segments` (indices into
    `KVCacheLayout.segments`; None: all). A slot keeps its layout: the other segments' pages
    of a part's chunks are neither read nor written, in the pool or on the GPU."""

    slots: npt.ArrayLike
    gpu_block_ids: npt.ArrayLike
    skip_leading_blocks: int = 0
    segments: Sequence[int] | None = None


class Part(NamedTuple):
    """A validated `JobPart`; `segments` is None when the part copies every segment."""

    slots: Ids
    gpu_ids: Ids
    skip: int
    segments: tuple[int, ...] | None


class Run(NamedTuple):
    """One copy: `length` units of `segment` from `gpu` (relative to its block 0) to/from `cpu`
    (relative to the pool's start)."""

    segment: int
    gpu: int
    cpu: int
    length: int


@dataclass(frozen=True)
class Batch:
    """Full chunks `first .. first+count-1` (indices into `CopyPlan.chunk_gpu_ids`) moved through
    the staging buffer; `slot_runs` are the (chunk index within the batch, pool offset, number of
    chunks) of runs of consecutive slots; only the pages of `segments` (None: all) are moved,
    see `staging_copies`."""

    first: int
    count: int
    slot_runs: list[tuple[int, int, int]]
    segments: tuple[int, ...] | None = None


@dataclass(frozen=True)
class CopyPlan:
    runs: list[Run]
    chunk_gpu_ids: Ids
    """`[chunks, blocks_per_chunk]` GPU block ids of the chunks that go through `batches`."""
    batches: list[Batch]


@dataclass(frozen=True)
class Geometry:
    """What planning needs to know about the layout and the pool, in units."""

    blocks_per_chunk: int
    num_blocks: int
    num_slots: int
    page: int
    strides: tuple[int, ...]
    """Per segment: units from one GPU block's page to the next block's."""
    slots_per_piece: int
    piece_stride: int
    staging_chunks: int
    min_direct_run: int
    segments: tuple[int, ...] | None = None
    """The segments a plan copies (None: all); the slot layout is the same either way."""

    @property
    def slot(self) -> int:
        return len(self.strides) * self.blocks_per_chunk * self.page

    @property
    def selected(self) -> Sequence[int]:
        return range(len(self.strides)) if self.segments is None else self.segments

    def select(self, segments: tuple[int, ...] | None) -> Geometry:
        """This geometry for planning a part that copies only `segments`."""
        return self if segments is None else dataclasses.replace(self, segments=segments)

    def slot_offsets(self, slots: Ids) -> Ids:
        piece, index = np.divmod(slots, self.slots_per_piece)
        offsets: Ids = piece * self.piece_stride + index * self.slot
        return offsets


def check_ids(name: str, values: npt.ArrayLike, limit: int, what: str) -> Ids:
    """`values` as a 1-D int64 array, each in `0..limit-1`."""
    try:
        arr = np.asarray(values)
    except Exception as exc:
        raise TypeError(
            f"{name} must be a 1-D sequence of ints, got a {type(values).__name__}"
        ) from exc
    if arr.size == 0:
        arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold ints, got {type(values).__name__} of {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    arr = arr.astype(np.int64, copy=False)
    bad = np.flatnonzero((arr < 0) | (arr >= limit))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"{name}[{i}]={arr[i]} is out of range: there are {limit} {what} "
            f"(allowed 0..{limit - 1})"
        )
    return arr


def check_job(g: Geometry, part: JobPart, store: bool, name: str = "") -> Part:
    """Validates one part's arguments, each error naming it `{name}slots` etc."""
    slot_ids = check_ids(f"{name}slots", part.slots, g.num_slots, "slots")
    gpu_ids = check_ids(f"{name}gpu_block_ids", part.gpu_block_ids, g.num_blocks, "GPU blocks")
    bpc = g.blocks_per_chunk
    skip_given = part.skip_leading_blocks
    try:
        skip = operator.index(skip_given)
    except TypeError:
        raise TypeError(
            f"{name}skip_leading_blocks must be an int in 0..{bpc - 1}, got {skip_given!r}"
        ) from None
    if isinstance(skip_given, bool) or not 0 <= skip < bpc or (skip and not len(slot_ids)):
        raise ValueError(
            f"{name}skip_leading_blocks={skip_given!r} is invalid; allowed: 0..{bpc - 1} "
            f"(blocks_per_chunk={bpc}), and 0 when there are no slots"
        )
    # Every slot gets at least one block: only the first chunk may start late (the skip) and
    # only the last may end early (a partial tail).
    most = len(slot_ids) * bpc - skip
    least = max(1, most - bpc + 1) if len(slot_ids) else 0
    if not least <= len(gpu_ids) <= most:
        raise ValueError(
            f"len({name}gpu_block_ids)={len(gpu_ids)} does not match len({name}slots)="
            f"{len(slot_ids)}: expected len(slots) * blocks_per_chunk - skip_leading_blocks = "
            f"{len(slot_ids)} * {bpc} - {skip} = {most}, or down to {least} when the last "
            f"chunk is partial"
        )
    # A destination written twice in one job would depend on copy order; sources may repeat.
    dest_name, dest = ("slots", slot_ids) if store else ("gpu_block_ids", gpu_ids)
    uniq, counts = np.unique(dest, return_counts=True)
    if uniq.size != dest.size:
        raise ValueError(
            f"{name}{dest_name} repeats {uniq[counts > 1].tolist()}: a job may write each "
            f"destination once"
        )
    segments = _check_segments(f"{name}segments", part.segments, len(g.strides))
    return Part(slot_ids, gpu_ids, skip, segments)


def _check_segments(
    name: str, segments: Sequence[int] | None, num_segments: int
) -> tuple[int, ...] | None:
    if segments is None:
        return None
    ids = check_ids(name, segments, num_segments, "segments")
    allowed = f"allowed: None (all) or distinct indices in 0..{num_segments - 1}"
    if not ids.size:
        raise ValueError(f"{name} is empty; {allowed}")
    uniq, counts = np.unique(ids, return_counts=True)
    if uniq.size != ids.size:
        raise ValueError(f"{name} repeats {uniq[counts > 1].tolist()}; {allowed}")
    # All segments in any order copy as None does, and may then go through the staging buffer.
    return None if uniq.size == num_segments else tuple(uniq.tolist())


def check_parts(g: Geometry, parts: Sequence[JobPart], store: bool) -> list[Part]:
    """Validates a job of several parts (`parts[i].slots` etc. in errors): each part as a
    single-part job, and across parts no slot (store) or no page of a GPU block (load: a block
    and one of its segments) written twice."""
    if not parts:
        raise ValueError("parts is empty: a job needs at least one part (a part may be empty)")
    checked = []
    for i, part in enumerate(parts):
        try:
            part = JobPart(*part)
        except TypeError:
            raise TypeError(f"parts[{i}] is a {type(part).__name__}, not a JobPart") from None
        checked.append(check_job(g, part, store, f"parts[{i}]."))
    if len(checked) > 1:
        _check_written_once(g, checked, store)
    return checked


def _check_written_once(g: Geometry, parts: list[Part], store: bool) -> None:
    dests = [p.slots if store else p.gpu_ids for p in parts]
    ids = np.concatenate(dests)
    owner = np.repeat(np.arange(len(parts)), [len(d) for d in dests])
    if store:
        found = _first_repeat(ids, owner)
        if found is not None:
            slot, who = found
            raise ValueError(
                f"slot {slot} is in parts[{who[0]}].slots and parts[{who[1]}].slots: a job may "
                f"write each slot once"
            )
        return
    # A block may be in several parts when they write disjoint segments of it.
    _, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
    shared = counts[inverse] > 1
    if not shared.any():
        return
    s = len(g.strides)
    writes = np.zeros((len(parts), s), dtype=bool)
    for i, p in enumerate(parts):
        writes[i, slice(None) if p.segments is None else list(p.segments)] = True
    entry, segment = np.nonzero(writes[owner[shared]])
    found = _first_repeat(ids[shared][entry] * s + segment, owner[shared][entry])
    if found is not None:
        (block, seg), who = divmod(found[0], s), found[1]
        raise ValueError(
            f"GPU block {block} is in parts[{who[0]}].gpu_block_ids and "
            f"parts[{who[1]}].gpu_block_ids, both writing its segment {seg}: a job may write "
            f"each page once"
        )


def _first_repeat(values: Ids, owner: Ids) -> tuple[int, list[int]] | None:
    """The smallest value listed more than once, and the parts that list it."""
    uniq, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    repeated = np.flatnonzero(counts > 1)
    if not repeated.size:
        return None
    r = int(repeated[0])
    return int(uniq[r]), owner[inverse == r].tolist()


def plan_copies(g: Geometry, slots: Ids, gpu_ids: Ids, skip: int, path: CopyPath) -> CopyPlan:
    """The copies of a validated part: GPU block `gpu_ids[j]` is block `skip + j` of the part,
    i.e. block `(skip + j) % blocks_per_chunk` of chunk `slots[(skip + j) // blocks_per_chunk]`;
    the pages of a partial first or last chunk that no block maps to are not copied, nor those of
    segments other than `g.segments`."""
    no_chunks = np.empty((0, g.blocks_per_chunk), dtype=np.int64)
    blocks = _blocks(g, slots, gpu_ids, skip)
    if path == "per_block":
        return CopyPlan(_runs(g, blocks, merge=False), no_chunks, [])
    total = len(gpu_ids) * len(g.selected) * g.page
    if path == "direct" or (path == "auto" and total >= g.min_direct_run * _num_runs(g, blocks)):
        return CopyPlan(_runs(g, blocks, merge=True), no_chunks, [])
    # A partial first or last chunk is small: it is copied directly, full chunks in batches.
    bpc = g.blocks_per_chunk
    head = min(len(gpu_ids), bpc - skip) if skip else 0
    full = (len(gpu_ids) - head) // bpc
    body = slice(head, head + full * bpc)
    full_slots = slots[1 if skip else 0 :][:full]
    edges = [
        (slots[:1], gpu_ids[:head], skip),
        (slots[len(slots) - 1 :], gpu_ids[body.stop :], 0),
    ]
    edge_runs = [
        run
        for edge_slots, edge_ids, edge_skip in edges
        if len(edge_ids)
        for run in _runs(g, _blocks(g, edge_slots, edge_ids, edge_skip), merge=True)
    ]
    batches = []
    for first in range(0, len(full_slots), g.staging_chunks):
        batch = full_slots[first : first + g.staging_chunks]
        piece = batch // g.slots_per_piece
        starts, counts = _run_starts((batch[1:] == batch[:-1] + 1) & (piece[1:] == piece[:-1]))
        offsets = g.slot_offsets(batch[starts])
        slot_runs = list(zip(starts.tolist(), offsets.tolist(), counts.tolist(), strict=True))
        batches.append(Batch(first, len(batch), slot_runs, g.segments))
    return CopyPlan(edge_runs, gpu_ids[body].reshape(-1, bpc), batches)


def merge_plans(plans: Sequence[CopyPlan]) -> CopyPlan:
    """One plan doing the copies of `plans` (a job's parts): their destinations are distinct
    (`check_parts`), so the order the copies run in is not observable."""
    if len(plans) == 1:
        return plans[0]
    batches: list[Batch] = []
    first = 0
    for p in plans:
        batches.extend(dataclasses.replace(b, first=first + b.first) for b in p.batches)
        first += len(p.chunk_gpu_ids)
    runs = [run for p in plans for run in p.runs]
    return CopyPlan(runs, np.concatenate([p.chunk_gpu_ids for p in plans]), batches)


def staging_copies(g: Geometry, batch: Batch) -> list[tuple[int, int, int]]:
    """The (staging offset, pool offset, length) of the copies between the staging buffer
    (`[chunks, segments, blocks_per_chunk, page]`) and the pool: whole runs of slots, or with a
    subset of segments one copy per slot and run of consecutive selected segments."""
    first, offset, count = (np.array(c, dtype=np.int64) for c in zip(*batch.slot_runs, strict=True))
    if batch.segments is None:
        staged, pooled, length = first * g.slot, offset, count * g.slot
    else:
        seg = np.array(batch.segments, dtype=np.int64)
        seg_starts, seg_counts = _run_starts(seg[1:] == seg[:-1] + 1)
        seg_units = g.blocks_per_chunk * g.page
        span_at, span_len = seg[seg_starts] * seg_units, seg_counts * seg_units
        within = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
        slot_at = (np.repeat(first, count) + within) * g.slot
        pool_at = np.repeat(offset, count) + within * g.slot
        staged = (slot_at[:, None] + span_at).ravel()
        pooled = (pool_at[:, None] + span_at).ravel()
        length = np.tile(span_len, len(slot_at))
    return list(zip(staged.tolist(), pooled.tolist(), length.tolist(), strict=True))


class _Blocks(NamedTuple):
    gpu: Ids
    cpu: Ids
    """Pool offset of each block's page in segment 0."""
    merged: tuple[Ids, Ids]
    """Start and length of the runs of blocks contiguous in the pool and on the GPU (for segments
    whose consecutive pages abut)."""


def _blocks(g: Geometry, slots: Ids, gpu_ids: Ids, skip: int) -> _Blocks:
    if not len(gpu_ids):
        return _Blocks(gpu_ids, gpu_ids, (gpu_ids, gpu_ids))
    chunk, index = np.divmod(np.arange(skip, skip + len(gpu_ids)), g.blocks_per_chunk)
    cpu = g.slot_offsets(slots)[chunk] + index * g.page
    piece = slots[chunk] // g.slots_per_piece
    joins = (
        (gpu_ids[1:] == gpu_ids[:-1] + 1)
        & (cpu[1:] == cpu[:-1] + g.page)
        & (piece[1:] == piece[:-1])
    )
    return _Blocks(gpu_ids, cpu, _run_starts(joins))


def _run_starts(joins: npt.NDArray[np.bool_]) -> tuple[Ids, Ids]:
    """Start index and length of each run, where `joins[j]` tells whether element `j+1`
    continues the run of element `j`."""
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return starts, np.diff(np.append(starts, len(joins) + 1))


def _num_runs(g: Geometry, blocks: _Blocks) -> int:
    return sum(
        len(blocks.merged[0]) if g.strides[s] == g.page else len(blocks.gpu) for s in g.selected
    )


def _runs(g: Geometry, blocks: _Blocks, merge: bool) -> list[Run]:
    n = len(blocks.gpu)
    single = (np.arange(n), np.ones(n, dtype=np.int64))
    runs: list[Run] = []
    for segment in g.selected:
        stride = g.strides[segment]
        starts, lengths = blocks.merged if merge and stride == g.page else single
        seg_offset = segment * g.blocks_per_chunk * g.page
        runs.extend(
            Run(segment, gpu, cpu, length)
            for gpu, cpu, length in zip(
                (blocks.gpu[starts] * stride).tolist(),
                (blocks.cpu[starts] + seg_offset).tolist(),
                (lengths * g.page).tolist(),
                strict=True,
            )
        )
    return runs
