"""The secondary-tier connector benchmark: one two-engine trace through vLLM 0.33's real scheduler
twice per tier, timing every call the scheduler makes into each engine's connector:

- Redis (issue 19): vLLM's OffloadingConnector + TieringOffloadingSpec + our RedisTier, and
  KVOffloadConnector + `secondary_tiers`, against one real `redis-server` (started here, flushed
  between runs);
- disk (issue 32): vLLM's OffloadingConnector + TieringOffloadingSpec + vLLM's own filesystem tier
  (`"type": "fs"`, FileSystemTierManager), and KVOffloadConnector + our DiskTier, each on a new
  directory of this machine's filesystem.

Engine 1 serves the trace cold: it computes, stores into its CPU tier and writes on to the tier.
Engine 2, a fresh replica (on the same directory), serves the same trace: its hits come from the
tier through promotion.
Trace: 32 requests of 2K-8K tokens (163K in all), each one of 8 shared prefixes plus its own
suffix, 4 output tokens, 8 at a time; 16-token blocks and chunks (vLLM's default); a CPU
tier of 256K tokens per engine. Every tier job takes one step on both seams (the rig waits,
untimed, for the I/O before each schedule). The copy workers are not timed (vLLM's CUDA-only one
is replaced by one that completes each job at once; ours copies on the CPU). Each connector runs
the trace 3 times and keeps its least hook time; `make bench` prints the table, `make test`
(`--benchmark-disable`) runs a 6-request trace once.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "vllm"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

pytest.importorskip("vllm.config", reason="vLLM is not installed (`make test` installs it)")

from rig import NoCopyWorker, make_rig, write_model_dir

from bench_connector import HOOKS, HookClock, hook_rows, shared_prefix_requests
from kvoffload.tiers.redis import RedisLookups
from kvoffload.vllm import DiskTier
from redis_server import redis_server

TPB = 16
NAMESPACE = "bench@shared"


def make_trace(small: bool) -> list[tuple[str, list[int]]]:
    return shared_prefix_requests(19, *((6, 2, 256, 512) if small else (32, 8, 1024, 4096)))


def tier_entry(connector: str, where: str) -> dict[str, Any]:
    """The tier at `where` (a Redis url, or a directory) in each seam's `secondary_tiers`."""
    if where.startswith("redis"):
        tier: dict[str, Any] = {"type": "RedisTier", "url": where, "namespace": NAMESPACE}
    elif connector == "vllm":
        return {"type": "fs", "root_dir": where}
    else:
        tier = {"type": "DiskTier", "path": where, "capacity_bytes": 1 << 40}
        tier["namespace"] = NAMESPACE
    if connector == "vllm":
        tier["module_path"] = "kvoffload.vllm"
    return tier


def bench_rig(model_dir: str, connector: str, tier: dict[str, Any], cpu_chunks: int) -> Any:
    """An engine of these benchmarks with one secondary tier: through our connector, or
    (`connector="vllm"`) through vLLM's tiering; copies complete at once, bytes unchecked."""
    extra: dict[str, Any] = {"secondary_tiers": [tier]}
    if connector == "vllm":
        extra["spec_name"] = "TieringOffloadingSpec"
    return make_rig(
        model_dir,
        connector=connector,
        extra=extra,
        vllm_worker=NoCopyWorker,
        tokens_per_block=TPB,
        chunk_tokens=TPB,
        cpu_chunks=cpu_chunks,
        num_gpu_blocks=2048,
        max_num_batched_tokens=4096,
        max_num_seqs=8,
        verify=False,
        max_model_len=20_000,
    )


def engine(connector: str, where: str, model_dir: str, cpu_chunks: int) -> Any:
    rig = bench_rig(model_dir, connector, tier_entry(connector, where), cpu_chunks)
    if connector == "kvoffload":
        # The disk's start-up scan runs beside the engine; engine 2 must see engine 1's files.
        while not all(getattr(t, "scanned", True) for t in rig.connector._sched().tier_lookups):
            time.sleep(0.001)
    return rig


def idle(rig: Any) -> Any:
    """A check that the engine's tier has no I/O in flight (lookups, loads and writes)."""
    conn = rig.connector
    if not hasattr(conn, "connector_scheduler"):
        sched = conn._sched()
        # The scheduler's lookups too: a Redis tier's connection (its lookups count answers that
        # only the next schedule() reads), a disk's probes for files its index lacks.
        clients = [rig.worker._worker().tiers[0].client]
        clients += [t._client if isinstance(t, RedisLookups) else t for t in sched.tier_lookups]
        return lambda: not any(c.in_flight() for c in clients)
    (tier,) = conn.connector_scheduler.manager.secondary_tiers
    if isinstance(tier, DiskTier):  # ours: its jobs and its probes
        disk = tier._client
        return lambda: not disk.in_flight() and not disk.probes_in_flight()
    if hasattr(tier, "_client"):  # our RedisTier
        clients = [tier._client, tier._lookup_client]
        return lambda: not any(c.in_flight() for c in clients)
    # vLLM's fs tier: its thread pool, and its lookup thread's queue.
    return lambda: tier._pool._inflight_jobs == 0 and tier._lookup_manager._lookup_queue.empty()


def one_step_io(rig: Any) -> None:
    """Before each schedule, waits (untimed) until the tier's I/O is idle: every job takes
    exactly one step on both seams. Otherwise the rig would spin while the tier works, and the
    cheaper connector would make more (idle) steps in the same time."""
    schedule = rig.scheduler.schedule
    quiet = idle(rig)

    def quiet_schedule() -> Any:
        deadline = time.monotonic() + 10
        while not quiet() and time.monotonic() < deadline:
            time.sleep(0.0001)
        return schedule()

    rig.scheduler.schedule = quiet_schedule


def serve_trace(rig: Any, trace: list[tuple[str, list[int]]], clock: HookClock) -> dict[str, int]:
    one_step_io(rig)
    conn = rig.connector
    for name in HOOKS:
        if hasattr(conn, name):
            setattr(conn, name, clock.wrap(name, getattr(conn, name)))
    for rid, tokens in trace:
        rig.add(rid, tokens, 4)
    rig.run(max_steps=1_000_000)
    return dict(rig.external_hits)


def settle(connector: str, rig: Any) -> None:
    """vLLM's tiering reports its writes to the tier at later steps: let them land before engine
    2 starts (ours keeps stepping until its writes ended)."""
    if connector == "vllm":
        (tier,) = rig.connector.connector_scheduler.manager.secondary_tiers
        tier.drain_jobs()
        rig.run(max_steps=1000)


def run_pair(connector: str, trace: list, model_dir: str, where: str) -> dict[str, Any]:
    cpu_chunks = 256 if len(trace) < 10 else 16384
    clocks = [HookClock(), HookClock()]
    start = time.perf_counter()
    one = engine(connector, where, model_dir, cpu_chunks)
    serve_trace(one, trace, clocks[0])
    settle(connector, one)
    two = engine(connector, where, model_dir, cpu_chunks)
    hits = serve_trace(two, trace, clocks[1])
    wall = time.perf_counter() - start
    for rig in (one, two):
        rig.connector.shutdown()
    per_hook: dict[str, float] = {}
    for c in clocks:
        for name, seconds in c.seconds.items():
            per_hook[name] = per_hook.get(name, 0.0) + seconds
    return {
        "per_hook": per_hook,
        "hook_s": sum(c.total for c in clocks),
        "steps": one.step + two.step,
        "hits": hits,
        "wall": wall,
    }


RESULTS: dict[tuple[str, str], dict[str, Any]] = {}
"""(tier, connector) -> the run."""
LABELS = {"redis": "vLLM Tiering+RedisTier", "disk": "vLLM Tiering+fs tier"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_model_dir(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="module")
def server():
    with redis_server() as s:
        yield s


def table(tier: str, theirs: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    a, b = sum(theirs["hits"].values()), sum(ours["hits"].values())
    lines = [
        "",
        f"{tier} tier: connector scheduler-side hooks, engine 1 (cold) + engine 2 (from the tier)",
        f"{'':28}{LABELS[tier]:>24}{'KVOffloadConnector':>20}{'ratio':>8}",
    ]
    lines += hook_rows(theirs["per_hook"], ours["per_hook"], (21, 17))
    lines += [
        f"{'total':<28}{theirs['hook_s'] * 1e3:>21.1f} ms{ours['hook_s'] * 1e3:>17.1f} ms"
        f"{theirs['hook_s'] / ours['hook_s']:7.1f}x",
        f"{'per step':<28}{theirs['hook_s'] / theirs['steps'] * 1e6:>21.0f} us"
        f"{ours['hook_s'] / ours['steps'] * 1e6:>17.0f} us",
        f"{'steps':<28}{theirs['steps']:>24}{ours['steps']:>20}",
        f"{'engine 2 hits':<28}{a:>24}{b:>20}  ({abs(a - b) / max(a, 1):.2%} apart)",
        f"{'wall':<28}{theirs['wall']:>22.1f} s{ours['wall']:>18.1f} s",
    ]
    return lines


@pytest.fixture(scope="module", autouse=True)
def _print_tables(request):
    yield
    lines = []
    for tier in LABELS:
        ours, theirs = RESULTS.get((tier, "kvoffload")), RESULTS.get((tier, "vllm"))
        if ours is not None and theirs is not None:
            lines += table(tier, theirs, ours)
    if lines:
        capture = request.config.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled():
            print("\n".join(lines) + "\n")
    RESULTS.clear()


@pytest.mark.parametrize("connector", ["vllm", "kvoffload"])
@pytest.mark.parametrize("tier", list(LABELS))
def test_secondary_tier_trace(benchmark, model_dir, server, tmp_path_factory, tier, connector):
    trace = make_trace(small=benchmark.disabled)
    rounds = 1 if benchmark.disabled else 3

    def where() -> str:
        """A fresh tier for each run: Redis flushed, or a new directory."""
        if tier == "redis":
            server.command("FLUSHALL")
            return server.url
        return str(tmp_path_factory.mktemp(f"{connector}-disk"))

    run = benchmark.pedantic(
        lambda: min(
            (run_pair(connector, trace, model_dir, where()) for _ in range(rounds)),
            key=lambda r: r["hook_s"],
        ),
        rounds=1,
        iterations=1,
    )
    assert len(run["hits"]) == len(trace)
    # Engine 2 finds the shared prefixes (and its own suffixes) engine 1 wrote.
    assert sum(run["hits"].values()) > 0
    RESULTS[(tier, connector)] = run
