"""Per-request `kv_transfer_params` caps, parsed with vLLM's contract: an invalid value is ignored
with one warning, never an error that would fail the request."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

MAX_OFFLOAD_TOKENS = "max_offload_tokens"
MAX_LOAD_TOKENS = "max_load_tokens"
KV_TRANSFER_PARAMS = "kv_transfer_params"
MAX_TOKEN_CAP = 2**63 - 1
"""The largest cap the core's token arithmetic takes."""


def checked_params(request_id: str, params: object, ignored: dict[str, int]) -> Mapping[str, Any]:
    """`params` if it is a mapping (or empty when `None`); anything else (it comes from users
    through the serving API) is ignored with one warning and counted under
    `ignored["kv_transfer_params"]`."""
    if params is None:
        return {}
    if isinstance(params, Mapping):
        return params
    logger.warning(
        "request %s: kv_transfer_params=%r (%s) is not a mapping; ignoring it",
        request_id,
        params,
        type(params).__name__,
    )
    ignored[KV_TRANSFER_PARAMS] = ignored.get(KV_TRANSFER_PARAMS, 0) + 1
    return {}


def parse_token_cap(
    request_id: str, params: Mapping[str, Any], key: str, ignored: dict[str, int]
) -> int | None:
    """The cap under `key`, or `None` when absent or invalid. Only `type(v) is int` in
    `0..2**63-1` is accepted (so `True`, `"8"`, `8.5`, `-1` and `2**64` are not); each rejection
    warns once and counts in `ignored[key]`."""
    raw = params.get(key)
    if raw is None:
        return None
    if type(raw) is int and 0 <= raw <= MAX_TOKEN_CAP:
        return raw
    logger.warning(
        "request %s: kv_transfer_params[%r]=%r (%s) is not an int in 0..2**63-1; ignoring it",
        request_id,
        key,
        raw,
        type(raw).__name__,
    )
    ignored[key] = ignored.get(key, 0) + 1
    return None


KV_LOAD_TIERS = "kv_load_tiers"
_MEDIA = frozenset({"CPU", "STORAGE"})
_LOCALITIES = frozenset({"LOCAL", "REMOTE"})

TierMatcher = tuple[str | None, str | None]
"""`(medium, locality)`, upper case; `None` matches any."""


def parse_load_tiers(
    request_id: str, params: Mapping[str, Any], ignored: dict[str, int]
) -> tuple[TierMatcher, ...] | None:
    """The request's `kv_load_tiers` filter, parsed as vLLM 0.33's `OffloadingConnector` parses
    it (`_parse_tier_filter`): a list of `{"medium": ..., "locality": ...}` matchers (either key
    may be left out; values case-insensitive). `None` allows every tier: the key absent, not a
    list, or only invalid entries. `[]` allows none. An invalid entry is skipped with one warning
    and counted in `ignored[kv_load_tiers]`. As in vLLM, the filter selects among the tiers behind
    the CPU tier; the CPU tier itself is always looked up."""
    raw = params.get(KV_LOAD_TIERS)
    if raw is None:
        return None

    def skip(why: str) -> None:
        logger.warning("request %s: kv_load_tiers %s; ignoring it", request_id, why)
        ignored[KV_LOAD_TIERS] = ignored.get(KV_LOAD_TIERS, 0) + 1

    if not isinstance(raw, list):
        skip(f"={raw!r} ({type(raw).__name__}) is not a list")
        return None
    matchers: list[TierMatcher] = []
    for entry in raw:
        if not isinstance(entry, dict):
            skip(f"entry {entry!r} is not a dict")
            continue
        matcher: list[str | None] = []
        for key, allowed in (("medium", _MEDIA), ("locality", _LOCALITIES)):
            value = entry.get(key)
            if value is None:
                matcher.append(None)
            elif isinstance(value, str) and value.upper() in allowed:
                matcher.append(value.upper())
            else:
                skip(f"entry {entry!r}: {key}={value!r} is not one of {sorted(allowed)}")
                break
        else:
            matchers.append((matcher[0], matcher[1]))
    if not matchers and raw:
        return None
    return tuple(matchers)


def tier_allowed(matchers: tuple[TierMatcher, ...] | None, medium: str, locality: str) -> bool:
    """Whether a tier of `medium` and `locality` passes a `parse_load_tiers` filter."""
    if matchers is None:
        return True
    return any(m in (None, medium) and loc in (None, locality) for m, loc in matchers)
