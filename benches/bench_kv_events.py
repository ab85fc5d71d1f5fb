"""What publishing KV events costs the scheduler: the connector benchmark's trace
(`bench_connector.py`: 64 requests of 8K-32K tokens over 8 shared prefixes, a CPU tier that
fills up and evicts) through vLLM 0.33's real scheduler, timing every call it makes into the
connector's scheduler side, with vLLM's KV events off, on, and on with
`self_describing_kv_events`; and vLLM's own OffloadingConnector (CPU spec) with them on, as the
baseline. vLLM's "null" publisher: the events are built, then dropped (what ZMQ then costs is
vLLM's, the same for both). Each setting runs the trace 3 times, all taking turns, and keeps its
least hook time. `make bench` prints the table; with --benchmark-disable (`make test`) the trace
shrinks to 8 requests of 1K-2K tokens.
"""

from __future__ import annotations

import pytest

from bench_connector import Run, Trace, make_trace, run_trace, write_model_dir

SETTINGS: dict[str, tuple[str, dict[str, object]]] = {
    "KVOffloadConnector, events off": ("kvoffload", {}),
    "KVOffloadConnector, events on": ("kvoffload", {"enable_events": True}),
    "KVOffloadConnector, self-describing": (
        "kvoffload",
        {"enable_events": True, "extra": {"self_describing_kv_events": True}},
    ),
    "vLLM OffloadingConnector, self-describing": (
        "vllm",
        {"enable_events": True, "extra": {"self_describing_kv_events": True}},
    ),
}
BASELINE = "KVOffloadConnector, events off"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_model_dir(str(tmp_path_factory.mktemp("tiny_llama")))


def taking_turns(rounds: int, trace: Trace, model_dir: str) -> dict[str, Run]:
    best: dict[str, Run] = {}
    for _ in range(rounds):
        for name, (connector, options) in SETTINGS.items():
            run = run_trace(connector, trace, model_dir, **options)
            if name not in best or run.clock.total < best[name].clock.total:
                best[name] = run
    return best


def test_kv_events_cost(benchmark, model_dir, request):
    trace = make_trace(benchmark.disabled)
    rounds = 1 if benchmark.disabled else 3
    runs = benchmark.pedantic(taking_turns, args=(rounds, trace, model_dir), rounds=1, iterations=1)
    base = runs[BASELINE]
    for run in runs.values():
        assert run.stored_chunks > 0
        assert (
            run.hit_tokens == base.hit_tokens
            or run is runs["vLLM OffloadingConnector, self-describing"]
        )
    lines = [
        "",
        "connector scheduler-side hooks with vLLM's KV events (one trace, vLLM's Scheduler)",
        f"{'':44}{'all hooks':>12}{'take_events':>13}{'per step':>11}{'vs off':>8}",
    ]
    for name, run in runs.items():
        events = run.clock.seconds.get("take_events", 0.0)
        total, ratio = run.clock.total, run.clock.total / base.clock.total
        lines.append(
            f"{name:<44}{total * 1e3:>9.1f} ms{events * 1e3:>10.1f} ms"
            f"{total / run.steps * 1e6:>8.0f} us{ratio:>7.2f}x"
        )
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print("\n".join(lines) + "\n")
