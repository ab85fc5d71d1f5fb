"""`RemoteLookups`: non-blocking existence checks against the shared tier, batched per step.

The contract of vLLM's `AsyncLookupManager`: `lookup` answers True or False once the server has
answered and None ("ask again") until then; the keys asked during a step go out together at
`flush`, as one pipelined job; one verdict per key is shared by every request asking for it; a
failed load marks its keys missing so the scheduler stops promoting them (vLLM #49176). The
difference: the job runs and completes on Rust threads and is polled from the caller's thread,
so no Python thread has to win the GIL from a busy scheduler before an answer counts.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable
from dataclasses import dataclass, field

from kvoffload.remote.client import OK, RemoteClient


@dataclass
class _Verdict:
    generation: int
    found: bool | None = None
    in_flight: bool = False
    requests: set[Hashable] = field(default_factory=set)


class RemoteLookups:
    """Give it a `RemoteClient` of its own: it takes every completion the client has."""

    def __init__(self, client: RemoteClient) -> None:
        self._client = client
        self._verdicts: dict[bytes, _Verdict] = {}
        self._request_keys: dict[Hashable, set[bytes]] = {}
        self._batch: list[tuple[bytes, int]] = []
        self._jobs: dict[int, list[tuple[bytes, int]]] = {}
        self._generation = 0
        self._need_poll = False

    def lookup(self, key: bytes, request: Hashable) -> bool | None:
        """True or False once known; None while the key's check is queued or in flight."""
        if self._need_poll:
            self._poll()
            self._need_poll = False
        verdict = self._verdicts.get(key)
        if verdict is None:
            verdict = self._verdicts[key] = _Verdict(self._generation)
            self._generation += 1
            self._batch.append((key, verdict.generation))
        verdict.requests.add(request)
        self._request_keys.setdefault(request, set()).add(key)
        return verdict.found

    def flush(self) -> None:
        """Sends this step's new keys as one job (once per step, after the lookups)."""
        self._poll()
        self._need_poll = True
        batch, self._batch = self._batch, []
        live = []
        for key, generation in batch:
            verdict = self._verdicts.get(key)
            if verdict is not None and verdict.generation == generation:
                verdict.in_flight = True
                live.append((key, generation))
        if live:
            self._jobs[self._client.lookup([k for k, _ in live])] = live

    def mark_miss(self, keys: Collection[bytes]) -> None:
        """Keys a load failed on count as missing until their requests finish."""
        for key in keys:
            verdict = self._verdicts.get(key)
            if verdict is not None and not verdict.in_flight and verdict.found is not None:
                verdict.found = False

    def cleanup(self, request: Hashable) -> None:
        """Drops a finished request's interest; a check still in flight stays until it lands."""
        for key in self._request_keys.pop(request, ()):
            verdict = self._verdicts[key]
            verdict.requests.discard(request)
            if not verdict.requests and not verdict.in_flight:
                del self._verdicts[key]

    def in_flight(self) -> int:
        return len(self._jobs)

    def _poll(self) -> None:
        for job, statuses in self._client.poll():
            for (key, generation), status in zip(self._jobs.pop(job, ()), statuses, strict=False):
                verdict = self._verdicts.get(key)
                if verdict is None or verdict.generation != generation:
                    continue
                verdict.in_flight = False
                if not verdict.requests:
                    del self._verdicts[key]
                else:
                    verdict.found = status == OK
