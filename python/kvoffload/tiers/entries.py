"""`secondary_tiers`: the tiers behind the CPU tier, in lookup order (CPU -> first -> second
...), each an entry in vLLM's tiering syntax whose `type` names its kind (`registry`), checked
key by key."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvoffload.errors import ConfigError
from kvoffload.tiers import registry
from kvoffload.tiers.identity import TierIdentity, ownership
from kvoffload.tiers.kind import TierConfig, TierKind

_LOCALITIES = ("LOCAL", "REMOTE")
# A chunk held by every tier's write at once: the CPU tier counts at most 15 holds per key.
MAX_TIERS = 4
# Keys of a vLLM tiering entry that mean nothing to this connector.
_TIERING_ONLY = {
    "backpressure": "each tier bounds its own writes instead (max_store_bytes_in_flight)",
    "enable_kv_events": "this connector publishes every tier's events whenever vLLM's KV "
    "events are on",
}
_EXAMPLE = (
    '[{"type": "DiskTier", "path": "/mnt/nvme/kvoffload", "capacity_bytes": 2000000000000, '
    '"namespace": "model@rev"}, {"type": "RedisTier", "url": "redis://host:6379/0", '
    '"namespace": "model@rev"}]'
)


@dataclass(frozen=True)
class TierSettings:
    """One secondary tier: its kind, its entry, its locality, and what its values depend on."""

    kind: TierKind
    config: TierConfig
    locality: str
    identity: TierIdentity
    """Rank 0's identity; each shard of a chunk is keyed under its own shard's digest."""

    @property
    def ownership(self) -> str:
        """Its name in KV events (`identity.ownership`)."""
        return ownership(self.kind.name, self.config.where, self.identity.digest())

    def shard_digest(self, shard: int) -> bytes:
        """The namespace digest of one shard of every chunk."""
        return dataclasses.replace(self.identity, rank=shard).digest()


def parse_entries(tiers: object) -> list[tuple[TierKind, TierConfig, str]]:
    """Each entry's kind, config and locality, in order; a bad entry is a `ConfigError` naming it.
    Not echoed back: an entry may hold a server's password."""
    if not isinstance(tiers, list) or not tiers:
        given = "an empty list" if tiers == [] else f"a {type(tiers).__name__}"
        raise ConfigError(
            f"secondary_tiers is {given}: expected a list of tiers in lookup order, e.g. "
            + _EXAMPLE
        )
    if len(tiers) > MAX_TIERS:
        raise ConfigError(
            f"secondary_tiers has {len(tiers)} entries; allowed: 1 to {MAX_TIERS} tiers"
        )
    entries = [_entry(i, entry) for i, entry in enumerate(tiers)]
    seen: dict[tuple[str, str], int] = {}
    for i, (_, config, _) in enumerate(entries):
        where = config.where
        first = seen.setdefault((where, config.namespace), i)
        if first != i:
            raise ConfigError(
                f"secondary_tiers[{i}] is secondary_tiers[{first}] again ({where}, namespace "
                f"{config.namespace!r}): list each tier once"
            )
    return entries


def _entry(i: int, entry: Any) -> tuple[TierKind, TierConfig, str]:
    name = f"secondary_tiers[{i}]"
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{name} must be a dict, got {type(entry).__name__}")
    type_ = entry.get("type")
    kind = registry.kind(type_) if isinstance(type_, str) else None
    if kind is None:
        raise ConfigError(
            f"{name} type={type_!r} is invalid; allowed: {', '.join(map(repr, registry.names()))}"
        )
    if entry.get("module_path", "kvoffload.vllm") != "kvoffload.vllm":
        raise ConfigError(
            f"{name} module_path={entry['module_path']!r} is invalid; allowed: "
            "'kvoffload.vllm' (or leave it out)"
        )
    for key, why in _TIERING_ONLY.items():
        if key in entry:
            raise ConfigError(
                f"{name} key {key!r} is read only by vLLM's TieringOffloadingSpec, not by "
                f"KVOffloadConnector: {why}; remove it"
            )
    locality = entry.get("locality", kind.locality)
    if locality not in _LOCALITIES:
        raise ConfigError(
            f"{name} locality={locality!r} is invalid; allowed: {', '.join(map(repr, _LOCALITIES))}"
        )
    try:
        config = kind.parse(entry)
    except ConfigError as exc:
        raise ConfigError(f"{name}: {exc}") from None
    return kind, config, locality
