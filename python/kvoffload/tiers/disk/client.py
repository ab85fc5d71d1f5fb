"""`DiskClient`: the Rust data path (`kvoffload._rust.DiskTier`), speaking in `ConfigError`s at
start-up."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvoffload import _rust
from kvoffload._buffers import lend
from kvoffload.errors import ConfigError
from kvoffload.store import Keys
from kvoffload.tiers.disk.config import DiskTierConfig
from kvoffload.tiers.status import Completion

logger = logging.getLogger(__name__)


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
        direct_io: str | None = None,
        log: bool = True,
        report_evictions: bool = False,
    ) -> None:
        """`capacity_bytes`, `io_threads` and `direct_io` default to the config's (a worker's
        handle holds its shard's part of the capacity; a handle that only answers lookups reads
        no chunk, and with `evict_files=False` forgets what it evicts without removing the
        file). `log`: say what open found, and each change of the write state (one handle per
        process does; a lookup handle never writes). `report_evictions`: keep the keys whose
        files eviction removed for `take_evicted` (whoever sets it drains them)."""
        try:
            self._tier = _rust.DiskTier(
                config.path,
                namespace_digest,
                chunk_bytes,
                config.capacity_bytes if capacity_bytes is None else capacity_bytes,
                direct_io=config.direct_io if direct_io is None else direct_io,
                io_threads=config.io_threads if io_threads is None else io_threads,
                rescan_interval_s=config.rescan_interval_s,
                max_store_bytes_in_flight=config.max_store_bytes_in_flight,
                breaker_failures=config.breaker_failures,
                breaker_cooldown_s=config.breaker_cooldown_s,
                evict_files=evict_files,
                read_only=config.read_only,
                probes_per_step=config.probes_per_step,
                probe_miss_ttl_s=config.probe_miss_ttl_s,
                file_mode=config.file_mode,
                report_evictions=report_evictions,
            )
        except (ValueError, OSError) as exc:
            raise ConfigError(f"DiskTier path={config.path!r}: {exc}") from exc
        self.config = config
        self.chunk_bytes = chunk_bytes
        self._log = log
        for note in self._tier.notes if log else ():
            logger.warning("DiskTier %s: %s", config.path, note)
        self._writes = self._tier.writes
        """The write state last seen: a change is logged once, from `poll` and `drain`."""

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

    @property
    def writes(self) -> str:
        """ "ok", "full" (stores dropped until the filesystem has room) or "read-only" (stores
        dropped; loads go on)."""
        return self._tier.writes

    def lookup_prefix(self, keys: Keys) -> int:
        """How many of `keys`, from the first, the tier's index holds (no I/O)."""
        return self._tier.lookup_prefix(keys)

    def lookup(self, keys: Keys, request: str) -> tuple[int, bool]:
        """`lookup_prefix`, and whether to ask again next step: where the index lacks a key,
        `request`'s probe looks for the files on the I/O threads once `flush` sends it (no I/O
        here)."""
        return self._tier.lookup(keys, request)

    def lookup_key(self, key: bytes, request: str) -> tuple[bool, bool]:
        """`lookup` for a caller that asks a prompt key by key (vLLM's tiering): whether the
        index holds `key`, and whether to ask again. A key past one that waits, of a prompt with
        no hit before it, is a miss for the step (only its first file is looked for)."""
        return self._tier.lookup_key(key, request)

    def flush(self) -> None:
        """Sends this step's probes (once a step, after its lookups)."""
        self._tier.flush()

    def probes_in_flight(self) -> int:
        return self._tier.probes_in_flight()

    def note_present(self, keys: Keys) -> None:
        """Takes `keys` into the index as just used: written through another handle."""
        self._tier.note_present(keys)

    def take_evicted(self) -> list[bytes]:
        """The keys whose files eviction removed since the last call (with
        `report_evictions`)."""
        return self._tier.take_evicted()

    def forget(self, keys: Keys) -> None:
        """Drops `keys` from the index, with no hold: chunks another handle evicted."""
        self._tier.forget(keys)

    def note_missing(self, keys: Keys) -> None:
        """Drops `keys` from the index: a load through another handle missed them."""
        self._tier.note_missing(keys)

    def store(self, keys: Sequence[bytes], buffer: Any, offsets: Sequence[int]) -> int:
        return lend(self._tier.submit_store, keys, buffer, offsets, writable=False)

    def load(self, keys: Sequence[bytes], buffer: Any, offsets: Sequence[int]) -> int:
        return lend(self._tier.submit_load, keys, buffer, offsets, writable=True)

    def poll(self) -> list[Completion]:
        done = self._tier.poll()
        self._say_writes()
        return done

    def drain(self, timeout_s: float) -> list[Completion]:
        """Blocks until no job is in flight, or `timeout_s`."""
        done = self._tier.drain(timeout_s)
        self._say_writes()
        return done

    def _say_writes(self) -> None:
        """Logs once each time stores stop or resume being written."""
        now = self._tier.writes
        if now == self._writes or not self._log:
            return
        self._writes, path = now, self.config.path
        if now == "full":
            logger.warning(
                "DiskTier %s: the filesystem is full: stores are dropped (counted in stores_full) "
                "until it has room again; what is on the disk is still served",
                path,
            )
        elif now == "read-only":
            logger.warning(
                "DiskTier %s refuses writes (%s): it serves what the directory holds, and stores "
                "are dropped (counted in stores_read_only; the directory is checked again every "
                "30 s). For a cache shipped read-only, set read_only: true to say so up front",
                path,
                self._tier.last_error,
            )
        else:
            logger.info("DiskTier %s: writing again", path)

    def in_flight(self) -> int:
        return self._tier.in_flight()

    def stats(self) -> dict[str, int]:
        return self._tier.stats()

    def close(self) -> None:
        self._tier.close()
