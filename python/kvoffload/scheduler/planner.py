"""What `OffloadScheduler` shares with its planners: a request's record, the jobs in flight, and
the `Planner` interface behind which one-group and several-group models plan differently."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol

from kvoffload._rust import BlockSet
from kvoffload.scheduler.config import OffloadConfig
from kvoffload.scheduler.hybrid import GroupState
from kvoffload.scheduler.jobs import IntArray, LoadJob, StoreJob
from kvoffload.scheduler.secondary_tier import SecondaryTier
from kvoffload.scheduler.stats import SchedulerStats
from kvoffload.store import CpuStore, KeyList


@dataclass(slots=True)
class Request:
    request_id: str
    num_prompt_tokens: int
    max_offload_tokens: int | None
    max_load_tokens: int | None
    num_tokens: int = 0
    keys: KeyList = field(default_factory=KeyList)
    block_ids: list[int] = field(default_factory=list)
    stored_chunks: int = 0
    """Chunks `[0, stored_chunks)` were offered to the store (or loaded, or local)."""
    planned_load: tuple[int, int] | None = None
    """`(num_local_tokens, loadable_tokens)` of the last lookup."""
    jobs: set[int] = field(default_factory=set)
    finishing: bool = False
    """Its final stores are being planned (no speculative token can be rejected any more)."""
    finished: bool = False
    rank: int | None = None
    """The request's place in the store's LRU order, drawn at its first store or load."""
    load_tiers: tuple[SecondaryTier, ...] = ()
    """The secondary tiers its `kv_load_tiers` let it load from, in lookup order."""
    groups: list[GroupState] | None = None
    """With several KV-cache groups (or a window group): each group's keys, table and store
    frontier, in place of `keys`, `block_ids` and `stored_chunks`."""
    new_tables: bool = False
    """With `groups`: its tables were handed over since the last `plan_step` (they hold blocks
    allocated in this step, not blocks handed out again)."""


class CheckedUpdate(NamedTuple):
    req: Request
    computed: int
    num_tokens: int
    new_blocks: Any
    """What the planner's `check_new_blocks` made of the update's new blocks."""
    shared_prefix_boundary: int


class InFlight(NamedTuple):
    kind: Literal["store", "load"]
    request_id: str
    keys: KeyList
    gpu_block_ids: IntArray
    window_blocks: Sequence[int] = ()
    """With several groups: the window and state blocks a store reads. Only window and Mamba
    groups free blocks while their request still runs (and the engine may hand them out again);
    every other block a job touches is held by its request."""


class Context:
    """The scheduler's state the planners read and change: the store, the counters and the
    jobs in flight."""

    def __init__(self, config: OffloadConfig, store: CpuStore) -> None:
        self.config = config
        self.store = store
        self.stats = SchedulerStats()
        self.requests: dict[str, Request] = {}
        self.jobs: dict[int, InFlight] = {}
        self.loads_in_flight = 0
        self._next_job_id = 0

    def track(
        self,
        kind: Literal["store", "load"],
        req: Request,
        keys: KeyList,
        blocks: IntArray,
        window_blocks: Sequence[int] = (),
    ) -> int:
        """A new job of `req` in flight; its id."""
        job_id = self._next_job_id
        self._next_job_id += 1
        self.jobs[job_id] = InFlight(kind, req.request_id, keys, blocks, window_blocks)
        req.jobs.add(job_id)
        if kind == "load":
            self.loads_in_flight += 1
            self.stats.load_jobs += 1
        else:
            self.stats.store_jobs += 1
        return job_id

    def rank(self, req: Request) -> int:
        if req.rank is None:
            req.rank = self.store.new_rank()
        return req.rank


class Planner(Protocol):
    """How a model's KV-cache groups are looked up, loaded and stored: `OneGroupPlanner` for one
    full-attention group, `SeveralGroupsPlanner` for several (or a window group). Arguments are
    checked by the `check_*` methods before anything changes."""

    def new_groups(self) -> list[GroupState] | None:
        """A new request's per-group state (None: one group, kept in the request itself)."""

    def check_local(self, req: Request, num_local_tokens: int) -> None:
        """Raises if the local prefix cannot be planned from."""

    def check_tables(self, name: str, values: Any) -> Any:
        """A request's whole block table(s), checked and copied."""

    def check_new_blocks(self, values: Any) -> Any:
        """The blocks a step allocated to a request, checked."""

    def check_reallocated(self, values: Iterable[int] | BlockSet) -> Any:
        """Every block handed out in a step, checked (`BlockSet`s are checked as filled)."""

    def state_groups(self) -> list[int]:
        """The groups whose states are stored from `StateBlock`s (Mamba's)."""

    def extend_keys(self, req: Request, block_hashes: Sequence[bytes]) -> None: ...

    def restart(self, req: Request) -> None:
        """The request (re)starts at token 0: no tables, nothing offered yet."""

    def drop_tables(self, req: Request) -> None: ...

    def set_tables(self, req: Request, tables: Any) -> None: ...

    def has_blocks(self, req: Request) -> bool: ...

    def lookup(self, req: Request, num_local: int, num_tokens: int) -> int | None:
        """Loadable tokens past the local prefix, or None: ask again next step."""

    def load(self, req: Request, tables: Any, num_local: int, loadable: int) -> LoadJob:
        """Pins what the lookup found (or raises with nothing pinned) and plans its load."""

    def store(self, c: CheckedUpdate) -> StoreJob | None:
        """Records a checked update and plans the request's stores; cannot fail half-way."""

    def would_store(self, c: CheckedUpdate) -> bool:
        """Whether the update has a chunk to offer; changes nothing."""

    def touch_finished(self, req: Request) -> None:
        """Refreshes a finished request's chunks, head after tail."""

    def reset_request(self, req: Request) -> None:
        """The tier was emptied: the request offers its chunks again from the first."""

    def flush(self, reallocated: Any) -> list[int]:
        """The jobs in flight that touch a block handed out again in this step."""
