"""`SeedCanary`: checks, once, that the replicas sharing a namespace hash blocks alike.

Block hashes chain from vLLM's `NONE_HASH`, drawn from `PYTHONHASHSEED` unless a sha256 prefix
hash is set: replicas with different seeds never share a prefix, and nothing else would say so.
The first replica writes its `NONE_HASH` under a canary key; the others compare theirs with it.
"""

from __future__ import annotations

import logging
import threading

from kvoffload.errors import KVOffloadError
from kvoffload.tiers.redis.client import RedisClient

CANARY_NAME = b"vllm-none-hash"


class SeedCanary:
    """Runs on a thread of its own: a network round trip has no place on the scheduler thread.
    Messages go to `log`, the seam's logger."""

    def __init__(self, client: RedisClient, log: logging.Logger) -> None:
        self._client = client
        self._log = log
        self._thread: threading.Thread | None = None

    def start(self, none_hash: bytes) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._check, args=(none_hash,), name="kvoffload-canary", daemon=True
            )
            self._thread.start()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=self._client.config.connect_timeout_s)

    def _check(self, none_hash: bytes) -> None:
        config = self._client.config
        try:
            outcome, theirs = self._client.canary(CANARY_NAME, none_hash)
        except KVOffloadError as exc:  # e.g. closed meanwhile: a warning at most, never a stop
            outcome, theirs = "down", str(exc).encode()
        if outcome == "down":
            self._log.info(
                "Redis tier %s: hash-seed canary not checked (%s)",
                config.masked_url,
                (theirs or b"").decode(errors="replace"),
            )
        elif outcome == "differs":
            self._log.warning(
                "Redis tier %s namespace %r: another replica hashes blocks from a different seed "
                "(NONE_HASH %s here, %s there), so no prefix will be shared between them. Set the "
                "same PYTHONHASHSEED on every replica, or use a sha256 prefix-caching hash.",
                config.masked_url,
                config.namespace,
                none_hash.hex()[:16],
                (theirs or b"").hex()[:16],
            )
