"""`kvoffload simulate` on a whole published trace: Mooncake's FAST'25 conversation trace (12,031
requests, about 145 M prompt tokens over an hour) on 1 instance (the baseline), on 8 behind
prefix-affinity, and on those 8 with a 512 GiB shared tier behind them (the shared-tier what-if).
Reports wall time, peak RSS and simulated requests per wall second of each.

The trace is read from $KVOFFLOAD_MOONCAKE_TRACE when set (conversation_trace.jsonl); otherwise
`kvoffload.simulate.gen_hash_ids_trace` generates one of the same shape: the same request count,
prompt and output lengths and a multi-turn reuse of id prefixes (each turn re-sends its
conversation so far). `make test` runs this once on its first 300 requests
(--benchmark-disable); `make bench` runs it whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from kvoffload.simulate.gen_hash_ids_trace import REQUESTS, write_trace

SMOKE_REQUESTS = 300
ENGINE = ["--gpu-blocks", "50000", "--max-running", "256", "--cpu-gib", "256"]


def _run(trace: str, instances: int, remote_gib: int | None, limit: int | None) -> dict:
    """One replay in a fresh process, so that its peak RSS is its own."""
    args = ["simulate", "--trace", trace, *ENGINE, "--json", "--quiet"]
    args += ["--instances", str(instances), "--router", "prefix-affinity"] * (instances > 1)
    args += ["--remote-gib", str(remote_gib)] if remote_gib else []
    args += ["--limit", str(limit)] if limit else []
    code = (
        "import json, resource, sys; from kvoffload.cli import main; "
        f"rc = main({args!r}); "
        "sys.stderr.write(json.dumps({'rss_kib': resource.getrusage(resource.RUSAGE_SELF)"
        ".ru_maxrss, 'rc': rc}))"
    )
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    stats = json.loads(done.stderr.strip().splitlines()[-1])
    assert stats["rc"] == 0, done.stderr
    out = json.loads(done.stdout)
    result = out["runs"][0]["result"]
    return {"wall_s": wall, "rss_mib": stats["rss_kib"] / 1024, **result}


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> str:
    given = os.environ.get("KVOFFLOAD_MOONCAKE_TRACE")
    if given:
        return given
    path = tmp_path_factory.mktemp("trace") / "conversation_like.jsonl"
    write_trace(path)
    return str(path)


@pytest.mark.parametrize(
    ("instances", "remote_gib"), [(1, None), (8, None), (8, 512)], ids=["1", "8", "8+shared"]
)
def test_whole_trace(benchmark, trace: str, instances: int, remote_gib: int | None) -> None:
    limit = SMOKE_REQUESTS if benchmark.disabled else None
    result = benchmark.pedantic(
        _run, args=(trace, instances, remote_gib, limit), rounds=1, iterations=1
    )
    benchmark.extra_info.update(
        {
            "wall_s": round(result["wall_s"], 1),
            "peak_rss_mib": round(result["rss_mib"]),
            "requests_per_wall_s": round(result["requests"] / result["wall_s"]),
            "hit_rate": round(result["gpu_hit_rate"] + result["cpu_hit_rate"], 4),
            "ttft_mean_s": round(result["ttft_mean_s"], 3),
        }
    )
    shared = f", {remote_gib} GiB shared tier" if remote_gib else ""
    sys.stderr.write(f"\n{instances} instance(s){shared}: {benchmark.extra_info}\n")
    assert result["requests"] == (limit or REQUESTS)
    assert result["rss_mib"] < 2048  # the target (memory, not time: a test may check it)
