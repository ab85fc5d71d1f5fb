"""The routers of a fleet (`fleet.py`) and how each ranks the instances for a request.

`prefix-affinity` knows what a router learns from vLLM's KV events of the GPU cache alone: the
longest prefix of the prompt each instance's GPU cache holds. `tier-aware` knows the offload
tiers too, as Dynamo's KV router and llm-d's precise prefix-cache scorer do once they index the
tiers' KV events: it walks the prompt's leading blocks, counts each in the tier of that instance
it would be loaded from (its GPU cache, then its CPU tier, its disk, the fleet's shared tier),
weights it by that medium and stops at the first block no tier holds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

ROUTERS = ("round-robin", "least-loaded", "prefix-affinity", "tier-aware")


@dataclass(frozen=True)
class TierWeights:
    """What a prompt block held in each medium is worth to `tier-aware` (a block computed anew:
    0). GPU, CPU ("host") and disk are Dynamo's defaults; the Simulator page of the docs says
    why the shared tier's is the disk's."""

    gpu: float = 1.0
    cpu: float = 0.75
    disk: float = 0.25
    shared: float = 0.25

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"{f.name}={value!r} is invalid: expected a finite number >= 0")

    def text(self) -> str:
        """`gpu 1, cpu 0.75, disk 0.25, shared 0.25`."""
        return ", ".join(f"{f.name} {getattr(self, f.name):g}" for f in dataclasses.fields(self))


TIER_NAMES = tuple(f.name for f in dataclasses.fields(TierWeights))


def parse_tier_weights(text: str) -> dict[str, float]:
    """`gpu=1,cpu=0.5`: the weights it names (`TierWeights(**them)` keeps the others' defaults).
    Raises `ValueError` naming the bad part and what is allowed."""
    given: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep or name not in TIER_NAMES:
            raise ValueError(
                f"expected NAME=WEIGHT pairs separated by commas, NAME one of "
                f"{', '.join(TIER_NAMES)}; got {part.strip()!r}"
            )
        if name in given:
            raise ValueError(f"{name} is given twice in {text!r}")
        try:
            weight = float(value)
        except ValueError:
            weight = math.nan
        if not 0 <= weight < math.inf:  # NaN fails too
            raise ValueError(f"{name}: expected a finite number >= 0, got {value!r}")
        given[name] = weight
    return given


def tier_aware_score(
    gpu_blocks: int,
    runs: Sequence[tuple[str, int]],
    blocks_per_chunk: int,
    weights: TierWeights,
) -> float:
    """An instance's score for a prompt: its `gpu_blocks` leading blocks in the GPU cache, then
    `runs` of whole chunks (tier, chunks) from the chunk that holds the first block past them,
    each in the first tier that holds it ("cpu", "disk" or "shared").

    The tiers behind the GPU hold and load whole chunks: a run that starts in a chunk the GPU
    partly holds brings that chunk's other blocks, and less than one chunk past the GPU's blocks
    loads nothing (the scheduler's lookup counts it as no hit), so it scores nothing."""
    score = weights.gpu * gpu_blocks
    skip = gpu_blocks % blocks_per_chunk  # the GPU's blocks of the first chunk
    blocks = [(name, n * blocks_per_chunk) for name, n in runs]
    if blocks:
        blocks[0] = (blocks[0][0], blocks[0][1] - skip)
    if sum(n for _, n in blocks) < blocks_per_chunk:
        return score
    weight = {"cpu": weights.cpu, "disk": weights.disk, "shared": weights.shared}
    return score + sum(weight[name] * n for name, n in blocks)
