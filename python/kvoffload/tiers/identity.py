"""The namespace digest: everything a chunk's bytes depend on that its block hash does not cover.

A block hash fingerprints tokens only. Two replicas may share a chunk only if they would have
written the same bytes for it: the same weights (the user's `namespace`), model, KV dtype, block
and chunk geometry, layers, parallel layout, bytes per chunk and byte layout, and our format
version. Any field that differs gives another digest, so the keys never meet.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

# Bumped whenever the value header (rust/kvoffload-tier) or a key scheme changes.
FORMAT_VERSION = 2


@dataclass(frozen=True)
class TierIdentity:
    namespace: str
    model: str
    kv_dtype: str
    tokens_per_block: int
    blocks_per_chunk: int
    layers: tuple[str, ...]
    tp_size: int
    pp_size: int
    rank: int
    bytes_per_chunk: int
    layout: str
    """Which writer laid the bytes out (e.g. vLLM's tiering CPU region or our pool), and how."""

    def digest(self) -> bytes:
        """16 bytes: BLAKE2b over the canonical JSON of every field and the format version."""
        fields = asdict(self)
        fields["format_version"] = FORMAT_VERSION
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(canonical.encode(), digest_size=16).digest()


def ownership(kind: str, where: str, digest: bytes) -> str:
    """The tier's name in vLLM's KV events (their `ownership`): `kind:` and 8 hex digits of where
    it is and what its values are. Equal for every replica sharing one tier (a router pools a
    shared tier's blocks by it); different for two tiers of one chain."""
    tag = hashlib.blake2b(where.encode() + digest, digest_size=4).hexdigest()
    return f"{kind}:{tag}"
