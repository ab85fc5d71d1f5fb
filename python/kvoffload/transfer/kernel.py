"""`copy_path="kernel"`: all copies of a job in one Triton launch over a table of addresses.

Each run of a job (a GPU page run and its pool range, from any layout: one tensor or one per
layer) is cut into tiles of at most `TILE_BYTES`; program `i` copies tile `i` from `src[i]` to
`dst[i]`. On CUDA the pool is registered with `cudaHostRegisterDefault`, which on a system with
unified virtual addressing maps it into the device's address space at its host addresses, so the
kernel reads and writes it there: no staging buffer and no per-layer launch. In CPU mode it
runs under `TRITON_INTERPRET=1` (the tests do).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

TILE_BYTES = 32 << 10
BLOCK_BYTES = 4 << 10

_TL_UNITS = {
    torch.int64: tl.int64,
    torch.int32: tl.int32,
    torch.int16: tl.int16,
    torch.uint8: tl.uint8,
}


@triton.jit
def _copy_tiles(
    src_ptrs,
    dst_ptrs,
    lengths,
    UNIT: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    src = tl.load(src_ptrs + i).to(tl.pointer_type(UNIT))
    dst = tl.load(dst_ptrs + i).to(tl.pointer_type(UNIT))
    n = tl.load(lengths + i)
    for start in range(0, TILE, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def copy_runs(
    src_bases: Sequence[int],
    dst_bases: Sequence[int],
    lengths: Sequence[int],
    unit: torch.dtype,
    device: torch.device,
) -> None:
    """Copies run `r`: `lengths[r]` units of `unit` from address `src_bases[r]` to
    `dst_bases[r]`, in one launch on the current stream."""
    unit_bytes = torch.empty(0, dtype=unit).element_size()
    tile, block = TILE_BYTES // unit_bytes, BLOCK_BYTES // unit_bytes
    src = np.asarray(src_bases, dtype=np.int64)
    dst = np.asarray(dst_bases, dtype=np.int64)
    n = np.asarray(lengths, dtype=np.int64)
    tiles = -(-n // tile)
    run = np.repeat(np.arange(len(n)), tiles)
    # Tile k of run r starts k * tile units in.
    within = np.arange(len(run)) - np.repeat(np.cumsum(tiles) - tiles, tiles)
    offset = within * tile
    table = np.stack(
        [src[run] + offset * unit_bytes, dst[run] + offset * unit_bytes, n[run] - offset]
    )
    host = torch.from_numpy(table)
    if device.type == "cuda":
        host = host.pin_memory()
    t = host.to(device, non_blocking=True)
    _copy_tiles[(len(run),)](t[0], t[1], t[2], UNIT=_TL_UNITS[unit], TILE=tile, BLOCK=block)
