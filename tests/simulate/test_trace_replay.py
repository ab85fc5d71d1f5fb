"""A hand-computed trace through the CLI: every number in the table follows from the arithmetic
in the comments."""

from __future__ import annotations

from pathlib import Path

import pytest
from sim_helpers import TINY, seg, write_trace

# A: system prompt (64 tokens = 4 blocks) + its question (16) -> 5 blocks, all stored.
# B: 96 unrelated tokens -> 6 blocks: with 6 GPU blocks it evicts all of A's from the GPU cache.
# C: the same system prompt + another question: the GPU cache has none of it, the CPU tier has
#    A's first 4 chunks -> loads 64 tokens, computes 16, stores its 1 new chunk.
THREE = [
    {"id": "A", "arrival": 0, "prompt": [seg("sys", 64), seg("a", 16)], "output_tokens": 1},
    {"id": "B", "arrival": 10, "prompt": [seg("other", 96)], "output_tokens": 1},
    {"id": "C", "arrival": 20, "prompt": [seg("sys", 64), seg("b", 16)], "output_tokens": 1},
]
ENGINE = ["--gpu-blocks", "6", "--max-running", "1", *TINY]
FLAT = [
    "--prefill-tokens-per-s", "20000", "--decode-step-ms", "15",
    "--prefill-attention-tokens", "0", "--hbm-gbps", "0",
]  # fmt: skip


def test_three_requests_give_exactly_the_computed_hits_and_writes(tmp_path, run_cli):
    trace = write_trace(tmp_path / "t.jsonl", THREE)
    code, out, _ = run_cli("--trace", trace, *ENGINE)
    assert code == 0
    (run,) = out["runs"]
    r = run["result"]
    assert r["prompt_tokens"] == 80 + 96 + 80
    assert r["gpu_hit_tokens"] == 0
    assert r["cpu_hit_tokens"] == 64
    assert r["recomputed_tokens"] == 80 + 96 + 16
    assert r["chunks_written"] == 5 + 6 + 1
    assert r["bytes_written"] == 12 * 16 * 1024
    assert (r["chunks_read"], r["bytes_read"]) == (4, 4 * 16 * 1024)
    assert r["decode_chunks_written"] == 0
    assert r["evictions"] == 0
    assert out["workload"] == {"trace": trace, "requests": 3, "seed": 0}
    assert out["engine"]["gpu_blocks"] == 6
    assert out["engine"]["bytes_per_chunk"] == 16 * 1024


def test_enough_gpu_blocks_turn_the_cpu_hit_into_a_gpu_hit(tmp_path, run_cli):
    trace = write_trace(tmp_path / "t.jsonl", THREE)
    _, out, _ = run_cli("--trace", trace, *TINY, "--gpu-blocks", "64")
    r = out["runs"][0]["result"]
    # B no longer evicts A's blocks: C finds the system prompt on the GPU and loads nothing.
    assert (r["gpu_hit_tokens"], r["cpu_hit_tokens"]) == (64, 0)
    assert r["chunks_written"] == 12


def test_offload_decode_stores_the_answer_too(tmp_path, run_cli):
    # A now generates 17 tokens: KV exists for 80 + 16 tokens, 6 blocks, the last one decode.
    lines = [{**THREE[0], "output_tokens": 17}, *THREE[1:]]
    trace = write_trace(tmp_path / "t.jsonl", lines)
    _, out, _ = run_cli("--trace", trace, *ENGINE, "--offload-decode")
    r = out["runs"][0]["result"]
    assert (r["chunks_written"], r["decode_chunks_written"]) == (6 + 6 + 1, 1)
    _, out, _ = run_cli("--trace", trace, *ENGINE)
    r = out["runs"][0]["result"]
    assert (r["chunks_written"], r["decode_chunks_written"]) == (12, 0)


def test_a_tier_smaller_than_one_prompt_serves_its_head(tmp_path, run_cli):
    # A's 11-chunk prompt can never fit the 6-slot tier whole: its first 6 chunks are stored
    # (a partial store), B (which stores nothing) evicts A from the 12 GPU blocks, and C, which
    # shares A's first 10 chunks, loads those 6.
    no_store = {"max_offload_tokens": 0}
    lines = [
        {"id": "A", "prompt": [seg("sys", 160), seg("a", 16)], "output_tokens": 1},
        {
            "id": "B",
            "arrival": 10,
            "prompt": [seg("other", 192)],
            "output_tokens": 1,
            "kv_transfer_params": no_store,
        },
        {"id": "C", "arrival": 20, "prompt": [seg("sys", 160), seg("b", 16)], "output_tokens": 1},
    ]
    trace = write_trace(tmp_path / "t.jsonl", lines)
    six_chunks = str(6 * 16 * 1024 / 2**30)
    flags = ["--gpu-blocks", "12", "--max-running", "1", "--kv-bytes-per-token", "1024"]
    _, out, _ = run_cli("--trace", trace, *flags, "--cpu-gib", six_chunks)
    r = out["runs"][0]["result"]
    assert r["cpu_hit_tokens"] == 6 * 16
    # C, longer than the tier too, keeps that head rather than evict it for its other chunks.
    assert r["chunks_written"] == 6


@pytest.mark.parametrize(
    ("flag_cap", "line_cap", "hit"),
    [
        (None, None, 64),
        ("32", None, 32),  # --max-load-tokens for every request
        ("32", 48, 48),  # a trace line's own value wins over the flag
        (None, 0, 0),
    ],
)
def test_load_caps_from_flags_and_lines(tmp_path, run_cli, flag_cap, line_cap, hit):
    c = dict(THREE[2])
    if line_cap is not None:
        c["kv_transfer_params"] = {"max_load_tokens": line_cap}
    trace = write_trace(tmp_path / "t.jsonl", [*THREE[:2], c])
    flags = [] if flag_cap is None else ["--max-load-tokens", flag_cap]
    _, out, _ = run_cli("--trace", trace, *ENGINE, *flags)
    assert out["runs"][0]["result"]["cpu_hit_tokens"] == hit


def test_token_id_prompts_share_prefixes_like_segments(tmp_path, run_cli):
    sys_ids = list(range(1, 65))
    lines = [
        {"id": "A", "prompt": [*sys_ids, *range(100, 116)], "output_tokens": 1},
        {"id": "B", "arrival": 10, "prompt": list(range(200, 296)), "output_tokens": 1},
        {"id": "C", "arrival": 20, "prompt": [*sys_ids, *range(300, 316)], "output_tokens": 1},
    ]
    _, out, _ = run_cli("--trace", write_trace(tmp_path / "t.jsonl", lines), *ENGINE)
    assert out["runs"][0]["result"]["cpu_hit_tokens"] == 64


def test_verify_data_checks_every_loaded_chunk(tmp_path, run_cli):
    pytest.importorskip("torch")
    trace = write_trace(tmp_path / "t.jsonl", THREE)
    code, out, err = run_cli("--trace", trace, *ENGINE, "--verify-data")
    assert code == 0, err
    r = out["runs"][0]["result"]
    assert (r["verified_chunks"], r["mismatched_blocks"]) == (4, 0)


def test_verify_data_catches_a_corrupted_copy(tmp_path, run_cli, monkeypatch):
    pytest.importorskip("torch")
    from kvoffload.simulate.verify import TransferDataCheck

    store = TransferDataCheck.store

    def corrupting_store(self, job):
        store(self, job)
        if job.request_id == "A":  # flip one byte of A's second chunk in the CPU pool
            self.engine.pool.slot(int(job.slots[1]))[0] ^= 0xFF

    monkeypatch.setattr(TransferDataCheck, "store", corrupting_store)
    trace = write_trace(tmp_path / "t.jsonl", THREE)
    code, out, err = run_cli("--trace", trace, *ENGINE, "--verify-data")
    assert code == 1
    assert out["runs"][0]["result"]["mismatched_blocks"] == 1
    assert "--verify-data: 1 loaded blocks held wrong bytes" in err


def test_the_docs_trace_example_runs_as_pasted(tmp_path, run_cli):
    page = (Path(__file__).parents[2] / "docs" / "simulator.md").read_text()
    example = page.split("**The kvoffload format**")[1].split("```json\n")[1].split("```")[0]
    trace = tmp_path / "t.jsonl"
    trace.write_text(example)
    code, out, err = run_cli("--trace", str(trace))
    assert code == 0, err
    r = out["runs"][0]["result"]
    assert r["requests"] == 3
    assert r["prompt_tokens"] == 6040 + 6035 + 5
    # r2 finds r1's 6,000-token document (375 blocks) in the GPU cache.
    assert r["gpu_hit_tokens"] == 6000


def test_ttft_counts_from_the_arrival(tmp_path, run_cli):
    # One request at a time, under the flat model (no attention term, no KV reads). A (8,192
    # prompt tokens, arrival 0) prefills in one step of
    # 15 ms + 8,192 / 20,000 s = 0.4246 s and finishes with its first token. B arrives at 0.01 s
    # but runs only after A: its step ends at 0.4246 + 0.015 + 16 / 20,000 = 0.4404 s, so its
    # TTFT is 0.4304 s, not the 0.0158 s of its own step.
    lines = [
        {"id": "A", "prompt": [seg("a", 8192)], "output_tokens": 1},
        {"id": "B", "arrival": 0.01, "prompt": [seg("b", 16)], "output_tokens": 1},
    ]
    trace = write_trace(tmp_path / "t.jsonl", lines)
    _, out, _ = run_cli("--trace", trace, "--max-running", "1", *TINY, *FLAT)
    r = out["runs"][0]["result"]
    assert r["ttft_mean_s"] == pytest.approx((0.4246 + 0.4304) / 2)
    assert r["ttft_p90_s"] == pytest.approx(0.4304)


def test_verify_data_catches_blocks_reused_while_a_store_is_in_flight(
    tmp_path, run_cli, monkeypatch
):
    pytest.importorskip("torch")
    from kvoffload.simulate import instance

    finish = instance.Instance._finish

    def free_blocks_at_once(self, finished):
        # An engine that ignores hold_blocks: frees the blocks its stores still read.
        finish(self, finished)
        for run in finished:
            self._release(run)

    monkeypatch.setattr(instance.Instance, "_finish", free_blocks_at_once)
    # A's stores (5 chunks at 0.01 GB/s: 8 ms) are still in flight when B, arriving at once,
    # takes A's freed blocks and computes into them; C then loads what A's stores copied.
    lines = [THREE[0], {**THREE[1], "arrival": 0.001}, {**THREE[2], "arrival": 1}]
    trace = write_trace(tmp_path / "t.jsonl", lines)
    code, out, _ = run_cli("--trace", trace, *ENGINE, "--pcie-gbps", "0.01", "--verify-data")
    assert code == 1
    assert out["runs"][0]["result"]["mismatched_blocks"] > 0


def test_attention_and_kv_reads_lengthen_the_steps(tmp_path, run_cli):
    # A: 8,192 prompt tokens, 2 output tokens; attention doubles a token's time at context 8,192.
    # Step 1 (prefill): 15 ms + 8,192 / 20,000 x (1 + (8,191 / 2) / 8,192) s = 0.015 + 0.614375 s
    # = 0.629375 s, the TTFT. Step 2 (decode) reads the KV of 8,192 tokens x 1,024 bytes at
    # 1 GB/s: 15 ms + 8.388608 ms, so the run ends at 0.652763608 s (nothing is stored).
    lines = [{"id": "A", "prompt": [seg("a", 8192)], "output_tokens": 2}]
    trace = write_trace(tmp_path / "t.jsonl", lines)
    model = ["--prefill-tokens-per-s", "20000", "--decode-step-ms", "15"]
    model += ["--prefill-attention-tokens", "8192", "--hbm-gbps", "1", "--max-offload-tokens", "0"]
    _, out, _ = run_cli("--trace", trace, *TINY, "--gpu-blocks", "1024", *model)
    r = out["runs"][0]["result"]
    assert r["ttft_mean_s"] == pytest.approx(0.629375)
    assert r["simulated_seconds"] == pytest.approx(0.652763608)


def test_a_recorded_trace_replays_at_the_block_size_its_first_line_names(tmp_path, run_cli):
    from kvoffload.scheduler.trace_recorder import TraceRecorder, TraceRecording

    path = tmp_path / "served.jsonl"
    recorder = TraceRecorder(TraceRecording(str(path)), 16)
    hashes = [bytes([i]) * 32 for i in range(4)]
    recorder.record(0.0, 0.0, 64, 4, hashes)  # 4 blocks of 16: at 512 tokens a block, refused
    recorder.record(1.0, 0.0, 64, 4, hashes)
    recorder.close()
    code, out, err = run_cli("--trace", str(path))
    assert code == 0, err
    assert out["workload"]["hash_block_tokens"] == 16
    assert out["runs"][0]["result"]["gpu_hit_tokens"] == 48  # the repeat, less its last block
    code, _, err = run_cli("--trace", str(path), "--hash-block-tokens", "512")
    assert code == 2 and "4 blocks of --hash-block-tokens 512 cannot hold" in err


def test_record_trace_files_joined_are_refused(tmp_path, run_cli):
    from kvoffload.scheduler.trace_recorder import TraceRecorder, TraceRecording

    parts = []
    for name, seed in (("a.jsonl", 1), ("b.jsonl", 2)):
        recorder = TraceRecorder(TraceRecording(str(tmp_path / name)), 16)
        recorder.record(0.0, 0.0, 64, 4, [bytes([seed, i]) * 16 for i in range(4)])
        recorder.close()
        parts.append((tmp_path / name).read_text())
    joined = tmp_path / "joined.jsonl"
    joined.write_text("".join(parts))
    code, _, err = run_cli("--trace", str(joined))
    # Both files number their blocks from 0: joined, b's prompt would repeat a's.
    assert code == 2
    assert "line 3: another record_trace file starts here" in err
