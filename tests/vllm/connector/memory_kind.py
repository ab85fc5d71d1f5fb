"""A test-only kind of secondary tier, `MemoryTier`: chunks in a dict of this process, shared by
every engine whose entry names the same `name`. It stands for "a third kind": everything it needs
is here and in one registry line (`kvoffload.tiers.registry.register(KIND)`); nothing outside its
folder names it."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvoffload.store import KeyList, KeyRange
from kvoffload.tiers import EXISTS, MISSING, OK, Completion
from kvoffload.tiers.checks import check_entry, namespace_of

TIERS: dict[str, dict[bytes, bytes]] = {}
"""Each `name`'s chunks, by namespace digest + key."""


@dataclass(frozen=True)
class MemoryTierConfig:
    name: str
    namespace: str
    read_only: bool = False
    enable_kv_events: bool = False

    @property
    def where(self) -> str:
        return f"memory:{self.name}"

    @property
    def drain_timeout_s(self) -> float:
        return 1.0

    @classmethod
    def from_dict(cls, entry: object) -> MemoryTierConfig:
        entry = check_entry(entry, "MemoryTier", cls.__dataclass_fields__)
        return cls(str(entry.get("name", "default")), namespace_of(entry, "MemoryTier"))


@dataclass
class MemoryLookups:
    chunks: dict[bytes, bytes]
    digests: Sequence[bytes]
    down: bool = False
    asked: int = 0
    closed: bool = False
    missed: set[bytes] = field(default_factory=set)

    def lookup_prefix(self, keys: KeyRange, request: str) -> tuple[int, bool]:
        self.asked += 1
        found = 0
        for key in keys:
            if key in self.missed or any(d + key not in self.chunks for d in self.digests):
                break
            found += 1
        return found, False

    def flush(self) -> None:
        pass

    def mark_miss(self, keys: Iterable[bytes]) -> None:
        self.missed.update(keys)

    def forget(self, keys: list[bytes]) -> None:
        pass  # it never evicts

    def mark_stored(self, keys: KeyList | list[bytes]) -> None:
        self.missed.difference_update(keys)

    def cleanup(self, request: str) -> None:
        pass

    def in_flight(self) -> int:
        return 0

    def start(self, none_hash: bytes) -> None:
        pass

    def note_workers_down(self, down: bool) -> None:
        self.down = down

    def take_report(self) -> dict[str, dict[str, int]]:
        return {}

    def close(self) -> None:
        self.closed = True


class MemoryDataPath:
    """Copies at submit time; the completions wait for the next poll, as a real tier's do."""

    last_error = None
    state = "up"

    def __init__(self, chunks: dict[bytes, bytes], digest: bytes, chunk_bytes: int) -> None:
        self.chunks, self.digest, self.chunk_bytes = chunks, digest, chunk_bytes
        self._ids = itertools.count(1)
        self._done: list[Completion] = []

    def _view(self, buffer: Any) -> np.ndarray:
        return np.asarray(buffer).reshape(-1).view(np.uint8)

    def store(self, keys: Sequence[bytes], buffer: Any, offsets: Sequence[int]) -> int:
        view, statuses = self._view(buffer), bytearray()
        for key, at in zip(keys, offsets, strict=True):
            if self.digest + key in self.chunks:
                statuses.append(EXISTS)
                continue
            self.chunks[self.digest + key] = view[at : at + self.chunk_bytes].tobytes()
            statuses.append(OK)
        return self._finish(statuses)

    def load(self, keys: Sequence[bytes], buffer: Any, offsets: Sequence[int]) -> int:
        view, statuses = self._view(buffer), bytearray()
        for key, at in zip(keys, offsets, strict=True):
            chunk = self.chunks.get(self.digest + key)
            if chunk is None:
                statuses.append(MISSING)
                continue
            view[at : at + self.chunk_bytes] = np.frombuffer(chunk, dtype=np.uint8)
            statuses.append(OK)
        return self._finish(statuses)

    def _finish(self, statuses: bytearray) -> int:
        job = next(self._ids)
        self._done.append((job, bytes(statuses)))
        return job

    def poll(self) -> list[Completion]:
        done, self._done = self._done, []
        return done

    def drain(self, timeout_s: float) -> list[Completion]:
        return self.poll()

    def take_evicted(self) -> list[bytes]:
        return []  # it never evicts

    def close(self) -> None:
        pass


class MemoryKind:
    name = "MemoryTier"
    locality = "LOCAL"
    sees_evictions = True  # it never evicts
    report = None

    def parse(self, entry: Mapping[str, Any]) -> MemoryTierConfig:
        return MemoryTierConfig.from_dict(entry)

    def check_shards(self, config: Any, num_shards: int, chunk_bytes: int) -> str | None:
        return None

    def open_lookups(
        self, config: MemoryTierConfig, digests: Sequence[bytes], chunk_bytes: int, num_shards: int
    ) -> MemoryLookups:
        return MemoryLookups(TIERS.setdefault(config.name, {}), list(digests))

    def open_data_path(
        self, config: MemoryTierConfig, digest: bytes, chunk_bytes: int, num_shards: int
    ) -> MemoryDataPath:
        return MemoryDataPath(TIERS.setdefault(config.name, {}), digest, chunk_bytes)

    def reporter(self, paths: Sequence[Any]) -> Any:
        raise AssertionError("a kind without a report is never asked for a reporter")


KIND = MemoryKind()
