"""Start-up of the CPU tier's pool (issue 20), CPU mode: how long the worker waits before its
first usable piece, and before the whole pool, for 1, 8 and 16 GiB. Baseline, in the same run:
a synchronous pool that prepares every page before it returns (what pinning the whole pool up
front costs; on the CPU the preparation is the first touch of every page, which the background
pool does too). Each size runs in a fresh process, so every page is faulted in anew. On a GPU the
same comparison with `cudaHostRegister` is part of `benches/gpu_check.sh`.

`make bench` runs 1, 8 and 16 GiB; `make test` (`--benchmark-disable`) runs 64 MiB once.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SLOT = 2 << 20  # a 2 MiB chunk
PIECE = 1 << 30  # the default pin_piece_bytes

_CHILD = f"""
import ctypes, json, sys, time
from kvoffload.transfer import CpuPool
gib, mode = float(sys.argv[1]), sys.argv[2]
slots = int(gib * 2**30) // {SLOT}
t0 = time.monotonic()
if mode == "sync":
    pool = CpuPool(slots, {SLOT}, piece_bytes={PIECE})
    ctypes.memset(pool.buffer.data_ptr(), 0, pool.buffer.numel())
    first = full = time.monotonic() - t0
else:
    pool = CpuPool(slots, {SLOT}, piece_bytes={PIECE}, background=True)
    while pool.usable_slots == 0:
        time.sleep(0.0005)
    first = time.monotonic() - t0
    pool.wait_ready()
    full = time.monotonic() - t0
print(json.dumps({{"first_s": first, "full_s": full, "usable": pool.usable_slots, "slots": slots}}))
pool.close()
"""


def _startup(gib: float, mode: str) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(gib), mode], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("gib", [1, 8, 16])
def test_pool_startup(benchmark, gib: int) -> None:
    size = 1 / 16 if benchmark.disabled else gib
    if benchmark.disabled and gib != 1:
        pytest.skip("smoke run: one small pool")
    result = benchmark.pedantic(
        lambda: (_startup(size, "sync"), _startup(size, "background")), rounds=1, iterations=1
    )
    sync, background = result
    benchmark.extra_info.update(
        {
            "sync_ready_s": round(sync["full_s"], 3),
            "background_first_piece_s": round(background["first_s"], 3),
            "background_full_s": round(background["full_s"], 3),
        }
    )
    sys.stderr.write(f"\n{size:g} GiB pool: {benchmark.extra_info}\n")
    # Both pools ended whole: every slot usable.
    assert sync["usable"] == sync["slots"] and background["usable"] == background["slots"]
