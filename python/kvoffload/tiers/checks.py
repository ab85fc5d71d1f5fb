"""What every kind's `secondary_tiers` entry is checked for first: a dict, no unknown key, and a
namespace."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvoffload.errors import ConfigError

VLLM_KEYS = frozenset({"type", "module_path", "backpressure", "locality"})
"""Keys vLLM's tier factory reads (or passes on) itself: not a kind's, not unknown either."""


def check_entry(entry: object, kind: str, keys: Iterable[str]) -> Mapping[str, Any]:
    """`entry` as a mapping whose keys are all `keys` or vLLM's, or a `ConfigError`: a typo in
    a tier's settings must stop start-up, not silently leave a replica outside the pool."""
    if not isinstance(entry, Mapping):
        raise ConfigError(f"a secondary tier entry must be a dict, got {type(entry).__name__}")
    allowed = set(keys)
    unknown = sorted(set(entry) - allowed - VLLM_KEYS, key=repr)
    if unknown:
        raise ConfigError(
            f"unknown {kind} key(s): {', '.join(map(repr, unknown))}; allowed: "
            f"{', '.join(sorted(allowed))}"
        )
    return entry


def namespace_of(entry: Mapping[str, Any], kind: str) -> str:
    """The required `namespace`: what keeps replicas with other weights apart."""
    namespace = entry.get("namespace")
    if not isinstance(namespace, str) or not namespace.strip() or len(namespace) > 1024:
        raise ConfigError(
            f"{kind} namespace={namespace!r} is invalid: it is required, a non-empty string of "
            "at most 1024 characters naming the model and its weights version (e.g. "
            "'llama-3.1-8b@rev-5f0b')"
        )
    return namespace
