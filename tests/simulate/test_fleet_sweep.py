"""`--sweep-instances`: the same trace on each fleet size, its table, JSON and plot, computed by
hand on a 4-request trace; and every bad value or combination of its flags."""

from __future__ import annotations

import pytest
from sim_helpers import FOUR, TINY, write_trace

from kvoffload.cli import main

ARGS = ["--hash-block-tokens", "32", *TINY, "--gpu-blocks", "64", "--max-running", "1"]
PROMPT_TOKENS = 64 + 3 * 96


def ttft(computed: int, context: int) -> float:
    """One prefill step of the default engine model: 6 ms plus `computed` tokens from
    `context` on at 30,000 tokens/s, attention doubling a token's time at context 30,000
    (one output token: no decode step, no KV read)."""
    return 0.006 + computed * (1 + (context + (computed - 1) / 2) / 30_000) / 30_000


MISS_64, MISS_96, HIT = ttft(64, 0), ttft(96, 0), ttft(32, 64)


@pytest.fixture
def trace(tmp_path) -> str:
    return write_trace(tmp_path / "four.jsonl", FOUR)


def test_each_fleet_size_replays_the_trace(trace, run_cli):
    code, out, err = run_cli("--trace", trace, *ARGS, "--sweep-instances", "4,1,2")
    assert code == 0, err
    runs = out["runs"]
    assert [(r["instances"], r["router"]) for r in runs] == [
        (1, "round-robin"),
        (2, "round-robin"),
        (4, "round-robin"),
    ]
    results = [r["result"] for r in runs]
    assert [r["prompt_tokens"] for r in results] == [PROMPT_TOKENS] * 3
    # 1 instance: B, C, D each find A's 64 tokens. 2: A, C on instance 0, B, D on 1, so B
    # misses and D hits B's copy. 4: every request alone on its instance, no hit.
    assert [r["gpu_hit_tokens"] + r["cpu_hit_tokens"] for r in results] == [192, 128, 0]
    means = [
        (MISS_64 + 3 * HIT) / 4,
        (MISS_64 + MISS_96 + 2 * HIT) / 4,
        (MISS_64 + 3 * MISS_96) / 4,
    ]
    assert [r["ttft_mean_s"] for r in results] == pytest.approx(means)
    # p99 of four requests is the slowest: A's 64 tokens, or a 96-token miss.
    assert [r["ttft_p99_s"] for r in results] == pytest.approx([MISS_64, MISS_96, MISS_96])
    assert "per_instance" not in runs[0]
    assert [[i["requests"] for i in r["per_instance"]] for r in runs[1:]] == [[2, 2], [1] * 4]


def test_the_one_instance_point_is_a_plain_run(trace, run_cli):
    _, swept, _ = run_cli("--trace", trace, *ARGS, "--sweep-instances", "1,2")
    _, plain, _ = run_cli("--trace", trace, *ARGS)

    def modelled(result: dict) -> dict:  # scheduler time is wall-clock
        return {k: v for k, v in result.items() if k != "scheduler_seconds"}

    assert modelled(swept["runs"][0]["result"]) == modelled(plain["runs"][0]["result"])


def test_the_sweep_table_has_one_row_per_size(trace, capsys):
    assert main(["simulate", "--trace", trace, *ARGS, "--sweep-instances", "1,2,4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[3] == (
        "fleet: 1/2/4 x round-robin (instances x router), each its own GPU cache and CPU tier"
    )
    assert lines[6].split() == [
        "instances", "setting", "GPU", "hits", "CPU", "hits", "all", "hits", "mean", "TTFT",
        "s", "p90", "TTFT", "s", "p99", "TTFT", "s", "simulated", "s", "load", "max/mean",
    ]  # fmt: skip
    rows = [line.split() for line in lines[7:]]
    assert [row[:5] for row in rows] == [
        ["1", "result", "54.5%", "0.0%", "54.5%"],  # 192 / 352 prompt tokens
        ["2", "result", "36.4%", "0.0%", "36.4%"],  # 128 / 352
        ["4", "result", "0.0%", "0.0%", "0.0%"],
    ]
    assert [row[5] for row in rows] == [
        f"{(MISS_64 + 3 * HIT) / 4:.3f}",
        f"{(MISS_64 + MISS_96 + 2 * HIT) / 4:.3f}",
        f"{(MISS_64 + 3 * MISS_96) / 4:.3f}",
    ]
    # The last request arrives at 30 s and takes one step.
    assert [row[8] for row in rows] == ["30.0"] * 3
    # Round-robin gives 2 instances 2 requests each, 4 one each: the busiest has the mean.
    assert [row[9] for row in rows] == ["1.00"] * 3


def test_compare_router_on_each_size(trace, run_cli):
    _, out, _ = run_cli("--trace", trace, *ARGS, "--sweep-instances", "1,2", "--compare", "router")
    hits = {
        (r["instances"], r["router"]): r["result"]["gpu_hit_tokens"] + r["result"]["cpu_hit_tokens"]
        for r in out["runs"]
    }
    # One instance: the router has no choice. Two: both are idle at every arrival, a tie, and
    # ties rotate, so least-loaded splits A's prefix as round-robin does; both prefix routers
    # follow A's prefix on instance 0's GPU.
    assert hits == {
        (1, "round-robin"): 192,
        (1, "least-loaded"): 192,
        (1, "prefix-affinity"): 192,
        (1, "tier-aware"): 192,
        (2, "round-robin"): 128,
        (2, "least-loaded"): 128,
        (2, "prefix-affinity"): 192,
        (2, "tier-aware"): 192,
    }


def test_the_sweep_plot_is_a_png(trace, tmp_path, capsys):
    image = pytest.importorskip("matplotlib.image")
    png = tmp_path / "fleet.png"
    argv = ["--trace", trace, *ARGS, "--sweep-instances", "1,2,4", "--plot", str(png)]
    assert main(["simulate", *argv]) == 0
    capsys.readouterr()
    pixels = image.imread(png)
    assert pixels.ndim == 3 and pixels.shape[0] > 200 and pixels.shape[1] > 400
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet.png", "four.jsonl"]


SEVENTEEN = ",".join(str(n) for n in range(1, 18))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--sweep-instances", "0"],
            "--sweep-instances: expected comma-separated instance counts (expected an int in "
            "1..256, got '0')",
        ),
        (["--sweep-instances", "1,257"], "expected an int in 1..256, got '257'"),
        (["--sweep-instances", "1,x"], "expected an int in 1..256, got 'x'"),
        (["--sweep-instances", ""], "expected an int in 1..256, got ''"),
        (["--sweep-instances", "2,2"], "--sweep-instances: expected 1 to 16 distinct instance"),
        ([f"--sweep-instances={SEVENTEEN}"], "expected 1 to 16 distinct instance counts"),
        (
            ["--sweep-instances", "1,2", "--instances", "2"],
            "--instances and --sweep-instances are exclusive",
        ),
        (
            ["--sweep-instances", "1,2", "--sweep-cpu-gib", "1,2"],
            "--sweep-cpu-gib and --sweep-instances are exclusive",
        ),
        (
            ["--sweep-instances", "1,2", "--compare", "instances"],
            "--compare instances and --sweep-instances are exclusive",
        ),
        (
            ["--sweep-instances", "1", "--router", "least-loaded"],
            "--router needs --instances N of 2 or more (or a --sweep-instances count of 2",
        ),
        (
            ["--sweep-instances", "1", "--per-instance"],
            "--per-instance needs --instances N of 2 or more (or a --sweep-instances count",
        ),
        (
            ["--sweep-instances", "1", "--compare", "router"],
            "--compare router needs --instances N of 2 or more (or a --sweep-instances count",
        ),
        (["--plot", "x.png"], "--plot needs --sweep-cpu-gib or --sweep-instances"),
    ],
)
def test_bad_sweep_instances(run_cli, args, message):
    code, out, err = run_cli(*args, json_out=False)
    assert code == 2
    assert message in err
    assert "Traceback" not in err
    assert out == ""
