"""The GPU prefix cache, modelled on vLLM's block pool: a request's blocks are ref-counted; a
freed block keeps its hash (a later request can still hit it) and joins the end of the free
queue; allocation takes the front of the queue and drops that block's hash."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class GpuPrefixCache:
    def __init__(self, num_blocks: int) -> None:
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash: list[bytes | None] = [None] * num_blocks
        self._block: dict[bytes, int] = {}
        self._ref = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def longest_hit(self, hashes: Sequence[bytes], max_blocks: int) -> list[int]:
        """The cached blocks holding the longest prefix of `hashes`, at most `max_blocks`."""
        out = []
        for h in hashes[:max_blocks]:
            b = self._block.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def num_idle(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` sit in the free queue (a hit on them takes them out of it)."""
        return sum(1 for b in blocks if not self._ref[b])

    def touch(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if not self._ref[b]:
                del self._free[b]
            self._ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"allocating {n} GPU blocks with {len(self._free)} free")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self._hash[b]
            if h is not None:
                self._hash[b] = None
                if self._block.get(h) == b:
                    del self._block[h]
            self._ref[b] = 1
            out.append(b)
        return out

    def cache(self, blocks: Sequence[int], hashes: Sequence[bytes]) -> None:
        """The blocks now hold the KV of these full blocks."""
        for b, h in zip(blocks, hashes, strict=True):
            self._hash[b] = h
            self._block.setdefault(h, b)  # a twin computed concurrently stays uncached

    def release(self, blocks: Sequence[int]) -> None:
        # Tail first, as vLLM frees: a prefix's tail is evicted before its head.
        for b in reversed(blocks):
            self._ref[b] -= 1
            if not self._ref[b]:
                self._free[b] = None
