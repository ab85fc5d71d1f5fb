"""The prefix-reuse bound of a workload: the most prompt tokens any tier, or all of them
together, could hit, whatever their sizes, the router and the order requests run in.

A prompt token is a hit only in a full block of the GPU's size that lies before the prompt's last
token (vLLM computes that token) and whose KV some request computed before. Blocks are hashed
with their whole prefix, so a block's hash names its prefix: a hash that more than one prompt
holds is hit at most once fewer than it is held, unless a request computes it outside the part
of its prompt that can hit (its output, or its prompt's last block), in which case every prompt
that holds it may hit it. Replayed one request at a time with caches that keep everything, a
run hits exactly this when every block a request computes outside that part comes before the
prompts that repeat it (always so in the built-in workloads); otherwise it stays an upper
bound."""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from kvoffload.simulate.report import SimResult, all_hit_rate
from kvoffload.simulate.workloads import Request

_Keys = npt.NDArray[np.uint64]


def prefix_reuse_bound(requests: Iterable[Request], tokens_per_block: int) -> int:
    """Prompt tokens of `requests` that repeat the KV of another request (see the module)."""
    can_hit: list[_Keys] = []
    computed_elsewhere: list[_Keys] = []
    for r in requests:
        hashes = r.block_hashes(tokens_per_block)
        n = (r.num_prompt - 1) // tokens_per_block
        # KV exists for every token but the last one generated.
        computed = (r.num_prompt + r.num_output - 1) // tokens_per_block
        can_hit.append(_keys(hashes[:n]))
        computed_elsewhere.append(_keys(hashes[n:computed]))
    if not can_hit:
        return 0
    held = np.concatenate(can_hit)
    distinct = np.unique(held)
    first_computed = int(np.count_nonzero(~np.isin(distinct, np.concatenate(computed_elsewhere))))
    return (len(held) - first_computed) * tokens_per_block


def _keys(hashes: list[bytes]) -> _Keys:
    """The first 8 bytes of each hash (of SHA-256: a collision in 2^64 is not a concern), so
    that a trace of millions of blocks fits in a few arrays of 8 bytes a block."""
    return np.frombuffer(b"".join(h[:8] for h in hashes), dtype=np.uint64)


def bound_line(bound: int, prompt_tokens: int, tokens_per_block: int) -> str:
    share = bound / prompt_tokens if prompt_tokens else 0.0
    return (
        f"prefix-reuse bound {share:.1%} ({bound:,} prompt tokens repeat KV another request "
        f"computes, in {tokens_per_block}-token blocks): no tier, nor all together, can hit more"
    )


def unchanged_note(
    labels: Sequence[str], results: Sequence[SimResult], bound: int, larger: str, cpu_gib: float
) -> str:
    """Why compared settings hit the same, if they do (to 0.1% of the prompt tokens), wrapped;
    else nothing. `larger` names a larger workload (a flag, or "a longer trace"); `cpu_gib`
    is the CPU tier's size."""
    prompt = results[0].prompt_tokens
    hits = [round(all_hit_rate(r) * prompt) for r in results]
    if len(results) < 2 or not prompt or max(hits) - min(hits) > prompt / 1000:
        return ""
    base, hit, share = results[0], hits[0] / prompt, bound / prompt
    out = (
        f"Every setting hits {hit:.1%} of the prompt tokens (all tiers together) against a "
        f"bound of {share:.1%}: "
    )
    outgrow = (
        "A comparison shows something where what repeats outgrows the GPU cache and the "
        f"tiers: {larger}, or a smaller --cpu-gib (e.g. {cpu_gib / 4:g})."
    )
    if share < 0.05:
        out += (
            "the workload repeats almost nothing, so no tier can hit more. Compare on one that "
            f"repeats more: {larger}, or --workload shared-prefix."
        )
    elif share - hit < 0.01:
        out += f"{labels[0]} already hits all but {share - hit:.1%} of it. " + outgrow
    else:
        out += (
            f"the {share - hit:.1%} between are tokens no tier held when asked for (still "
            "being computed when a request repeating them arrived, or evicted before they "
            "came back)."
        )
        if not (base.evictions or base.disk_evictions or base.remote_evictions):
            out += (
                f" The baseline ({labels[0]}) evicts nothing: all it computed still fits, so "
                "neither a larger tier nor one behind the CPU tier has more to serve. " + outgrow
            )
    return textwrap.fill(out, 100)
