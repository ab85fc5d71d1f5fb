"""`--plot FILE.png`: a sweep drawn against its axis. A CPU-tier sweep: CPU hit rate and GB
written per size; a fleet sweep: hit rate and TTFT (mean solid, p99 dashed) per instance count."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

from kvoffload.simulate.report import SimResult, all_hit_rate

Series = tuple[str, str, Callable[[SimResult], float]]
"""(label suffix, line style, value) of one line per setting."""

# A sweep's axis: its x label, and each panel's y label and lines.
PANELS: dict[str, tuple[str, list[tuple[str, list[Series]]]]] = {
    "cpu_gib": (
        "CPU tier (GiB)",
        [
            ("CPU-tier hits (% of prompt tokens)", [("", "-", lambda r: 100 * r.cpu_hit_rate)]),
            ("GB written GPU->CPU", [("", "-", lambda r: r.bytes_written / 1e9)]),
        ],
    ),
    "instances": (
        "instances",
        [
            (
                "prefix hits, every tier (% of prompt tokens)",
                [("", "-", lambda r: 100 * all_hit_rate(r))],
            ),
            (
                "TTFT s",
                [(" mean", "-", lambda r: r.ttft_mean_s), (" p99", "--", lambda r: r.ttft_p99_s)],
            ),
        ],
    ),
}


def plot_sweep(
    path: str | Path,
    axis: str,
    points: Sequence[float],
    labels: Sequence[str],
    results: Sequence[Sequence[SimResult]],
    title: str,
) -> None:
    """Draws the sweep along `axis` (a key of `PANELS`); `results[i][j]` is point `points[i]`,
    setting `labels[j]`. Writes the PNG atomically: a reader never sees half a file, and a
    failed run leaves any earlier plot in place. Raises `ImportError` without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xlabel, panels = PANELS[axis]
    fig, axes = plt.subplots(1, len(panels), figsize=(10, 4), constrained_layout=True)
    for ax, (ylabel, series) in zip(axes, panels, strict=True):
        for j, label in enumerate(labels):
            color = f"C{j}"
            for suffix, style, value in series:
                ys = [value(row[j]) for row in results]
                ax.plot(points, ys, style, color=color, marker="o", label=label + suffix)
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(points), [f"{p:g}" for p in points])
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    # The title's engine line is longer than the figure is wide.
    lines = [part for line in title.splitlines() for part in textwrap.wrap(line, 150)]
    fig.suptitle("\n".join(lines), fontsize=9)
    path = Path(path)
    # Created like any new file (umask applies), renamed over the target when complete.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "xb") as f:
            fig.savefig(f, format="png", dpi=110)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)
