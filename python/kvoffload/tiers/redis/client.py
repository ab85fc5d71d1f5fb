"""`RedisClient`: the Rust data path (`kvoffload._rust.RemoteTier`) plus what only Python can do:
find the address of any contiguous buffer (the abi3 binding has no buffer protocol), and speak in
`ConfigError`s at start-up."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvoffload import _rust
from kvoffload._buffers import lend
from kvoffload.errors import ConfigError
from kvoffload.tiers.redis.config import RedisTierConfig
from kvoffload.tiers.status import Completion


class RedisClient:
    """Jobs of many chunks against one Redis/Valkey server, run on Rust threads without the GIL.

    Every chunk is `chunk_bytes` long and read from or written to `buffer[offset:offset +
    chunk_bytes]` in place. The buffer must stay unchanged (stores) or untouched (loads) until
    its job's completion comes back from `poll`, `wait` or `drain`; the Rust side holds a
    reference to it until then (and past the join of its workers when the client closes).
    """

    def __init__(
        self,
        config: RedisTierConfig,
        namespace_digest: bytes,
        chunk_bytes: int,
        *,
        connections: int | None = None,
        lookup_digests: Sequence[bytes] | None = None,
    ) -> None:
        """`lookup_digests`: when each rank stores its own shard of a chunk under its own digest,
        all of them (`namespace_digest` among them): a lookup then finds a chunk only when every
        shard is there. Unset, lookups ask `namespace_digest`'s key alone."""
        options = config.client_options()
        if connections is not None:
            options["connections"] = connections
        if lookup_digests is not None:
            options["lookup_namespaces"] = list(lookup_digests)
        try:
            self._tier = _rust.RemoteTier(config.url, namespace_digest, chunk_bytes, **options)
        except _rust.RemoteError as exc:
            raise ConfigError(f"secondary tier url={config.masked_url!r}: {exc}") from exc
        except ValueError as exc:
            raise ConfigError(f"secondary tier: {exc}") from exc
        self.config = config
        self.chunk_bytes = chunk_bytes

    @property
    def startup_error(self) -> str | None:
        """Why the server could not be reached at start-up (the tier then starts down)."""
        return self._tier.startup_error

    @property
    def last_error(self) -> str | None:
        """The latest reason a job, an item or the canary failed (for logs)."""
        return self._tier.last_error

    @property
    def state(self) -> str:
        """The circuit breaker: "up", "down" (every job fails fast) or "half-open"."""
        return self._tier.state

    def take_evicted(self) -> list[bytes]:
        """Nothing: the server evicts on its own, unseen (a replica that finds a chunk gone
        withdraws it)."""
        return []

    def canary(self, name: bytes, identity: bytes) -> tuple[str, bytes | None]:
        return self._tier.canary(name, identity, self.config.connect_timeout_s)

    def lookup(self, keys: Sequence[bytes]) -> int:
        return self._tier.submit_lookup(list(keys))

    def store(self, keys: Sequence[bytes], buffer: Any, offsets: Sequence[int]) -> int:
        return lend(self._tier.submit_store, keys, buffer, offsets, writable=False)

    def load(self, keys: Sequence[bytes], buffer: Any, offsets: Sequence[int]) -> int:
        return lend(self._tier.submit_load, keys, buffer, offsets, writable=True)

    def poll(self) -> list[Completion]:
        return self._tier.poll()

    def wait(self, timeout_s: float) -> list[Completion]:
        """Blocks (without the GIL) until some job completes or `timeout_s` passes."""
        return self._tier.wait(timeout_s)

    def drain(self, timeout_s: float) -> list[Completion]:
        """Blocks until no job is queued or running (each ends by its deadline)."""
        return self._tier.drain(timeout_s)

    def in_flight(self) -> int:
        return self._tier.in_flight()

    def stats(self) -> dict[str, int]:
        return self._tier.stats()

    def node_stats(self) -> dict[str, dict[str, int]]:
        """Per node (a cluster's primaries, or the one server), by `host:port`: `bytes_written`,
        `bytes_read`, `failures` (monotonic) and `resting` (1 while it is left alone after a
        failure)."""
        return self._tier.node_stats()

    def close(self) -> None:
        self._tier.close()
