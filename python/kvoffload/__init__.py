"""kvoffload: KV-cache offloading from GPU memory to a CPU-memory tier for LLM serving.

`import kvoffload` stays light (no torch, no vllm): the transfer engine lives in
`kvoffload.transfer` (needs torch) and the vLLM adapters in `kvoffload.vllm`.
"""

from importlib.metadata import PackageNotFoundError, version

from kvoffload.errors import ConfigError, InvalidStateError, KVOffloadError, NotSupportedError
from kvoffload.store import (
    MAX_KEY_LEN,
    POLICY_NAMES,
    CpuStore,
    KeyList,
    KeyRange,
    KeyStatus,
    PrefixLookup,
    StoreEvent,
    StorePlan,
    StoreStats,
)

try:
    __version__ = version("kvoffload")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "MAX_KEY_LEN",
    "POLICY_NAMES",
    "ConfigError",
    "CpuStore",
    "InvalidStateError",
    "KVOffloadError",
    "KeyList",
    "KeyRange",
    "KeyStatus",
    "NotSupportedError",
    "PrefixLookup",
    "StoreEvent",
    "StorePlan",
    "StoreStats",
    "__version__",
]
