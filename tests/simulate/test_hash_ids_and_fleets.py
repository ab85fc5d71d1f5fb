"""Hash-ids traces (Mooncake's format) and fleets of engines behind a router, with hits
computed by hand or from the ids."""

from __future__ import annotations

import collections
import io
import json
import random
import sys

import pytest
from sim_helpers import FOUR, TINY, ids_line, seg, write_trace

from kvoffload.cli import main

BLOCK = ["--hash-block-tokens", "32"]  # one id = 32 tokens = 2 GPU blocks = 2 chunks


# L1 computes ids 1, 2 (64 tokens, 4 chunks stored). L2 arrives at the same ms with id 1 and a
# partial id 3 (16 of its 32 tokens): it runs after L1 (one at a time) and finds id 1 (32
# tokens) on the GPU, storing the 1 chunk of id 3 it computes. L3 (10 s later): ids 1, 2 and a
# partial id 4: 64 tokens on the GPU (its hit may reach (80 - 1) // 16 = 4 blocks), 1 new chunk.
HAND = [ids_line(0, [1, 2], 64), ids_line(0, [1, 3], 48), ids_line(10_000, [1, 2, 4], 80)]
ENGINE = [*TINY, "--gpu-blocks", "64", "--max-running", "1"]


def test_a_hand_made_hash_ids_trace_gives_the_computed_hits(tmp_path, run_cli):
    trace = write_trace(tmp_path / "t.jsonl", HAND)
    code, out, err = run_cli("--trace", trace, *BLOCK, *ENGINE)
    assert code == 0, err
    r = out["runs"][0]["result"]
    assert r["requests"] == 3
    assert r["prompt_tokens"] == 64 + 48 + 80
    assert r["gpu_hit_tokens"] == 32 + 64
    assert r["cpu_hit_tokens"] == 0
    assert r["recomputed_tokens"] == 64 + 16 + 16
    assert r["chunks_written"] == 4 + 1 + 1
    assert out["workload"]["format"] == "hash-ids"


def test_the_same_requests_in_both_formats_give_the_same_table(tmp_path, capsys):
    # Id n's tokens are segment "n"'s: a partial block is a shorter use of the segment.
    same = [
        {"id": "a", "prompt": [seg("1", 32), seg("2", 32)], "output_tokens": 1},
        {"id": "b", "prompt": [seg("1", 32), seg("3", 16)], "output_tokens": 1},
        {"id": "c", "arrival": 10, "prompt": [seg("1", 32), seg("2", 32), seg("4", 16)],
         "output_tokens": 1},
    ]  # fmt: skip
    tables = []
    for name, lines, extra in (("h.jsonl", HAND, BLOCK), ("k.jsonl", same, [])):
        trace = write_trace(tmp_path / name, lines)
        assert main(["simulate", "--trace", trace, *extra, *ENGINE, "--offload-decode"]) == 0
        out = capsys.readouterr().out.splitlines()
        # Past the title (it names the file and format); scheduler time is wall-clock, and its
        # width sets the columns', so cells are compared, not padding.
        tables.append([line.split() for line in out[1:] if not line.startswith("scheduler")])
    assert tables[0] == tables[1]


def random_tree_trace(n: int, gap_ms: float, wave: int = 1, seed: int = 1) -> list[dict]:
    """Requests that extend earlier requests' id prefixes, in whole 32-token blocks, arriving
    `wave` at a time, `gap_ms` apart."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    next_id, lines = 0, []
    for i in range(n):
        base = rng.choice(prompts)[: rng.randint(1, 6)] if prompts and rng.random() < 0.7 else []
        fresh = list(range(next_id, next_id + rng.randint(1, 4)))
        next_id += len(fresh)
        prompts.append(base + fresh)
        lines.append(
            ids_line(i // wave * gap_ms, base + fresh, 32 * len(base + fresh), rng.randint(1, 8))
        )
    return lines


def reuse_bound(lines: list[dict], wave: int = 1) -> int:
    """For each request, the tokens of the longest prefix of its ids that a request of an
    earlier wave of `wave` requests started with (1: any earlier request). Every request has an
    id of its own, so the prompt's last token is never in such a prefix."""
    bound, seen, done = 0, set(), set()
    for i, line in enumerate(lines):
        if i % wave == 0:
            done |= seen
        ids = line["hash_ids"]
        bound += 32 * max((k for k in range(len(ids) + 1) if tuple(ids[:k]) in done), default=0)
        seen.update(tuple(ids[:k]) for k in range(1, len(ids) + 1))
    return bound


def test_with_an_unbounded_tier_sequential_hits_equal_the_prefix_reuse_bound(tmp_path, run_cli):
    # One request at a time (100 s apart): nothing is lost to concurrency, and a 64 MiB tier
    # (4,096 chunks) keeps every chunk, so every reusable token is a hit (GPU or CPU) and no
    # other token is. The GPU cache is just large enough for the largest request.
    lines = random_tree_trace(60, 100_000)
    bound = reuse_bound(lines)
    trace = write_trace(tmp_path / "t.jsonl", lines)
    tier = ["--kv-bytes-per-token", "1024", "--cpu-gib", str(64 / 1024)]
    code, out, err = run_cli("--trace", trace, *BLOCK, *tier, "--gpu-blocks", "24")
    assert code == 0, err
    r = out["runs"][0]["result"]
    assert r["evictions"] == 0
    assert r["gpu_hit_tokens"] + r["cpu_hit_tokens"] == bound
    assert bound > 0


def test_concurrent_arrivals_lose_exactly_what_is_not_computed_yet(tmp_path, run_cli):
    # Waves of 10 at once, 100 s apart: a wave is admitted in one step (10 of 16 running), so a
    # request finds the prefixes of earlier waves (GPU or the 64 MiB tier, which keeps every
    # chunk) and none of its own wave's, which are not computed yet when it is admitted.
    lines = random_tree_trace(60, 100_000, wave=10)
    trace = write_trace(tmp_path / "t.jsonl", lines)
    tier = ["--kv-bytes-per-token", "1024", "--cpu-gib", str(64 / 1024)]
    _, out, _ = run_cli("--trace", trace, *BLOCK, *tier, "--gpu-blocks", "512")
    r = out["runs"][0]["result"]
    assert r["evictions"] == 0
    assert r["gpu_hit_tokens"] + r["cpu_hit_tokens"] == reuse_bound(lines, wave=10)
    assert reuse_bound(lines) - reuse_bound(lines, wave=10) > 0  # what concurrency loses


@pytest.mark.parametrize(
    ("router", "per_instance", "hits"),
    [
        # Round-robin: A, C on instance 0 and B, D on 1: B misses, C hits A's 64 tokens on
        # instance 0, D hits B's copy on instance 1.
        ("round-robin", [2, 2], 64 + 64),
        # Prefix-affinity: A goes to instance 0 (a tie at 0 tokens; ties rotate from instance
        # 0 for the first request), and B, C, D follow A's 64 cached tokens there.
        ("prefix-affinity", [4, 0], 64 + 64 + 64),
        # Least-loaded: every arrival finds both idle, a tie, and ties rotate: round-robin's
        # placement.
        ("least-loaded", [2, 2], 64 + 64),
    ],
)
def test_routers_on_two_instances(tmp_path, run_cli, router, per_instance, hits):
    trace = write_trace(tmp_path / "t.jsonl", FOUR)
    fleet = ["--instances", "2", "--router", router]
    code, out, err = run_cli("--trace", trace, *BLOCK, *ENGINE, *fleet)
    assert code == 0, err
    (run,) = out["runs"]
    assert (run["instances"], run["router"]) == (2, router)
    assert [r["requests"] for r in run["per_instance"]] == per_instance
    r = run["result"]
    assert r["requests"] == 4
    assert r["gpu_hit_tokens"] + r["cpu_hit_tokens"] == hits
    assert r["gpu_hit_tokens"] == sum(i["gpu_hit_tokens"] for i in run["per_instance"])


def test_one_instance_prints_what_no_fleet_prints(capsys):
    small = ["--conversations", "4", "--turns", "2", "--gpu-blocks", "512"]
    tables = []
    for extra in ([], ["--instances", "1"]):
        assert main(["simulate", *small, "--compare", "offload_prompt_only", *extra]) == 0
        out = capsys.readouterr().out.splitlines()
        # Scheduler time is wall-clock and sets the columns' width: compare cells.
        tables.append([line.split() for line in out if not line.startswith("scheduler")])
    assert tables[0] == tables[1]
    assert not any(cells[:1] == ["fleet:"] for cells in tables[0])


def test_compare_instances_and_the_per_instance_table(tmp_path, capsys):
    trace = write_trace(tmp_path / "t.jsonl", FOUR)
    args = ["--trace", trace, *BLOCK, *ENGINE, "--instances", "2", "--compare", "instances"]
    assert main(["simulate", *args, "--per-instance"]) == 0
    out = capsys.readouterr().out
    assert "fleet: 1/2 x round-robin (instances x router)" in out
    assert out.splitlines()[6].split() == ["1", "instance", "2", "instances", "change"]
    assert "per instance (2 instances, 0.000976562 GiB):" in out


def test_limit_start_and_time_scale_pick_a_part(tmp_path, run_cli):
    trace = write_trace(tmp_path / "t.jsonl", FOUR)
    # From 10 s on: B, C, D; the first two of them; arrivals halved and counted from 10 s.
    part = ["--start", "10", "--limit", "2", "--time-scale", "0.5"]
    _, out, _ = run_cli("--trace", trace, *BLOCK, *ENGINE, *part)
    r = out["runs"][0]["result"]
    assert (r["requests"], r["prompt_tokens"]) == (2, 96 + 96)
    # B computes all 96 tokens; C (5 s later) finds ids 1, 2 on the GPU.
    assert r["gpu_hit_tokens"] == 64
    assert out["workload"]["start"] == 10


GOOD = ids_line(0, [1, 2], 600)


@pytest.mark.parametrize(
    ("line", "field", "problem"),
    [
        ({**GOOD, "session": 1}, "session", "unknown field of the hash-ids format; allowed:"),
        ({k: v for k, v in GOOD.items() if k != "timestamp"}, "timestamp", "missing"),
        ({**GOOD, "timestamp": -5}, "timestamp", "expected ms in 0..1e+12, got -5"),
        ({**GOOD, "input_length": 0}, "input_length", "expected an int in 1.."),
        ({**GOOD, "output_length": 1.5}, "output_length", "expected an int in 1..16777215"),
        ({**GOOD, "hash_ids": []}, "hash_ids", "expected a non-empty list of block ids"),
        ({**GOOD, "hash_ids": [1, -2]}, "hash_ids", "block ids must be ints in 0.."),
        (
            {**GOOD, "hash_ids": [1, 2, 3]},
            "hash_ids",
            "3 blocks of --hash-block-tokens 512 cannot hold input_length 600 (it needs 2)",
        ),
    ],
)
def test_bad_hash_ids_lines_name_the_line_and_field(tmp_path, run_cli, line, field, problem):
    trace = write_trace(tmp_path / "t.jsonl", [GOOD, "", line])
    code, out, err = run_cli("--trace", trace, *TINY, json_out=False)
    assert code == 2
    assert f"--trace {trace} line 3: {field}: {problem}" in err
    assert "Traceback" not in err
    assert out == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--limit", "3"], "--limit needs --trace"),
        (["--time-scale", "0"], "--time-scale: expected a number in 1e-06..1e+06"),
        (["--router", "least-loaded"], "--router needs --instances N of 2 or more"),
        (["--per-instance"], "--per-instance needs --instances N of 2 or more"),
        (["--compare", "instances"], "--compare instances needs --instances N of 2 or more"),
        (["--instances", "0"], "--instances: expected an int in 1..256, got '0'"),
        (["--router", "random", "--instances", "2"], "--router: invalid choice: 'random'"),
        (["--hbm-gbps", "-1"], "--hbm-gbps: expected 0 (off) or a number in 1..1e+06"),
        (["--hbm-gbps", "1e-300"], "--hbm-gbps: expected 0 (off) or a number in 1..1e+06"),
        (
            ["--prefill-attention-tokens", "5e-324"],
            "--prefill-attention-tokens: expected 0 (off) or a number in 1..1e+09",
        ),
        (["--trace-format", "csv"], "--trace-format: invalid choice: 'csv'"),
    ],
)
def test_bad_fleet_and_trace_flags(run_cli, args, message):
    code, out, err = run_cli(*args, json_out=False)
    assert code == 2
    assert message in err
    assert "Traceback" not in err
    assert out == ""


def test_a_hash_ids_line_in_a_kvoffload_trace_names_its_field(tmp_path, run_cli):
    trace = write_trace(tmp_path / "t.jsonl", [HAND[0]])
    code, _, err = run_cli("--trace", trace, "--trace-format", "kvoffload", json_out=False)
    assert code == 2
    assert "line 1: hash_ids: unknown field; allowed: arrival, id," in err


def test_the_generated_conversation_trace_replays(tmp_path, run_cli):
    from kvoffload.simulate.gen_hash_ids_trace import main as generate

    path = tmp_path / "conv.jsonl"
    assert generate([str(path), "--requests", "40", "--seed", "3"]) == 0
    first = path.read_bytes()
    assert generate([str(path), "--requests", "40", "--seed", "3"]) == 0
    assert path.read_bytes() == first  # seeded: the same file again
    lines = [json.loads(line) for line in first.splitlines()]
    assert len(lines) == 40
    assert [x["timestamp"] for x in lines] == [i * 90_000 for i in range(40)]  # 1 h / 40
    # A follow-up turn re-sends an earlier request's full blocks; the block partial there comes
    # back under a new id (as in Mooncake's traces), so an id that ends a request partially
    # appears nowhere else.
    earlier = {tuple(x["hash_ids"][:-1]) for x in lines}
    assert any(
        tuple(x["hash_ids"][:k]) in earlier for x in lines for k in range(1, len(x["hash_ids"]))
    )
    uses = collections.Counter(b for x in lines for b in x["hash_ids"])
    partial = [x["hash_ids"][-1] for x in lines if x["input_length"] % 512]
    assert partial
    assert all(uses[b] == 1 for b in partial)
    code, out, err = run_cli("--trace", str(path), "--gpu-blocks", "4096", "--max-running", "64")
    assert code == 0, err
    r = out["runs"][0]["result"]
    assert r["requests"] == 40
    assert r["prompt_tokens"] == sum(x["input_length"] for x in lines)
    assert r["gpu_hit_tokens"] + r["cpu_hit_tokens"] > 0


def test_a_partial_block_is_the_head_of_the_full_block_with_its_id(tmp_path, run_cli):
    # X: id 1 and 24 tokens of id 2; Y (10 s later): ids 1, 2 whole and 16 tokens of id 3. X
    # cached its 3 full 16-token blocks (48 tokens: the 4th holds only 8 prompt tokens); Y
    # hits all 3 only if id 2's first 24 tokens are the same in both (otherwise 32).
    lines = [ids_line(0, [1, 2], 56), ids_line(10_000, [1, 2, 3], 80)]
    trace = write_trace(tmp_path / "t.jsonl", lines)
    code, out, err = run_cli("--trace", trace, *BLOCK, *ENGINE)
    assert code == 0, err
    r = out["runs"][0]["result"]
    assert (r["gpu_hit_tokens"], r["cpu_hit_tokens"]) == (48, 0)


@pytest.mark.parametrize(
    ("router", "per_instance", "hits"),
    [("least-loaded", [2, 2], 0), ("prefix-affinity", [3, 1], 64)],
)
def test_prefix_affinity_prefers_the_prefix_to_the_less_loaded_instance(
    tmp_path, run_cli, router, per_instance, hits
):
    # P (ids 1, 2) at 0 s goes to instance 0 (all idle: the rotation starts there). At 1 s, S
    # (1 output token) goes to instance 1 (a tie; the rotation's turn) and L (1,000 output
    # tokens, 6 s of decoding) to the idle instance 0. At 3 s, Q (P's ids and one of its own)
    # finds instance 0 busy with L and instance 1 idle: least-loaded sends it to 1, where none
    # of it is, prefix-affinity to 0, where P's 64 tokens are.
    lines = [
        ids_line(0, [1, 2], 64),
        ids_line(1_000, [20], 32),
        ids_line(1_000, [30], 32, 1_000),
        ids_line(3_000, [1, 2, 40], 96),
    ]
    trace = write_trace(tmp_path / "t.jsonl", lines)
    fleet = ["--instances", "2", "--router", router]
    engine = [*TINY, "--gpu-blocks", "128", "--max-running", "1"]
    code, out, err = run_cli("--trace", trace, *BLOCK, *engine, *fleet)
    assert code == 0, err
    (run,) = out["runs"]
    assert [r["requests"] for r in run["per_instance"]] == per_instance
    assert run["result"]["gpu_hit_tokens"] + run["result"]["cpu_hit_tokens"] == hits


def test_hash_block_tokens_is_refused_for_a_detected_kvoffload_trace(tmp_path, run_cli):
    trace = write_trace(tmp_path / "t.jsonl", [{"id": "a", "prompt": [1, 2], "output_tokens": 1}])
    code, out, err = run_cli("--trace", trace, *BLOCK, json_out=False)
    assert code == 2
    assert (
        f"--hash-block-tokens applies to hash-ids traces only; {trace} is in the kvoffload" in err
    )
    assert out == ""


@pytest.mark.parametrize("change", ["delete", "rewrite"])
def test_a_trace_that_changes_after_the_check_is_a_clean_error(tmp_path, change, monkeypatch):
    from kvoffload.simulate import command

    path = tmp_path / "t.jsonl"
    trace = write_trace(path, FOUR)
    load = command.load_trace

    def load_then_change(*args, **kwargs):
        checked = load(*args, **kwargs)
        if change == "delete":
            path.unlink()
        else:
            path.write_text("# gone\n")
        return checked

    monkeypatch.setattr(command, "load_trace", load_then_change)
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    assert main(["simulate", "--trace", trace, *BLOCK, *ENGINE]) == 1
    assert f"kvoffload simulate: --trace {trace}: changed after it was checked" in err.getvalue()


def test_any_hash_ids_field_detects_the_format(tmp_path, run_cli):
    # The first line decides the format: without hash_ids it is still a hash-ids line.
    trace = write_trace(tmp_path / "t.jsonl", [{k: v for k, v in GOOD.items() if k != "hash_ids"}])
    code, _, err = run_cli("--trace", trace, json_out=False)
    assert code == 2
    assert "line 1: hash_ids: expected a non-empty list of block ids, got None" in err
