"""`--router tier-aware` (a prompt's leading blocks held per tier, weighted per medium) against
`prefix-affinity` (the GPU cache alone) on a hand-computed trace, its score in whole chunks,
the `--tier-weights` flag, and how evenly a fleet was loaded."""

from __future__ import annotations

import pytest
from sim_helpers import TINY, ids_line, write_trace

from kvoffload import _rust
from kvoffload.cli import main
from kvoffload.simulate.routers import TierWeights, tier_aware_score
from kvoffload.simulate.shared_tier import SharedTierConfig, SimulatedSharedTier

BLOCK = ["--hash-block-tokens", "32"]  # one id = 32 tokens = 2 GPU blocks = 2 chunks
ENGINE = [*TINY, "--gpu-blocks", "10", "--max-running", "1", "--instances", "2"]
# L (ids 1-4) and S (ids 1, 6) arrive together: L goes to instance 0 (all tie; the rotation
# starts there), S to the idle instance 1 (nothing is computed yet: a tie, then the least
# loaded). F (5 s; ids of its own, all 10 GPU blocks) goes to instance 0 (a tie; the rotation's
# turn) and evicts L from its GPU cache; L's 8 chunks stay in its CPU tier. At 10 s Q (ids 1-4
# and one more) finds on instance 0 its first 8 blocks in the CPU tier only, on instance 1 its
# first 2 (id 1) in the GPU cache.
TRACE = [
    ids_line(0, [1, 2, 3, 4], 128),
    ids_line(0, [1, 6], 64),
    ids_line(5_000, [20, 21, 22, 23, 24], 160),
    ids_line(10_000, [1, 2, 3, 4, 30], 160),
]


def run_trace(tmp_path, run_cli, *fleet: str) -> dict:
    trace = write_trace(tmp_path / "t.jsonl", TRACE)
    code, out, err = run_cli("--trace", trace, *BLOCK, *ENGINE, *fleet)
    assert code == 0, err
    (run,) = out["runs"]
    return run


@pytest.mark.parametrize(
    ("fleet", "per_instance", "gpu_hits", "cpu_hits"),
    [
        # 8 blocks x 0.75 = 6 on instance 0 against 2 x 1 on instance 1: Q loads 128 tokens
        # from instance 0's CPU tier and computes the last 32.
        (["--router", "tier-aware"], [3, 1], 0, 128),
        # 8 x 0.2 = 1.6 against 2: the GPU's shorter prefix wins, Q computes 128 tokens.
        (["--router", "tier-aware", "--tier-weights", "cpu=0.2"], [2, 2], 32, 0),
        # 8 x 0.75 = 6 against 2 x 4 = 8.
        (["--router", "tier-aware", "--tier-weights", "gpu=4"], [2, 2], 32, 0),
        # The GPU cache alone: 0 blocks on instance 0, 2 on instance 1.
        (["--router", "prefix-affinity"], [2, 2], 32, 0),
    ],
)
def test_tier_weights_decide_between_a_cpu_prefix_and_a_shorter_gpu_one(
    tmp_path, run_cli, fleet, per_instance, gpu_hits, cpu_hits
):
    run = run_trace(tmp_path, run_cli, *fleet)
    assert [r["requests"] for r in run["per_instance"]] == per_instance
    r = run["result"]
    assert (r["gpu_hit_tokens"], r["cpu_hit_tokens"]) == (gpu_hits, cpu_hits)
    assert r["recomputed_tokens"] == 128 + 64 + 160 + 160 - gpu_hits - cpu_hits
    # The busiest instance's requests over the mean (4 requests on 2 instances).
    assert r["load_max_over_mean"] == max(per_instance) / 2


def test_the_tier_aware_run_names_its_weights(tmp_path, run_cli):
    run = run_trace(tmp_path, run_cli, "--router", "tier-aware", "--tier-weights", "cpu=0.2")
    # Only the tiers the fleet has: no disk, no shared tier here.
    assert run["tier_weights"] == {"gpu": 1.0, "cpu": 0.2}
    assert "tier_weights" not in run_trace(tmp_path, run_cli, "--router", "prefix-affinity")


def test_compare_router_runs_all_four_and_prints_the_load_row(tmp_path, capsys):
    trace = write_trace(tmp_path / "t.jsonl", TRACE)
    assert main(["simulate", "--trace", trace, *BLOCK, *ENGINE, "--compare", "router"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[4] == "tier-aware weights per prompt block held: gpu 1, cpu 0.75"
    assert lines[7].split() == ["round-robin", "least-loaded", "prefix-affinity", "tier-aware"]
    assert lines[8].split() == ["requests", "4", "4", "4", "4"]
    # Round-robin and least-loaded: L, F on instance 0, S, Q on 1.
    assert lines[9].split() == ["load", "max/mean", "1.00", "1.00", "1.00", "1.50"]


def test_a_single_engine_has_no_load_row_or_field(tmp_path, run_cli, capsys):
    trace = write_trace(tmp_path / "t.jsonl", TRACE)
    one = [a for a in ENGINE if a not in ("--instances", "2")]
    _, out, _ = run_cli("--trace", trace, *BLOCK, *one)
    assert "load_max_over_mean" not in out["runs"][0]["result"]
    assert main(["simulate", "--trace", trace, *BLOCK, *one]) == 0
    assert "load max/mean" not in capsys.readouterr().out


W = TierWeights()


@pytest.mark.parametrize(
    ("gpu_blocks", "runs", "blocks_per_chunk", "score"),
    [
        # Each block in the first tier that holds it: 2 on the GPU, then 4 + 8 + 4 blocks.
        (2, [("cpu", 1), ("disk", 2), ("shared", 1)], 4, 2 + 0.75 * 2 + 0.25 * 8 + 0.25 * 4),
        (0, [("shared", 3)], 1, 0.25 * 3),
        (5, [], 1, 5.0),
        # Chunks of 2 blocks: the GPU holds 3 blocks, the CPU tier chunks 1 (blocks 2, 3) on:
        # one chunk brings block 3 only, less than a chunk, which the scheduler does not load.
        (3, [("cpu", 1)], 2, 3.0),
        # Two chunks bring blocks 3-5: the load passes a chunk, block 3 comes with it.
        (3, [("cpu", 2)], 2, 3 + 0.75 * 3),
        # From a chunk boundary, one chunk is enough.
        (2, [("cpu", 1)], 2, 2 + 0.75 * 2),
        (0, [("disk", 1)], 4, 0.25 * 4),
    ],
)
def test_the_score_counts_tiers_behind_the_gpu_in_whole_chunks(
    gpu_blocks, runs, blocks_per_chunk, score
):
    assert tier_aware_score(gpu_blocks, runs, blocks_per_chunk, W) == pytest.approx(score)


def test_a_router_reads_a_tier_without_keeping_a_key_longer():
    # Room for 2 keys, and 64 samples of 2 keys: the victim is the least recently used.
    def victim_after(read: str) -> list[int]:
        tier = SimulatedSharedTier(SharedTierConfig(2, lru_samples=64))
        a, b, c = (bytes([i]) * 32 for i in range(3))
        tier.put([a, b], 0.0)
        if read == "peek":
            assert tier.peek_prefix([a], 1.0) == 1
        else:
            assert tier.lookup_prefix([a], 1.0) == 1
        tier.put([c], 1.0)
        return [tier.peek_prefix([k], 1.0) for k in (a, b, c)]

    assert victim_after("peek") == [0, 1, 1]  # a, the least recently used, went
    assert victim_after("lookup") == [1, 0, 1]  # the lookup was a use: b went
    assert _rust.SampledLru(1).peek_prefix([b"x" * 32], 0.0) == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--instances", "2", "--tier-weights", "cpu=0.5"],
            "--tier-weights needs --router tier-aware (or --compare router)",
        ),
        (
            ["--instances", "2", "--router", "prefix-affinity", "--tier-weights", "cpu=0.5"],
            "--tier-weights needs --router tier-aware (or --compare router)",
        ),
        (
            ["--tier-weights", "ram=1"],
            "argument --tier-weights: expected NAME=WEIGHT pairs separated by commas, NAME one "
            "of gpu, cpu, disk, shared; got 'ram=1'",
        ),
        (["--tier-weights", "gpu"], "got 'gpu'"),
        (
            ["--tier-weights", "gpu=1,cpu=-0.5"],
            "argument --tier-weights: cpu: expected a finite number >= 0, got '-0.5'",
        ),
        (["--tier-weights", "cpu=nan"], "cpu: expected a finite number >= 0, got 'nan'"),
        (["--tier-weights", "disk=inf"], "disk: expected a finite number >= 0, got 'inf'"),
        (["--tier-weights", "cpu=x"], "cpu: expected a finite number >= 0, got 'x'"),
        (["--tier-weights", "cpu=1,cpu=2"], "cpu is given twice in 'cpu=1,cpu=2'"),
        (
            ["--instances", "2", "--router", "tier-aware", "--tier-weights", "disk=0.5"],
            "--tier-weights disk=... needs --disk-gib: there is no disk tier",
        ),
        (
            ["--instances", "2", "--compare", "router", "--tier-weights", "shared=0.5"],
            "--tier-weights shared=... needs --remote-gib: there is no shared tier",
        ),
    ],
)
def test_bad_tier_weights(run_cli, args, message):
    code, out, err = run_cli(*args, json_out=False)
    assert code == 2
    assert message in err
    assert "Traceback" not in err
    assert out == ""


def test_weights_are_checked_in_the_library_too():
    with pytest.raises(ValueError, match=r"cpu=-1 is invalid: expected a finite number >= 0"):
        TierWeights(cpu=-1)
