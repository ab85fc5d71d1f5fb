"""The status of each key of a finished tier job, as every tier's Rust data path reports it."""

from __future__ import annotations

from kvoffload import _rust

OK = _rust.REMOTE_OK
MISSING = _rust.REMOTE_MISSING
CORRUPT = _rust.REMOTE_CORRUPT
FAILED = _rust.REMOTE_FAILED
DROPPED = _rust.REMOTE_DROPPED
EXISTS = _rust.REMOTE_EXISTS

Completion = tuple[int, bytes]
"""A finished job: its id and one status byte per key (`OK`, `MISSING`, ...)."""
