"""`DiskLookups`: the scheduler's lookups against a disk tier (`kvoffload.tiers.kind.TierLookups`).

They answer from the index of a handle of its own on the directory: the workers' handles do the
I/O and remove the files past `capacity_bytes`, and report what they removed (`forget`); this one
reads no chunk and evicts nothing itself, so it holds what they hold. It learns of the chunks its
engine's workers wrote as their writes end (`mark_stored`), of a chunk a load missed at once
(`mark_miss`), and of other engines' chunks and evictions at each rescan. Where the index lacks a
key, a probe looks for the files on its I/O threads and the lookup says "ask again" for that step
(at most `probes_per_step` a step), so what another engine wrote a moment ago is a hit at the next
step, not at the next rescan.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvoffload.store import KeyRange, Keys
from kvoffload.tiers.disk.client import DiskClient
from kvoffload.tiers.disk.config import DiskTierConfig


class DiskLookups:
    def __init__(self, client: DiskClient) -> None:
        self._client = client
        self.down = False
        """Set while the disk's breaker is open on a worker that reads or writes it (the
        scheduler's handle does no I/O to find out): every lookup is then a miss at once."""

    @classmethod
    def open(
        cls, config: DiskTierConfig, namespace_digest: bytes, chunk_bytes: int, capacity_bytes: int
    ) -> DiskLookups:
        """A lookup handle on `config`'s directory under one shard's digest (a chunk's shards
        are written together, so one stands for all), whose index forgets chunks past
        `capacity_bytes`."""
        # Its I/O threads only look for files (probes): a few serve a shared filesystem's
        # latency; it never reads a chunk, so O_DIRECT is not probed for.
        client = DiskClient(
            config,
            namespace_digest,
            chunk_bytes,
            capacity_bytes=capacity_bytes,
            io_threads=min(config.io_threads, 4),
            evict_files=False,
            direct_io="off",
            log=False,
        )
        return cls(client)

    def lookup_prefix(self, keys: KeyRange, request: str) -> tuple[int, bool]:
        """How many leading keys the directory holds, and whether a probe is still looking for
        the files the index lacks (ask again next step)."""
        return self._client.lookup(keys, request)

    def flush(self) -> None:
        """Sends this step's probes."""
        self._client.flush()

    def mark_miss(self, keys: Iterable[bytes]) -> None:
        self._client.note_missing(list(keys))

    def forget(self, keys: list[bytes]) -> None:
        """A worker evicted `keys`: gone, found again once stored again."""
        self._client.forget(keys)

    def mark_stored(self, keys: Keys) -> None:
        self._client.note_present(keys)

    def cleanup(self, request: str) -> None:
        """Nothing is kept per request."""

    def start(self, none_hash: bytes) -> None:
        """Nothing to check: a disk's files are its engines' own."""

    def note_workers_down(self, down: bool) -> None:
        self.down = down

    def take_report(self) -> dict[str, dict[str, int]]:
        """Nothing: this handle does no I/O (the workers report theirs)."""
        return {}

    def in_flight(self) -> int:
        """Probes sent and not yet answered."""
        return self._client.probes_in_flight()

    @property
    def scanned(self) -> bool:
        """Whether what the directory held at start-up is in the index yet."""
        return self._client.scanned

    def close(self) -> None:
        self._client.close()
