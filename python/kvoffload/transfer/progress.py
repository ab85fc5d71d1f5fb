"""`PoolProgress`: each worker's usable CPU slots, read by the scheduler's process.

vLLM's `OffloadingConnector` has no channel from a spec's workers to its manager, so the workers
of one engine publish how much of their pool is ready in a small shared file (one int64 per
rank, in /dev/shm when there is one), named after the engine. A worker writes its own entry;
the manager reads the least of them: a slot counts once every worker has it.
"""

from __future__ import annotations

import mmap
import os
import re
import tempfile

import numpy as np

_ROOT = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class PoolProgress:
    def __init__(self, name: str, world_size: int) -> None:
        if type(world_size) is not int or world_size < 1:
            raise ValueError(f"world_size={world_size!r} is invalid; allowed: an int >= 1")
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        self.path = os.path.join(_ROOT, f"kvoffload-{safe}.pool")
        self.world_size = world_size
        size = 8 * world_size
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # zeros: no rank has anything ready yet
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._slots = np.frombuffer(self._map, dtype=np.int64, count=world_size)

    def publish(self, rank: int, usable: int) -> None:
        """This worker's usable slots (an aligned 8-byte store: readers see the old or the new).
        Stored plus one, so that 0 stays "this rank never published"."""
        self._slots[rank] = usable + 1

    def usable(self) -> int:
        """The slots every worker has ready (0 while some rank has not published)."""
        return max(0, int(self._slots.min()) - 1)

    def missing_ranks(self) -> list[int]:
        """Ranks that never published: workers on another host, or not started."""
        return [int(r) for r in np.flatnonzero(self._slots == 0)]

    def close(self, *, unlink: bool = False) -> None:
        if self._map.closed:
            return
        del self._slots
        self._map.close()
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
