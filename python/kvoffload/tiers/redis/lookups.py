"""`RedisLookups`: non-blocking existence checks against a Redis tier, batched per step.

The contract of vLLM's `AsyncLookupManager`: `lookup` answers True or False once the server has
answered and None ("ask again") until then; the keys asked during a step go out together at
`flush`, as one pipelined job; one verdict per key is shared by every request asking for it; a
failed load marks its keys missing so the scheduler stops promoting them (vLLM #49176). The
differences: the verdicts live in Rust (`kvoffload._rust.RemoteLookups`, one call for a whole
prefix), and the job runs and completes on Rust threads and is polled from the caller's thread,
so no Python thread has to win the GIL from a busy scheduler before an answer counts.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvoffload import _rust
from kvoffload.store import Keys
from kvoffload.tiers.redis.client import RedisClient


class RedisLookups:
    """Give it a `RedisClient` of its own: it takes every completion the client has. Requests
    are named by their id (a `str`)."""

    def __init__(self, client: RedisClient) -> None:
        self._client = client
        self._table = _rust.RemoteLookups(client._tier)

    def lookup(self, key: bytes, request: str) -> bool | None:
        """True or False once known; None while the key's check is queued or in flight."""
        return self._table.lookup(key, request)

    def lookup_prefix(self, keys: Keys, request: str) -> tuple[int, bool]:
        """`lookup` of each key in order, in one call: how many leading keys were found, and
        whether an answer before the first known miss is still out (then ask again). Every key
        up to that miss is asked for, so a whole prefix goes out in one batch."""
        return self._table.lookup_prefix(keys, request)

    def flush(self) -> None:
        """Sends this step's new keys as one job (once per step, after the lookups)."""
        self._table.flush()

    def mark_miss(self, keys: Iterable[bytes]) -> None:
        """Keys a load failed on count as missing until their requests finish."""
        self._table.mark_miss(list(keys))

    def forget(self, keys: list[bytes]) -> None:
        """Nothing: the server evicts on its own, and every lookup asks it."""

    def mark_stored(self, keys: Keys) -> None:
        """Nothing to note: verdicts are per request, and a later request asks the server (which
        may have evicted them meanwhile)."""

    def cleanup(self, request: str) -> None:
        """Drops a finished request's interest; a check still in flight stays until it lands."""
        self._table.cleanup(request)

    @property
    def down(self) -> bool:
        """The lookup connection's breaker is open: every check would fail at once."""
        return self._client.state == "down"

    def in_flight(self) -> int:
        """Lookup jobs sent and not yet applied."""
        return self._table.in_flight()

    def __len__(self) -> int:
        """Keys with a verdict, known or not."""
        return len(self._table)
