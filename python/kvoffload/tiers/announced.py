"""`Announced`: which chunks a tier's KV events announced and have not withdrawn.

A router counts each announcement of a block (vLLM asks consumers to), so a chunk is announced
once while a tier holds it and withdrawn once: a second write of it, or a removal of a chunk this
engine never announced, would leave the count wrong. While the tier's breaker is open (every
lookup a miss) what it announced is withdrawn, and announced again when it closes where the
engine still knows the chunks' tokens.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class Announced(Generic[K]):
    def __init__(self) -> None:
        self._keys: set[K] = set()
        self.withdrawn = False
        """The breaker is open: nothing is announced until it closes."""

    def stored(self, keys: Iterable[K]) -> list[K]:
        """The keys of `keys` to announce as stored now."""
        new = [k for k in keys if k not in self._keys]
        self._keys.update(new)
        return [] if self.withdrawn else new

    def removed(self, keys: list[K], *, announced_elsewhere: bool = False) -> list[K]:
        """The keys of `keys` to announce as removed now: those it announced, or all of them
        when another engine may have (a shared tier's writer)."""
        mine = [k for k in keys if k in self._keys]
        self._keys.difference_update(mine)
        if self.withdrawn:
            return []
        return keys if announced_elsewhere else mine

    def breaker(self, down: bool, *, announce_again: bool = True) -> tuple[str, list[K]]:
        """The event the breaker's state calls for: `("removed", keys)` as it opens, `("stored",
        keys)` as it closes (or nothing, forgetting them, without `announce_again`)."""
        if down == self.withdrawn:
            return "stored", []
        self.withdrawn = down
        if down:
            return "removed", list(self._keys)
        if not announce_again:
            self._keys.clear()
            return "stored", []
        return "stored", list(self._keys)
