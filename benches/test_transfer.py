"""Transfer engine benchmarks: the engine's copy paths against the per-block copy loop baseline.

Each group stores one job of random GPU blocks to random slots and loads another back, on CUDA
when there is a device, else in CPU mode with fewer blocks. `benches/gpu_check.sh` prints the
full GB/s table (`python -m kvoffload.transfer.bandwidth`).
"""

import itertools

import numpy as np
import pytest
import torch

from kvoffload.transfer import TransferEngine
from kvoffload.transfer.bandwidth import DIRECTIONS, LAYOUTS, format_table, make_caches, measure

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
BLOCKS = 256 if CUDA else 4  # 2 MiB each (Llama-3-8B, 16-token blocks)


@pytest.mark.parametrize("kind", sorted(LAYOUTS.values()))
@pytest.mark.parametrize("path", ["auto", "batched", "per_block"])
def test_store_and_load(benchmark, kind, path):
    rng = np.random.default_rng(0)
    blocks = rng.permutation(2 * BLOCKS).reshape(2, BLOCKS)
    slots = rng.permutation(2 * BLOCKS).reshape(2, BLOCKS)
    caches = make_caches(kind, 2 * BLOCKS, DEVICE)
    engine = TransferEngine(caches, num_slots=2 * BLOCKS, blocks_per_chunk=1, copy_path=path)
    jobs = itertools.count()

    def store_and_load():
        store, load = next(jobs), next(jobs)
        engine.submit_store(store, blocks[0], slots[0])
        engine.submit_load(load, slots[1], blocks[1])
        engine.wait([store, load])
        return engine.get_finished()

    benchmark.group = f"transfer {kind}, {BLOCKS} blocks each way"
    results = benchmark(store_and_load)
    assert [r.success for r in results] == [True, True]
    engine.close()


def test_bandwidth_table_runs_in_cpu_mode():
    rows = measure(torch.device("cpu"), blocks_per_job=1, reps=1)
    assert [(r.layout, r.direction) for r in rows] == [
        (name, d) for name in LAYOUTS for d in DIRECTIONS
    ]
    assert all(min(r.engine, r.per_block, r.ceiling) > 0 for r in rows)
    assert format_table(rows, "title").count("\n") == len(rows) + 1
