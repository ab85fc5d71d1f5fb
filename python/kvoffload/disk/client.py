"""`DiskClient`: the Rust data path (`kvoffload._rust.DiskTier`), speaking in `ConfigError`s at
start-up."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvoffload import _rust
from kvoffload._buffers import lend
from kvoffload.disk.config import DiskTierConfig
from kvoffload.errors import ConfigError
from kvoffload.store import Keys

Completion = tuple[int, bytes]
"""A finished job: its id and one status byte per key (`kvoffload.remote.OK`, ...)."""


class DiskClient:
    """Jobs of many chunks against one directory, run on Rust I/O threads without the GIL.

    Every chunk is `chunk_bytes` long and read from or written to `buffer[offset:offset +
    chunk_bytes]` in place; the buffer must stay unchanged (stores) or untouched (loads) until its
    job's completion comes back from `poll` or `drain` (the Rust side keeps it alive until then).
    """

    def __init__(
        self,
        config: DiskTierConfig,
        namespace_digest: bytes,
        chunk_bytes: int,
        *,
        capacity_bytes: int | None = None,
        io_threads: int | None = None,
        evict_files: bool = True,
    ) -> None:
        """`capacity_bytes` and `io_threads` default to the config's (a worker's handle holds its
        shard's part of the capacity; a handle that only answers lookups does no I/O but its
        scans, and with `evict_files=False` forgets what it evicts without removing the file)."""
        try:
            self._tier = _rust.DiskTier(
                config.path,
                namespace_digest,
                chunk_bytes,
                config.capacity_bytes if capacity_bytes is None else capacity_bytes,
                direct_io=config.direct_io,
                io_threads=config.io_threads if io_threads is None else io_threads,
                rescan_interval_s=config.rescan_interval_s,
                max_store_bytes_in_flight=config.max_store_bytes_in_flight,
                breaker_failures=config.breaker_failures,
                breaker_cooldown_s=config.breaker_cooldown_s,
                evict_files=evict_files,
            )
        except (ValueError, OSError) as exc:
            raise ConfigError(f"DiskTier path={config.path!r}: {exc}") from exc
        self.config = config
        self.chunk_bytes = chunk_bytes

    @property
    def direct(self) -> bool:
        """Whether reads and writes bypass the page cache (`O_DIRECT`)."""
        return self._tier.direct

    @property
    def scanned(self) -> bool:
        """Whether what the directory held at start-up is in the index yet."""
        return self._tier.scanned

    @property
    def state(self) -> str:
        """The breaker: "up", "down" (a failing disk: every chunk fails at once, lookups miss)
        or "half-open"."""
        return self._tier.state

    @property
    def last_error(self) -> str | None:
        """Why the last item failed (with the file's path), for logs."""
        return self._tier.last_error

    def lookup_prefix(self, keys: Keys) -> int:
        """How many of `keys`, from the first, the tier holds (no I/O)."""
        return self._tier.lookup_prefix(keys)

    def note_present(self, keys: Keys) -> None:
        """Takes `keys` into the index as just used: written through another handle."""
        self._tier.note_present(keys)

    def note_missing(self, keys: Keys) -> None:
        """Drops `keys` from the index: a load through another handle missed them."""
        self._tier.note_missing(keys)

    def store(self, keys: Sequence[bytes], buffer: Any, offsets: Sequence[int]) -> int:
        return lend(self._tier.submit_store, keys, buffer, offsets, writable=False)

    def load(self, keys: Sequence[bytes], buffer: Any, offsets: Sequence[int]) -> int:
        return lend(self._tier.submit_load, keys, buffer, offsets, writable=True)

    def poll(self) -> list[Completion]:
        return self._tier.poll()

    def drain(self, timeout_s: float) -> list[Completion]:
        """Blocks until no job is in flight, or `timeout_s`."""
        return self._tier.drain(timeout_s)

    def in_flight(self) -> int:
        return self._tier.in_flight()

    def stats(self) -> dict[str, int]:
        return self._tier.stats()

    def close(self) -> None:
        self._tier.close()
