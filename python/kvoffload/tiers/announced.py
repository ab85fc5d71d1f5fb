"""`Announced`: what a secondary tier's KV events announce and withdraw.

A router counts each announcement of a block (vLLM asks consumers to), so a tier whose evictions
this engine sees (a node's own disk: its workers report them) is *tracked*: each chunk announced
once while it holds it, withdrawn once, and only if it was announced. When its breaker opens,
everything it announced is withdrawn and forgotten; a chunk comes back when a write puts it there
or a promotion finds it there (after a restart too). A tier that evicts unseen (a shared Redis,
a shared filesystem) keeps nothing here: each write is announced, each load that finds a chunk
gone withdraws it, whoever wrote it, and its breaker (one replica's view) changes nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class Announced(Generic[K]):
    def __init__(self, tracked: bool) -> None:
        self.tracked = tracked
        self._keys: set[K] = set()
        self._down = False
        self._gone: dict[int, set[K]] = {}
        """Write job -> its keys a handle evicted before the job was reported."""

    def stored(self, keys: Iterable[K]) -> list[K]:
        """The keys of `keys` (now in the tier) to announce."""
        if not self.tracked:
            return list(keys)
        if self._down:
            return []
        new = [k for k in keys if k not in self._keys]
        self._keys.update(new)
        return new

    def removed(self, keys: list[K]) -> list[K]:
        """The keys of `keys` (gone from the tier) to withdraw."""
        if not self.tracked:
            return keys
        mine = [k for k in keys if k in self._keys]
        self._keys.difference_update(mine)
        return mine

    def breaker(self, down: bool) -> list[K]:
        """The keys to withdraw as the tier's breaker opens (its lookups all miss), forgotten."""
        if not self.tracked or down == self._down:
            return []
        self._down = down
        keys = list(self._keys) if down else []
        self._keys.clear()
        return keys

    def evicted(self, keys: list[K], writing: Iterable[tuple[int, Iterable[K]]]) -> list[K]:
        """A handle evicted `keys`: those to withdraw. `writing` are the writes still out, by
        job: a key one of them wrote and that was evicted since is not announced when it ends."""
        gone = set(keys)
        for job, job_keys in writing:
            hit = gone.intersection(job_keys)
            if hit:
                self._gone.setdefault(job, set()).update(hit)
        return self.removed(keys)

    def take_gone(self, job: int) -> set[K]:
        """The keys write `job` put in the tier that were evicted before it was reported (see
        `evicted`): not in the tier, whatever the write says."""
        return self._gone.pop(job, set())
