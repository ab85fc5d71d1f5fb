"""A router beside a real engine (`scenario.py` with `"routed": [...]`): vLLM's ZMQ publisher
sends the engine's KV events, `kv_router.KVRouter` reads them off the wire, and before each
request predicts the tokens it will find; the request then runs alone and vLLM reports them
(`num_cached_tokens`: its GPU prefix cache's and the connector's)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[1]))  # kv_router, shared with the rig's tests

from kv_router import Instance, router


def run_routed(llm: Any, spec: dict[str, Any], params: Any, settle: Any) -> list[list[int]]:
    """`[predicted, reported]` per request of `spec["routed"]` (prompt indices, in order)."""
    from vllm.inputs import TokensPrompt
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, maybe_convert_block_hash

    config = llm.llm_engine.vllm_config
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    block_size = config.cache_config.block_size
    chunk_tokens = config.kv_transfer_config.kv_connector_extra_config["block_size"]
    known: dict[Any, bytes] = {}

    def hash_tokens(parent: Any, tokens: list[int]) -> Any:
        h = hash_block_tokens(hash_fn, None if parent is None else known[parent], tokens)
        known[maybe_convert_block_hash(h)] = h
        return maybe_convert_block_hash(h)

    def hashes(tokens: list[int]) -> list[Any]:
        out, parent = [], None
        for i in range(len(tokens) // block_size):
            parent = hash_tokens(parent, tokens[i * block_size : (i + 1) * block_size])
            out.append(parent)
        return out

    events = config.kv_events_config
    publisher = llm.llm_engine.engine_core.engine_core.scheduler.kv_event_publisher
    results = []
    with router(block_size, chunk_tokens, hash_tokens) as kv:
        # What the PUB socket sends before the subscription reaches it comes by replay.
        kv.connect(Instance("engine", events.endpoint, events.replay_endpoint))
        for index in spec["routed"]:
            tokens = spec["prompts"][index]
            publisher._event_queue.join()
            kv.catch_up("engine", publisher._buffer[-1][0] if publisher._buffer else -1)
            predicted = kv.predict("engine", hashes(tokens), len(tokens))
            (output,) = llm.generate(
                [TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False
            )
            settle(llm, False)
            results.append([predicted, output.num_cached_tokens])
    return results
