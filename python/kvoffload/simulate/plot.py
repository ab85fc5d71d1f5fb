"""`--plot FILE.png`: CPU hit rate and GB written against the CPU-tier size of a sweep."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from kvoffload.simulate.report import SimResult


def plot_sweep(
    path: str | Path,
    sizes: Sequence[float],
    labels: Sequence[str],
    results: Sequence[Sequence[SimResult]],
    title: str,
) -> None:
    """Writes the PNG atomically: a reader never sees half a file, and a failed run leaves any
    earlier plot in place. Raises `ImportError` without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (hits, written) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for j, label in enumerate(labels):
        hits.plot(sizes, [100 * row[j].cpu_hit_rate for row in results], marker="o", label=label)
        written.plot(
            sizes, [row[j].bytes_written / 1e9 for row in results], marker="o", label=label
        )
    for ax, ylabel in (
        (hits, "CPU-tier hits (% of prompt tokens)"),
        (written, "GB written GPU->CPU"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(sizes), [f"{s:g}" for s in sizes])
        ax.set_xlabel("CPU tier (GiB)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
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
