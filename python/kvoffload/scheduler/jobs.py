"""What the scheduler hands the engine: plain data (ints, numpy arrays, `KeyList`s) that pickles
to worker processes. Slotted, not frozen: an engine builds a `RequestUpdate` per running request
per step, and a frozen dataclass's `__init__` pays an `object.__setattr__` call per field. Treat
them as read-only."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

from kvoffload.scheduler.hybrid import GroupSlice
from kvoffload.store import KeyList

IntArray = npt.NDArray[np.int64]


@dataclass(slots=True)
class StoreJob:
    """Copy GPU blocks to CPU slots: chunk `i` is `gpu_block_ids[i*bpc:(i+1)*bpc]` → `slots[i]`."""

    job_id: int
    request_id: str
    keys: KeyList
    slots: IntArray
    gpu_block_ids: IntArray
    chunk_indices: IntArray
    """Which chunks of the request these are (for tests, logs and events)."""
    parts: tuple[GroupSlice, ...] = ()
    """With several KV-cache groups: which slots and blocks belong to which group, in order
    (`()`: one group)."""


@dataclass(slots=True)
class LoadJob:
    """Copy CPU slots to GPU blocks. The first `skip_leading_blocks` GPU blocks of the first chunk
    are already on the GPU and are not written: `gpu_block_ids` lists only the blocks to write,
    `len(slots) * blocks_per_chunk - skip_leading_blocks` of them."""

    job_id: int
    request_id: str
    keys: KeyList
    slots: IntArray
    gpu_block_ids: IntArray
    skip_leading_blocks: int
    num_tokens: int
    """Tokens this load provides beyond the request's local prefix."""
    first_chunk: int
    parts: tuple[GroupSlice, ...] = ()
    """With several KV-cache groups: each group's slots and blocks, in order, each with its own
    skip; the contract above then holds per part (`skip_leading_blocks` is 0 and `first_chunk`
    is the earliest part's). `()`: one group."""


@dataclass(slots=True)
class TierJob:
    """A transfer between CPU slots and secondary tier `tier` (its place in the chain), `keys[i]`
    <-> `slots[i]`, each worker its own shard of every chunk. A promotion fills the slots (its
    keys are pending in the CPU tier until every worker has reported); a cascade writes them on
    (they are held until then)."""

    job_id: int
    keys: KeyList
    slots: IntArray
    tier: int = 0


@dataclass(slots=True)
class RequestUpdate:
    """What one engine step did to a running request."""

    request_id: str
    num_computed_tokens: int
    """Tokens whose KV exists once this step's forward pass is done."""
    num_tokens: int
    """The request's tokens so far (prompt + output)."""
    new_block_ids: Sequence[int] | Sequence[Sequence[int]] = ()
    """GPU blocks allocated to the request in this step, appended to its block table (with
    several KV-cache groups, one sequence per group)."""
    block_hashes: Sequence[bytes] | None = None
    """The request's block hashes so far (vLLM's `request.block_hashes`); `None`: unchanged."""
    shared_prefix_boundary: int = 0
    """A shared-prefix junction the engine keeps (vLLM's `request.shared_prefix_boundary`): a
    window group stores the chunks a hit there reads too."""


@dataclass(slots=True)
class StateBlock:
    """A state block a Mamba group's request committed in this step (vLLM's "align" mode
    hand-offs, `boundary_state_offloads`): block `block_id` of group `group` holds the state
    after the request's first `num_tokens` tokens. Stored when that is a chunk boundary."""

    request_id: str
    group: int
    block_id: int
    num_tokens: int


@dataclass(slots=True)
class StepPlan:
    store_jobs: list[StoreJob] = field(default_factory=list)
    flush_job_ids: list[int] = field(default_factory=list)
    """In-flight jobs (stores reading, or loads writing, a GPU block the engine just
    reallocated): wait for them before the step's forward pass."""
    promote_jobs: list[TierJob] = field(default_factory=list)
    """Promotions from the secondary tiers that lookups started since the last plan."""
    cascade_jobs: list[TierJob] = field(default_factory=list)
    """Chunks whose stores completed, to write on to the secondary tiers (in store order, as the
    budget of chunks held by writes allows)."""


@dataclass(slots=True)
class FinishPlan:
    store_jobs: list[StoreJob]
    """The last stores of the request (tokens computed but not yet offered)."""
    hold_blocks: bool
    """The request's GPU blocks are still read by stores (or written by a load): free them only
    once a `JobResult` says `request_released`. False for a request preempted with jobs in
    flight: it holds no blocks."""


@dataclass(slots=True)
class JobResult:
    job_id: int
    request_id: str
    kind: Literal["store", "load"]
    success: bool
    failed_gpu_block_ids: IntArray
    """For a failed load: the GPU blocks it did not fill, whose tokens must be recomputed."""
    request_released: bool
    """The request had finished and this was its last job: its GPU blocks may be freed."""
