"""`CpuPool`: the CPU tier's memory, `num_slots` chunk-sized slots in one exactly-sized buffer."""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvoffload.errors import KVOffloadError

logger = logging.getLogger(__name__)

MAX_PIECE_BYTES = 64 << 30
"""The most bytes registered with the CUDA driver in one call."""


class CpuPool:
    """`num_slots` slots of `slot_bytes` each; every slot is one contiguous range of bytes.

    The buffer is an anonymous `mmap` of exactly the size needed (not rounded up to a power of
    two as `pin_memory=True` allocations are), viewed as a tensor whose storage starts where the
    mapping does, so torch sees the registered range from the storage's base (`is_pinned()`).
    When `pin_device` is a CUDA device it is page-locked with `cudaHostRegister` in pieces of at
    most `piece_bytes` whole slots. Each piece starts on a page
    boundary so no page is registered twice; the padding is under one page per piece. A copy must
    not span two pieces (the driver would see pageable memory): runs of slots are split at every
    `slots_per_piece` slots. Without `pin_device` (CPU mode) nothing is registered and no
    CUDA call is made.

    With `background=True` the constructor returns at once and a thread prepares the pieces in
    slot order: each is page-locked (CUDA) or first-touched (CPU mode: its pages are faulted in),
    and `usable_slots` grows by a piece's slots when it is done. A slot at or past
    `usable_slots` must not be copied to or from. A piece that fails ends the growth there with
    one warning; the pool stays usable at that size. With `numa_node`, the pool's pages are
    bound to that NUMA node (`mbind`) before anything touches them. `before_piece(i)`, if given,
    runs on that thread before piece `i` (tests slow a start-up down with it, or make a piece
    fail by raising `OSError`).
    """

    def __init__(
        self,
        num_slots: int,
        slot_bytes: int,
        *,
        pin_device: torch.device | None = None,
        piece_bytes: int = 1 << 30,
        background: bool = False,
        numa_node: int | None = None,
        before_piece: Callable[[int], None] | None = None,
    ) -> None:
        for name, value, low in (("num_slots", num_slots, 1), ("slot_bytes", slot_bytes, 1)):
            if type(value) is not int or value < low:
                raise ValueError(f"{name}={value!r} is invalid; allowed: an int >= {low}")
        if type(piece_bytes) is not int or not 0 < piece_bytes <= MAX_PIECE_BYTES:
            raise ValueError(
                f"pin_piece_bytes={piece_bytes!r} is invalid; allowed: an int in "
                f"1..{MAX_PIECE_BYTES}"
            )
        if slot_bytes > MAX_PIECE_BYTES:
            raise ValueError(
                f"slot_bytes={slot_bytes} exceeds {MAX_PIECE_BYTES}, the largest range one "
                f"cudaHostRegister call may pin; use fewer blocks per chunk"
            )
        page = mmap.PAGESIZE
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.slots_per_piece = min(num_slots, max(1, piece_bytes // slot_bytes))
        self.num_pieces = -(-num_slots // self.slots_per_piece)
        self.piece_stride = -(-self.slots_per_piece * slot_bytes // page) * page
        """Bytes from the start of one piece to the start of the next."""
        last_slots = num_slots - (self.num_pieces - 1) * self.slots_per_piece
        nbytes = (self.num_pieces - 1) * self.piece_stride + last_slots * slot_bytes
        nbytes = -(-nbytes // page) * page
        memory = mmap.mmap(-1, nbytes)
        # Created outside inference mode whatever the caller's mode: copies use it in any mode.
        with torch.inference_mode(False):
            self.buffer: torch.Tensor = torch.frombuffer(memory, dtype=torch.uint8)
        """The whole pool as flat bytes (page-aligned; includes the padding between pieces)."""
        self.numa_node = numa_node
        if numa_node is not None:  # before anything touches a page: they are placed at first touch
            bind_to_node(self.buffer.data_ptr(), nbytes, numa_node)
        self.pinned = pin_device is not None
        self._pieces: list[int] = []
        """Addresses of the registered pieces (CUDA)."""
        self._ready_pieces = 0
        self._first_done = threading.Event()
        """Set once the first piece is ready, or the preparation ended without it."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.started_at = time.monotonic()
        self.first_piece_s: float | None = None
        """Seconds from construction to the first usable piece."""
        self.all_pieces_s: float | None = None
        """Seconds to the whole pool, or `None` while growing (or if it stopped short)."""
        # The tensor keeps the mapping alive; the finalizer keeps it until it is unregistered,
        # and (at interpreter exit too) stops a preparation still running before it does.
        self._threads: list[threading.Thread] = []
        self._finalizer = weakref.finalize(
            self, _release, memory, self._pieces, self._stop, self._threads
        )
        if background:
            self._thread = threading.Thread(
                target=self._prepare,
                args=(pin_device, before_piece),
                name="kvoffload-pool",
                daemon=True,
            )
            self._threads.append(self._thread)
            self._thread.start()
            return
        if pin_device is not None:
            self._pieces.extend(_register(self.buffer, self._piece_ranges(), pin_device))
        self._ready_pieces = self.num_pieces
        self._first_done.set()
        self.first_piece_s = self.all_pieces_s = time.monotonic() - self.started_at

    @property
    def usable_slots(self) -> int:
        """Slots whose memory is ready (pinned, or first-touched in CPU mode)."""
        return min(self.num_slots, self._ready_pieces * self.slots_per_piece)

    @property
    def growing(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def first_piece_pending(self) -> bool:
        """The first piece is being prepared still (not ready, not failed, not stopped)."""
        return not self._first_done.is_set()

    def wait_first_piece(self, timeout_s: float) -> bool:
        """Blocks until the first piece is ready (then True) or the preparation ended without
        it or `timeout_s` passed (then False)."""
        self._first_done.wait(timeout_s)
        return self._ready_pieces > 0

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Blocks until the background preparation has ended (done, failed or closed)."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _prepare(
        self, device: torch.device | None, before_piece: Callable[[int], None] | None
    ) -> None:
        try:
            self._prepare_pieces(device, before_piece)
        finally:
            self._first_done.set()

    def _prepare_pieces(
        self, device: torch.device | None, before_piece: Callable[[int], None] | None
    ) -> None:
        ranges = self._piece_ranges()
        total = sum(n for _, n in ranges)
        for i, (offset, nbytes) in enumerate(ranges):
            if self._stop.is_set():
                return
            try:
                if before_piece is not None:
                    before_piece(i)
                if device is None:
                    # ctypes releases the GIL for the call: the fault-in runs beside Python.
                    ctypes.memset(self.buffer.data_ptr() + offset, 0, nbytes)
                else:
                    self._pieces.extend(
                        _register(self.buffer, [(offset, nbytes)], device, quiet=True)
                    )
            except Exception as exc:  # whatever refused the piece, the tier keeps what it has
                logger.warning(
                    "kvoffload: the CPU tier stops growing at %.2f of %.2f GiB: piece %d of %d "
                    "could not be prepared (%s)",
                    self.usable_slots * self.slot_bytes / 2**30,
                    total / 2**30,
                    i,
                    len(ranges),
                    exc,
                )
                return
            self._ready_pieces = i + 1
            if i == 0:
                self.first_piece_s = time.monotonic() - self.started_at
                self._first_done.set()
        self.all_pieces_s = time.monotonic() - self.started_at
        logger.info(
            "kvoffload: the CPU tier's %.2f GiB is ready: first piece after %.2f s, all after "
            "%.2f s",
            total / 2**30,
            self.first_piece_s or 0.0,
            self.all_pieces_s,
        )

    def _piece_ranges(self) -> list[tuple[int, int]]:
        """(byte offset, length) of each piece."""
        ranges = []
        for p in range(self.num_pieces):
            slots = min(self.slots_per_piece, self.num_slots - p * self.slots_per_piece)
            ranges.append((p * self.piece_stride, slots * self.slot_bytes))
        return ranges

    def slot_offsets(self, slots: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Byte offset in `buffer` of each slot."""
        piece, index = np.divmod(slots, self.slots_per_piece)
        offsets: npt.NDArray[np.int64] = piece * self.piece_stride + index * self.slot_bytes
        return offsets

    def slot(self, slot: int) -> torch.Tensor:
        """The bytes of one slot (a view)."""
        if type(slot) is not int or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot={slot!r} is invalid; allowed: 0..{self.num_slots - 1}")
        offset = int(self.slot_offsets(np.array(slot)))
        return self.buffer[offset : offset + self.slot_bytes]

    def close(self) -> None:
        """Stops a background preparation, then unregisters the memory (also done when the pool
        is garbage-collected). Copies that use the pool must have finished."""
        self._finalizer()

    def __repr__(self) -> str:
        return (
            f"CpuPool(num_slots={self.num_slots}, slot_bytes={self.slot_bytes}, "
            f"pieces={self.num_pieces}, pinned={self.pinned})"
        )


# mbind(2): its syscall number per architecture, and the policy that places pages on the node
# while it has room (MPOL_BIND would OOM-kill the worker when the node fills up instead).
_SYS_MBIND = {"x86_64": 237, "aarch64": 235}
_MPOL_PREFERRED = 1


class NumaBindError(ValueError):
    """`numa_node` could not be applied to the pool's memory."""


def bind_to_node(address: int, nbytes: int, node: int) -> None:
    """Places `nbytes` of memory at `address` (page-aligned, not touched yet) on NUMA `node`
    while it has room (MPOL_PREFERRED), or raises `NumaBindError` naming `numa_node` when the kernel
    refuses (no such node, or the call is not permitted, as under Docker's default seccomp)."""
    if type(node) is not int or not 0 <= node < 1024:
        raise NumaBindError(f"numa_node={node!r} is invalid; allowed: an int in 0..1023")
    number = _SYS_MBIND.get(os.uname().machine)
    if number is None:
        raise NumaBindError(
            f"numa_node={node}: binding memory is not supported on {os.uname().machine}"
        )
    words = node // 64 + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // 64] = 1 << (node % 64)
    libc = ctypes.CDLL(None, use_errno=True)
    # The kernel reads maxnode - 1 bits of the mask.
    rc = libc.syscall(
        number,
        ctypes.c_void_p(address),
        ctypes.c_ulong(nbytes),
        _MPOL_PREFERRED,
        mask,
        ctypes.c_ulong(words * 64 + 1),
        0,
    )
    if rc != 0:
        err = ctypes.get_errno()
        if err in (errno.EPERM, errno.ENOSYS):
            raise NumaBindError(
                f"numa_node={node}: mbind is not permitted here ({os.strerror(err)})"
            )
        raise NumaBindError(
            f"numa_node={node} is invalid: mbind refused it ({os.strerror(err)}); allowed: a "
            f"node of this machine (see /sys/devices/system/node)"
        )


def _register(
    buffer: torch.Tensor, ranges: list[tuple[int, int]], device: torch.device, quiet: bool = False
) -> list[int]:
    """Page-locks each range and returns their addresses, one driver call per piece (torch's
    binding releases the GIL during each)."""
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    total = sum(n for _, n in ranges)
    done: list[int] = []
    done_bytes = 0
    log_every = max(1, len(ranges) // 10)
    started = time.monotonic()
    if not quiet:
        logger.info("pinning %.2f GiB of CPU memory in %d pieces", total / 2**30, len(ranges))
    with torch.cuda.device(device):
        for i, (offset, nbytes) in enumerate(ranges):
            ptr = buffer.data_ptr() + offset
            err = cudart.cudaHostRegister(ptr, nbytes, 0)
            if err != cudart.cudaError.success:
                # The failure stays as CUDA's last error, which torch would report at the next
                # kernel launch as that launch's failure (often a misleading "out of memory").
                _clear_last_cuda_error()
                _unregister(buffer, done)
                raise KVOffloadError(
                    f"cudaHostRegister of {nbytes} bytes (piece {i} of {len(ranges)}) failed: "
                    f"{cudart.cudaGetErrorString(err)}"
                )
            done.append(ptr)
            done_bytes += nbytes
            if not quiet and ((i + 1) % log_every == 0 or i + 1 == len(ranges)):
                logger.info(
                    "pinned %.2f / %.2f GiB (%.1f s)",
                    done_bytes / 2**30,
                    total / 2**30,
                    time.monotonic() - started,
                )
    return done


def _release(
    memory: object, ptrs: list[int], stop: threading.Event, threads: list[threading.Thread]
) -> None:
    stop.set()
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join()
    _unregister(memory, ptrs)


def _unregister(memory: object, ptrs: list[int]) -> None:
    """Takes the pool's memory as an argument only so that the finalizer keeps it allocated until
    it has been unregistered."""
    if ptrs:
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        for ptr in ptrs:
            err = cudart.cudaHostUnregister(ptr)
            if err != cudart.cudaError.success:
                _clear_last_cuda_error()
                logger.warning(
                    "cudaHostUnregister of the CPU pool at 0x%x failed: %s",
                    ptr,
                    cudart.cudaGetErrorString(err),
                )
        ptrs.clear()


def _cudart_library() -> Any:
    """The CUDA runtime torch loaded (the same library, so the same last-error state), or None:
    torch's own binding offers no `cudaGetLastError`."""
    for name in ("libcudart.so.12", "libcudart.so.13", "libcudart.so.11.0", "libcudart.so"):
        try:
            return ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
    return None


def _clear_last_cuda_error() -> None:
    lib = _cudart_library()
    if lib is None:
        logger.warning("could not load the CUDA runtime to clear a failed call's error state")
        return
    lib.cudaGetLastError()
