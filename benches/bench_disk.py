"""The disk tier's data path against `fio` on the same filesystem, in the same run.

Store and load GB/s of `DiskClient` (Rust: one file per chunk, written under a temporary name and
renamed, `O_DIRECT` where the filesystem takes it, a job's chunks spread over `io_threads`) against
`fio` doing the same I/O: `O_DIRECT`, 2 MiB blocks, one 2 MiB file per chunk, as many jobs as our
I/O threads, no fsync (neither side syncs). Ours also writes each chunk's 4 KiB header block and
renames each file; fio does neither. A chunk is 2 MiB, 64 per job.

`make bench` prints the table; `make test` runs it once on a few chunks, untimed (without `fio`,
ours alone), and checks the bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from kvoffload.tiers import OK
from kvoffload.tiers.disk import DiskClient, DiskTierConfig

MiB = 1 << 20
CHUNK = 2 * MiB
THREADS = 8


def aligned(n: int) -> np.ndarray:
    """`n` chunks of page-aligned memory, as vLLM's CPU region is."""
    raw = np.empty(n * CHUNK + 4096, dtype=np.uint8)
    start = -raw.ctypes.data % 4096
    pool = raw[start : start + n * CHUNK]
    pool[:] = np.random.default_rng(1).integers(0, 256, pool.size, dtype=np.uint8)
    return pool


def finish(c: DiskClient, job: int) -> bytes:
    return dict(c.drain(120.0))[job]


def ours(path: Path, pool: np.ndarray, rounds: int) -> tuple[float, float, bool]:
    n = pool.size // CHUNK
    entry = {
        "path": str(path),
        "capacity_bytes": 1 << 40,
        "namespace": "bench",
        "io_threads": THREADS,
    }
    c = DiskClient(DiskTierConfig.from_dict(entry), hashlib.md5(b"bench").digest(), CHUNK)
    offsets = [i * CHUNK for i in range(n)]
    dst = aligned(n)
    store_s = load_s = 0.0
    for r in range(rounds):
        ks = [f"r{r}-{i:06d}".encode().ljust(36, b".") for i in range(n)]
        t = time.perf_counter()
        assert finish(c, c.store(ks, pool, offsets)) == bytes([OK]) * n
        store_s += time.perf_counter() - t
        t = time.perf_counter()
        assert finish(c, c.load(ks, dst, offsets)) == bytes([OK]) * n
        load_s += time.perf_counter() - t
        assert np.array_equal(dst, pool)
    total = n * CHUNK * rounds
    direct = c.direct
    c.close()
    return total / store_s / 1e9, total / load_s / 1e9, direct


def fio(path: Path, n: int, rounds: int, slab: bool = False) -> tuple[float, float] | None:
    """fio's write and read GB/s of `n` 2 MiB chunks per round over THREADS jobs, O_DIRECT: one
    new file per chunk every round (as our stores write new chunks), or with `slab` one
    preallocated file per job rewritten in place every round (the best a slab layout with a
    slot map could do here: no file to create, no block to allocate, no rename)."""
    exe = shutil.which("fio")
    if exe is None:
        return None
    per_job = max(1, n // THREADS)
    if slab:
        layout = ["--nrfiles=1", f"--filesize={per_job * 2}M", "--fallocate=native"]
    else:
        layout = [f"--nrfiles={per_job}", "--filesize=2M", "--file_service_type=sequential"]
    results = []
    for rw in ("write", "read"):
        out = subprocess.run(
            [
                exe,
                "--name=chunks",
                f"--directory={path}",
                f"--rw={rw}",
                "--bs=2M",
                "--direct=1",
                "--ioengine=psync",
                f"--numjobs={THREADS}",
                *layout,
                f"--size={per_job * 2}M",
                f"--loops={rounds}",
                "--group_reporting",
                "--output-format=json",
                # New files every loop, as each of our rounds writes new chunks.
                *(["--unlink_each_loop=1"] if rw == "write" and not slab else []),
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=600,
        )
        job = json.loads(out.stdout)["jobs"][0]
        results.append(job["write" if rw == "write" else "read"]["bw_bytes"] / 1e9)
    return results[0], results[1]


def test_disk_data_path(benchmark):
    full = not benchmark.disabled
    n, rounds = (64, 5) if full else (4, 1)
    pool = aligned(n)
    # The system's temporary directory: a real filesystem here (ext4), not tmpfs.
    with tempfile.TemporaryDirectory(prefix="kvo-bench-disk-") as d:
        root = Path(d)

        def run() -> dict:
            res: dict = {"ours": ours(root / "ours", pool, rounds)}
            for name, slab in (("fio", False), ("slab", True)):
                (root / name).mkdir()
                res[name] = fio(root / name, n, rounds, slab) if full else None
            return res

        res = benchmark.pedantic(run, rounds=1)
    if not full:
        return
    os_, ol, direct = res["ours"]
    print(f"\n2 MiB chunks, {n} per job, {rounds} rounds, {THREADS} I/O threads, direct={direct}")
    print("| | store GB/s | load GB/s |")
    print("|---|---|---|")
    print(f"| kvoffload DiskClient | {os_:.2f} | {ol:.2f} |")
    if res["fio"] is None:
        print("fio is not installed: no baseline")
        return
    fs, fl = res["fio"]
    ss, sl = res["slab"]
    print(f"| fio (O_DIRECT, psync, {THREADS} jobs, 2 MiB files) | {fs:.2f} | {fl:.2f} |")
    print(f"| fio, one preallocated file per job (a slab) | {ss:.2f} | {sl:.2f} |")
    print(f"ours / fio: store {os_ / fs:.2f}x, load {ol / fl:.2f}x")
    print(f"ours / slab: store {os_ / ss:.2f}x, load {ol / sl:.2f}x")


def listing_with_times(root: Path) -> int:
    """The baseline: what any rebuild must do, in plain Python (every file's name and time)."""
    n = 0
    for sub in os.scandir(root):
        if sub.is_dir():
            for entry in os.scandir(sub.path):
                for f in os.scandir(entry.path):
                    f.stat()
                    n += 1
    return n


def test_index_rebuild(benchmark):
    """The start-up index rebuild of a directory of 100,000 chunk files (`make test`: 500):
    seconds from open until every file is in the index, against listing the directory with each
    file's time in Python (page cache warm for both: the files were just written)."""
    files = 500 if benchmark.disabled else 100_000
    chunk = 4096  # small files: the rebuild reads names and times, never payloads
    entry = {"path": "", "capacity_bytes": 1 << 40, "namespace": "bench"}
    digest = hashlib.md5(b"bench").digest()
    pool = np.zeros(1024 * chunk, dtype=np.uint8)
    with tempfile.TemporaryDirectory(prefix="kvo-bench-rebuild-") as d:
        config = DiskTierConfig.from_dict({**entry, "path": d})
        writer = DiskClient(config, digest, chunk)
        for start in range(0, files, 1024):
            ks = [f"{i:012d}".encode() for i in range(start, min(files, start + 1024))]
            statuses = finish(writer, writer.store(ks, pool, [i * chunk for i in range(len(ks))]))
            assert statuses == bytes([OK]) * len(ks)
        writer.close()

        def rebuild() -> float:
            t = time.perf_counter()
            c = DiskClient(config, digest, chunk)
            while not c.scanned:
                time.sleep(0.0005)
            took = time.perf_counter() - t
            assert c.stats()["chunks"] == files
            c.close()
            return took

        ours = benchmark.pedantic(rebuild, rounds=1)
        t = time.perf_counter()
        assert listing_with_times(Path(d)) == files
        listing = time.perf_counter() - t
    if not benchmark.disabled:
        print(
            f"\nindex rebuild of {files:,} files: {ours:.2f} s "
            f"(Python listing with times: {listing:.2f} s, {listing / ours:.2f}x ours)"
        )
