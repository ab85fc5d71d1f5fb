"""`KVOffloadConnector`: our connector end to end (`kv_connector_module_path: kvoffload.vllm`).

`connector` holds vLLM's connector API, `scheduler_side` and `worker_side` its two halves,
`settings` what both compute alike from vLLM's config, `metadata` what the scheduler hands the
workers each step and they report back, `stats` its metrics."""

from kvoffload.vllm.connector.connector import KVOffloadConnector
from kvoffload.vllm.connector.stats import KVOffloadStats

__all__ = ["KVOffloadConnector", "KVOffloadStats"]
