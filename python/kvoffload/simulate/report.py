"""What a simulation measured, and how it is printed: one table, side by side when settings are
compared; one row per point of a sweep (CPU-tier sizes or fleet sizes); one per instance."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SimResult:
    requests: int = 0
    prompt_tokens: int = 0
    gpu_hit_tokens: int = 0
    """Prompt tokens found in the GPU prefix cache."""
    cpu_hit_tokens: int = 0
    """Prompt tokens loaded from the CPU tier (not copied there from a tier behind it for it)."""
    disk_hit_tokens: int = 0
    """Prompt tokens copied from the instance's disk tier to the CPU tier, then loaded."""
    remote_hit_tokens: int = 0
    """Prompt tokens copied from the shared tier to the CPU tier, then loaded."""
    recomputed_tokens: int = 0
    """Prompt tokens computed (`prompt = GPU + CPU + disk + remote hits + recomputed`)."""
    chunks_written: int = 0
    decode_chunks_written: int = 0
    """Written chunks holding any token past the prompt."""
    bytes_written: int = 0
    chunks_read: int = 0
    bytes_read: int = 0
    evictions: int = 0
    store_refusals: int = 0
    load_wait_seconds: float = 0.0
    """Requests' time waiting for their loads, summed (other requests compute meanwhile)."""
    load_stall_seconds: float = 0.0
    """Time the GPU had nothing to compute because every runnable request waited for a load."""
    prefill_seconds_saved: float = 0.0
    """GPU time saved: CPU hits at the prefill rate, minus the load stalls."""
    ttft_mean_s: float = 0.0
    ttft_p90_s: float = 0.0
    ttft_p99_s: float = 0.0
    simulated_seconds: float = 0.0
    steps: int = 0
    scheduler_seconds: float = 0.0
    """Real time spent inside the offload scheduler (and store)."""
    disk_bytes_read: int = 0
    """Bytes copied from the disk tier to the CPU tier."""
    disk_bytes_written: int = 0
    """Bytes written from the CPU tier to the disk tier."""
    disk_evictions: int = 0
    """Chunks the disk tier evicted."""
    remote_bytes_read: int = 0
    """Bytes copied from the shared tier to the CPU tier."""
    remote_bytes_written: int = 0
    """Bytes written from the CPU tier to the shared tier."""
    remote_evictions: int = 0
    """Keys the shared tier evicted for this instance's writes."""
    verified_chunks: int = 0
    mismatched_blocks: int = 0
    ignored_params: dict[str, int] = field(default_factory=dict)
    load_max_over_mean: float = 1.0
    """A fleet's busiest instance's requests over the mean per instance: 1.0 is an even spread
    (one engine: 1.0)."""

    @property
    def cpu_hit_rate(self) -> float:
        return self.cpu_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def disk_hit_rate(self) -> float:
        return self.disk_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def remote_hit_rate(self) -> float:
        return self.remote_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def gpu_hit_rate(self) -> float:
        return self.gpu_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def scheduler_us_per_step(self) -> float:
        return self.scheduler_seconds / self.steps * 1e6 if self.steps else 0.0


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f}"


def _tokens(attr: str) -> Callable[[SimResult], tuple[float, str]]:
    def row(r: SimResult) -> tuple[float, str]:
        n = getattr(r, attr)
        share = n / r.prompt_tokens if r.prompt_tokens else 0.0
        return n, f"{n:,} ({share:.1%})"

    return row


# (label, value and its text); the value feeds the change column.
ROWS: list[tuple[str, Callable[[SimResult], tuple[float, str]]]] = [
    ("requests", lambda r: (r.requests, f"{r.requests:,}")),
    ("prompt tokens", lambda r: (r.prompt_tokens, f"{r.prompt_tokens:,}")),
    ("GPU prefix-cache hits", _tokens("gpu_hit_tokens")),
    ("CPU-tier hits", _tokens("cpu_hit_tokens")),
    ("tokens recomputed", _tokens("recomputed_tokens")),
    ("chunks written GPU->CPU", lambda r: (r.chunks_written, f"{r.chunks_written:,}")),
    (
        "  of them past the prompt",
        lambda r: (r.decode_chunks_written, f"{r.decode_chunks_written:,}"),
    ),
    ("GB written GPU->CPU", lambda r: (r.bytes_written, _gb(r.bytes_written))),
    ("GB read CPU->GPU", lambda r: (r.bytes_read, _gb(r.bytes_read))),
    ("evictions", lambda r: (r.evictions, f"{r.evictions:,}")),
    ("store refusals", lambda r: (r.store_refusals, f"{r.store_refusals:,}")),
    (
        "prefill s saved (est.)",
        lambda r: (r.prefill_seconds_saved, f"{r.prefill_seconds_saved:,.1f}"),
    ),
    ("mean TTFT s", lambda r: (r.ttft_mean_s, f"{r.ttft_mean_s:.3f}")),
    ("p90 TTFT s", lambda r: (r.ttft_p90_s, f"{r.ttft_p90_s:.3f}")),
    ("simulated s", lambda r: (r.simulated_seconds, f"{r.simulated_seconds:,.1f}")),
]

MEASURED_ROWS: list[tuple[str, Callable[[SimResult], str]]] = [
    ("scheduler us/step", lambda r: f"{r.scheduler_us_per_step:.1f} ({r.steps:,} steps)"),
]
"""Wall-clock time of this machine, not simulated: printed apart, with no change column (two
runs of the same settings differ by tens of percent)."""
MEASURED_TITLE = "measured on this machine (wall clock, noisy; not simulated):"

FLEET_ROWS: dict[str, list[tuple[str, Callable[[SimResult], tuple[float, str]]]]] = {
    "requests": [
        ("load max/mean", lambda r: (r.load_max_over_mean, f"{r.load_max_over_mean:.2f}")),
    ],
}
"""For a fleet: the rows that follow the named row of `ROWS`."""

TIERS = ("disk", "remote")
"""The tiers behind the CPU tier, in lookup order: an instance's disk, the fleet's shared tier."""
TIER_ROWS: dict[str, dict[str, list[tuple[str, Callable[[SimResult], tuple[float, str]]]]]] = {
    "disk": {
        "CPU-tier hits": [("disk-tier hits", _tokens("disk_hit_tokens"))],
        "GB read CPU->GPU": [
            ("GB read disk->CPU", lambda r: (r.disk_bytes_read, _gb(r.disk_bytes_read))),
            ("GB written CPU->disk", lambda r: (r.disk_bytes_written, _gb(r.disk_bytes_written))),
            ("disk evictions", lambda r: (r.disk_evictions, f"{r.disk_evictions:,}")),
        ],
    },
    "remote": {
        "CPU-tier hits": [("remote-tier hits", _tokens("remote_hit_tokens"))],
        "GB read CPU->GPU": [
            ("GB read remote->CPU", lambda r: (r.remote_bytes_read, _gb(r.remote_bytes_read))),
            (
                "GB written CPU->remote",
                lambda r: (r.remote_bytes_written, _gb(r.remote_bytes_written)),
            ),
            ("remote evictions", lambda r: (r.remote_evictions, f"{r.remote_evictions:,}")),
        ],
    },
}
"""Per tier behind the CPU tier: the rows that follow the named row of `ROWS` where it runs."""


def _change(a: float, b: float) -> str:
    if a == b:
        return "0%"
    if a == 0:
        return "new"
    return f"{(b - a) / abs(a):+.1%}"


def _grid(rows: Sequence[Sequence[str]], right_from: int = 1) -> str:
    """Columns from `right_from` on are right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i < right_from else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    )


def table(
    labels: Sequence[str],
    results: Sequence[SimResult],
    tiers: Sequence[str] = (),
    fleet: bool = False,
    note: str = "",
) -> str:
    """One column per result; with two, a last column of the change from the first (the
    baseline) to the second; with `tiers` (of `TIERS`, those some run has), their rows too, and
    with `fleet` (some run has several instances) how evenly they were loaded. Then `note`, and
    apart from the simulated rows, those measured on this machine."""
    rows = [["", *labels]]
    if len(results) == 2:
        rows[0].append("change")
    extras = [TIER_ROWS[t] for t in tiers] + [FLEET_ROWS] * fleet
    shown = [r for row in ROWS for r in [row, *(x for e in extras for x in e.get(row[0], []))]]
    for label, value in shown:
        cells = [value(r) for r in results]
        row = [label] + [text for _, text in cells]
        if len(results) == 2 and label not in ("requests", "prompt tokens"):
            row.append(_change(cells[0][0], cells[1][0]))
        elif len(results) == 2:
            row.append("")
        rows.append(row)
    ignored = {k: v for r in results for k, v in r.ignored_params.items()}
    measured = [[label, *(text(r) for r in results)] for label, text in MEASURED_ROWS]
    # One grid, so the measured rows line up with the simulated ones above them.
    lines = _grid(rows + [m + [""] * (len(rows[0]) - len(m)) for m in measured]).split("\n")
    out = "\n".join(lines[: len(rows)])
    out += f"\n{note}" if note else ""
    out += f"\n\n{MEASURED_TITLE}\n" + "\n".join(lines[len(rows) :])
    if any(r.verified_chunks for r in results):
        out += "\nverified chunks: " + ", ".join(
            f"{r.verified_chunks:,} ({r.mismatched_blocks} bad blocks)" for r in results
        )
    if ignored:
        out += f"\nignored request params: {ignored}"
    return out


def all_hit_rate(r: SimResult) -> float:
    """Prompt tokens not recomputed: GPU, CPU, disk and remote hits together."""
    return r.gpu_hit_rate + r.cpu_hit_rate + r.disk_hit_rate + r.remote_hit_rate


# A sweep's axis: its column title, and the columns of each run.
SWEEP_COLUMNS: dict[str, tuple[str, list[tuple[str, Callable[[SimResult], str]]]]] = {
    "cpu_gib": (
        "CPU GiB",
        [
            ("GPU hits", lambda r: f"{r.gpu_hit_rate:.1%}"),
            ("CPU hits", lambda r: f"{r.cpu_hit_rate:.1%}"),
            ("GB written", lambda r: _gb(r.bytes_written)),
            ("GB read", lambda r: _gb(r.bytes_read)),
            ("evictions", lambda r: f"{r.evictions:,}"),
            ("prefill s saved", lambda r: f"{r.prefill_seconds_saved:,.1f}"),
        ],
    ),
    "instances": (
        "instances",
        [
            ("GPU hits", lambda r: f"{r.gpu_hit_rate:.1%}"),
            ("CPU hits", lambda r: f"{r.cpu_hit_rate:.1%}"),
            ("all hits", lambda r: f"{all_hit_rate(r):.1%}"),
            ("mean TTFT s", lambda r: f"{r.ttft_mean_s:.3f}"),
            ("p90 TTFT s", lambda r: f"{r.ttft_p90_s:.3f}"),
            ("p99 TTFT s", lambda r: f"{r.ttft_p99_s:.3f}"),
            ("simulated s", lambda r: f"{r.simulated_seconds:,.1f}"),
        ],
    ),
}


_TIER_HITS: dict[str, tuple[str, Callable[[SimResult], str]]] = {
    "disk": ("disk hits", lambda r: f"{r.disk_hit_rate:.1%}"),
    "remote": ("remote hits", lambda r: f"{r.remote_hit_rate:.1%}"),
}


def _with_tiers(
    columns: list[tuple[str, Callable[[SimResult], str]]], tiers: Sequence[str]
) -> list[tuple[str, Callable[[SimResult], str]]]:
    """The hit rates of `tiers` follow the CPU tier's, in lookup order."""
    at = [title for title, _ in columns].index("CPU hits") + 1
    return [*columns[:at], *(_TIER_HITS[t] for t in tiers), *columns[at:]]


_LOAD_COLUMN: tuple[str, Callable[[SimResult], str]] = (
    "load max/mean",
    lambda r: f"{r.load_max_over_mean:.2f}",
)


def sweep_table(
    axis: str,
    points: Sequence[float],
    labels: Sequence[str],
    results: Sequence[Sequence[SimResult]],
    tiers: Sequence[str] = (),
    fleet: bool = False,
) -> str:
    """One row per point of the sweep along `axis` (a key of `SWEEP_COLUMNS`) and setting;
    `results[i][j]` is point `points[i]`, setting `labels[j]`; with `fleet` (some run has
    several instances), a last column of how evenly they were loaded."""
    name, columns = SWEEP_COLUMNS[axis]
    columns = _with_tiers(columns, tiers) + [_LOAD_COLUMN] * fleet
    rows = [[name, "setting", *(title for title, _ in columns)]]
    for point, per_setting in zip(points, results, strict=True):
        for label, r in zip(labels, per_setting, strict=True):
            rows.append([f"{point:g}", label, *(cell(r) for _, cell in columns)])
    return _grid(rows, right_from=2)


def title(workload: Mapping[str, Any], engine: Mapping[str, Any]) -> str:
    """Two lines: the workload, and the engine model that ran it."""
    if "trace" in workload:
        n = workload["requests"]
        what = f"trace {workload['trace']} ({n:,} request{'s' * (n != 1)}"
        if "format" in workload:
            what += f", {workload['format']}, time scale {workload['time_scale']:g}"
            what += f", from {workload['start']:g} s" if workload["start"] else ""
        what += ")"
    else:
        sizes = ", ".join(
            f"{k.replace('_', ' ')} {v}" for k, v in workload.items() if k not in ("name", "seed")
        )
        what = f"{workload['name']}: {sizes}"
    model = engine["model"] or f"{engine['kv_bytes_per_token']:,} KV bytes/token"
    return (
        f"{what}, seed {workload['seed']}\n"
        f"{model}, {engine['tokens_per_block'] * engine['blocks_per_chunk']}-token chunks of "
        f"{engine['bytes_per_chunk'] / 2**20:g} MiB, GPU cache {engine['gpu_blocks']:,} blocks, "
        f"{engine['max_running']} running, {engine['max_batched_tokens']:,} tokens/step, PCIe "
        f"{engine['pcie_gbps']:g} GB/s, prefill {engine['prefill_tokens_per_s']:,.0f} tok/s "
        f"(attention x2 at {engine['prefill_attention_tokens']:,.0f}), decode step "
        f"{engine['decode_step_ms']:g} ms + KV at {engine['hbm_gbps']:,.0f} GB/s"
    )


def instance_table(results: Sequence[SimResult], tiers: Sequence[str] = ()) -> str:
    """One row per instance of a fleet: what the router gave it and what its caches did (with
    `tiers`, their hits, and the GB over its link to the shared tier each way)."""
    columns: list[tuple[str, Callable[[SimResult], str]]] = [
        ("requests", lambda r: f"{r.requests:,}"),
        ("GPU hits", lambda r: f"{r.gpu_hit_rate:.1%}"),
        ("CPU hits", lambda r: f"{r.cpu_hit_rate:.1%}"),
        ("GB written", lambda r: _gb(r.bytes_written)),
        ("mean TTFT s", lambda r: f"{r.ttft_mean_s:.3f}"),
        ("p90 TTFT s", lambda r: f"{r.ttft_p90_s:.3f}"),
    ]
    columns = _with_tiers(columns, tiers)
    if "remote" in tiers:
        at = [title for title, _ in columns].index("GB written") + 1
        columns[at:at] = [
            ("GB net in", lambda r: _gb(r.remote_bytes_read)),
            ("GB net out", lambda r: _gb(r.remote_bytes_written)),
        ]
    rows = [["instance", *(title for title, _ in columns)]]
    rows += [[str(i), *(cell(r) for _, cell in columns)] for i, r in enumerate(results)]
    return _grid(rows)


def header(
    workload: Mapping[str, Any],
    engine: Mapping[str, Any],
    sizes: Sequence[float],
    policies: Sequence[str],
    fleet: str | None = None,
    weights: str | None = None,
    reuse: str | None = None,
) -> str:
    """The title, the CPU tier, for a fleet its instances and router (and `weights`, the
    tier-aware router's, if it runs), the disk and shared tiers if any and the `reuse` line
    (the workload's prefix-reuse bound); then a blank line."""
    tier = ", ".join(f"{s:g}" for s in sizes)
    caps = [
        f"{k} {engine[k]}"
        for k in ("max_load_tokens", "max_offload_tokens")
        if engine[k] is not None
    ]
    fleet_line = (
        f"\nfleet: {fleet} (instances x router), each its own GPU cache and CPU tier"
        if fleet
        else ""
    )
    return (
        f"{title(workload, engine)}\nCPU tier {tier} GiB ({'/'.join(policies)})"
        + (f", {', '.join(caps)}" if caps else "")
        + fleet_line
        + (f"\ntier-aware weights per prompt block held: {weights}" if weights else "")
        + _disk_line(engine)
        + _remote_line(engine)
        + (f"\n{reuse}" if reuse else "")
        + "\n"
    )


def _disk_line(engine: Mapping[str, Any]) -> str:
    if "disk_gib" not in engine:
        return ""
    return (
        f"\ndisk tier {engine['disk_gib']:g} GiB ({engine['disk_chunks']:,} chunks, least "
        f"recently used out first) behind each instance's CPU tier, at "
        f"{engine['disk_gbps']:g} GB/s + {engine['disk_latency_ms']:g} ms per batch"
    )


def _remote_line(engine: Mapping[str, Any]) -> str:
    if "remote_gib" not in engine:
        return ""
    nodes, node_gbps = engine.get("remote_nodes", 1), engine.get("remote_node_gbps")
    size = f"{engine['remote_gib']:g} GiB"
    if nodes > 1:
        size = f"{nodes} nodes of {size}"
    node_links = (
        "" if node_gbps is None else f"; each node's own link {node_gbps:g} GB/s, shared by all"
    )
    return (
        f"\nshared tier {size} ({engine['remote_chunks']:,} chunks, "
        f"sampled LRU of 5 as Redis allkeys-lru) behind every instance, each linked at "
        f"{engine['remote_gbps']:g} GB/s + {engine['remote_latency_ms']:g} ms per batch"
        + node_links
    )
