"""The kvoffload exception hierarchy.

Every error kvoffload raises on purpose is a `KVOffloadError` or a plain `TypeError` /
`ValueError` naming the bad argument. `ConfigError` is both a `KVOffloadError` and a
`ValueError`, so either `except` catches it.
"""

from kvoffload._rust import InvalidStateError, KVOffloadError


class ConfigError(KVOffloadError, ValueError):
    """A configuration key has a wrong type or value; the message names the key and what is
    allowed."""


class NotSupportedError(KVOffloadError):
    """A configuration kvoffload understands but does not support yet (e.g. several KV groups)."""


__all__ = ["ConfigError", "InvalidStateError", "KVOffloadError", "NotSupportedError"]
