"""Time to first token on a real vLLM engine (the CPU build), served from each tier against
computed, and the throughput when nothing hits, with the connector against without it.

`make bench-e2e` (part of `make bench`) runs it in full: a random-weight Llama of 4 layers,
hidden size 512 (prefill of 4,096 tokens takes seconds on two cores, a load of their 32 MiB of
KV milliseconds), three repeated 4,096-token prompts a row. `make test` runs it quick (the
suite's small model, 512-token prompts, one a row) so that it never rots; its numbers mean
nothing. Every row comes from engines started in this same run: the baseline is the engine
with no connector.

A CPU number, not a GPU one: it shows the mechanism end to end (a load replaces a prefill);
on a GPU both prefill and copies are far faster, and their ratio differs.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).parents[2] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "e2e")]  # the suite's model and Redis server

from configs import ours, spec  # noqa: E402
from engine import build_model, engine_env, run_logged  # noqa: E402

from redis_server import redis_server  # noqa: E402

HERE = Path(__file__).parent
FULL = os.environ.get("KVOFFLOAD_BENCH_FULL") == "1"
PROMPT_TOKENS = 4096 if FULL else 512
ROUNDS = 3 if FULL else 1
BATCH = (8, 1024, 32) if FULL else (4, 256, 8)  # prompts, tokens each, tokens generated
TIER_BYTES = 512 << 20


def _prompts(seed: int, n: int, tokens: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 2048) for _ in range(tokens)] for _ in range(n)]


def test_ttft_by_tier(tmp_path: Path) -> None:
    if FULL:
        model = build_model(tmp_path / "model", layers=4, hidden=512, heads=8, kv_heads=4)
    else:
        model = build_model(tmp_path / "model")
    counter = iter(range(100))

    def engine(config: dict[str, Any] | None, prompts: list[list[int]], **spec: Any) -> Any:
        n = next(counter)
        engine_args: dict[str, Any] = {
            "block_size": 32,
            "max_model_len": PROMPT_TOKENS + 64,
            "max_num_batched_tokens": PROMPT_TOKENS + 64,  # a prompt prefills in one step
            "dtype": "float32",
            "enforce_eager": True,
            "disable_log_stats": False,
        }
        if config is not None:
            engine_args["kv_transfer_config"] = config
        path, out, log = (tmp_path / f"{n}.{s}" for s in ("spec", "out", "log"))
        path.write_text(
            json.dumps({"model": str(model), "engine": engine_args, "prompts": prompts, **spec})
        )
        cmd = [sys.executable, str(HERE / "ttft_engine.py"), str(path), str(out)]
        if run_logged(cmd, engine_env(), log, timeout=1200):
            pytest.fail(f"engine failed:\n{log.read_text()[-6000:]}")
        return json.loads(out.read_text())

    def batches(seed: int) -> dict[str, Any]:
        return {
            "batches": [_prompts(seed * 10 + r, BATCH[0], BATCH[1]) for r in range(ROUNDS)],
            "batch_tokens": BATCH[2],
        }

    rows: dict[str, list[float]] = {}
    whole = PROMPT_TOKENS // 32 * 32 * ROUNDS  # what a tier serves the timed prompts
    throughput: dict[str, float] = {}
    base = engine(None, _prompts(1, ROUNDS, PROMPT_TOKENS), **batches(100))
    assert base["external_hits"] == 0
    rows["computed (no connector)"] = base["ttft"]
    throughput["no connector"] = statistics.median(base["throughput"])
    cpu = engine(
        ours(TIER_BYTES), _prompts(2, ROUNDS, PROMPT_TOKENS), store_first=True, **batches(200)
    )
    assert cpu["external_hits"] == whole
    rows["CPU tier (KVOffloadConnector)"] = cpu["ttft"]
    throughput["KVOffloadConnector"] = statistics.median(cpu["throughput"])
    inside_vllm = engine(spec(TIER_BYTES), _prompts(3, ROUNDS, PROMPT_TOKENS), store_first=True)
    assert inside_vllm["external_hits"] == whole
    rows["CPU tier (KVOffloadSpec)"] = inside_vllm["ttft"]
    with redis_server() as redis:
        for name, tier in (
            ("disk", {"type": "DiskTier", "path": str(tmp_path / "disk"),
                      "capacity_bytes": 1 << 30, "namespace": "bench"}),
            ("Redis", {"type": "RedisTier", "url": redis.url, "namespace": "bench"}),
        ):  # fmt: skip
            prompts = _prompts(4 if name == "disk" else 5, ROUNDS, PROMPT_TOKENS)
            config = ours(TIER_BYTES, secondary_tiers=[tier])
            engine(config, prompts, store_first=True)  # stores; its exit flushes the tier
            # A second engine: its CPU tier is empty, every hit is promoted from the tier.
            second = engine(config, prompts)
            assert second["external_hits"] == whole
            rows[f"{name} tier, new engine (KVOffloadConnector)"] = second["ttft"]
    base_ttft = statistics.median(rows["computed (no connector)"])
    lines = [
        f"Time to first token, {PROMPT_TOKENS}-token prompt, median of {ROUNDS} (CPU build):",
        "",
        "| served from | TTFT (ms) | speed-up over computed |",
        "|---|---:|---:|",
    ]
    for name, times in rows.items():
        median = statistics.median(times)
        lines.append(f"| {name} | {median * 1000:.0f} | {base_ttft / median:.2f}x |")
    ratio = throughput["KVOffloadConnector"] / throughput["no connector"]
    lines += [
        "",
        f"Throughput when nothing hits ({BATCH[0]} distinct {BATCH[1]}-token prompts, "
        f"{BATCH[2]} tokens each, median of {ROUNDS} batches): "
        + ", ".join(f"{k} {v:.0f} tokens/s" for k, v in throughput.items())
        + f"; with the connector / without: {ratio:.3f}",
    ]
    table = "\n".join(lines)
    print("\n" + table)
    if FULL:  # the quick run's numbers mean nothing: not kept
        Path(".benchmarks").mkdir(exist_ok=True)
        Path(".benchmarks/e2e_ttft.md").write_text(table + "\n")
    # Each tier served every timed prompt (asserted above); the timings themselves are not
    # asserted (a shared machine's).
