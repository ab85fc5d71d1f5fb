"""The transfer engine: torch copies of KV chunks between the GPU cache and a pinned CPU pool.

This is the only part of kvoffload that imports torch. `TransferEngine` is the entry point;
`KVCacheLayout` tells how big a chunk is before an engine exists (e.g. to turn a byte budget into
a number of slots), and `CpuPool` is the engine's slot memory.
"""

try:
    import torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("kvoffload.transfer needs torch: pip install 'kvoffload[torch]'") from exc

from kvoffload.transfer.engine import TransferEngine, TransferResult
from kvoffload.transfer.layout import KVCacheLayout, KVCaches
from kvoffload.transfer.plan import COPY_PATHS, CopyPath, JobPart
from kvoffload.transfer.pool import MAX_PIECE_BYTES, CpuPool

__all__ = [
    "COPY_PATHS",
    "MAX_PIECE_BYTES",
    "CopyPath",
    "CpuPool",
    "JobPart",
    "KVCacheLayout",
    "KVCaches",
    "TransferEngine",
    "TransferResult",
]
