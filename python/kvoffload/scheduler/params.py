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
