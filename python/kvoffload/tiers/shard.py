"""`ShardIO`: one worker's shard of every chunk, moved between its CPU slots and one secondary
tier (a shared Redis tier, or a disk).

Each worker holds its own part of each chunk (its TP/PP rank's layers and heads) in its own pool,
so each writes and reads that part under a digest of its own rank: no bytes cross between
workers, and a chunk is whole in a tier only when every rank's shard is there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvoffload.tiers.status import EXISTS, OK, Completion

IntArray = npt.NDArray[np.int64]
_WRITTEN = np.array([OK, EXISTS], dtype=np.uint8)
"""Statuses of a shard that is in the tier after a write (ours, or another writer's first)."""


class DataPath(Protocol):
    """What a worker's handle on one secondary tier offers (`kvoffload.tiers.redis.RedisClient`,
    `kvoffload.tiers.disk.DiskClient`)."""

    def store(self, keys: Sequence[bytes], buffer: Any, offsets: Sequence[int]) -> int: ...
    def load(self, keys: Sequence[bytes], buffer: Any, offsets: Sequence[int]) -> int: ...
    def poll(self) -> list[Completion]: ...
    def drain(self, timeout_s: float) -> list[Completion]: ...
    def close(self) -> None: ...
    @property
    def last_error(self) -> str | None: ...
    @property
    def state(self) -> str:
        """Its breaker: "up", "down" (every job fails fast) or "half-open"."""

    def take_evicted(self) -> list[bytes]:
        """The keys whose shards this handle's own eviction removed since the last call (none
        where the server evicts on its own, unseen, as Redis does)."""


class ShardIO:
    """Promotions (tier -> slots) and cascades (slots -> tier) over `buffer`, the pool's memory,
    where slot `s` starts at byte `slot_offsets(s)`. Every call only submits or polls: the I/O
    runs on the Rust data path's threads."""

    def __init__(
        self,
        client: DataPath,
        buffer: Any,
        slot_offsets: Callable[[IntArray], IntArray],
    ) -> None:
        self.client = client
        self._buffer = buffer
        self._offsets = slot_offsets
        self._promotions: dict[int, int] = {}
        self._cascades: dict[int, int] = {}
        self._done_promotions: dict[int, bytes] = {}
        self._done_cascades: dict[int, tuple[int, bytes]] = {}

    def promote(self, job_id: int, keys: Sequence[bytes], slots: IntArray) -> None:
        """Fills `slots` from the tier."""
        try:
            rust_job = self.client.load(list(keys), self._buffer, self._offsets(slots).tolist())
        except ValueError:  # a slot outside the pool: the job fails, nothing is touched
            self._done_promotions[job_id] = bytes(len(keys))
            return
        self._promotions[rust_job] = job_id

    def cascade(self, job_id: int, keys: Sequence[bytes], slots: IntArray) -> None:
        """Writes `slots` on to the tier (each key only if it is absent there)."""
        try:
            rust_job = self.client.store(list(keys), self._buffer, self._offsets(slots).tolist())
        except ValueError:
            self._done_cascades[job_id] = (0, bytes(len(keys)))
            return
        self._cascades[rust_job] = job_id

    def take_done(self) -> tuple[dict[int, bytes], dict[int, tuple[int, bytes]]]:
        """Promotions ended since the last call (`job_id -> 1 or 0 per key: filled`) and
        cascades (`job_id -> (shards written or already there, 1 or 0 per key: in the tier)`)."""
        for rust_job, statuses in self.client.poll():
            status = np.frombuffer(statuses, dtype=np.uint8)
            if rust_job in self._promotions:
                filled = (status == OK).astype(np.uint8).tobytes()
                self._done_promotions[self._promotions.pop(rust_job)] = filled
            else:
                in_tier = np.isin(status, _WRITTEN)
                self._done_cascades[self._cascades.pop(rust_job)] = (
                    int(in_tier.sum()),
                    in_tier.astype(np.uint8).tobytes(),
                )
        promotions, self._done_promotions = self._done_promotions, {}
        cascades, self._done_cascades = self._done_cascades, {}
        return promotions, cascades

    @property
    def busy(self) -> bool:
        return bool(self._promotions or self._cascades)

    def close(self, timeout_s: float) -> None:
        """Lets the jobs in flight end (each by its deadline), then closes the data path."""
        if self.busy:
            self.client.drain(timeout_s)
        self.client.close()
