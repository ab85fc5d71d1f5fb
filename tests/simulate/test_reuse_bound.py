"""Every run prints the workload's prefix-reuse bound (the most any tier could hit); a comparison
whose settings hit the same says why; wall-clock rows stand apart from the simulated ones."""

from __future__ import annotations

import pytest
from sim_helpers import TINY, ids_line, write_trace
from test_hash_ids_and_fleets import BLOCK, random_tree_trace, reuse_bound

from kvoffload._docs import docs_url
from kvoffload.cli import main
from kvoffload.simulate.reuse import prefix_reuse_bound
from kvoffload.simulate.workloads import ReasoningChat


def test_the_default_workloads_bound_is_what_its_conversations_repeat():
    # Per conversation: turns 1-3 repeat the whole prompt before them (2,304 + 2,816 + 3,328
    # tokens; the thinking, dropped from the next prompt, is never repeated); turn 0 repeats
    # its system prompt (2,048) unless it is the first of the 4 to use it (28 of 32 do).
    requests = ReasoningChat().requests(0)
    assert prefix_reuse_bound(requests, 16) == 32 * 8_448 + 28 * 2_048 == 327_680
    # The order does not matter: the first to compute a block is whichever runs first.
    assert prefix_reuse_bound(requests[::-1], 16) == 327_680


def test_kv_computed_past_a_prompt_counts_too(run_cli):
    # A chat answer of 17 tokens: turn 0's 65 tokens compute 4 full blocks (the last token's KV
    # never exists), the 4th holding the answer, which turn 1 repeats after the 48 tokens of
    # turn 0's prompt: 64 tokens, all hit in the GPU cache.
    chat = ["--workload", "chat", "--conversations", "1", "--turns", "2", "--system-prompts", "1"]
    chat += ["--system-prompt-tokens", "32", "--user-tokens", "16", "--answer-tokens", "17"]
    _, out, _ = run_cli(*chat)
    assert out["prefix_reuse_bound_tokens"] == 64
    assert out["runs"][0]["result"]["gpu_hit_tokens"] == 64


def test_one_request_at_a_time_with_room_for_everything_hits_the_bound(tmp_path, run_cli):
    lines = random_tree_trace(60, 100_000)
    trace = write_trace(tmp_path / "t.jsonl", lines)
    tier = ["--kv-bytes-per-token", "1024", "--cpu-gib", str(64 / 1024), "--gpu-blocks", "24"]
    _, out, _ = run_cli("--trace", trace, *BLOCK, *tier)
    r = out["runs"][0]["result"]
    assert out["prefix_reuse_bound_tokens"] == reuse_bound(lines) == 3_840
    assert r["gpu_hit_tokens"] + r["cpu_hit_tokens"] == 3_840


@pytest.mark.parametrize("router", ["round-robin", "prefix-affinity", "tier-aware"])
def test_no_router_or_tier_hits_more_than_the_bound(tmp_path, run_cli, router):
    # Waves of 10 at once on 4 instances with a shared tier: whoever computes first, the hits of
    # all tiers together stay within the bound.
    lines = random_tree_trace(60, 100_000, wave=10)
    trace = write_trace(tmp_path / "t.jsonl", lines)
    fleet = [*TINY, "--gpu-blocks", "64", "--instances", "4", "--router", router]
    _, out, _ = run_cli("--trace", trace, *BLOCK, *fleet, "--remote-gib", str(1 / 1024))
    r = out["runs"][0]["result"]
    hits = r["gpu_hit_tokens"] + r["cpu_hit_tokens"] + r["remote_hit_tokens"]
    assert 0 < hits <= out["prefix_reuse_bound_tokens"] == reuse_bound(lines)


def _note(out: str) -> str:
    """The lines between the last simulated row and the measured ones, joined."""
    return " ".join(out.split("\nsimulated s")[1].split("\n\n")[0].splitlines()[1:])


def test_the_default_shared_tier_comparison_says_why_it_changes_nothing(capsys):
    # What `make run` shows with a shared tier: the 8 GiB CPU tier already keeps everything.
    assert main(["simulate", "--compare", "shared_tier", "--remote-gib", "64"]) == 0
    out = capsys.readouterr().out
    assert (
        "prefix-reuse bound 83.3% (327,680 prompt tokens repeat KV another request computes, "
        "in 16-token blocks): no tier, nor all together, can hit more\n\n"
    ) in out
    assert _note(out) == (
        "Every setting hits 77.1% of the prompt tokens (all tiers together) against a bound of "
        "83.3%: the 6.2% between are tokens no tier held when asked for (still being computed "
        "when a request repeating them arrived, or evicted before they came back). The baseline "
        "(no shared tier) evicts nothing: all it computed still fits, so neither a larger tier "
        "nor one behind the CPU tier has more to serve. A comparison shows something where what "
        "repeats outgrows the GPU cache and the tiers: a larger workload (e.g. --conversations "
        "128), or a smaller --cpu-gib (e.g. 2)."
    )


def test_a_comparison_that_changes_the_hits_has_no_note(capsys):
    argv = ["simulate", "--compare", "shared_tier", "--remote-gib", "64", "--cpu-gib", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "remote-tier hits                      0 (0.0%)        29,440 (7.5%)" in out
    assert "Every setting hits" not in out


def test_a_workload_that_repeats_nothing_is_named(tmp_path, capsys):
    # Four prompts of their own ids: nothing repeats, no policy can hit anything.
    trace = write_trace(tmp_path / "t.jsonl", [ids_line(i, [i], 32) for i in range(4)])
    argv = ["simulate", "--trace", trace, *BLOCK, *TINY, "--compare", "eviction_policy"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "prefix-reuse bound 0.0% (0 prompt tokens repeat" in out
    assert _note(out).startswith(
        "Every setting hits 0.0% of the prompt tokens (all tiers together) against a bound of "
        "0.0%: the workload repeats almost nothing, so no tier can hit more."
    )


def test_a_baseline_at_the_bound_is_named(tmp_path, capsys):
    lines = random_tree_trace(60, 100_000)
    trace = write_trace(tmp_path / "t.jsonl", lines)
    tier = ["--kv-bytes-per-token", "1024", "--cpu-gib", str(64 / 1024), "--gpu-blocks", "24"]
    assert main(["simulate", "--trace", trace, *BLOCK, *tier, "--compare", "eviction_policy"]) == 0
    assert _note(capsys.readouterr().out).startswith(
        "Every setting hits 44.1% of the prompt tokens (all tiers together) against a bound of "
        "44.1%: lru already hits all but 0.0% of it. A comparison shows something where what "
        "repeats outgrows the GPU cache and the tiers: a longer trace, or a smaller --cpu-gib"
    )


def test_wall_clock_rows_stand_apart_with_no_change_column(capsys):
    small = ["--conversations", "2", "--turns", "2", "--compare", "offload_prompt_only"]
    assert main(["simulate", *small]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("measured on this machine (wall clock, noisy; not simulated):")
    assert lines[at - 1] == ""
    (row,) = lines[at + 1 :]
    assert row.startswith("scheduler us/step")
    assert row.endswith(" steps)")  # the second run's value: no change column after it
    assert not any(line.startswith("scheduler") for line in lines[:at])


def test_help_points_at_the_published_docs(capsys):
    assert main(["simulate", "--help"]) == 0
    out = capsys.readouterr().out
    assert docs_url("simulator") in out
    assert "docs/" not in out.replace(docs_url("simulator"), "")
