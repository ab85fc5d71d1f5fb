"""KV-cache groups of hybrid models, as the scheduler plans them (engine-agnostic).

A hybrid model (sliding-window or chunked-local attention, or Mamba / linear-attention layers,
beside full attention) keeps one block table per group. Every group has the same block size and
chunk; keys differ by the group index (a key's last 4 bytes). A full-attention group is hit
through its whole prefix, a window group only through the chunks its attention reads before the
hit boundary, and it stores only the chunks a later hit can reach; a Mamba group keeps one state
per request and is hit through the chunk that ends at the boundary, whose key holds the state
after it: the rules of vLLM 0.33's `OffloadingConnector`, whose decisions these reproduce (see
`HybridPlanner` in `hybrid.py`, and the lookup in the core's `hybrid/lookup.rs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvoffload.store import GroupSpec

GroupKind = Literal["full", "sliding", "chunked_local", "mamba"]
GROUP_KINDS: tuple[GroupKind, ...] = ("full", "sliding", "chunked_local", "mamba")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group. `window` is the sliding window (tokens a sliding layer attends,
    itself included) or the attention chunk of chunked-local attention; `extra_retained_tokens`
    are the tokens a sliding group keeps past its window for multi-token speculative decoding;
    `eagle` marks the draft model's group (EAGLE/MTP), whose last chunk is volatile. A "mamba"
    group (vLLM's Mamba "align" mode: one state block per request, the states at block
    boundaries handed to the connector) has no window."""

    kind: GroupKind = "full"
    window: int = 0
    extra_retained_tokens: int = 0
    eagle: bool = False

    def __post_init__(self) -> None:
        if self.kind not in GROUP_KINDS:
            raise ValueError(f"kind={self.kind!r} is invalid; allowed: {', '.join(GROUP_KINDS)}")
        windowed = self.kind in ("sliding", "chunked_local")
        if type(self.window) is not int or (self.window < 1 if windowed else self.window != 0):
            allowed = "an int >= 1" if windowed else f"0 for a {self.kind} group"
            raise ValueError(f"window={self.window!r} of a {self.kind} group is invalid: {allowed}")
        if type(self.extra_retained_tokens) is not int or self.extra_retained_tokens < 0:
            raise ValueError(
                f"extra_retained_tokens={self.extra_retained_tokens!r} is invalid: an int >= 0"
            )
        if type(self.eagle) is not bool:
            raise ValueError(f"eagle={self.eagle!r} is invalid: true or false")
        if self.kind == "mamba":
            # vLLM's draft models have no Mamba layers; a state has no window to extend.
            if self.eagle:
                raise ValueError("eagle=True is invalid for a mamba group; allowed: False")
            if self.extra_retained_tokens:
                raise ValueError(
                    f"extra_retained_tokens={self.extra_retained_tokens!r} is invalid for a mamba "
                    "group; allowed: 0"
                )

    def window_chunks(self, tokens_per_chunk: int) -> int | None:
        """Chunks a hit needs before its boundary (`None`: the whole prefix)."""
        if self.kind == "full":
            return None
        if self.kind == "mamba":
            return 1  # the state after the boundary
        if self.kind == "chunked_local":
            return cdiv(self.window, tokens_per_chunk)
        return max(
            cdiv(self.window, tokens_per_chunk),
            cdiv(self.window - 1 + self.extra_retained_tokens, tokens_per_chunk),
        )

    def spec(self, tokens_per_chunk: int) -> GroupSpec:
        """The group as the store's hybrid lookup takes it (`CpuStore.lookup_groups`)."""
        window = self.window_chunks(tokens_per_chunk)
        return (self.kind, window, self.window, self.extra_retained_tokens, self.eagle)
