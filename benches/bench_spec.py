"""The spec benchmark of issue 7: vLLM 0.33's OffloadingConnector on its real scheduler runs the
connector benchmark's trace twice, with vLLM's CPU spec (CPUOffloadingManager) and with ours
(KVOffloadSpec: KVOffloadManager), and the time spent inside each manager is compared.

Every call the connector makes into its manager is recorded (with its answer) while the trace
runs; the two runs must make the same calls with the same answers (lookups, chunk ids, evictions,
events), and load and store the same. Each recorded call sequence is then replayed into a fresh
manager of its kind, uninstrumented, and timed (best of 5, the two kinds taking turns): that is
the time inside the manager, without the cost of recording it. `make bench` prints the table;
with --benchmark-disable (`make test`) the trace shrinks.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from bench_connector import Trace, make_trace, trace_rig

pytest.importorskip("vllm.config", reason="vLLM is not installed (`make test` installs it)")

from rig import stored_chunks, write_model_dir
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from kvoffload.vllm import KVOffloadManager

METHODS = (
    "on_new_request",
    "lookup",
    "get_load_source",
    "prepare_load",
    "touch",
    "complete_load",
    "prepare_store",
    "complete_store",
    "on_request_finished",
    "on_schedule_end",
    "has_pending_work",
    "take_events",
    "get_stats",
    "reset_cache",
    "on_reset_flushed",
)


@dataclass
class Recorder:
    """Stands in for the manager: forwards every call and records it with its answer."""

    inner: Any
    calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)
    answers: list[Any] = field(default_factory=list)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in METHODS:
            return attr

        def record(*args: Any, **kwargs: Any) -> Any:
            args = tuple(list(a) if isinstance(a, set | list) else a for a in args)
            out = attr(*args, **kwargs)
            if name == "take_events":
                out = list(out)
            self.calls.append((name, args, kwargs))
            self.answers.append(_comparable(name, out))
            return out

        return record


def _comparable(name: str, out: Any) -> Any:
    if name in ("prepare_load", "prepare_store") and out is not None:
        spec = out if name == "prepare_load" else out.store_spec
        ids = [int(b) for b in spec.block_ids]
        if name == "prepare_load":
            return ids
        return (list(out.keys_to_store), ids, list(out.evicted_keys))
    if name == "take_events":
        return [(tuple(e.keys), e.removed, e.metadata_only) for e in out]
    if name == "get_stats":
        return out.data if out is not None else None
    if name == "lookup":
        return out.name
    return None


@dataclass
class SpecRun:
    recorder: Recorder
    steps: int
    hit_tokens: dict[str, int]
    stored_chunks: int
    fresh_manager: Any


def run_trace(spec: str, trace: Trace, model_dir: str) -> SpecRun:
    rig = trace_rig(spec, trace, model_dir)
    sched = rig.connector.connector_scheduler
    manager = sched.manager
    if spec == "vllm":
        assert isinstance(manager, CPUOffloadingManager)
        fresh = lambda: CPUOffloadingManager(trace.cpu_chunks)  # noqa: E731
    else:
        assert isinstance(manager, KVOffloadManager)
        fresh = lambda: KVOffloadManager(trace.cpu_chunks)  # noqa: E731
    recorder = Recorder(manager)
    sched.manager = recorder
    for rid, tokens in trace.requests:
        rig.add(rid, tokens, 4)
    rig.run(max_steps=100_000)
    return SpecRun(recorder, rig.step, dict(rig.external_hits), stored_chunks(rig), fresh)


def replay(run: SpecRun, check: bool = False) -> float:
    """Seconds to make the recorded calls on a fresh manager, with fresh request contexts that
    hold the same key positions. With `check` (untimed use), each answer must be the recorded
    one: the replay made the same decisions."""
    contexts: dict[int, ReqContext] = {}

    def fresh_ctx(ctx: Any) -> Any:
        if not isinstance(ctx, ReqContext):
            return ctx
        new = contexts.get(id(ctx))
        if new is None:
            new = contexts[id(ctx)] = ReqContext(ctx.req_id, ctx.kv_transfer_params)
            for key, pos in ctx._offload_key_positions.items():
                new.set_offload_key_position(key, pos)
        return new

    manager = run.fresh_manager()
    bound = [
        (getattr(manager, name), tuple(fresh_ctx(a) for a in args), kwargs, name)
        for name, args, kwargs in run.recorder.calls
    ]
    if check:
        for (method, args, kwargs, name), answer in zip(bound, run.recorder.answers, strict=True):
            out = method(*args, **kwargs)
            assert _comparable(name, list(out) if name == "take_events" else out) == answer, name
        return 0.0
    start = time.perf_counter()
    for method, args, kwargs, name in bound:
        out = method(*args, **kwargs)
        if name == "take_events":
            list(out)
    return time.perf_counter() - start


RESULTS: dict[str, tuple[SpecRun, float]] = {}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_model_dir(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="module", autouse=True)
def _print_table(request):
    yield
    if set(RESULTS) != {"vllm", "spec"}:
        return
    (theirs, t_sec), (ours, o_sec) = RESULTS["vllm"], RESULTS["spec"]
    counts: dict[str, int] = {}
    for name, _, _ in ours.recorder.calls:
        counts[name] = counts.get(name, 0) + 1
    lines = [
        "",
        "time inside the manager, one trace through vLLM's OffloadingConnector and Scheduler",
        f"{'':22}{'CPUOffloadingManager':>22}{'KVOffloadManager':>20}{'ratio':>8}",
        f"{'total':<22}{t_sec * 1e3:>19.1f} ms{o_sec * 1e3:>17.1f} ms{t_sec / o_sec:7.1f}x",
        f"{'per step':<22}{t_sec / theirs.steps * 1e6:>19.0f} us"
        f"{o_sec / ours.steps * 1e6:>17.0f} us",
        f"calls: {', '.join(f'{n} {c}' for n, c in sorted(counts.items()))}",
        f"{ours.steps} steps, {sum(ours.hit_tokens.values())} tokens loaded, "
        f"{ours.stored_chunks} chunks stored (both)",
    ]
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print("\n".join(lines) + "\n")
    RESULTS.clear()


def test_same_calls_and_answers_through_either_spec(model_dir, benchmark):
    """Not timed by pytest-benchmark: it checks the two runs agree, then replays them."""
    trace = make_trace(small=benchmark.disabled)
    runs = {spec: run_trace(spec, trace, model_dir) for spec in ("vllm", "spec")}
    theirs, ours = runs["vllm"], runs["spec"]
    assert [c[0] for c in ours.recorder.calls] == [c[0] for c in theirs.recorder.calls]
    assert ours.recorder.answers == theirs.recorder.answers
    assert ours.hit_tokens == theirs.hit_tokens and sum(ours.hit_tokens.values()) > 0
    assert ours.stored_chunks == theirs.stored_chunks
    stores = [
        answer
        for (name, _, _), answer in zip(ours.recorder.calls, ours.recorder.answers, strict=True)
        if name == "prepare_store"
    ]
    assert any(answer is not None and answer[2] for answer in stores)  # the tier evicted
    for run in runs.values():
        replay(run, check=True)
    rounds = 1 if benchmark.disabled else 5
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):  # interleaved, so that both see the same machine
        for spec, run in runs.items():
            gc.collect()
            best[spec] = min(best[spec], replay(run))
    for spec, run in runs.items():
        RESULTS[spec] = (run, best[spec])
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
