"""The three seed controls through vLLM's real scheduler: `offload_prompt_only`,
`max_offload_tokens` and `max_load_tokens`, with exact GPU block offsets, through both seams
(`seam`: KVOffloadConnector, and KVOffloadSpec inside vLLM's OffloadingConnector).

Blocks of 4 tokens, chunks of 12 (3 blocks); offsets are positions in the request's block table.
"""

from __future__ import annotations

import logging

import pytest
from rig import make_rig, prompt


def run_one(model_dir, is_async, seam, rid, prompt_len, max_tokens, params=None, **extra):
    rig = make_rig(model_dir, is_async=is_async, connector=seam, extra=extra)
    rig.add(rid, prompt(1, prompt_len), max_tokens, params)
    rig.run()
    return rig


def test_prompt_only_by_default_stores_prompt_chunks_only(model_dir, is_async, seam):
    # Prompt 24 + 49 output tokens: KV exists for 72 tokens (the last sampled one has none).
    rig = run_one(model_dir, is_async, seam, "r", 24, 49)
    assert len(rig.outputs["r"]) == 49
    assert rig.offsets_stored("r") == set(range(6))


def test_prompt_only_off_stores_decode_chunks(model_dir, is_async, seam):
    rig = run_one(model_dir, is_async, seam, "r", 24, 49, offload_prompt_only=False)
    assert rig.offsets_stored("r") == set(range(18))


def test_prompt_final_partial_chunk_is_not_stored(model_dir, is_async, seam):
    rig = run_one(model_dir, is_async, seam, "r", 30, 20)
    assert rig.offsets_stored("r") == set(range(6))  # 2 whole chunks of the 30-token prompt


@pytest.mark.parametrize(
    ("cap", "offsets"),
    [
        (None, set(range(12))),
        (0, set()),
        (12, {0, 1, 2}),
        (13, {0, 1, 2}),  # whole chunks only
        (30, set(range(6))),
        (1000, set(range(12))),
    ],
)
def test_max_offload_tokens(model_dir, is_async, seam, cap, offsets):
    params = None if cap is None else {"max_offload_tokens": cap}
    rig = run_one(model_dir, is_async, seam, "r", 48, 4, params)
    assert rig.offsets_stored("r") == offsets


@pytest.mark.parametrize("bad", ["8", True, -1, 8.5])
def test_invalid_max_offload_tokens_is_ignored_with_one_warning(
    model_dir, is_async, seam, bad, caplog
):
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        rig = run_one(model_dir, is_async, seam, "r", 48, 4, {"max_offload_tokens": bad})
    assert rig.offsets_stored("r") == set(range(12))
    if seam == "spec":
        return  # vLLM's connector parses the parameters (and warns) itself
    warnings = [r for r in caplog.records if "max_offload_tokens" in r.getMessage()]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "request r" in message and repr(bad) in message and type(bad).__name__ in message
    assert rig.connector._sched().scheduler.stats().ignored_params == {"max_offload_tokens": 1}


def stored_then_loaded(model_dir, is_async, seam, params, *, prompt_len=48, extra_tokens=10):
    """Request "a" stores its 48-token prompt (4 chunks); the GPU prefix cache is dropped; "b"
    repeats that prompt plus `extra_tokens` with `params`."""
    rig = make_rig(model_dir, is_async=is_async, connector=seam)
    rig.add("a", prompt(7, prompt_len), 2)
    rig.run()
    rig.reset_gpu_prefix_cache()
    rig.add("b", prompt(7, prompt_len) + prompt(8, extra_tokens), 3, params)
    rig.run()
    return rig


@pytest.mark.parametrize(
    ("cap", "loaded"),
    [(None, 48), (0, 0), (12, 12), (20, 12), (30, 24), (48, 48), (1000, 48)],
)
def test_max_load_tokens(model_dir, is_async, seam, cap, loaded):
    params = None if cap is None else {"max_load_tokens": cap}
    rig = stored_then_loaded(model_dir, is_async, seam, params)
    load = rig.load_of("b")
    assert (0 if load is None else load.num_tokens) == loaded
    if loaded:
        assert load.skip_leading_blocks == 0
        assert len(load.gpu_block_ids) == loaded // 4
    # b's first forward pass checked every loaded position byte for byte, then computed the rest.
    assert rig.checked_positions["b"] >= 58
    assert len(rig.outputs["b"]) == 3
    if seam == "spec":
        return
    stats = rig.connector._sched().scheduler.stats()
    assert stats.hit_tokens == loaded
    assert stats.lookups == (1 if cap == 0 else 2)  # 0 disables b's lookup ("a" missed once)


@pytest.mark.parametrize("bad", ["8", True, -1, 8.5])
def test_invalid_max_load_tokens_is_ignored(model_dir, is_async, seam, bad, caplog):
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        rig = stored_then_loaded(model_dir, is_async, seam, {"max_load_tokens": bad})
    assert rig.load_of("b").num_tokens == 48
    if seam == "kvoffload":  # vLLM's connector warns through its own logger
        assert sum("max_load_tokens" in r.getMessage() for r in caplog.records) == 1


def test_max_load_tokens_does_not_limit_stores(model_dir, is_async, seam):
    rig = run_one(model_dir, is_async, seam, "r", 48, 2, {"max_load_tokens": 0})
    assert rig.offsets_stored("r") == set(range(12))


def test_whole_prompt_hit_still_computes_the_last_token(model_dir, is_async, seam):
    rig = stored_then_loaded(model_dir, is_async, seam, None, extra_tokens=0)
    load = rig.load_of("b")
    assert load.num_tokens == 48  # the whole prompt comes from the CPU tier
    # vLLM rewinds a full hit by one token: b's first forward computes only its last token.
    first = next(s["b"] for s in rig.scheduled if "b" in s)
    assert first == 1
    assert len(rig.outputs["b"]) == 3
    assert rig.outputs["b"] == rig.outputs["a"][:2] + rig.outputs["b"][2:]


def test_local_prefix_not_chunk_aligned_loads_the_rest(model_dir, is_async, seam):
    """The GPU prefix cache holds 16 tokens (4 blocks: one block into chunk 1); the load starts
    at chunk 1 and skips that block."""
    rig = make_rig(model_dir, is_async=is_async, connector=seam)
    rig.add("a", prompt(3, 48), 2)
    rig.run()
    rig.reset_gpu_prefix_cache()
    # c computes (no load) and leaves the first 16 tokens of a's prompt in the GPU prefix cache.
    rig.add("c", prompt(3, 18) + prompt(4, 4), 1, {"max_load_tokens": 0})
    rig.run()
    rig.add("b", prompt(3, 48) + prompt(5, 6), 2)
    rig.run()
    load = rig.load_of("b")
    assert load.first_chunk == 1 and load.skip_leading_blocks == 1
    assert load.num_tokens == 48 - 16
    assert len(load.gpu_block_ids) == 3 * 3 - 1  # chunks 1..3, less the block already local
    assert rig.checked_positions["b"] >= 54
