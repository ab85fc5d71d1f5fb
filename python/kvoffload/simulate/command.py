"""`kvoffload simulate`: its flags, their checks, and the run that prints the table."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvoffload.scheduler import OffloadConfig
from kvoffload.simulate.engine import EngineConfig, simulate
from kvoffload.simulate.models import DEFAULT_MODEL, MODELS
from kvoffload.simulate.report import SimResult, header, sweep_table, table, title
from kvoffload.simulate.trace import TraceError, load_trace
from kvoffload.simulate.verify import PAGE_BYTES
from kvoffload.simulate.workloads import WORKLOADS, SimRequest, Workload, describe
from kvoffload.store import POLICY_NAMES

SIMULATE_HELP = """\
Replays a workload through the real offload scheduler and CPU-tier store around a model of a
vLLM engine (no GPU, no vLLM) and prints what the CPU tier saves and costs. `--compare` puts
two settings side by side, `--sweep-cpu-gib` sizes the tier. The README's "Simulator" section
explains the model, the trace format and how to read the table.

Exit codes: 0 done, 1 `--verify-data` found wrong bytes (or the output could not be written),
2 a usage error (the message names the flag and what it allows)."""

_MAX_GPU_BLOCKS = 1 << 22
_MAX_SLOTS = 1 << 22
"""The simulator keeps per-block and per-slot state in memory: 4M of each is plenty."""
_MAX_TOKENS = 1 << 26
"""Prompt and output tokens of a whole workload (4 bytes each)."""
_MAX_BLOCKS = 1 << 22
"""Full blocks of all requests together: each keeps a 32-byte hash object (about 100 bytes)."""
_MAX_VERIFY_BYTES = 1 << 30
"""The CPU pool `--verify-data` allocates: 64 bytes per block of every slot."""
_COUNT_MAX = 1 << 20
COMPARISONS = ("offload_prompt_only", "eviction_policy")


class UsageError(Exception):
    """A bad flag or flag combination: exit code 2."""


def _int_in(lo: int, hi: int) -> Callable[[str], int]:
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


def _sizes(text: str) -> list[float]:
    parts = [p.strip() for p in text.split(",")]
    try:
        sizes = [_positive(p) for p in parts]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated sizes in GiB, each a finite number > 0, got {text!r}"
        ) from None
    if len(set(sizes)) != len(sizes) or not 1 <= len(sizes) <= 16:
        raise argparse.ArgumentTypeError(f"expected 1 to 16 distinct sizes, got {text!r}")
    return sorted(sizes)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@functools.cache
def _workload_fields() -> dict[str, dict[str, Any]]:
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
        help="replay these requests instead; format in the README ('Simulator')",
    )
    w.add_argument("--seed", type=_int_in(0, 2**63 - 1), default=0, help="default: 0")
    for name, f in _workload_fields().items():
        defaults = ", ".join(f"{k} {v}" for k, v in f["defaults"].items())
        w.add_argument(
            _flag(name),
            type=_int_in(f["min"], _COUNT_MAX),
            metavar="N",
            help=f"{f['help']} (default: {defaults})",
        )

    e = s.add_argument_group("engine model")
    d = EngineConfig()
    kv = e.add_mutually_exclusive_group()
    kv.add_argument(
        "--model",
        choices=list(MODELS),
        help=f"sets the KV bytes per token (default: {DEFAULT_MODEL}, bf16)",
    )
    kv.add_argument(
        "--kv-bytes-per-token",
        type=_int_in(1, 1 << 30),
        metavar="N",
        help="KV bytes per token over all layers, instead of --model",
    )
    e.add_argument(
        "--tokens-per-block", type=_int_in(1, 4096), default=16, metavar="N", help="default: 16"
    )
    e.add_argument(
        "--blocks-per-chunk",
        type=_int_in(1, 4096),
        default=1,
        metavar="N",
        help="GPU blocks per offloaded chunk (default: 1)",
    )
    engine_flags: list[tuple[str, Callable[[str], Any], str]] = [
        ("gpu_blocks", _int_in(1, _MAX_GPU_BLOCKS), "GPU KV-cache blocks"),
        ("max_running", _int_in(1, 1 << 16), "requests running at once"),
        ("max_batched_tokens", _int_in(1, 1 << 24), "tokens per step (chunked prefill)"),
        ("pcie_gbps", _float_in(0.01, 10_000), "GB/s per direction"),
        ("prefill_tokens_per_s", _float_in(1, 1e9), "prompt tokens computed per second"),
        ("decode_step_ms", _float_in(0.001, 1e6), "time of a step without prompt tokens"),
    ]
    for name, parse, help in engine_flags:
        e.add_argument(
            _flag(name),
            type=parse,
            default=getattr(d, name),
            metavar="N",
            help=f"{help} (default: {getattr(d, name):g})",
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
        type=_int_in(0, 2**63 - 1),
        metavar="N",
        help="kv_transfer_params cap for every request (a trace line's own value wins)",
    )
    o.add_argument(
        "--max-offload-tokens",
        type=_int_in(0, 2**63 - 1),
        metavar="N",
        help="kv_transfer_params cap on the tokens stored, for every request (likewise)",
    )

    r = s.add_argument_group("runs and output")
    r.add_argument("--compare", choices=COMPARISONS, help="run both values side by side")
    r.add_argument(
        "--sweep-cpu-gib",
        type=_sizes,
        metavar="LIST",
        help="run each CPU tier size, e.g. 1,2,4,8,16",
    )
    r.add_argument("--plot", metavar="FILE.png", help="with --sweep-cpu-gib: plot it (matplotlib)")
    r.add_argument(
        "--verify-data",
        action="store_true",
        help="move real bytes with the transfer engine in CPU mode and check every load (torch)",
    )
    r.add_argument("--json", action="store_true", help="print only machine-readable JSON")
    r.add_argument("--quiet", action="store_true", help="no progress bar")


@dataclass(frozen=True)
class _Setting:
    label: str
    offload_prompt_only: bool
    eviction_policy: str


def _settings(args: argparse.Namespace) -> list[_Setting]:
    prompt_only = not args.offload_decode
    policy = args.eviction_policy or "lru"
    if args.compare == "offload_prompt_only":
        if args.offload_decode:
            raise UsageError("--offload-decode contradicts --compare offload_prompt_only")
        # The baseline first: the change column then reads as what prompt-only does.
        return [
            _Setting("prompt-only off", False, policy),
            _Setting("prompt-only on", True, policy),
        ]
    if args.compare == "eviction_policy":
        if args.eviction_policy:
            raise UsageError("--eviction-policy contradicts --compare eviction_policy")
        return [_Setting(p, prompt_only, p) for p in POLICY_NAMES]
    return [_Setting("result", prompt_only, policy)]


def _workload(args: argparse.Namespace) -> tuple[list[SimRequest], dict[str, Any]]:
    given = {n for n in _workload_fields() if getattr(args, n) is not None}
    if args.trace is not None:
        if args.workload is not None or given:
            flags = ["--workload"] * (args.workload is not None) + [_flag(n) for n in sorted(given)]
            raise UsageError(f"{', '.join(flags)} cannot be combined with --trace")
        try:
            requests = load_trace(args.trace, seed=args.seed, max_tokens=_MAX_TOKENS)
        except TraceError as e:
            raise UsageError(str(e)) from None
        return requests, {"trace": args.trace, "requests": len(requests), "seed": args.seed}
    cls = WORKLOADS[args.workload or "reasoning-chat"]
    own = {f.name for f in dataclasses.fields(cls)}
    if given - own:
        foreign = ", ".join(_flag(n) for n in sorted(given - own))
        allowed = ", ".join(_flag(n) for n in sorted(own))
        raise UsageError(f"{foreign} does not apply to --workload {cls.name} (it takes {allowed})")
    workload: Workload = cls(**{n: getattr(args, n) for n in given})
    if workload.num_tokens() > _MAX_TOKENS:
        raise UsageError(
            f"{describe(workload)} makes {workload.num_tokens():,} tokens; the simulator takes "
            f"at most {_MAX_TOKENS:,}: use fewer or smaller requests"
        )
    info = {"name": cls.name, **dataclasses.asdict(workload), "seed": args.seed}
    return workload.requests(args.seed), info


def _with_caps(requests: list[SimRequest], args: argparse.Namespace) -> list[SimRequest]:
    caps = {
        k: v
        for k, v in (
            ("max_load_tokens", args.max_load_tokens),
            ("max_offload_tokens", args.max_offload_tokens),
        )
        if v is not None
    }
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


def _check_flags(args: argparse.Namespace) -> None:
    """What no single flag's parser can see: combinations and optional dependencies."""
    if args.plot is not None:
        if args.sweep_cpu_gib is None:
            raise UsageError("--plot needs --sweep-cpu-gib (it plots the sweep)")
        _check_plot(args.plot)
    if args.verify_data and importlib.util.find_spec("torch") is None:
        raise UsageError("--verify-data needs torch: pip install 'kvoffload[torch]'")
    if args.sweep_cpu_gib is not None and args.cpu_gib is not None:
        raise UsageError("--cpu-gib and --sweep-cpu-gib are exclusive")
    if args.max_batched_tokens < args.max_running:
        raise UsageError(
            f"--max-batched-tokens {args.max_batched_tokens} is less than --max-running "
            f"{args.max_running}: every running request decodes one token a step (vLLM refuses "
            "this too)"
        )


def _check_sizes(requests: Sequence[SimRequest], engine: EngineConfig, tpb: int) -> None:
    blocks = sum((len(r.prompt) + len(r.output)) // tpb for r in requests)
    if blocks > _MAX_BLOCKS:
        raise UsageError(
            f"the workload makes {blocks:,} blocks of --tokens-per-block {tpb}; the simulator "
            f"takes at most {_MAX_BLOCKS:,}: use fewer or smaller requests, or larger blocks"
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


class OutputGone(Exception):
    """stdout could not be written (other than a reader that left): exit code 1."""


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
        raise OutputGone(f"cannot write the output: {e.strerror or e}") from None


def run(args: argparse.Namespace) -> int:
    """Runs `kvoffload simulate`; raises `UsageError` / `OutputGone` for the caller to report."""
    _check_flags(args)
    settings = _settings(args)
    sizes = args.sweep_cpu_gib or [args.cpu_gib or 8.0]
    size_flag = "--sweep-cpu-gib" if args.sweep_cpu_gib else "--cpu-gib"
    model = args.model or DEFAULT_MODEL
    kv_bytes = args.kv_bytes_per_token or MODELS[model]
    bytes_per_chunk = kv_bytes * args.tokens_per_block * args.blocks_per_chunk
    slots = {size: _check_slots(size_flag, size, bytes_per_chunk) for size in sizes}
    if args.verify_data:
        pool = max(slots.values()) * args.blocks_per_chunk * PAGE_BYTES
        if pool > _MAX_VERIFY_BYTES:
            raise UsageError(
                f"--verify-data would allocate a {pool / 2**30:.1f} GiB CPU pool (64 bytes per "
                f"block of every slot); at most {_MAX_VERIFY_BYTES >> 30} GiB: use a smaller "
                f"{size_flag} or larger chunks"
            )
    engine = EngineConfig(
        gpu_blocks=args.gpu_blocks,
        max_running=args.max_running,
        max_batched_tokens=args.max_batched_tokens,
        pcie_gbps=args.pcie_gbps,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        decode_step_ms=args.decode_step_ms,
    )
    requests, workload_info = _workload(args)
    _check_sizes(requests, engine, args.tokens_per_block)
    requests = _with_caps(requests, args)
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
    bar = _progress(len(requests) * len(sizes) * len(settings), args)
    grid: list[list[SimResult]] = []
    try:
        for size in sizes:
            row = []
            for st in settings:
                config = OffloadConfig(
                    tokens_per_block=args.tokens_per_block,
                    blocks_per_chunk=args.blocks_per_chunk,
                    cpu_bytes_to_use=int(size * 2**30),
                    offload_prompt_only=st.offload_prompt_only,
                    eviction_policy=st.eviction_policy,
                )
                row.append(_run(requests, engine, config, bytes_per_chunk, slots[size], args, bar))
            grid.append(row)
    finally:
        if bar is not None:
            bar.close()
    labels = [st.label for st in settings]
    if args.json:
        runs = [
            {
                "label": st.label,
                "cpu_gib": size,
                "offload_prompt_only": st.offload_prompt_only,
                "eviction_policy": st.eviction_policy,
                "result": {
                    **dataclasses.asdict(res),
                    "cpu_hit_rate": res.cpu_hit_rate,
                    "gpu_hit_rate": res.gpu_hit_rate,
                },
            }
            for size, row in zip(sizes, grid, strict=True)
            for st, res in zip(settings, row, strict=True)
        ]
        out = {"workload": workload_info, "engine": engine_info, "runs": runs}
        _emit(json.dumps(out, indent=2, allow_nan=False))
    else:
        policies = sorted({st.eviction_policy for st in settings})
        _emit(header(workload_info, engine_info, sizes, policies))
        if args.sweep_cpu_gib is None:
            _emit(table(labels, grid[0]))
        else:
            _emit(sweep_table(sizes, labels, grid))
    code = 0
    if args.plot is not None:
        from kvoffload.simulate.plot import plot_sweep

        try:
            plot_sweep(args.plot, sizes, labels, grid, title(workload_info, engine_info))
        except OSError as e:
            write_error(
                f"kvoffload simulate: --plot {args.plot}: cannot write it: {e.strerror or e}"
            )
            code = 1
    bad = sum(res.mismatched_blocks for row in grid for res in row)
    if bad:
        write_error(f"kvoffload simulate: --verify-data: {bad} loaded blocks held wrong bytes")
        code = 1
    return code


def _run(
    requests: Sequence[SimRequest],
    engine: EngineConfig,
    config: OffloadConfig,
    bytes_per_chunk: int,
    num_slots: int,
    args: argparse.Namespace,
    bar: Any,
) -> SimResult:
    data = None
    if args.verify_data:
        from kvoffload.simulate.verify import TransferDataCheck

        data = TransferDataCheck(engine.gpu_blocks, num_slots, config.blocks_per_chunk)
    try:
        return simulate(
            requests,
            engine,
            config,
            bytes_per_chunk,
            data=data,
            on_finish=(lambda: bar.update(1)) if bar is not None else (lambda: None),
        )
    finally:
        if data is not None:
            data.close()
