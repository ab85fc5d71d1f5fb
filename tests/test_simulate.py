import json

import pytest

from kvoffload.cli import main
from kvoffload.scheduler import OffloadConfig
from kvoffload.simulate import Workload, simulate

# 2 sessions x 2 turns sharing one 64-token system prompt; 16-token user turns.
SMALL = Workload(sessions=2, turns=2, system_prompts=1, system_prompt_tokens=64, user_tokens=16)


def run(answer_tokens=32, prompt_only=True, params=None, cpu_bytes=1 << 20):
    config = OffloadConfig.from_dict(
        {
            "tokens_per_block": 16,
            "cpu_bytes_to_use": cpu_bytes,
            "offload_prompt_only": prompt_only,
        }
    )
    w = Workload(**{**SMALL.__dict__, "answer_tokens": answer_tokens})
    return simulate(config, w, bytes_per_chunk=1024, kv_params=params or {})


def test_hits_follow_the_shared_prefixes():
    r = run()
    # Prompts: 80, 80 (turn 0), then 80 + 32 answer + 16 user = 128 (turn 1).
    assert r.prompt_tokens == 80 + 80 + 128 + 128
    # s1 t0 finds the system prompt (64); turn 1 finds each session's previous prompt (80).
    assert r.loaded_tokens == 0 + 64 + 80 + 80
    assert r.computed_prompt_tokens == r.prompt_tokens - r.loaded_tokens
    assert r.scheduler["chunks_stored"] == 5 + 1 + 3 + 3


def test_decode_offload_also_reuses_the_answer():
    r = run(prompt_only=False)
    # Turn 1 also finds the previous answer: KV exists for 111 of its 112 tokens -> 6 chunks.
    assert r.loaded_tokens == 0 + 64 + 96 + 96


def test_max_load_tokens_caps_every_load():
    assert run(params={"max_load_tokens": 32}).loaded_tokens == 0 + 32 + 32 + 32


def test_a_small_tier_evicts():
    r = run(cpu_bytes=6 * 1024)
    assert r.store["num_slots"] == 6
    assert r.store["evictions"] > 0
    assert r.loaded_tokens < 224


def test_a_tier_smaller_than_one_prompt_refuses_every_offer():
    # Every request offers at least 5 chunks at once; 4 slots never take them (all-or-nothing).
    r = run(cpu_bytes=4 * 1024)
    assert r.loaded_tokens == 0
    assert r.store["used_slots"] == 0
    assert r.scheduler["store_refusals"] > 0


def test_cli_json(capsys):
    assert (
        main(
            [
                "simulate",
                "--sessions",
                "2",
                "--turns",
                "2",
                "--system-prompts",
                "1",
                "--system-prompt-tokens",
                "64",
                "--user-tokens",
                "16",
                "--answer-tokens",
                "32",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["loaded_tokens"] == 224
    assert out["hit_rate"] == pytest.approx(224 / 416)


def test_cli_reports_bad_config(capsys):
    assert main(["simulate", "--eviction-policy", "fifo"]) == 2
    assert "eviction_policy='fifo'" in capsys.readouterr().err
