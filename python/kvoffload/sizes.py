"""Byte settings take an int of bytes or a size string, as an operator writes one: "64GiB",
"512MiB", "2TB" (binary units KiB to TiB, decimal KB to TB, any case)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any

from kvoffload.errors import ConfigError

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)\s*", re.IGNORECASE)


def size_value(key: str, value: Any, owner: str = "") -> Any:
    """`value` in bytes if it is a size string; any other value is left for the caller's own
    check. A string that is no whole number of bytes is a `ConfigError` naming `owner` (e.g.
    "DiskTier "), the key and the value."""
    if not isinstance(value, str):
        return value
    match = _SIZE.fullmatch(value)
    if match is not None:
        size = Decimal(match[1]) * _UNITS[match[2].lower()]
        if size == size.to_integral_value():
            return int(size)
    raise ConfigError(
        f"{owner}{key}={value!r} is invalid: expected an int of bytes or a size such as "
        "'64GiB', '512MiB' or '2TB'"
    )


def with_sizes(settings: Mapping[str, Any], keys: Iterable[str], owner: str = "") -> dict[str, Any]:
    """A copy of `settings` with each of `keys` given as a size string in bytes."""
    out = dict(settings)
    for key in keys:
        if key in out:
            out[key] = size_value(key, out[key], owner)
    return out
