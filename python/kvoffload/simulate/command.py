"""`kvoffload simulate`: the workload it replays, the size checks, and the runs that print the
table (`flags.py` defines the flags, `runs.py` which runs they ask for)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

from kvoffload._docs import docs_url
from kvoffload.scheduler import OffloadConfig
from kvoffload.simulate.flags import UsageError, flag, workload_fields
from kvoffload.simulate.fleet import FleetResult, simulate_fleet
from kvoffload.simulate.instance import DataCheck, EngineConfig
from kvoffload.simulate.models import DEFAULT_MODEL, MODELS, SPEED_FLAGS, model_speeds
from kvoffload.simulate.report import (
    TIERS,
    SimResult,
    header,
    instance_table,
    sweep_table,
    table,
    title,
)
from kvoffload.simulate.reuse import bound_line, prefix_reuse_bound, unchanged_note
from kvoffload.simulate.routers import TierWeights
from kvoffload.simulate.runs import Plan, Setting, plan
from kvoffload.simulate.shared_tier import SharedTierConfig, disk_tier
from kvoffload.simulate.trace import (
    Trace,
    TraceError,
    TraceOptions,
    load_trace,
    recorded_block_tokens,
)
from kvoffload.simulate.verify import PAGE_BYTES
from kvoffload.simulate.workloads import WORKLOADS, Request, SimRequest, Workload, describe

SIMULATE_HELP = f"""\
Replays a workload through the real offload scheduler and CPU-tier store around a model of a
vLLM engine (no GPU, no vLLM) and prints what the CPU tier saves and costs, on one engine or a
fleet behind a router. `--compare` puts two settings side by side, `--sweep-cpu-gib` sizes the
tier, `--sweep-instances` the fleet. {docs_url("simulator")} explains the model, the trace
formats and how to read the table.

Exit codes: 0 done, 1 `--verify-data` found wrong bytes (or the output could not be written),
2 a usage error (the message names the flag and what it allows)."""

_MAX_SLOTS = 1 << 22
"""The simulator keeps per-slot state in memory: 4M slots is plenty."""
_MAX_TOKENS = 1 << 26
"""Prompt and output tokens of a whole generated workload (held at once, 4 bytes each)."""
_MAX_BLOCKS = 1 << 22
"""Full blocks of all requests together: each keeps a 32-byte hash object (about 100 bytes)."""
_MAX_VERIFY_BYTES = 1 << 30
"""The CPU pool `--verify-data` allocates: 64 bytes per block of every slot."""
_TRACE_FLAGS = ("trace_format", "hash_block_tokens", "time_scale", "start", "limit")


def _workload(args: argparse.Namespace) -> tuple[list[SimRequest] | Trace, dict[str, Any]]:
    given = {n for n in workload_fields() if getattr(args, n) is not None}
    trace_flags = [flag(n) for n in _TRACE_FLAGS if getattr(args, n) is not None]
    if args.trace is not None:
        if args.workload is not None or given:
            flags = ["--workload"] * (args.workload is not None) + [flag(n) for n in sorted(given)]
            raise UsageError(f"{', '.join(flags)} cannot be combined with --trace")
        options = TraceOptions(
            format=args.trace_format,
            hash_block_tokens=args.hash_block_tokens or recorded_block_tokens(args.trace) or 512,
            time_scale=args.time_scale or 1.0,
            start=args.start or 0.0,
            limit=args.limit,
            seed=args.seed,
        )
        try:
            trace = load_trace(args.trace, options)
        except TraceError as e:
            raise UsageError(str(e)) from None
        if args.hash_block_tokens is not None and trace.format == "kvoffload":
            raise UsageError(
                f"--hash-block-tokens applies to hash-ids traces only; {args.trace} is in the "
                "kvoffload format"
            )
        info = {"trace": args.trace, "requests": len(trace), "seed": args.seed}
        if trace.format != "kvoffload" or trace_flags:
            info |= {
                "format": trace.format,
                **(
                    {"hash_block_tokens": options.hash_block_tokens}
                    if trace.format != "kvoffload"
                    else {}
                ),
                "time_scale": options.time_scale,
                "start": options.start,
                "limit": options.limit,
            }
        return trace, info
    if trace_flags:
        raise UsageError(f"{', '.join(trace_flags)} needs --trace")
    cls = WORKLOADS[args.workload or "reasoning-chat"]
    own = {f.name for f in dataclasses.fields(cls)}
    if given - own:
        foreign = ", ".join(flag(n) for n in sorted(given - own))
        allowed = ", ".join(flag(n) for n in sorted(own))
        raise UsageError(f"{foreign} does not apply to --workload {cls.name} (it takes {allowed})")
    workload: Workload = cls(**{n: getattr(args, n) for n in given})
    if workload.num_tokens() > _MAX_TOKENS:
        raise UsageError(
            f"{describe(workload)} makes {workload.num_tokens():,} tokens; the simulator takes "
            f"at most {_MAX_TOKENS:,}: use fewer or smaller requests"
        )
    info = {"name": cls.name, **dataclasses.asdict(workload), "seed": args.seed}
    return workload.requests(args.seed), info


def _with_caps(
    requests: list[SimRequest] | Trace, args: argparse.Namespace
) -> list[SimRequest] | Trace:
    caps = {
        k: v
        for k, v in (
            ("max_load_tokens", args.max_load_tokens),
            ("max_offload_tokens", args.max_offload_tokens),
        )
        if v is not None
    }
    if isinstance(requests, Trace):
        return requests.with_params(caps)
    if not caps:
        return requests
    return [
        dataclasses.replace(r, kv_transfer_params={**caps, **(r.kv_transfer_params or {})})
        for r in requests
    ]


def _check_slots(flag: str, cpu_gib: float, bytes_per_chunk: int) -> int:
    slots = int(cpu_gib * 2**30) // bytes_per_chunk
    if slots < 1:
        raise UsageError(
            f"{flag} {cpu_gib:g} holds no chunk: one chunk is {bytes_per_chunk:,} bytes "
            f"({bytes_per_chunk / 2**30:.4g} GiB)"
        )
    if slots > _MAX_SLOTS:
        raise UsageError(
            f"{flag} {cpu_gib:g} makes {slots:,} chunks of {bytes_per_chunk:,} bytes; the "
            f"simulator takes at most {_MAX_SLOTS:,}: raise --blocks-per-chunk"
        )
    return slots


def _check_flags(args: argparse.Namespace) -> None:
    """Optional dependencies (`runs.py` checks how the flags combine, `EngineConfig` how the
    engine's do)."""
    if args.verify_data and importlib.util.find_spec("torch") is None:
        raise UsageError("--verify-data needs torch: pip install 'kvoffload[torch]'")


def _speeds(args: argparse.Namespace) -> dict[str, float]:
    """`SPEED_FLAGS`: each flag given, else `--model`'s; `--kv-bytes-per-token` names no model,
    so the speeds not given stay the default model's, with a warning."""
    d = EngineConfig()
    reference = {name: getattr(d, name) for name in SPEED_FLAGS}
    given = {name: getattr(args, name) for name in SPEED_FLAGS if getattr(args, name) is not None}
    if args.kv_bytes_per_token is None:
        return model_speeds(args.model or DEFAULT_MODEL, reference) | given
    missing = [flag(name) for name in SPEED_FLAGS if name not in given]
    if missing:
        write_error(
            f"kvoffload simulate: warning: --kv-bytes-per-token changes only the KV size: "
            f"{', '.join(missing)} stay {DEFAULT_MODEL}'s on one H200 (use --model, or give "
            "them for your model)"
        )
    return reference | given


def _check_sizes(requests: list[SimRequest] | Trace, engine: EngineConfig, tpb: int) -> None:
    if isinstance(requests, Trace):  # streamed: only the live requests' blocks are held
        tokens, rid = requests.largest
        need = -(-(tokens - 1) // tpb)
    else:
        blocks = sum((len(r.prompt) + len(r.output)) // tpb for r in requests)
        if blocks > _MAX_BLOCKS:
            raise UsageError(
                f"the workload makes {blocks:,} blocks of --tokens-per-block {tpb}; the "
                f"simulator takes at most {_MAX_BLOCKS:,}: use fewer or smaller requests, or "
                "larger blocks"
            )
        need, rid = engine.largest(requests, tpb)
    if need > engine.gpu_blocks:
        raise UsageError(
            f"--gpu-blocks {engine.gpu_blocks} is too small: request {rid!r} needs {need:,} "
            f"blocks of {tpb} tokens (the most of any request)"
        )


def _progress(total: int, args: argparse.Namespace) -> Any:
    try:
        from tqdm import tqdm  # type: ignore[import-untyped]
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return None
    on_tty = sys.stderr is not None and sys.stderr.isatty()
    off = args.quiet or args.json or not on_tty
    return tqdm(total=total, disable=off, delay=1.0, unit="req", file=sys.stderr, leave=False)


def write_error(message: str) -> None:
    """Writes to stderr, if there is one."""
    if sys.stderr is not None:
        sys.stderr.write(message + "\n")


class RunFailed(Exception):
    """The run could not finish: stdout could not be written (other than a reader that left),
    or the trace changed after it was checked: exit code 1."""


def _emit(text: str) -> None:
    """Prints; a reader that went away (`| head`) or a closed stdout ends the output quietly."""
    if sys.stdout is None:
        return
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        # Python would complain again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except OSError as e:
        raise RunFailed(f"cannot write the output: {e.strerror or e}") from None


def run(args: argparse.Namespace) -> int:
    """Runs `kvoffload simulate`; raises `UsageError` / `RunFailed` for the caller to report."""
    _check_flags(args)
    runs = plan(args)
    model = args.model or DEFAULT_MODEL
    kv_bytes = args.kv_bytes_per_token or MODELS[model]
    bytes_per_chunk = kv_bytes * args.tokens_per_block * args.blocks_per_chunk
    size_flag = "--sweep-cpu-gib" if runs.axis == "cpu_gib" else "--cpu-gib"
    slots = {
        st.cpu_gib: _check_slots(size_flag, st.cpu_gib, bytes_per_chunk) for st in runs.cells()
    }
    remote = None
    if args.remote_gib is not None:
        d = SharedTierConfig(1)
        nodes = args.remote_nodes or 1
        remote = SharedTierConfig(
            _check_slots("--remote-gib", args.remote_gib, bytes_per_chunk) * nodes,
            gbps=d.gbps if args.remote_gbps is None else args.remote_gbps,
            latency_ms=d.latency_ms if args.remote_latency_ms is None else args.remote_latency_ms,
            seed=args.seed,
            nodes=nodes,
            node_gbps=args.remote_node_gbps,
        )
    disk = None
    if args.disk_gib is not None:
        disk = disk_tier(
            _check_slots("--disk-gib", args.disk_gib, bytes_per_chunk),
            gbps=args.disk_gbps,
            latency_ms=args.disk_latency_ms,
            seed=args.seed,
        )
    # The tiers behind the CPU tier some run has: only their rows and fields are shown, so that
    # without them the output is as it was.
    tiers = [t for t, config in (("disk", disk), ("remote", remote)) if config is not None]
    weights = TierWeights(**(args.tier_weights or {}))
    if args.verify_data:
        pool = max(slots.values()) * args.blocks_per_chunk * PAGE_BYTES
        if pool > _MAX_VERIFY_BYTES:
            raise UsageError(
                f"--verify-data would allocate a {pool / 2**30:.1f} GiB CPU pool (64 bytes per "
                f"block of every slot); at most {_MAX_VERIFY_BYTES >> 30} GiB: use a smaller "
                f"{size_flag} or larger chunks"
            )
    try:
        engine = EngineConfig(
            gpu_blocks=args.gpu_blocks,
            max_running=args.max_running,
            max_batched_tokens=args.max_batched_tokens,
            pcie_gbps=args.pcie_gbps,
            hbm_gbps=args.hbm_gbps,
            **_speeds(args),
        )
    except ValueError as e:  # each value passed its flag's check: their combination did not
        raise UsageError(re.sub(r"(\w+)=", lambda m: flag(m[1]) + " ", str(e))) from None
    requests, workload_info = _workload(args)
    _check_sizes(requests, engine, args.tokens_per_block)
    requests = _with_caps(requests, args)
    try:
        bound = prefix_reuse_bound(requests, args.tokens_per_block)
    except TraceError as e:  # the file changed since `load_trace` checked it
        raise RunFailed(str(e)) from None
    engine_info = {
        **dataclasses.asdict(engine),
        "model": None if args.kv_bytes_per_token else model,
        "kv_bytes_per_token": kv_bytes,
        "tokens_per_block": args.tokens_per_block,
        "blocks_per_chunk": args.blocks_per_chunk,
        "bytes_per_chunk": bytes_per_chunk,
        "max_load_tokens": args.max_load_tokens,
        "max_offload_tokens": args.max_offload_tokens,
    }
    if disk is not None:
        engine_info |= {
            "disk_gib": args.disk_gib,
            "disk_chunks": disk.capacity,
            "disk_gbps": disk.gbps,
            "disk_latency_ms": disk.latency_ms,
        }
    if remote is not None:
        engine_info |= {
            "remote_gib": args.remote_gib,
            "remote_chunks": remote.capacity,
            "remote_gbps": remote.gbps,
            "remote_latency_ms": remote.latency_ms,
        }
        if remote.nodes > 1 or remote.node_gbps is not None:
            engine_info |= {"remote_nodes": remote.nodes, "remote_node_gbps": remote.node_gbps}
    bar = _progress(len(requests) * len(runs.cells()), args)
    try:
        grid = [
            [
                _run(
                    requests,
                    engine,
                    bytes_per_chunk,
                    slots[st.cpu_gib],
                    remote if st.remote_gib is not None else None,
                    disk if st.disk_gib is not None else None,
                    st,
                    args,
                    bar,
                    weights,
                )
                for st in row
            ]
            for row in runs.grid
        ]
    except TraceError as e:  # the file changed since `load_trace` checked it
        raise RunFailed(str(e)) from None
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        out = {
            "workload": workload_info,
            "engine": engine_info,
            "prefix_reuse_bound_tokens": bound,
            "runs": _json_runs(runs, grid, tiers, weights),
        }
        _emit(json.dumps(out, indent=2, allow_nan=False))
    else:
        _emit(
            _text(runs, grid, workload_info, engine_info, args.per_instance, tiers, weights, bound)
        )
    totals = [[res.fleet for res in row] for row in grid]
    code = 0
    if args.plot is not None:
        from kvoffload.simulate.plot import plot_sweep

        assert runs.axis is not None  # `plan` refuses --plot without a sweep
        try:
            plot_sweep(
                args.plot,
                runs.axis,
                runs.points,
                runs.labels,
                totals,
                title(workload_info, engine_info),
            )
        except OSError as e:
            write_error(
                f"kvoffload simulate: --plot {args.plot}: cannot write it: {e.strerror or e}"
            )
            code = 1
    bad = sum(res.mismatched_blocks for row in totals for res in row)
    if bad:
        write_error(f"kvoffload simulate: --verify-data: {bad} loaded blocks held wrong bytes")
        code = 1
    return code


def _json_runs(
    runs: Plan, grid: list[list[FleetResult]], tiers: Sequence[str], weights: TierWeights
) -> list[dict[str, Any]]:
    """With `tiers` (those some run has behind its CPU tier), each run's sizes of them and
    their counts too; a fleet's run its load balance, and a tier-aware one its weights."""
    fleets = runs.fleet() is not None
    return [
        {
            "label": st.label,
            "cpu_gib": st.cpu_gib,
            "offload_prompt_only": st.offload_prompt_only,
            "eviction_policy": st.eviction_policy,
            **({"instances": st.instances, "router": st.router} if fleets else {}),
            **(
                {"tier_weights": _shown_weights(weights, tiers)}
                if st.router == "tier-aware" and fleets
                else {}
            ),
            **{f"{t}_gib": getattr(st, f"{t}_gib") for t in tiers},
            "result": _json_result(res.fleet, tiers, fleet=st.instances > 1),
            **(
                {"per_instance": [_json_result(r, tiers) for r in res.instances]}
                if st.instances > 1
                else {}
            ),
        }
        for settings, row in zip(runs.grid, grid, strict=True)
        for st, res in zip(settings, row, strict=True)
    ]


_TIER_FIELDS = ("hit_tokens", "bytes_read", "bytes_written", "evictions")
"""A tier's fields of `SimResult`, each under its name (`disk_hit_tokens`, ...)."""


def _shown_weights(weights: TierWeights, tiers: Sequence[str]) -> dict[str, float]:
    """The weights of the tiers the fleet has (`tiers`: those behind the CPU tier)."""
    have = {"gpu", "cpu", *("shared" if t == "remote" else t for t in tiers)}
    return {k: v for k, v in dataclasses.asdict(weights).items() if k in have}


def _json_result(res: SimResult, tiers: Sequence[str], fleet: bool = False) -> dict[str, Any]:
    """With `fleet` (a run of several instances), how evenly they were loaded."""
    out = dataclasses.asdict(res)
    if not fleet:
        del out["load_max_over_mean"]
    for tier in TIERS:
        if tier not in tiers:
            for name in _TIER_FIELDS:
                del out[f"{tier}_{name}"]
    return {
        **out,
        "cpu_hit_rate": res.cpu_hit_rate,
        "gpu_hit_rate": res.gpu_hit_rate,
        **{f"{t}_hit_rate": getattr(res, f"{t}_hit_rate") for t in tiers},
    }


def _text(
    runs: Plan,
    grid: list[list[FleetResult]],
    workload_info: dict[str, Any],
    engine_info: dict[str, Any],
    per_instance: bool,
    tiers: Sequence[str],
    weights: TierWeights,
    bound: int,
) -> str:
    """The header with the workload's prefix-reuse `bound`, the table (or the sweep's), why
    compared settings hit the same if they do, and with `per_instance` one table per fleet;
    with `tiers` (those some run has behind its CPU tier), their rows and columns too."""
    cells = runs.cells()
    sizes = sorted({st.cpu_gib for st in cells})
    policies = sorted({st.eviction_policy for st in cells})
    fleet = runs.fleet()
    shown = None
    if fleet is not None and any(st.router == "tier-aware" for st in cells):
        shown = ", ".join(f"{k} {v:g}" for k, v in _shown_weights(weights, tiers).items())
    totals = [[res.fleet for res in row] for row in grid]
    prompt_tokens = totals[0][0].prompt_tokens
    tpb = engine_info["tokens_per_block"]
    reuse = bound_line(bound, prompt_tokens, tpb)
    out = [header(workload_info, engine_info, sizes, policies, fleet, shown, reuse)]
    if runs.axis is None:
        note = unchanged_note(
            runs.labels, totals[0], bound, _larger(workload_info), runs.cells()[0].cpu_gib
        )
        out.append(table(runs.labels, totals[0], tiers, fleet is not None, note))
    else:
        out.append(
            sweep_table(runs.axis, runs.points, runs.labels, totals, tiers, fleet is not None)
        )
    if per_instance:
        for settings, row in zip(runs.grid, grid, strict=True):
            for st, res in zip(settings, row, strict=True):
                if st.instances > 1:
                    what = [st.label] * (len(runs.labels) > 1)
                    what += [f"{st.instances} instances"] * (runs.axis == "instances")
                    what.append(f"{st.cpu_gib:g} GiB")
                    out.append(
                        f"\nper instance ({', '.join(what)}):\n"
                        + instance_table(res.instances, tiers)
                    )
    return "\n".join(out)


def _larger(workload_info: dict[str, Any]) -> str:
    """A workload 4x the size of this one, for a hint: its first size flag (the number of
    conversations, prefixes or agents) 4x larger."""
    if "trace" in workload_info:
        return "a longer trace"
    name = dataclasses.fields(WORKLOADS[workload_info["name"]])[0].name
    return f"a larger workload (e.g. {flag(name)} {workload_info[name] * 4})"


def _run(
    requests: Sequence[Request] | Trace,
    engine: EngineConfig,
    bytes_per_chunk: int,
    num_slots: int,
    remote: SharedTierConfig | None,
    disk: SharedTierConfig | None,
    setting: Setting,
    args: argparse.Namespace,
    bar: Any,
    weights: TierWeights,
) -> FleetResult:
    config = OffloadConfig(
        tokens_per_block=args.tokens_per_block,
        blocks_per_chunk=args.blocks_per_chunk,
        cpu_bytes_to_use=int(setting.cpu_gib * 2**30),
        offload_prompt_only=setting.offload_prompt_only,
        eviction_policy=setting.eviction_policy,
    )
    checks: list[DataCheck] = []

    def data() -> DataCheck | None:
        if not args.verify_data:
            return None
        from kvoffload.simulate.verify import TransferDataCheck

        checks.append(TransferDataCheck(engine.gpu_blocks, num_slots, config.blocks_per_chunk))
        return checks[-1]

    try:
        return simulate_fleet(
            requests,
            engine,
            config,
            bytes_per_chunk,
            instances=setting.instances,
            router=setting.router,
            data=data,
            on_finish=(lambda: bar.update(1)) if bar is not None else (lambda: None),
            remote=remote,
            disk=disk,
            tier_weights=weights,
        )
    finally:
        for check in checks:
            check.close()
