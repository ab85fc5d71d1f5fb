"""Each instance's own disk tier behind its CPU tier (`--disk-gib`), alone and in a chain with the
fleet's shared tier: hand-computed traces, the output without it unchanged, and its flags."""

from __future__ import annotations

import pytest
from sim_helpers import ids_line, write_trace

BLOCK = ["--hash-block-tokens", "32"]  # one id = 32 tokens = 2 GPU blocks = 2 chunks
CHUNK = 16 * 1024  # 16 tokens of 1 KiB
# Round numbers, as in test_shared_tier.py: 4 chunks (64 KiB) take 1 ms over PCIe or the disk's
# link (65,536 bytes at 0.065536 GB/s), a batch 2 ms more on the disk; a step 1 ms plus its
# prompt tokens at 8,000 a second. The CPU tier holds 4 chunks, the GPU 8 blocks.
ENGINE = [
    "--kv-bytes-per-token", "1024",
    "--cpu-gib", str(4 * CHUNK / 2**30),
    "--gpu-blocks", "8",
    "--pcie-gbps", "0.065536",
    "--prefill-tokens-per-s", "8000",
    "--prefill-attention-tokens", "0",
    "--decode-step-ms", "1",
]  # fmt: skip
DISK = ["--disk-gib", str(1 / 1024), "--disk-gbps", "0.065536", "--disk-latency-ms", "2"]
# A (ids 1, 2: 64 tokens); X 5 s later (128 tokens of its own: it takes every GPU block, and its
# 8 chunks push A's 4 out of the 4-slot CPU tier); B 5 s after that, A's ids and one more.
TRACE = [
    ids_line(0, [1, 2], 64),
    ids_line(5_000, [7, 8, 9, 10], 128),
    ids_line(10_000, [1, 2, 3], 96),
]
_DISK_KEYS = {
    "disk_hit_tokens",
    "disk_bytes_read",
    "disk_bytes_written",
    "disk_evictions",
    "disk_hit_rate",
}


def test_a_prefix_the_cpu_tier_dropped_comes_back_from_the_disk(tmp_path, run_cli):
    trace = write_trace(tmp_path / "t.jsonl", TRACE)
    code, out, err = run_cli("--trace", trace, *BLOCK, *ENGINE, *DISK, "--compare", "disk_tier")
    assert code == 0, err
    assert [run["label"] for run in out["runs"]] == ["no disk tier", "disk tier"]
    assert [run["disk_gib"] for run in out["runs"]] == [None, 1 / 1024]
    without, with_disk = (run["result"] for run in out["runs"])
    # Without it B finds nothing (its GPU blocks and CPU slots went to X): 96 tokens computed
    # in one step, 1 ms + 96 / 8,000 s = 13 ms.
    assert without["recomputed_tokens"] == 64 + 128 + 96
    assert without["disk_hit_tokens"] == 0
    # With it, A's 4 chunks come back from the disk: 2 + 1 ms, then 1 ms over PCIe, then B's
    # last 32 tokens: 1 ms + 32 / 8,000 s = 5 ms; TTFT 9 ms.
    assert with_disk["disk_hit_tokens"] == 64
    assert (with_disk["gpu_hit_tokens"], with_disk["cpu_hit_tokens"]) == (0, 0)
    assert with_disk["recomputed_tokens"] == 64 + 128 + 32
    assert with_disk["disk_bytes_read"] == 4 * CHUNK
    assert with_disk["bytes_read"] == 4 * CHUNK  # then loaded as a CPU hit
    # Every chunk the CPU tier stored went to the disk: A's 4 and 4 of X's 8 (the tier has 4
    # slots; B's new chunks found none beside its own 4 loaded ones).
    assert with_disk["disk_bytes_written"] == with_disk["bytes_written"] == (4 + 4) * CHUNK
    assert with_disk["disk_evictions"] == 0
    assert with_disk["disk_hit_rate"] == pytest.approx(64 / (64 + 128 + 96))
    ttft = (0.009 + 0.017 + 0.009) / 3  # A 1 + 64/8 ms, X 1 + 128/8 ms, B 9 ms
    assert with_disk["ttft_mean_s"] == pytest.approx(ttft)
    assert without["ttft_mean_s"] == pytest.approx((0.009 + 0.017 + 0.013) / 3)
    assert out["engine"]["disk_chunks"] == 64  # 1 MiB of 16 KiB chunks


def test_a_small_disk_evicts_the_least_recently_used(tmp_path, run_cli):
    # 6 chunks: X's 4 push A's first 2 out (least recently used first), so B's prefix misses
    # the disk at chunk 0; B's own 4 then push 4 more out.
    small = ["--disk-gib", str(6 * CHUNK / 2**30)]
    code, out, err = run_cli(
        "--trace", write_trace(tmp_path / "t.jsonl", TRACE), *BLOCK, *ENGINE, *small
    )
    assert code == 0, err
    r = out["runs"][0]["result"]
    assert r["disk_hit_tokens"] == 0
    assert r["disk_evictions"] == 2 + 4
    assert r["disk_bytes_written"] == r["bytes_written"] == (4 + 4 + 4) * CHUNK


def test_a_chain_promotes_from_the_disk_first_then_the_shared_tier(tmp_path, run_cli):
    # Two instances, round-robin: A and B on instance 0, X on instance 1. A 4th request C on
    # instance 1 shares A's prefix: its own disk lacks it, the shared tier has it.
    trace = [*TRACE, ids_line(15_000, [1, 2, 4], 96)]
    remote = ["--remote-gib", str(1 / 1024), "--remote-gbps", "0.065536"]
    args = ["--trace", write_trace(tmp_path / "t.jsonl", trace), *BLOCK, *ENGINE, *DISK]
    code, out, err = run_cli(*args, *remote, "--instances", "2")
    assert code == 0, err
    zero, one = out["runs"][0]["per_instance"]
    # Instance 0: A, then B, whose GPU blocks and CPU slots were not taken by X (on the other
    # instance): a GPU hit, no tier asked.
    assert (zero["gpu_hit_tokens"], zero["disk_hit_tokens"], zero["remote_hit_tokens"]) == (
        64,
        0,
        0,
    )
    # Instance 1: X, then C: its CPU tier and disk hold only X's chunks; A's prefix comes from
    # the shared tier.
    assert (one["disk_hit_tokens"], one["remote_hit_tokens"]) == (0, 64)
    assert one["remote_bytes_read"] == 4 * CHUNK
    # Everything its CPU tier stored (4 of X's chunks) reached both tiers behind it.
    assert one["disk_bytes_written"] == one["remote_bytes_written"] == one["bytes_written"]
    assert one["bytes_written"] == 4 * CHUNK
    header = run_cli(*args, *remote, "--instances", "2", json_out=False)[1]
    assert "disk tier 0.000976562 GiB (64 chunks" in header
    assert "disk-tier hits" in header and "remote-tier hits" in header


def test_without_a_disk_the_output_is_as_it_was(tmp_path, run_cli):
    trace = write_trace(tmp_path / "t.jsonl", TRACE)
    code, out, err = run_cli("--trace", trace, *BLOCK, *ENGINE)
    assert code == 0, err
    assert not _DISK_KEYS & set(out["runs"][0]["result"])
    assert not any(k.startswith("disk") for k in out["engine"])
    code, text, _ = run_cli("--trace", trace, *BLOCK, *ENGINE, json_out=False)
    assert "disk tier" not in text and "disk-tier" not in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--disk-gbps", "5"], "--disk-gbps needs --disk-gib"),
        (["--disk-latency-ms", "1"], "--disk-latency-ms needs --disk-gib"),
        (["--compare", "disk_tier"], "--compare disk_tier needs --disk-gib"),
        (["--disk-gib", "0"], "--disk-gib"),
        (["--disk-gib", "1", "--verify-data"], "--verify-data cannot be combined with --disk-gib"),
        (["--disk-gib", "1", "--disk-gbps", "0"], "--disk-gbps"),
    ],
)
def test_bad_disk_flags_name_the_flag(tmp_path, run_cli, args, message):
    trace = write_trace(tmp_path / "t.jsonl", TRACE)
    code, _, err = run_cli("--trace", trace, *BLOCK, *ENGINE, *args)
    assert code == 2
    assert message in err
