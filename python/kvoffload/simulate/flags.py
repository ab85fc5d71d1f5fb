"""The flags of `kvoffload simulate`: each value is checked as it is parsed (a bad one is a usage
error naming the flag and what it allows); `runs.py` checks how they combine."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, TypeVar

from kvoffload._docs import docs_url
from kvoffload.simulate.instance import MIN_HBM_GBPS, EngineConfig
from kvoffload.simulate.models import DEFAULT_MODEL, MODELS, SPEED_FLAGS
from kvoffload.simulate.routers import ROUTERS, TierWeights, parse_tier_weights
from kvoffload.simulate.shared_tier import SharedTierConfig, disk_tier
from kvoffload.simulate.trace import FORMATS
from kvoffload.simulate.workloads import WORKLOADS
from kvoffload.store import POLICY_NAMES

MAX_GPU_BLOCKS = 1 << 22
"""The simulator keeps per-block state in memory: 4M blocks is plenty."""
MAX_INSTANCES = 256
_MAX_SWEEP = 16
"""Points of a sweep: each is a whole replay."""
_COUNT_MAX = 1 << 20
COMPARISONS = (
    "offload_prompt_only",
    "eviction_policy",
    "instances",
    "router",
    "disk_tier",
    "shared_tier",
)
T = TypeVar("T", int, float)


class UsageError(Exception):
    """A bad flag or flag combination: exit code 2."""


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            value = None
        if value is None or not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"expected an int in {lo}..{hi:,}, got {text!r}")
        return value

    return parse


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def _float_in(lo: float, hi: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not lo <= value <= hi:  # NaN fails too
            raise argparse.ArgumentTypeError(f"expected a number in {lo:g}..{hi:g}, got {text!r}")
        return value

    return parse


def _off_or(lo: float, hi: float) -> Callable[[str], float]:
    """0 (the term is off) or a number in `lo..hi`: a tiny positive value would make a step
    take forever (its time overflows)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (value == 0 or lo <= value <= hi):  # NaN fails too
            raise argparse.ArgumentTypeError(
                f"expected 0 (off) or a number in {lo:g}..{hi:g}, got {text!r}"
            )
        return value

    return parse


def _tier_weights(text: str) -> dict[str, float]:
    try:
        return parse_tier_weights(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _sweep(parse: Callable[[str], T], what: str) -> Callable[[str], list[T]]:
    """A comma-separated list of distinct values for `parse`, sorted."""

    def parse_list(text: str) -> list[T]:
        try:
            values = [parse(p.strip()) for p in text.split(",")]
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what} ({e})") from None
        if len(set(values)) != len(values) or len(values) > _MAX_SWEEP:
            raise argparse.ArgumentTypeError(
                f"expected 1 to {_MAX_SWEEP} distinct {what}, got {text!r}"
            )
        return sorted(values)

    return parse_list


def flag(name: str) -> str:
    """`--name-of-it` for the attribute `name_of_it`."""
    return "--" + name.replace("_", "-")


@functools.cache
def workload_fields() -> dict[str, dict[str, Any]]:
    """Every workload size flag: its bound, help and per-workload defaults."""
    out: dict[str, dict[str, Any]] = {}
    for wname, cls in WORKLOADS.items():
        for f in dataclasses.fields(cls):
            entry = out.setdefault(f.name, {"min": f.metadata["min"], "help": f.metadata["help"]})
            entry.setdefault("defaults", {})[wname] = f.default
    return out


def add_arguments(s: argparse.ArgumentParser) -> None:
    """The flags of `kvoffload simulate`, each validated as it is parsed."""
    w = s.add_argument_group("workload")
    w.add_argument(
        "--workload",
        choices=list(WORKLOADS),
        default=None,
        help="generated traffic (default: reasoning-chat)",
    )
    w.add_argument(
        "--trace",
        metavar="FILE.jsonl",
        help=f"replay these requests instead; formats: {docs_url('simulator')}",
    )
    w.add_argument(
        "--trace-format",
        choices=FORMATS,
        help="the trace's format (default: the first request line decides)",
    )
    w.add_argument(
        "--hash-block-tokens",
        type=int_in(1, 1 << 20),
        metavar="N",
        help="tokens per hash id of a hash-ids trace (default: the block size a record_trace "
        "file names on its first line, else 512)",
    )
    w.add_argument(
        "--time-scale",
        type=_float_in(1e-6, 1e6),
        metavar="X",
        help="multiply the trace's arrivals by X (0.5: twice as fast; default: 1)",
    )
    w.add_argument(
        "--start",
        type=_float_in(0, 1e9),
        metavar="SECONDS",
        help="replay the trace from this second of its own clock (default: 0)",
    )
    w.add_argument(
        "--limit",
        type=int_in(1, 1 << 30),
        metavar="N",
        help="replay at most N requests of the trace (the first to arrive)",
    )
    w.add_argument("--seed", type=int_in(0, 2**63 - 1), default=0, help="default: 0")
    for name, f in workload_fields().items():
        defaults = ", ".join(f"{k} {v}" for k, v in f["defaults"].items())
        w.add_argument(
            flag(name),
            type=int_in(f["min"], _COUNT_MAX),
            metavar="N",
            help=f"{f['help']} (default: {defaults})",
        )

    e = s.add_argument_group("engine model")
    d = EngineConfig()
    kv = e.add_mutually_exclusive_group()
    kv.add_argument(
        "--model",
        choices=list(MODELS),
        help=f"sets the KV bytes per token (bf16) and the prefill and decode speeds, scaled "
        f"from {DEFAULT_MODEL}'s on one H200 by the model's size (default: {DEFAULT_MODEL})",
    )
    kv.add_argument(
        "--kv-bytes-per-token",
        type=int_in(1, 1 << 30),
        metavar="N",
        help="KV bytes per token over all layers, instead of --model (the speeds stay "
        f"{DEFAULT_MODEL}'s unless given)",
    )
    e.add_argument(
        "--tokens-per-block", type=int_in(1, 4096), default=16, metavar="N", help="default: 16"
    )
    e.add_argument(
        "--blocks-per-chunk",
        type=int_in(1, 4096),
        default=1,
        metavar="N",
        help="GPU blocks per offloaded chunk (default: 1)",
    )
    engine_flags: list[tuple[str, Callable[[str], Any], str]] = [
        ("gpu_blocks", int_in(1, MAX_GPU_BLOCKS), "GPU KV-cache blocks"),
        ("max_running", int_in(1, 1 << 16), "requests running at once"),
        ("max_batched_tokens", int_in(1, 1 << 24), "tokens per step (chunked prefill)"),
        ("pcie_gbps", _float_in(0.01, 10_000), "GB/s per direction"),
        ("prefill_tokens_per_s", _float_in(1, 1e9), "prompt tokens computed per second"),
        (
            "prefill_attention_tokens",
            _off_or(1, 1e9),
            "context at which attention doubles a prompt token's time; 0: none",
        ),
        ("decode_step_ms", _float_in(0.001, 1e6), "time of a step before reading KV"),
        ("hbm_gbps", _off_or(MIN_HBM_GBPS, 1e6), "GPU memory GB/s for reading decode KV; 0: free"),
    ]
    for name, parse, help in engine_flags:
        default = f"{getattr(d, name):g}"
        if name in SPEED_FLAGS:  # None: --model's (`command._speeds`)
            default = f"--model's; {DEFAULT_MODEL}: {default}"
        e.add_argument(
            flag(name),
            type=parse,
            default=None if name in SPEED_FLAGS else getattr(d, name),
            metavar="N",
            help=f"{help} (default: {default})",
        )

    o = s.add_argument_group("offloading")
    o.add_argument("--cpu-gib", type=_positive, metavar="GIB", help="CPU tier size (default: 8)")
    o.add_argument("--eviction-policy", choices=POLICY_NAMES, help="default: lru")
    o.add_argument(
        "--offload-decode",
        action="store_true",
        help="also offload KV computed while decoding (offload_prompt_only=false)",
    )
    o.add_argument(
        "--max-load-tokens",
        type=int_in(0, 2**63 - 1),
        metavar="N",
        help="kv_transfer_params cap for every request (a trace line's own value wins)",
    )
    o.add_argument(
        "--max-offload-tokens",
        type=int_in(0, 2**63 - 1),
        metavar="N",
        help="kv_transfer_params cap on the tokens stored, for every request (likewise)",
    )

    fl = s.add_argument_group("fleet")
    fl.add_argument(
        "--instances",
        type=int_in(1, MAX_INSTANCES),
        metavar="N",
        help="engines, each with its own GPU cache and CPU tier (default: 1)",
    )
    fl.add_argument(
        "--router",
        choices=ROUTERS,
        help="places each request (default: round-robin); least-loaded: the fewest unfinished "
        "requests; prefix-affinity: the longest prefix in the instance's GPU cache (all a "
        "router learns from vLLM's KV events of the GPU cache); tier-aware: the prefix in "
        "each of its tiers, weighted per tier (--tier-weights); ties go to the least loaded",
    )
    d_weights = TierWeights()
    fl.add_argument(
        "--tier-weights",
        type=_tier_weights,
        metavar="NAME=W,...",
        help="what tier-aware counts a prompt block held in each tier: gpu, cpu, disk, shared "
        f"(default: {','.join(f'{k}={v:g}' for k, v in dataclasses.asdict(d_weights).items())})",
    )
    fl.add_argument("--per-instance", action="store_true", help="also a table per instance")

    dk = s.add_argument_group(
        "disk tier (each instance's own NVMe, behind its CPU tier and before the shared tier)"
    )
    dd = disk_tier(1)
    dk.add_argument(
        "--disk-gib", type=_positive, metavar="GIB", help="its size per instance (default: none)"
    )
    dk.add_argument(
        "--disk-gbps",
        type=_float_in(0.01, 10_000),
        metavar="N",
        help=f"GB/s of its drive, per direction (default: {dd.gbps:g})",
    )
    dk.add_argument(
        "--disk-latency-ms",
        type=_float_in(0, 10_000),
        metavar="MS",
        help=f"time of one batch of reads or writes beyond its bytes (default: {dd.latency_ms:g})",
    )

    rt = s.add_argument_group(
        "shared tier (a Redis/Valkey server, or a cluster, behind every instance)"
    )
    dr = SharedTierConfig(1)
    rt.add_argument(
        "--remote-gib", type=_positive, metavar="GIB", help="its size per node (default: none)"
    )
    rt.add_argument(
        "--remote-nodes",
        type=int_in(1, 1000),
        metavar="N",
        help="primaries of a Redis Cluster the chunks spread over, by slot (default: 1)",
    )
    rt.add_argument(
        "--remote-node-gbps",
        type=_float_in(0.01, 10_000),
        metavar="N",
        help="GB/s of each node's own link, per direction, shared by every instance "
        "(default: not modelled; 12.5 is a 100 Gb NIC)",
    )
    rt.add_argument(
        "--remote-gbps",
        type=_float_in(0.01, 10_000),
        metavar="N",
        help=f"GB/s of each instance's link to it, per direction (default: {dr.gbps:g})",
    )
    rt.add_argument(
        "--remote-latency-ms",
        type=_float_in(0, 10_000),
        metavar="MS",
        help=f"round trip of one batch of reads or writes (default: {dr.latency_ms:g})",
    )

    r = s.add_argument_group("runs and output")
    r.add_argument("--compare", choices=COMPARISONS, help="run both values side by side")
    r.add_argument(
        "--sweep-cpu-gib",
        type=_sweep(_positive, "sizes in GiB"),
        metavar="LIST",
        help="run each CPU tier size, e.g. 1,2,4,8,16",
    )
    r.add_argument(
        "--sweep-instances",
        type=_sweep(int_in(1, MAX_INSTANCES), "instance counts"),
        metavar="LIST",
        help="run each fleet size behind --router, e.g. 1,2,4,8",
    )
    r.add_argument("--plot", metavar="FILE.png", help="draw the sweep (needs matplotlib)")
    r.add_argument(
        "--verify-data",
        action="store_true",
        help="move real bytes with the transfer engine in CPU mode and check every load (torch)",
    )
    r.add_argument("--json", action="store_true", help="print only machine-readable JSON")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
