"""A gate for `CpuPool(before_piece=...)`: the tests decide when each piece of a background pool
may be prepared, and which ones fail, instead of sleeping."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Gate:
    """`before_piece`: piece `i` starts only once `open(i)` was called; `fail` pieces raise."""

    def __init__(self, fail: frozenset[int] = frozenset()) -> None:
        self.allowed = -1
        self.fail = fail
        self.cond = threading.Condition()

    def open(self, upto: int) -> None:
        with self.cond:
            self.allowed = upto
            self.cond.notify_all()

    def __call__(self, i: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.allowed >= i, timeout=30)
        if i in self.fail:
            raise OSError(f"injected: piece {i} cannot be pinned")


def until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)
