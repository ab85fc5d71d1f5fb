"""The caller's buffer as the Rust data paths take it: one contiguous uint8 array sharing its
memory, whose address crosses to Rust (the abi3 binding has no buffer protocol)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


def bytes_view(buffer: Any, *, writable: bool) -> np.ndarray[Any, Any]:
    """The buffer as one contiguous uint8 array sharing its memory (a copy would defeat both the
    zero-copy path and, for loads, the destination)."""
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    if writable and view.readonly:
        raise ValueError("buffer must be writable for a load")
    return np.frombuffer(view.cast("B"), dtype=np.uint8)


def lend(
    submit: Callable[[list[bytes], Any, int, int, list[int]], int],
    keys: Sequence[bytes],
    buffer: Any,
    offsets: Sequence[int],
    *,
    writable: bool,
) -> int:
    """Submits a job over `buffer` (its array, address and size: the binding keeps the array
    until the job's completion is handed out)."""
    array = bytes_view(buffer, writable=writable)
    return submit(list(keys), array, array.ctypes.data, array.nbytes, list(offsets))
