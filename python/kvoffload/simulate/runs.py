"""Which runs one `kvoffload simulate` makes: the settings `--compare` puts side by side, at each
point of a sweep (`--sweep-cpu-gib` sizes the CPU tier, `--sweep-instances` the fleet), and the
checks of flag combinations that no single flag's parser can see."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvoffload.simulate.flags import UsageError
from kvoffload.simulate.routers import ROUTERS
from kvoffload.store import POLICY_NAMES

DEFAULT_CPU_GIB = 8.0


@dataclass(frozen=True)
class Setting:
    """One run: a fleet of `instances` behind `router`, each with a CPU tier of `cpu_gib` and a
    disk tier of `disk_gib` behind it, and a shared tier of `remote_gib` behind them all (None:
    no such tier)."""

    label: str
    offload_prompt_only: bool
    eviction_policy: str
    instances: int
    router: str
    cpu_gib: float
    remote_gib: float | None = None
    disk_gib: float | None = None


@dataclass(frozen=True)
class Plan:
    axis: str | None
    """What the sweep varies ("cpu_gib" or "instances"), None without a sweep."""
    points: Sequence[float]
    """The sweep's values; without a sweep, the one CPU-tier size."""
    labels: list[str]
    """The settings compared at each point."""
    grid: list[list[Setting]]
    """`grid[i][j]`: setting `labels[j]` at point `points[i]`."""

    def cells(self) -> list[Setting]:
        return [st for row in self.grid for st in row]

    def fleet(self) -> str | None:
        """The instance counts and routers, for the header, when any run is a fleet."""
        if all(st.instances == 1 for st in self.cells()):
            return None
        counts = sorted({st.instances for st in self.cells()})
        routers = sorted({st.router for st in self.cells()})
        return f"{'/'.join(map(str, counts))} x {'/'.join(routers)}"


def plan(args: argparse.Namespace) -> Plan:
    """The runs the flags ask for; raises `UsageError` for flags that contradict each other."""
    _check_combinations(args)
    base = _compared(args)
    labels = [st.label for st in base]
    if args.sweep_cpu_gib is not None:
        points = args.sweep_cpu_gib
        grid = [[dataclasses.replace(st, cpu_gib=p) for st in base] for p in points]
        return Plan("cpu_gib", points, labels, grid)
    if args.sweep_instances is not None:
        points = args.sweep_instances
        grid = [[dataclasses.replace(st, instances=p) for st in base] for p in points]
        return Plan("instances", points, labels, grid)
    return Plan(None, [base[0].cpu_gib], labels, [base])


def _fleet_size(args: argparse.Namespace) -> int:
    """The most instances any run has."""
    return max(args.sweep_instances) if args.sweep_instances else args.instances or 1


def _compared(args: argparse.Namespace) -> list[Setting]:
    prompt_only = not args.offload_decode
    policy = args.eviction_policy or "lru"
    n, router = args.instances or 1, args.router or "round-robin"
    cpu_gib = args.cpu_gib or DEFAULT_CPU_GIB

    def setting(
        label: str,
        prompt_only: bool,
        policy: str,
        n: int,
        router: str,
        remote_gib: float | None = args.remote_gib,
        disk_gib: float | None = args.disk_gib,
    ) -> Setting:
        return Setting(label, prompt_only, policy, n, router, cpu_gib, remote_gib, disk_gib)

    if args.compare == "offload_prompt_only":
        if args.offload_decode:
            raise UsageError("--offload-decode contradicts --compare offload_prompt_only")
        # The baseline first: the change column then reads as what prompt-only does.
        return [
            setting("prompt-only off", False, policy, n, router),
            setting("prompt-only on", True, policy, n, router),
        ]
    if args.compare == "eviction_policy":
        if args.eviction_policy:
            raise UsageError("--eviction-policy contradicts --compare eviction_policy")
        return [setting(p, prompt_only, p, n, router) for p in POLICY_NAMES]
    if args.compare == "instances":
        if args.sweep_instances is not None:
            raise UsageError(
                "--compare instances and --sweep-instances are exclusive (the sweep already "
                "compares instance counts)"
            )
        if n < 2:
            raise UsageError("--compare instances needs --instances N of 2 or more (vs 1)")
        return [
            setting("1 instance", prompt_only, policy, 1, router),
            setting(f"{n} instances", prompt_only, policy, n, router),
        ]
    if args.compare == "router":
        if args.router:
            raise UsageError("--router contradicts --compare router")
        if _fleet_size(args) < 2:
            raise UsageError(
                "--compare router needs --instances N of 2 or more (or a --sweep-instances "
                "count of 2 or more)"
            )
        return [setting(r, prompt_only, policy, n, r) for r in ROUTERS]
    if args.compare == "shared_tier":
        if args.remote_gib is None:
            raise UsageError("--compare shared_tier needs --remote-gib (the shared tier's size)")
        return [
            setting("no shared tier", prompt_only, policy, n, router, None),
            setting("shared tier", prompt_only, policy, n, router),
        ]
    if args.compare == "disk_tier":
        if args.disk_gib is None:
            raise UsageError("--compare disk_tier needs --disk-gib (the disk tier's size)")
        return [
            setting("no disk tier", prompt_only, policy, n, router, disk_gib=None),
            setting("disk tier", prompt_only, policy, n, router),
        ]
    return [setting("result", prompt_only, policy, n, router)]


def _check_plot(path: str) -> None:
    target = Path(path)
    if not target.name or target.is_dir():
        raise UsageError(f"--plot {path!r}: expected a file name (e.g. sweep.png)")
    parent = target.parent
    if not parent.is_dir():
        raise UsageError(f"--plot {path}: {str(parent)!r} is not a directory")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"--plot {path}: directory {str(parent)!r} is not writable")
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib: pip install 'kvoffload[plot]'")


def _check_combinations(args: argparse.Namespace) -> None:
    if args.sweep_cpu_gib is not None and args.cpu_gib is not None:
        raise UsageError("--cpu-gib and --sweep-cpu-gib are exclusive")
    if args.sweep_instances is not None:
        if args.instances is not None:
            raise UsageError("--instances and --sweep-instances are exclusive")
        if args.sweep_cpu_gib is not None:
            raise UsageError("--sweep-cpu-gib and --sweep-instances are exclusive: sweep one")
    if args.plot is not None:
        if args.sweep_cpu_gib is None and args.sweep_instances is None:
            raise UsageError(
                "--plot needs --sweep-cpu-gib or --sweep-instances (it plots the sweep)"
            )
        _check_plot(args.plot)
    if args.remote_gib is None:
        for name in ("remote_gbps", "remote_latency_ms", "remote_nodes", "remote_node_gbps"):
            if getattr(args, name) is not None:
                raise UsageError(f"--{name.replace('_', '-')} needs --remote-gib")
    elif args.verify_data:
        raise UsageError(
            "--verify-data cannot be combined with --remote-gib: the shared tier moves no bytes"
        )
    if args.disk_gib is None:
        for name in ("disk_gbps", "disk_latency_ms"):
            if getattr(args, name) is not None:
                raise UsageError(f"--{name.replace('_', '-')} needs --disk-gib")
    elif args.verify_data:
        raise UsageError(
            "--verify-data cannot be combined with --disk-gib: the disk tier moves no bytes"
        )
    if args.tier_weights is not None:
        if args.router != "tier-aware" and args.compare != "router":
            raise UsageError(
                "--tier-weights needs --router tier-aware (or --compare router): only that "
                "router weights the tiers"
            )
        for tier, size in (("disk", args.disk_gib), ("shared", args.remote_gib)):
            if tier in args.tier_weights and size is None:
                flag = "--disk-gib" if tier == "disk" else "--remote-gib"
                raise UsageError(f"--tier-weights {tier}=... needs {flag}: there is no {tier} tier")
    for given, name in ((args.per_instance, "--per-instance"), (args.router, "--router")):
        if given and _fleet_size(args) < 2:
            raise UsageError(
                f"{name} needs --instances N of 2 or more (or a --sweep-instances count of 2 "
                "or more)"
            )
