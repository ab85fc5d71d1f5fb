"""The shared remote tier behind a fleet: a hand-computed two-instance trace, the fleet without
it unchanged, Redis-like sampled LRU, and its flags."""

from __future__ import annotations

import pytest
from sim_helpers import TINY, ids_line, write_trace

from kvoffload import _rust
from kvoffload.simulate.shared_tier import SharedTierConfig, SimulatedSharedTier
from kvoffload.store import KeyList

BLOCK = ["--hash-block-tokens", "32"]  # one id = 32 tokens = 2 GPU blocks = 2 chunks
CHUNK = 16 * 1024  # TINY: 16 tokens of 1 KiB
# Every time is a round number: 4 chunks (64 KiB) take 1 ms over PCIe or the network link
# (65,536 bytes at 0.065536 GB/s), a batch over the network 2 ms more; a step 1 ms plus its
# prompt tokens at 8,000 a second (no attention term, no KV read: one output token each).
ENGINE = [
    *TINY,
    "--gpu-blocks", "64",
    "--pcie-gbps", "0.065536",
    "--prefill-tokens-per-s", "8000",
    "--prefill-attention-tokens", "0",
    "--decode-step-ms", "1",
    "--instances", "2",
]  # fmt: skip
REMOTE = ["--remote-gib", str(1 / 1024), "--remote-gbps", "0.065536", "--remote-latency-ms", "2"]
# A (ids 1, 2: 64 tokens) on instance 0; B 10 s later (ids 1, 2, 3: 96 tokens) on instance 1,
# round-robin: B's first 64 tokens are A's, which only the shared tier has.
TWO = [ids_line(0, [1, 2], 64), ids_line(10_000, [1, 2, 3], 96)]
_REMOTE_KEYS = {
    "remote_hit_tokens",
    "remote_bytes_read",
    "remote_bytes_written",
    "remote_evictions",
    "remote_hit_rate",
}


def test_the_second_instance_loads_the_first_ones_prefix_from_the_shared_tier(tmp_path, run_cli):
    trace = write_trace(tmp_path / "t.jsonl", TWO)
    code, out, err = run_cli("--trace", trace, *BLOCK, *ENGINE, *REMOTE)
    assert code == 0, err
    a, b = out["runs"][0]["per_instance"]
    # A computes its 64 tokens in one step: 1 ms + 64 / 8,000 s = 9 ms. Its 4 chunks reach
    # instance 0's CPU tier at 9 + 1 = 10 ms and the shared tier at 10 + 2 + 1 = 13 ms.
    assert (a["recomputed_tokens"], a["chunks_written"]) == (64, 4)
    assert a["remote_bytes_written"] == 4 * CHUNK
    assert a["ttft_mean_s"] == pytest.approx(0.009)
    # B (at 10 s) misses instance 1's GPU cache and CPU tier; the shared tier has chunks 0-3
    # (chunks 4-5 are B's own). Copied over the network: 10 s + 2 + 1 ms; loaded over PCIe:
    # 1 ms more; then one step computes its last 32 tokens: 1 ms + 32 / 8,000 s = 5 ms. TTFT:
    # 3 + 1 + 5 = 9 ms. It stores its 2 new chunks, and writes them to the shared tier.
    assert b["remote_hit_tokens"] == 64
    assert (b["gpu_hit_tokens"], b["cpu_hit_tokens"], b["recomputed_tokens"]) == (0, 0, 32)
    assert b["remote_bytes_read"] == 4 * CHUNK
    assert b["bytes_read"] == 4 * CHUNK  # then loaded as a CPU hit
    assert b["remote_bytes_written"] == 2 * CHUNK
    assert b["chunks_written"] == 2
    assert b["ttft_mean_s"] == pytest.approx(0.009)
    r = out["runs"][0]["result"]
    assert r["remote_hit_rate"] == pytest.approx(64 / (64 + 96))
    assert r["remote_bytes_written"] == 6 * CHUNK
    assert r["remote_evictions"] == 0
    assert out["engine"]["remote_chunks"] == 64  # 1 MiB of 16 KiB chunks


def test_compare_shared_tier_puts_the_fleet_without_it_first(tmp_path, run_cli):
    trace = write_trace(tmp_path / "t.jsonl", TWO)
    code, out, err = run_cli("--trace", trace, *BLOCK, *ENGINE, *REMOTE, "--compare", "shared_tier")
    assert code == 0, err
    without, with_tier = (run["result"] for run in out["runs"])
    assert [run["label"] for run in out["runs"]] == ["no shared tier", "shared tier"]
    assert [run["remote_gib"] for run in out["runs"]] == [None, 1 / 1024]
    # Without it B computes all 96 tokens: 1 ms + 96 / 8,000 s = 13 ms; with it 9 ms (above).
    assert without["remote_hit_tokens"] == 0
    assert without["recomputed_tokens"] == 64 + 96
    assert without["ttft_mean_s"] == pytest.approx((0.009 + 0.013) / 2)
    assert with_tier["ttft_mean_s"] == pytest.approx((0.009 + 0.009) / 2)


def test_a_server_link_shared_by_the_fleet_delays_the_promotion(tmp_path, run_cli):
    trace = write_trace(tmp_path / "t.jsonl", TWO)
    # The server's own link at half the instance link's speed: B's 4 chunks (64 KiB) take
    # 2 ms + 2 ms there, against 1 ms + 2 ms on B's link; TTFT 4 + 1 + 5 = 10 ms (9 ms above).
    slow = ["--remote-node-gbps", "0.032768"]
    code, out, err = run_cli("--trace", trace, *BLOCK, *ENGINE, *REMOTE, *slow)
    assert code == 0, err
    _, b = out["runs"][0]["per_instance"]
    assert b["remote_hit_tokens"] == 64
    assert b["ttft_mean_s"] == pytest.approx(0.010)
    assert (out["engine"]["remote_nodes"], out["engine"]["remote_node_gbps"]) == (1, 0.032768)
    # Four nodes of the same size and link: four times the chunks, B's chunks spread over
    # their links (a node with all 4 of them is no slower than the one server).
    code, out, err = run_cli(
        "--trace", trace, *BLOCK, *ENGINE, *REMOTE, *slow, "--remote-nodes", "4"
    )
    assert code == 0, err
    _, b = out["runs"][0]["per_instance"]
    assert out["engine"]["remote_chunks"] == 4 * 64
    assert b["remote_hit_tokens"] == 64
    assert 0.009 <= b["ttft_mean_s"] <= 0.010


def test_node_links_take_each_node_its_own_chunks():
    keys = KeyList([bytes([i]) * 32 for i in range(40)])
    tier = SimulatedSharedTier(SharedTierConfig(100, latency_ms=1.0, nodes=3, node_gbps=1.0))
    counts = _rust.cluster_node_counts(keys, 3)
    assert sum(counts) == 40 and min(counts) > 0, counts
    # Each node moves its chunks of 1 MB at 1 MB/ms after 1 ms; the batch ends with the busiest.
    done = tier.node_transfer("read", keys, 1_000_000, now=5.0)
    assert done == pytest.approx(5.0 + (1.0 + max(counts)) / 1e3)
    assert tier.node_bytes["read"] == [c * 1_000_000 for c in counts]
    # A second batch queues behind the first on the same nodes.
    again = tier.node_transfer("read", keys, 1_000_000, now=5.0)
    assert again == pytest.approx(done + (1.0 + max(counts)) / 1e3)
    # Not modelled: no wait, bytes still counted.
    free = SimulatedSharedTier(SharedTierConfig(100, nodes=3))
    assert free.node_transfer("write", keys, 10, now=2.0) == 2.0
    assert sum(free.node_bytes["write"]) == 400


def _without_wall_clock(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "scheduler_seconds"}


def test_no_shared_tier_equals_the_fleet_without_the_flags(tmp_path, run_cli, capsys):
    trace = write_trace(tmp_path / "t.jsonl", TWO)
    _, plain, _ = run_cli("--trace", trace, *BLOCK, *ENGINE, "--per-instance")
    _, compared, _ = run_cli(
        "--trace", trace, *BLOCK, *ENGINE, *REMOTE, "--compare", "shared_tier", "--per-instance"
    )
    assert plain is not None and compared is not None
    # Without the flags no key of the shared tier appears, in the engine, the run or a result.
    assert not [k for k in plain["engine"] if k.startswith("remote")]
    run = plain["runs"][0]
    assert "remote_gib" not in run
    assert not [k for r in [run["result"], *run["per_instance"]] for k in r if k in _REMOTE_KEYS]
    # The run without the tier in the comparison is the plain fleet, instance by instance.
    off = compared["runs"][0]
    for mine, theirs in zip(
        [off["result"], *off["per_instance"]], [run["result"], *run["per_instance"]], strict=True
    ):
        assert mine.pop("remote_hit_tokens") == 0
        assert mine.pop("remote_bytes_written") == 0
        assert {k: v for k, v in _without_wall_clock(mine).items() if k not in _REMOTE_KEYS} == (
            _without_wall_clock(theirs)
        )


def _keys(*names: bytes) -> KeyList:
    return KeyList(list(names))


def test_the_tier_reads_a_key_only_once_its_write_landed():
    tier = SimulatedSharedTier(SharedTierConfig(4))
    assert tier.put(_keys(b"a", b"b"), ready_at=2.0) == 0
    assert tier.lookup_prefix([b"a", b"b"], now=1.0) == 0
    assert tier.lookup_prefix([b"a", b"c", b"b"], now=2.0) == 1  # stops at the absent key
    tier.put(_keys(b"a"), ready_at=5.0)  # a rewrite keeps it readable
    assert tier.lookup_prefix([b"a"], now=2.0) == 1


def test_eviction_takes_the_least_recently_used_of_five_sampled_keys():
    # Capacity 1: the only key is the whole sample.
    tier = SimulatedSharedTier(SharedTierConfig(1))
    tier.put(_keys(b"old"), 0.0)
    assert tier.put(_keys(b"new"), 0.0) == 1
    assert (tier.lookup_prefix([b"old"], 1.0), tier.lookup_prefix([b"new"], 1.0)) == (0, 1)
    # Capacity 2, keys x (used last) and y: a sample of 5 from {x, y} misses y with chance
    # 1/32, and never evicts x when it holds y. Over 20 seeds y goes each time but one or two.
    gone = []
    for seed in range(20):
        tier = SimulatedSharedTier(SharedTierConfig(2, seed=seed))
        tier.put(_keys(b"y", b"x"), 0.0)
        tier.lookup_prefix([b"x"], 0.0)
        tier.put(_keys(b"z"), 0.0)
        gone.append(b"y" if tier.lookup_prefix([b"y"], 0.0) == 0 else b"x")
    assert gone.count(b"y") >= 18
    # Seeded: the same seed evicts the same keys.
    runs = []
    for _ in range(2):
        tier = SimulatedSharedTier(SharedTierConfig(8, seed=7))
        tier.put(KeyList([bytes([i]) for i in range(40)]), 0.0)
        runs.append([tier.lookup_prefix([bytes([i])], 0.0) for i in range(40)])
    assert runs[0] == runs[1]
    assert sum(runs[0]) == 8


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--remote-gib", "0"], "--remote-gib: expected a finite number > 0, got '0'"),
        (["--remote-gib", "nan"], "--remote-gib: expected a finite number > 0, got 'nan'"),
        (["--remote-gib", "0.001"], "--remote-gib 0.001 holds no chunk: one chunk is 2,097,152"),
        (["--remote-gib", "1e9"], "the simulator takes at most 4,194,304: raise --blocks-per"),
        (
            ["--remote-gib", "1", "--remote-gbps", "0"],
            "--remote-gbps: expected a number in 0.01..10000, got '0'",
        ),
        (
            ["--remote-gib", "1", "--remote-latency-ms", "-1"],
            "--remote-latency-ms: expected a number in 0..10000, got '-1'",
        ),
        (["--remote-gbps", "10"], "--remote-gbps needs --remote-gib"),
        (["--remote-latency-ms", "1"], "--remote-latency-ms needs --remote-gib"),
        (["--remote-nodes", "3"], "--remote-nodes needs --remote-gib"),
        (["--remote-node-gbps", "12.5"], "--remote-node-gbps needs --remote-gib"),
        (
            ["--remote-gib", "1", "--remote-nodes", "0"],
            "--remote-nodes: expected an int in 1..1,000",
        ),
        (["--compare", "shared_tier"], "--compare shared_tier needs --remote-gib"),
        (
            ["--remote-gib", "1", "--verify-data"],
            "--verify-data cannot be combined with --remote-gib",
        ),
    ],
)
def test_bad_shared_tier_flags(run_cli, args, message):
    code, out, err = run_cli(*args, json_out=False)
    assert code == 2
    assert message in err
    assert "Traceback" not in err
    assert out == ""
