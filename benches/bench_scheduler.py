"""The scheduler benchmark of issue 3: scheduler-side cost for one 131,072-token prompt with
16-token chunks (8,192 keys), kvoffload's OffloadScheduler against vLLM 0.33's
CPUOffloadingManager driven the way its connector drives it, in the same run:

- lookup: a request whose whole prefix is in the CPU tier. kvoffload: `lookup` (key derivation
  from the block hashes, the load window, one prefix lookup). vLLM: key derivation and its
  per-key `lookup` loop.
- store: a fresh prompt's 8,192 chunks. kvoffload: `plan_step` (storable chunks, one
  `prepare_store`, the StoreJob with its GPU blocks) and `complete_job`. vLLM: key derivation,
  one `prepare_store` and one `complete_store`.

Both tiers hold 32,768 chunks, so later rounds evict. `make bench` prints the table; with
--benchmark-disable (`make test`) the prompt shrinks to 2,048 tokens and vLLM is left out.
"""

from __future__ import annotations

import importlib.util
import itertools
from typing import Any

import pytest

from kvoffload.scheduler import OffloadConfig, OffloadScheduler, RequestUpdate

TOKENS_PER_BLOCK = 16
SLOTS = 32_768
ROUNDS = 15
_ids = itertools.count()
RESULTS: dict[str, dict[str, float]] = {}
_TIMED = {"on": False}


def prompt_tokens(benchmark) -> int:
    if benchmark.disabled:
        return 2_048
    _TIMED["on"] = True
    return 131_072


def fresh_hashes(num_tokens: int) -> list[bytes]:
    tag = next(_ids).to_bytes(4, "big")
    return [tag + i.to_bytes(28, "big") for i in range(num_tokens // TOKENS_PER_BLOCK)]


def new_scheduler() -> OffloadScheduler:
    config = OffloadConfig.from_dict(
        {"tokens_per_block": TOKENS_PER_BLOCK, "cpu_bytes_to_use": SLOTS}
    )
    return OffloadScheduler.create(config, bytes_per_chunk=1)


def record(benchmark, impl: str, op: str) -> None:
    if not benchmark.disabled:
        RESULTS.setdefault(op, {})[impl] = benchmark.stats.stats.min


@pytest.fixture(scope="module", autouse=True)
def _print_table(request):
    yield
    if _TIMED["on"] and RESULTS:
        lines = ["", "scheduler-side cost, one 131,072-token prompt (8,192 keys), min over rounds"]
        for op, r in RESULTS.items():
            ours, theirs = r.get("kvoffload"), r.get("vLLM")
            line = f"{op:<7} kvoffload {ours * 1e3:8.3f} ms" if ours else f"{op:<7} -"
            if theirs:
                line += f"   vLLM {theirs * 1e3:8.3f} ms"
            if ours and theirs:
                line += f"   vLLM / kvoffload = {theirs / ours:.1f}x"
            lines.append(line)
        capture = request.config.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled():
            print("\n".join(lines) + "\n")
    RESULTS.clear()


def test_kvoffload_lookup(benchmark):
    n = prompt_tokens(benchmark)
    sched = new_scheduler()
    hashes = fresh_hashes(n)
    sched.add_request("warm", n)
    sched.on_allocated("warm", range(n // TOKENS_PER_BLOCK))
    (job,) = sched.plan_step([RequestUpdate("warm", n, n + 1, (), hashes)]).store_jobs
    sched.complete_job(job.job_id, True)

    def setup():
        rid = f"r{next(_ids)}"
        sched.add_request(rid, n)
        return (rid, 0, n, hashes), {}

    hit = benchmark.pedantic(sched.lookup, setup=setup, rounds=ROUNDS, iterations=1)
    assert hit == n
    record(benchmark, "kvoffload", "lookup")


def test_kvoffload_store(benchmark):
    n = prompt_tokens(benchmark)
    sched = new_scheduler()
    blocks = list(range(n // TOKENS_PER_BLOCK))

    def setup():
        rid = f"r{next(_ids)}"
        hashes = fresh_hashes(n)
        sched.add_request(rid, n)
        assert sched.lookup(rid, 0, n, hashes) == 0
        sched.on_allocated(rid, blocks)
        return (RequestUpdate(rid, n, n + 1, (), hashes),), {}

    def plan_and_complete(update: RequestUpdate) -> int:
        (job,) = sched.plan_step([update]).store_jobs
        sched.complete_job(job.job_id, True)
        return len(job.keys)

    stored = benchmark.pedantic(plan_and_complete, setup=setup, rounds=ROUNDS, iterations=1)
    assert stored == n // TOKENS_PER_BLOCK
    record(benchmark, "kvoffload", "store")


def _vllm() -> Any:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (`make test` installs vLLM 0.33)")
    from vllm.v1.kv_offload import base
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    return base, CPUOffloadingManager


@pytest.fixture
def vllm_api(benchmark):
    if benchmark.disabled:
        pytest.skip("smoke run: importing vLLM takes seconds")
    return _vllm()


def test_vllm_lookup(benchmark, vllm_api):
    base, manager_cls = vllm_api
    n = prompt_tokens(benchmark)
    manager = manager_cls(num_chunks=SLOTS, cache_policy="lru")
    hashes = fresh_hashes(n)
    ctx = base.ReqContext(req_id="warm")
    manager.on_new_request(ctx)
    keys = [base.make_offload_key(h, 0) for h in hashes]
    manager.complete_store(manager.prepare_store(keys, ctx).keys_to_store, ctx)
    manager.on_request_finished(ctx)
    hit_result = base.LookupResult.HIT

    def setup():
        ctx = base.ReqContext(req_id=f"r{next(_ids)}")
        manager.on_new_request(ctx)
        return (ctx,), {}

    def lookup(ctx: Any) -> int:
        keys = [base.make_offload_key(h, 0) for h in hashes]
        hits = 0
        for key in keys:
            if manager.lookup(key, ctx) is not hit_result:
                break
            hits += 1
        return hits * TOKENS_PER_BLOCK

    assert benchmark.pedantic(lookup, setup=setup, rounds=ROUNDS, iterations=1) == n
    record(benchmark, "vLLM", "lookup")


def test_vllm_store(benchmark, vllm_api):
    base, manager_cls = vllm_api
    n = prompt_tokens(benchmark)
    manager = manager_cls(num_chunks=SLOTS, cache_policy="lru")

    def setup():
        ctx = base.ReqContext(req_id=f"r{next(_ids)}")
        manager.on_new_request(ctx)
        return (ctx, fresh_hashes(n)), {}

    def store(ctx: Any, hashes: list[bytes]) -> int:
        keys = [base.make_offload_key(h, 0) for h in hashes]
        out = manager.prepare_store(keys, ctx)
        manager.complete_store(out.keys_to_store, ctx)
        return len(out.keys_to_store)

    stored = benchmark.pedantic(store, setup=setup, rounds=ROUNDS, iterations=1)
    assert stored == n // TOKENS_PER_BLOCK
    record(benchmark, "vLLM", "store")
