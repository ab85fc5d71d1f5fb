"""Our `DiskTier` against vLLM 0.33's own filesystem tier (`FileSystemTierManager`, `"type":
"fs"`), both inside one vLLM `TieringOffloadingSpec`, on the same filesystem, in the same run.

Both tiers sit behind one CPU region and get the same jobs, submitted as vLLM's tiering submits
them: a store job, then a load of those chunks into other rows (checked byte for byte), polled
until done, 3 rounds of new keys. Two chunk sizes of the test model: 2 MiB (4096 tokens, 64 per
job: an 8B model's 16-token chunk is about this size) and 8 KiB (16 tokens, 2048 per job: where
the cost per file, not the device, sets the pace). Each tier runs with its shipped defaults
(vLLM's: 16 read and 16 write threads and its C I/O extension; ours: 8 I/O threads; both
`O_DIRECT` where the filesystem takes it).

`make bench` prints the table; `make test` runs one round of 4 chunks of each size, untimed.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "vllm"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

pytest.importorskip("vllm.config", reason="vLLM is not installed (`make test` installs it)")

from rig import write_model_dir
from tiering_rig import make_tiering_rig
from vllm.v1.kv_offload.tiering.base import TransferJob

SIZES = {"2 MiB": (4096, 64), "8 KiB": (16, 2048)}
"""Chunk size -> (tokens per chunk, chunks per job)."""
ROUNDS = 3
RESULTS: dict[str, tuple[tuple[float, float], tuple[float, float], bool]] = {}


def tiers(tmp: Path, chunk_tokens: int, per_job: int) -> list[Any]:
    """Both tiers behind one CPU region of `2 * per_job` chunks."""
    model_dir = tmp / "model"
    model_dir.mkdir()
    rig = make_tiering_rig(
        write_model_dir(str(model_dir)),
        [
            {"type": "fs", "root_dir": str(tmp / "vllm-fs")},
            {
                "type": "DiskTier",
                "module_path": "kvoffload.vllm",
                "path": str(tmp / "kvoffload"),
                "capacity_bytes": 1 << 40,
                "namespace": "bench",
            },
        ],
        tokens_per_block=16,
        chunk_tokens=chunk_tokens,
        cpu_chunks=2 * per_job,
        num_gpu_blocks=max(512, 2 * chunk_tokens // 16),
        max_model_len=max(8192, 2 * chunk_tokens),
        verify=False,
    )
    return list(rig.connector.connector_scheduler.manager.secondary_tiers)


def run_job(tier: Any, job: TransferJob) -> float:
    """Submits `job` as vLLM's tiering does and polls until it ends; its seconds."""
    start = time.perf_counter()
    (tier.submit_load if job.is_promotion else tier.submit_store)(job)
    while True:
        done = list(tier.get_finished_jobs())
        if done:
            assert [(r.job_id, r.success) for r in done] == [(job.job_id, True)]
            return time.perf_counter() - start
        time.sleep(0.0002)


def throughput(tier: Any, per_job: int, rounds: int) -> tuple[float, float]:
    region = np.asarray(tier._primary_kv_view)  # the one CPU region both tiers serve
    rng = np.random.default_rng(7)
    chunk = tier.block_size_bytes
    src, dst = np.arange(per_job), np.arange(per_job, 2 * per_job)
    store_s = load_s = 0.0
    for r in range(rounds):
        region[src] = rng.integers(0, 256, (per_job, chunk), dtype=np.uint8)
        keys = [
            bytes(32 - 8) + r.to_bytes(4, "big") + i.to_bytes(4, "big") + bytes(4)
            for i in range(per_job)
        ]
        store_s += run_job(tier, TransferJob(2 * r, keys, src, False, None))  # type: ignore[arg-type]
        load_s += run_job(tier, TransferJob(2 * r + 1, keys, dst, True, None))  # type: ignore[arg-type]
        assert np.array_equal(region[dst], region[src])
    total = per_job * chunk * rounds
    return total / store_s / 1e9, total / load_s / 1e9


@pytest.fixture(scope="module", autouse=True)
def _print_table(request):
    yield
    if not RESULTS:
        return
    direct = all(d for _, _, d in RESULTS.values())
    lines = [
        "",
        f"disk tier vs vLLM's FileSystemTierManager, {ROUNDS} rounds "
        f"({'O_DIRECT' if direct else 'buffered'} I/O here), GB/s",
        f"{'':16}{'vLLM fs':>10}{'DiskTier':>10}{'ratio':>8}",
    ]
    for size, ((ts, tl), (os_, ol), _) in RESULTS.items():
        lines.append(f"{size + ' store':<16}{ts:>10.2f}{os_:>10.2f}{os_ / ts:>7.2f}x")
        lines.append(f"{size + ' load':<16}{tl:>10.2f}{ol:>10.2f}{ol / tl:>7.2f}x")
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print("\n".join(lines) + "\n")
    RESULTS.clear()


@pytest.mark.parametrize("size", list(SIZES))
def test_disk_tier_against_vllms_fs_tier(benchmark, tmp_path, size):
    chunk_tokens, per_job = SIZES[size]
    per_job, rounds = (4, 1) if benchmark.disabled else (per_job, ROUNDS)
    vllm_fs, ours = tiers(tmp_path, chunk_tokens, per_job)
    result = benchmark.pedantic(
        lambda: (throughput(vllm_fs, per_job, rounds), throughput(ours, per_job, rounds)),
        rounds=1,
        iterations=1,
    )
    RESULTS[size] = (*result, ours._client.direct)
    for tier in (vllm_fs, ours):
        tier.shutdown()
