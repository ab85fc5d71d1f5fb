"""A router beside a real engine (`scenario.py` with `"routed": [...]`): vLLM's ZMQ publisher
sends the engine's KV events, `kv_router.KVRouter` reads them off the wire, and before each
request predicts the tokens it will find; the request then runs alone and vLLM reports them
(`num_cached_tokens`: its GPU prefix cache's and the connector's)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[1]))  # kv_router, shared with the rig's tests

from kv_router import Instance, PromptHasher, router


def run_routed(llm: Any, spec: dict[str, Any], params: Any, settle: Any) -> list[list[int]]:
    """`[predicted, reported]` per request of `spec["routed"]` (prompt indices, in order)."""
    from vllm.inputs import TokensPrompt
    from vllm.utils.hashing import get_hash_fn_by_name

    config = llm.llm_engine.vllm_config
    hasher = PromptHasher(
        config.cache_config.block_size,
        get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo),
    )
    chunk_tokens = config.kv_transfer_config.kv_connector_extra_config["block_size"]

    events = config.kv_events_config
    publisher = llm.llm_engine.engine_core.engine_core.scheduler.kv_event_publisher
    results = []
    with router(hasher.block_size, chunk_tokens, hasher) as kv:
        # What the PUB socket sends before the subscription reaches it comes by replay.
        kv.connect(Instance("engine", events.endpoint, events.replay_endpoint))
        for index in spec["routed"]:
            tokens = spec["prompts"][index]
            publisher._event_queue.join()
            kv.catch_up("engine", publisher._buffer[-1][0] if publisher._buffer else -1)
            predicted = kv.predict("engine", hasher.prompt(tokens), len(tokens))
            (output,) = llm.generate(
                [TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False
            )
            settle(llm, False)
            results.append([predicted, output.num_cached_tokens])
    return results
