"""The transfer bandwidth table: GB/s of the engine, of the per-block copy loop (the baseline) and
of one large copy of the same bytes (the ceiling), per direction and both at once.

`python -m kvoffload.transfer.bandwidth [--out DIR]` measures on CUDA when there is a device, else
in CPU mode with small sizes; `benches/gpu_check.sh` runs it.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvoffload.errors import KVOffloadError
from kvoffload.transfer.engine import TransferEngine
from kvoffload.transfer.layout import KVCaches
from kvoffload.transfer.plan import CopyPath

# Llama-3-8B in bf16 with 16-token blocks: 32 layers x K/V x 8 KV heads x 128 dims x 16 tokens
# = 32 KiB per layer and K/V, 2 MiB per block.
LAYERS, TOKENS, HEADS, HEAD_SIZE = 32, 16, 8, 128
LAYOUTS = {
    "cross-layer, 2 MiB blocks": "cross_layer",
    "per-layer, 32 KiB pieces": "per_layer",
}
DIRECTIONS = ("D2H", "H2D", "both")


@dataclass(frozen=True)
class Row:
    layout: str
    direction: str
    engine: float
    per_block: float
    ceiling: float
    """GB/s (1e9 bytes per second)."""
    kernel: float | None = None
    """GB/s of `copy_path="kernel"` (CUDA only: interpreted on the CPU it says nothing)."""


def make_caches(kind: str, num_blocks: int, device: torch.device) -> KVCaches:
    page = (TOKENS, HEADS, HEAD_SIZE)
    if kind == "cross_layer":
        return torch.ones(num_blocks, LAYERS, 2, *page, dtype=torch.bfloat16, device=device)
    return [
        torch.ones(2, num_blocks, *page, dtype=torch.bfloat16, device=device) for _ in range(LAYERS)
    ]


def measure(device: torch.device, blocks_per_job: int, reps: int) -> list[Row]:
    rng = np.random.default_rng(0)
    rows = []
    for name, kind in LAYOUTS.items():
        caches = make_caches(kind, 2 * blocks_per_job, device)
        # Random block ids and slots: nothing merges, as with a fragmented cache.
        blocks = rng.permutation(2 * blocks_per_job).reshape(2, blocks_per_job)
        slots = rng.permutation(2 * blocks_per_job).reshape(2, blocks_per_job)
        engine = _engine_rates(caches, "auto", blocks, slots, reps)
        per_block = _engine_rates(caches, "per_block", blocks, slots, reps)
        kernel = None
        if device.type == "cuda":
            kernel = _engine_rates(caches, "kernel", blocks, slots, reps)
        block_bytes = LAYERS * 2 * TOKENS * HEADS * HEAD_SIZE * 2
        ceiling = _ceiling_rates(device, blocks_per_job * block_bytes, reps)
        for d in DIRECTIONS:
            k = None if kernel is None else kernel[d]
            rows.append(Row(name, d, engine[d], per_block[d], ceiling[d], k))
        del caches
        gc.collect()
    return rows


def _engine_rates(
    caches: KVCaches, path: CopyPath, blocks: np.ndarray, slots: np.ndarray, reps: int
) -> dict[str, float]:
    with TransferEngine(caches, num_slots=slots.size, blocks_per_chunk=1, copy_path=path) as engine:
        job_bytes = blocks.shape[1] * engine.layout.block_bytes
        jobs = itertools.count()

        def run(store: bool, load: bool) -> None:
            ids = []
            if store:
                ids.append(next(jobs))
                engine.submit_store(ids[-1], blocks[0], slots[0])
            if load:
                ids.append(next(jobs))
                engine.submit_load(ids[-1], slots[1], blocks[1])
            engine.wait(ids)
            if not all(r.success for r in engine.get_finished()):
                raise KVOffloadError(f"a {path} transfer failed while measuring; see the log")

        rates = {
            "D2H": _rate(lambda: run(True, False), job_bytes, reps),
            "H2D": _rate(lambda: run(False, True), job_bytes, reps),
            "both": _rate(lambda: run(True, True), 2 * job_bytes, reps),
        }
    return rates


def _ceiling_rates(device: torch.device, nbytes: int, reps: int) -> dict[str, float]:
    cuda = device.type == "cuda"
    dev = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
    host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
    streams = [torch.cuda.Stream(device) for _ in range(2)] if cuda else []  # type: ignore[no-untyped-call]

    def run(store: bool, load: bool) -> None:
        for i, (dst, src) in enumerate(((host[0], dev[0]), (dev[1], host[1]))):
            if (store, load)[i]:
                if cuda:
                    with torch.cuda.stream(streams[i]):
                        dst.copy_(src, non_blocking=True)
                else:
                    dst.copy_(src)
        if cuda:
            torch.cuda.synchronize(device)

    return {
        "D2H": _rate(lambda: run(True, False), nbytes, reps),
        "H2D": _rate(lambda: run(False, True), nbytes, reps),
        "both": _rate(lambda: run(True, True), 2 * nbytes, reps),
    }


def _rate(run: Callable[[], None], nbytes: int, reps: int) -> float:
    """Best GB/s over `reps` runs after one warm-up run."""
    run()
    best = float("inf")
    for _ in range(reps):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return nbytes / best / 1e9


def format_table(rows: list[Row], title: str) -> str:
    lines = [
        title,
        f"{'layout':<27} {'dir':<5} {'engine':>8} {'per-block':>10} {'ceiling':>8} "
        f"{'engine/ceiling':>15} {'engine/per-block':>17} {'kernel':>8} {'kernel/ceiling':>15}",
    ]
    for r in rows:
        kernel = "-" if r.kernel is None else f"{r.kernel:.2f}"
        share = "-" if r.kernel is None else f"{r.kernel / r.ceiling:.0%}"
        lines.append(
            f"{r.layout:<27} {r.direction:<5} {r.engine:8.2f} {r.per_block:10.2f} "
            f"{r.ceiling:8.2f} {r.engine / r.ceiling:15.0%} {r.engine / r.per_block:16.1f}x "
            f"{kernel:>8} {share:>15}"
        )
    return "\n".join(lines)


def check_targets(rows: list[Row]) -> list[str]:
    """The H100/H200 targets: cross-layer >= 90% of the ceiling per direction and >= 80 GB/s
    both ways; per-layer >= 3x the per-block loop."""
    lines = []
    for r in rows:
        if r.layout.startswith("cross") and r.direction != "both":
            ok, want = r.engine >= 0.9 * r.ceiling, ">= 90% of ceiling"
        elif r.layout.startswith("cross"):
            ok, want = r.engine >= 80, ">= 80 GB/s"
        else:
            ok, want = r.engine >= 3 * r.per_block, ">= 3x per-block"
        lines.append(f"{'PASS' if ok else 'MISS'}  {r.layout}, {r.direction}: {want}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--out", type=Path, help="also write the table to DIR/transfer_bandwidth.txt"
    )
    parser.add_argument("--blocks", type=int, help="GPU blocks (2 MiB each) per job")
    parser.add_argument("--reps", type=int, help="timed runs per measurement (best is kept)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    blocks = args.blocks or (512 if cuda else 16)
    reps = args.reps or 5
    where = f"CUDA, {torch.cuda.get_device_name(device)}" if cuda else "CPU mode"
    title = (
        f"transfer bandwidth in GB/s ({where}, torch {torch.__version__}): {blocks} random "
        f"blocks = {blocks * 2} MiB per job and direction, blocks_per_chunk=1, best of {reps}"
    )
    rows = measure(device, blocks, reps)
    text = format_table(rows, title)
    if cuda:
        text += "\ntargets (H100/H200):\n" + "\n".join(check_targets(rows))
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "transfer_bandwidth.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
