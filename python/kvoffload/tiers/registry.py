"""The kinds of secondary tier, keyed by the `type` of a `secondary_tiers` entry (as vLLM's tier
factory keys its own). A built-in kind is imported when an entry first names it."""

from __future__ import annotations

import importlib

from kvoffload.tiers.kind import TierKind

_BUILT_IN = {
    "RedisTier": "kvoffload.tiers.redis",
    "DiskTier": "kvoffload.tiers.disk",
}
"""Each built-in kind's module (its `KIND`)."""
_KINDS: dict[str, TierKind] = {}


_MEMBERS = (
    "name",
    "locality",
    "sees_evictions",
    "report",
    "parse",
    "check_shards",
    "open_lookups",
    "open_data_path",
    "reporter",
)
"""What a `TierKind` has (`report` may be None)."""


def register(kind: TierKind) -> None:
    """Adds a kind, named by `kind.name` (the `type` of its entries). A `TypeError` names what
    it lacks; a `ValueError`, a name already taken."""
    missing = [m for m in _MEMBERS if not hasattr(kind, m)]
    if missing:
        raise TypeError(
            f"tier kind {kind!r} lacks {', '.join(missing)}; a TierKind has "
            f"{', '.join(_MEMBERS)} (see kvoffload.tiers.kind)"
        )
    name = kind.name
    if not isinstance(name, str) or not name:
        raise TypeError(f"tier kind {kind!r} has name={name!r}; allowed: a non-empty str")
    if name in _BUILT_IN or name in _KINDS:
        raise ValueError(f"tier kind {name!r} is registered already; allowed: a new name")
    _KINDS[name] = kind


def names() -> list[str]:
    """Every kind's name, the built-in ones first."""
    return [*_BUILT_IN, *(name for name in _KINDS if name not in _BUILT_IN)]


def kind(name: str) -> TierKind | None:
    """The kind named `name`, or None."""
    found = _KINDS.get(name)
    if found is None and name in _BUILT_IN:
        found = importlib.import_module(_BUILT_IN[name]).KIND
        _KINDS[name] = found
    return found


def kinds() -> list[TierKind]:
    """Every kind (the built-in ones imported)."""
    return [k for k in map(kind, names()) if k is not None]
