"""The engine model on small generated workloads: the table adds up, and the GPU prefix cache
behaves like vLLM's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvoffload.scheduler import OffloadConfig
from kvoffload.simulate import (
    Agentic,
    Chat,
    EngineConfig,
    ReasoningChat,
    SharedPrefix,
    SimRequest,
    simulate,
)
from kvoffload.simulate.gpu_cache import GpuPrefixCache
from kvoffload.simulate.workloads import block_hashes

BPC_BYTES = 16 * 1024  # 16 tokens x 1 KiB

SMALL = {
    "reasoning-chat": ReasoningChat(
        conversations=6,
        turns=3,
        system_prompts=2,
        system_prompt_tokens=128,
        user_tokens=32,
        thinking_tokens=64,
        answer_tokens=32,
    ),
    "chat": Chat(
        conversations=6,
        turns=3,
        system_prompts=2,
        system_prompt_tokens=128,
        user_tokens=32,
        answer_tokens=32,
    ),
    "shared-prefix": SharedPrefix(prefixes=3, prefix_tokens=256, questions=24),
    "agentic": Agentic(agents=4, steps=4, system_prompt_tokens=256, tool_output_tokens=64),
}
ENGINE = EngineConfig(gpu_blocks=128, max_running=4, max_batched_tokens=256)


def run(workload, *, prompt_only=True, cpu_chunks=512, blocks_per_chunk=1, policy="lru"):
    """A GPU cache of twice the largest request: small enough that the CPU tier gets hits."""
    requests = workload.requests(0)
    gpu_blocks = 2 * max(ENGINE.blocks_needed(r, 16) for r in requests)
    engine = dataclasses.replace(ENGINE, gpu_blocks=gpu_blocks)
    config = OffloadConfig(
        16, blocks_per_chunk, cpu_chunks * BPC_BYTES * blocks_per_chunk, prompt_only, policy
    )
    return simulate(requests, engine, config, BPC_BYTES * blocks_per_chunk)


@pytest.mark.parametrize("name", list(SMALL))
@pytest.mark.parametrize("prompt_only", [True, False])
@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_the_table_adds_up(name, prompt_only, blocks_per_chunk):
    w = SMALL[name]
    r = run(w, prompt_only=prompt_only, blocks_per_chunk=blocks_per_chunk)
    requests = w.requests(0)
    assert r.requests == len(requests)
    assert r.prompt_tokens == sum(len(q.prompt) for q in requests)
    assert r.gpu_hit_tokens + r.cpu_hit_tokens + r.recomputed_tokens == r.prompt_tokens
    chunk_bytes = BPC_BYTES * blocks_per_chunk
    assert r.bytes_written == r.chunks_written * chunk_bytes
    assert r.bytes_read == r.chunks_read * chunk_bytes
    # A load starts at a block inside its first chunk and ends on a chunk boundary.
    tpc = 16 * blocks_per_chunk
    assert (r.chunks_read - 1) * tpc < r.cpu_hit_tokens <= r.chunks_read * tpc or r.chunks_read == 0
    assert r.cpu_hit_tokens > 0 and r.gpu_hit_tokens > 0
    assert r.ttft_p90_s >= r.ttft_mean_s * 0.5 > 0
    if prompt_only:
        assert r.decode_chunks_written == 0


def test_prompt_only_writes_fewer_chunks_on_reasoning_chat():
    on, off = run(SMALL["reasoning-chat"]), run(SMALL["reasoning-chat"], prompt_only=False)
    assert on.chunks_written < off.chunks_written
    assert (on.decode_chunks_written, off.decode_chunks_written > 0) == (0, True)
    # The thinking never comes back: its chunks are never hit, so prompt-only loses no hits.
    assert on.cpu_hit_tokens >= off.cpu_hit_tokens


def test_a_small_tier_evicts_and_hits_less():
    big, small = run(SMALL["chat"]), run(SMALL["chat"], cpu_chunks=12)
    assert big.evictions == 0 < small.evictions
    assert small.cpu_hit_tokens < big.cpu_hit_tokens


def test_arc_runs_the_same_workload():
    lru, arc = run(SMALL["agentic"]), run(SMALL["agentic"], policy="arc")
    assert lru.prompt_tokens == arc.prompt_tokens
    assert arc.gpu_hit_tokens + arc.cpu_hit_tokens + arc.recomputed_tokens == arc.prompt_tokens


def test_reasoning_chat_strips_the_thinking_from_the_next_prompt():
    w = ReasoningChat(conversations=2, turns=2, thinking_tokens=5, answer_tokens=3)
    first, _, second, _ = w.requests(0)
    assert second.after == first.request_id
    thinking, answer = first.output[:5], first.output[5:]
    prefix = np.concatenate([first.prompt, answer])
    assert np.array_equal(second.prompt[: len(prefix)], prefix)
    assert len(second.prompt) == len(prefix) + w.user_tokens
    assert not np.array_equal(second.prompt[len(first.prompt) :][:5], thinking)


def test_chat_keeps_the_answer_verbatim():
    first, _, second, _ = Chat(conversations=2, turns=2).requests(0)
    kept = np.concatenate([first.prompt, first.output])
    assert np.array_equal(second.prompt[: len(kept)], kept)


def test_agentic_contexts_grow_by_action_and_tool_output():
    w = Agentic(agents=1, steps=3, action_tokens=4, tool_output_tokens=6)
    a, b, c = w.requests(0)
    assert np.array_equal(b.prompt[: len(a.prompt) + 4], np.concatenate([a.prompt, a.output]))
    assert len(c.prompt) == len(b.prompt) + 4 + 6


@pytest.mark.parametrize("w", [*SMALL.values(), ReasoningChat(), Agentic(steps=3)])
def test_num_tokens_is_what_the_requests_hold(w):
    assert w.num_tokens() == sum(len(r.prompt) + len(r.output) for r in w.requests(1))


def test_requests_wait_for_the_turn_they_follow():
    # One conversation, two turns, four slots: turn 1 still starts only after turn 0 ended.
    w = Chat(conversations=1, turns=2, system_prompt_tokens=64, user_tokens=16, answer_tokens=16)
    r = simulate(w.requests(0), ENGINE, OffloadConfig(16, 1, 48 * BPC_BYTES), BPC_BYTES)
    # Turn 1 finds turn 0's prompt and its answer's first full block on the GPU.
    assert r.gpu_hit_tokens == 64 + 16 + 0
    assert r.steps == 16 + 16


def test_a_loaded_whole_prompt_still_computes_its_last_token():
    # The prompt is exactly 4 chunks, all in the CPU tier: the lookup offers 64 tokens, so
    # nothing is recomputed, but the engine still runs a step for the last token.
    tokens = np.arange(1, 65, dtype=np.int32)
    other = np.arange(1000, 1096, dtype=np.int32)
    out = np.ones(1, dtype=np.int32)
    reqs = [
        SimRequest("a", tokens, out),
        SimRequest("b", other, out, arrival=1.0),
        SimRequest("c", tokens, out, arrival=2.0),
    ]
    engine = EngineConfig(gpu_blocks=6, max_running=1)
    r = simulate(reqs, engine, OffloadConfig(16, 1, 48 * BPC_BYTES), BPC_BYTES)
    assert (r.gpu_hit_tokens, r.cpu_hit_tokens, r.recomputed_tokens) == (0, 64, 64 + 96)
    assert r.steps == 3


def test_gpu_cache_evicts_least_recently_freed_tails_first():
    cache = GpuPrefixCache(4)
    hashes = block_hashes(np.arange(64, dtype=np.int32), 16)
    blocks = cache.allocate(4)
    cache.cache(blocks, hashes)
    cache.release(blocks)
    assert cache.longest_hit(hashes, 4) == blocks
    # Freed tail first: one new block takes the last block of the prefix.
    (b,) = cache.allocate(1)
    assert b == blocks[3]
    assert cache.longest_hit(hashes, 4) == blocks[:3]
    # A hit takes idle blocks out of the free queue.
    assert cache.num_idle(blocks[:3]) == 3
    cache.touch(blocks[:3])
    assert (cache.num_free, cache.num_idle(blocks[:3])) == (0, 0)
    with pytest.raises(RuntimeError, match="allocating 1 GPU blocks with 0 free"):
        cache.allocate(1)


def test_requests_the_gpu_cannot_hold_are_refused():
    w = Chat(conversations=1, turns=1)
    with pytest.raises(ValueError, match="gpu_blocks=128 is too small: request 'c0-t0' needs 176"):
        simulate(w.requests(0), ENGINE, OffloadConfig(16, 1, 48 * BPC_BYTES), BPC_BYTES)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("gpu_blocks", 0, "gpu_blocks=0 is invalid: expected an int >= 1"),
        ("max_running", 2.0, "max_running=2.0 is invalid: expected an int >= 1"),
        ("pcie_gbps", float("inf"), "pcie_gbps=inf is invalid: expected a finite number > 0"),
        ("decode_step_ms", -1, "decode_step_ms=-1 is invalid: expected a finite number > 0"),
    ],
)
def test_engine_config_names_a_bad_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{field: value})


def test_repeated_request_ids_are_refused():
    req = SimRequest("x", np.arange(1, 17, dtype=np.int32), np.ones(1, dtype=np.int32))
    with pytest.raises(ValueError, match="requests repeat a request_id"):
        simulate([req, req], ENGINE, OffloadConfig(16, 1, 48 * BPC_BYTES), BPC_BYTES)


def test_a_request_following_an_unknown_one_is_refused():
    req = SimRequest(
        "x", np.arange(1, 17, dtype=np.int32), np.ones(1, dtype=np.int32), after="nobody"
    )
    with pytest.raises(ValueError, match=r"requests follow unknown request ids: \['nobody'\]"):
        simulate([req], ENGINE, OffloadConfig(16, 1, 48 * BPC_BYTES), BPC_BYTES)
