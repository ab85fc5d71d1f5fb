"""`KVOffloadSpec`: our manager (`manager`) and copy worker (`worker`) inside vLLM's own
`OffloadingConnector` (`spec_module_path: kvoffload.vllm`)."""

from kvoffload.vllm.spec.manager import KVOffloadManager
from kvoffload.vllm.spec.spec import KVOffloadSpec
from kvoffload.vllm.spec.worker import KVOffloadWorker

__all__ = ["KVOffloadManager", "KVOffloadSpec", "KVOffloadWorker"]
