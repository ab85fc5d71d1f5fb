"""The store benchmark of issue 2: kvoffload's CpuStore against a plain-Python OrderedDict LRU
store with the same semantics (benches/lru_baseline.py) and vLLM 0.33's CPUOffloadingManager
(lru and arc), on one trace:

- store 200,000 keys (36 bytes: a 32-byte hash and a 4-byte group index) in batches of 64 into
  100,000 slots, so the second half of the stores each evict a key;
- look up the 100,000 present keys, batch by batch, as prefix lookups;
- load them in batches of 64: prepare_load, touch, complete_load;
- one prefix lookup of 8,192 present keys (including the Python -> Rust call for kvoffload);
- index metadata bytes per entry with the store full: kvoffload's from its stats (key copies
  included), the Python stores' by tracemalloc (keys themselves not counted).

kvoffload runs twice per policy: fed lists of `bytes` (as the other stores are) and fed views of
one contiguous `KeyList` (its fastest input).

`make bench` (pytest --benchmark-only -s) prints a table of per-key ns, bytes per entry and the
ratios. With --benchmark-disable (`make test`) the trace shrinks to 2,000 keys into 1,000 slots
and vLLM is left out (importing it takes seconds), so the benchmarks run once, fast, and never
rot. Set KVOFFLOAD_BENCH_VLLM=1 to drive vLLM in that mode too.
"""

from __future__ import annotations

import gc
import importlib.metadata
import importlib.util
import os
import random
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from kvoffload import CpuStore, KeyList
from lru_baseline import OrderedDictLruStore


@dataclass(frozen=True)
class Scale:
    num_slots: int
    num_keys: int
    batch: int
    prefix: int
    store_rounds: int
    lookup_rounds: int
    load_rounds: int
    prefix_rounds: int


FULL = Scale(100_000, 200_000, 64, 8_192, 3, 5, 3, 100)
SMOKE = Scale(1_000, 2_000, 64, 512, 1, 1, 1, 1)


class Trace:
    def __init__(self, scale: Scale) -> None:
        rng = random.Random(2)
        group = (0).to_bytes(4, "big")
        self.scale = scale
        self.keys = [rng.randbytes(32) + group for _ in range(scale.num_keys)]
        n, b = scale.num_slots, scale.batch
        # Two halves, each cut into batches: exactly the first half is evicted by the second,
        # whatever order a policy evicts the keys of one batch in.
        first, second = self.keys[:n], self.keys[n:]
        self.store_batches = [first[i : i + b] for i in range(0, n, b)] + [
            second[i : i + b] for i in range(0, len(second), b)
        ]
        self.present = self.keys[-n:]
        self.present_batches = [self.present[i : i + b] for i in range(0, n, b)]
        self.prefix = self.present[: scale.prefix]
        # The same batches as views of one contiguous KeyList (kvoffload reads them in place).
        total = len(self.keys)
        self.keylist = KeyList(self.keys)
        view = self.keylist.view
        self.store_views = [view(i, min(i + b, n)) for i in range(0, n, b)] + [
            view(i, min(i + b, total)) for i in range(n, total, b)
        ]
        self.present_views = [view(i, min(i + b, total)) for i in range(total - n, total, b)]
        self.prefix_view = view(total - n, total - n + scale.prefix)


_TRACES: dict[Scale, Trace] = {}


def trace_for(scale: Scale) -> Trace:
    if scale not in _TRACES:
        _TRACES[scale] = Trace(scale)
    return _TRACES[scale]


# --- the stores under test ---------------------------------------------------------------------


class Driver:
    """One implementation, driven through the trace with its own API."""

    name: str
    vllm = False

    def new(self, num_slots: int) -> Any:
        raise NotImplementedError

    # The trace's batches in the form this driver takes them.
    def store_batches(self, trace: Trace) -> list[Any]:
        return trace.store_batches

    def present_batches(self, trace: Trace) -> list[Any]:
        return trace.present_batches

    def prefix(self, trace: Trace) -> list[Any]:
        return [trace.prefix]

    def store(self, s: Any, batches: list[list[bytes]]) -> None:
        raise NotImplementedError

    def lookup(self, s: Any, batches: list[list[bytes]]) -> int:
        """Prefix lookups, batch by batch; returns the keys found ready."""
        raise NotImplementedError

    def load(self, s: Any, batches: list[list[bytes]]) -> None:
        raise NotImplementedError

    def bytes_per_entry(self, trace: Trace) -> float:
        """Python objects the store holds per slot, full, after the store trace."""
        gc.collect()
        tracemalloc.start()
        try:
            s = self.new(trace.scale.num_slots)
            self.store(s, self.store_batches(trace))
            gc.collect()
            used, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        del s
        return used / trace.scale.num_slots


class KvoffloadDriver(Driver):
    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.name = f"kvoffload {policy}"

    def new(self, num_slots: int) -> CpuStore:
        return CpuStore(num_slots, self.policy)

    def store(self, s: CpuStore, batches: list[list[bytes]]) -> None:
        for batch in batches:
            plan = s.prepare_store(batch)
            assert plan is not None
            s.complete_store(plan.keys)

    def lookup(self, s: CpuStore, batches: list[list[bytes]]) -> int:
        hits = 0
        for batch in batches:
            hits += s.lookup_prefix(batch).hits
        return hits

    def load(self, s: CpuStore, batches: list[list[bytes]]) -> None:
        for batch in batches:
            s.prepare_load(batch)
            s.touch(batch)
            s.complete_load(batch)

    def bytes_per_entry(self, trace: Trace) -> float:
        s = self.new(trace.scale.num_slots)
        self.store(s, self.store_batches(trace))
        st = s.stats()
        assert st.used_slots == st.num_slots
        return st.metadata_bytes_per_slot


class KvoffloadKeyListDriver(KvoffloadDriver):
    """The same store fed views of one KeyList instead of lists of bytes objects."""

    def __init__(self, policy: str) -> None:
        super().__init__(policy)
        self.name = f"kvoffload {policy}, KeyList"

    def store_batches(self, trace: Trace) -> list[Any]:
        return trace.store_views

    def present_batches(self, trace: Trace) -> list[Any]:
        return trace.present_views

    def prefix(self, trace: Trace) -> list[Any]:
        return [trace.prefix_view]


class BaselineDriver(Driver):
    name = "OrderedDict lru"

    def new(self, num_slots: int) -> OrderedDictLruStore:
        return OrderedDictLruStore(num_slots)

    def store(self, s: OrderedDictLruStore, batches: list[list[bytes]]) -> None:
        for batch in batches:
            plan = s.prepare_store(batch)
            assert plan is not None
            s.complete_store(plan[0])

    def lookup(self, s: OrderedDictLruStore, batches: list[list[bytes]]) -> int:
        hits = 0
        for batch in batches:
            hits += s.lookup_prefix(batch)[0]
        return hits

    def load(self, s: OrderedDictLruStore, batches: list[list[bytes]]) -> None:
        for batch in batches:
            s.prepare_load(batch)
            s.touch(batch)
            s.complete_load(batch)


class VllmDriver(Driver):
    """vLLM 0.33's CPUOffloadingManager as its offloading connector drives it: each batch is one
    request with its own ReqContext (on_new_request ... on_request_finished), and lookups are one
    call per key, stopping at the first key that is not a hit."""

    vllm = True

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.name = f"vLLM {policy}"
        self._api: dict[str, Any] | None = None
        self._requests = 0

    def api(self) -> dict[str, Any]:
        if self._api is None:
            from vllm.v1.kv_offload.base import LookupResult, ReqContext
            from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

            self._api = {
                "Manager": CPUOffloadingManager,
                "ReqContext": ReqContext,
                "HIT": LookupResult.HIT,
            }
        return self._api

    def _request(self, m: Any) -> Any:
        self._requests += 1
        ctx = self.api()["ReqContext"](req_id=f"bench-{self._requests}")
        m.on_new_request(ctx)
        return ctx

    def new(self, num_slots: int) -> Any:
        return self.api()["Manager"](num_chunks=num_slots, cache_policy=self.policy)

    def store(self, m: Any, batches: list[list[bytes]]) -> None:
        for batch in batches:
            ctx = self._request(m)
            out = m.prepare_store(batch, ctx)
            assert out is not None
            m.complete_store(out.keys_to_store, ctx)
            m.on_request_finished(ctx)

    def lookup(self, m: Any, batches: list[list[bytes]]) -> int:
        hit = self.api()["HIT"]
        ctx = self._request(m)
        hits = 0
        lookup = m.lookup
        for batch in batches:
            for key in batch:
                if lookup(key, ctx) is not hit:
                    break
                hits += 1
        return hits

    def load(self, m: Any, batches: list[list[bytes]]) -> None:
        for batch in batches:
            ctx = self._request(m)
            m.prepare_load(batch, ctx)
            m.touch(batch, ctx)
            m.complete_load(batch, ctx)
            m.on_request_finished(ctx)


DRIVERS: list[Driver] = [
    KvoffloadDriver("lru"),
    KvoffloadDriver("arc"),
    KvoffloadKeyListDriver("lru"),
    KvoffloadKeyListDriver("arc"),
    BaselineDriver(),
    VllmDriver("lru"),
    VllmDriver("arc"),
]


def vllm_unavailable() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (`make test` installs vLLM 0.33)"
    version = importlib.metadata.version("vllm")
    if not version.startswith("0.33."):
        return f"vLLM {version} is installed; this comparison drives vLLM 0.33's manager"
    return None


# --- results and the table ---------------------------------------------------------------------

RESULTS: dict[str, dict[str, float]] = {}
_RUN = {"timed": False}
COLUMNS = [
    ("store", "store ns/key"),
    ("lookup", "lookup ns/key"),
    ("load", "load ns/key"),
    ("prefix", "prefix lookup us"),
    ("bytes", "bytes/entry"),
]
COMPARISONS = [
    ("kvoffload lru", "OrderedDict lru"),
    ("kvoffload lru", "vLLM lru"),
    ("kvoffload arc", "vLLM arc"),
    ("kvoffload lru, KeyList", "vLLM lru"),
    ("kvoffload arc, KeyList", "vLLM arc"),
]


def format_table(results: dict[str, dict[str, float]], scale: Scale) -> str:
    prefix_label = f"prefix {scale.prefix} us"
    headers = [
        "implementation",
        *(prefix_label if c == "prefix" else label for c, label in COLUMNS),
    ]
    rows = []
    for driver in DRIVERS:
        r = results.get(driver.name, {})
        rows.append([driver.name, *(f"{r[c]:,.1f}" if c in r else "-" for c, _ in COLUMNS)])
    rows.append([])
    for ours, theirs in COMPARISONS:
        a, b = results.get(ours, {}), results.get(theirs, {})
        cells = [
            f"{b[c] / a[c]:.1f}x" if c in a and c in b and a[c] > 0 else "-" for c, _ in COLUMNS
        ]
        rows.append([f"{theirs} / {ours}", *cells])
    widths = [max(len(str(x[i])) for x in [headers, *rows] if x) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
        return "  ".join([first, *rest])

    title = (
        f"kvoffload store benchmark: {scale.num_keys:,} keys of 36 bytes stored in batches of "
        f"{scale.batch} into {scale.num_slots:,} slots; {scale.num_slots:,} present keys looked "
        f"up and loaded in batches of {scale.batch}; min over rounds"
    )
    out = [title, line(headers), line(["-" * w for w in widths])]
    out += [line(r) if r else "" for r in rows]
    out.append("ratios: the other store's cost / kvoffload's (higher: kvoffload is cheaper)")
    return "\n".join(out)


@pytest.fixture(scope="module", autouse=True)
def _print_table(request):
    yield
    scale = FULL if _RUN["timed"] else SMOKE
    table = format_table(RESULTS, scale)
    if _RUN["timed"] and RESULTS:
        capture = request.config.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled():
            print("\n\n" + table + "\n")
    RESULTS.clear()


# --- the benchmarks ----------------------------------------------------------------------------


@pytest.fixture
def scale(benchmark) -> Scale:
    if benchmark.disabled:
        return SMOKE
    _RUN["timed"] = True
    return FULL


@pytest.fixture(params=DRIVERS, ids=lambda d: d.name.replace(" ", "-"))
def driver(request, scale) -> Driver:
    d: Driver = request.param
    if d.vllm:
        reason = vllm_unavailable()
        if reason is None and scale is SMOKE and not os.environ.get("KVOFFLOAD_BENCH_VLLM"):
            reason = "smoke run: importing vLLM takes seconds (set KVOFFLOAD_BENCH_VLLM=1)"
        if reason:
            pytest.skip(reason)
    return d


_FULL_STORES: dict[tuple[str, Scale], Any] = {}


def full_store(driver: Driver, trace: Trace) -> Any:
    """A store after the whole store trace, built once per driver and scale."""
    key = (driver.name, trace.scale)
    if key not in _FULL_STORES:
        _FULL_STORES.clear()  # one at a time: vLLM's are hundreds of MB
        s = driver.new(trace.scale.num_slots)
        driver.store(s, driver.store_batches(trace))
        _FULL_STORES[key] = s
    return _FULL_STORES[key]


def record(benchmark, driver: Driver, column: str, per: float, scale_to: float = 1e9) -> None:
    if not benchmark.disabled:
        RESULTS.setdefault(driver.name, {})[column] = benchmark.stats.stats.min / per * scale_to


def run(benchmark, driver: Driver, target: Callable[..., Any], rounds: int, **kwargs: Any) -> Any:
    """Times `rounds` calls (five times as many for kvoffload, whose rounds are short)."""
    if isinstance(driver, KvoffloadDriver) and not benchmark.disabled:
        rounds *= 5
    return benchmark.pedantic(target, rounds=rounds, iterations=1, **kwargs)


def test_store(benchmark, driver, scale):
    trace = trace_for(scale)
    benchmark.group = "store: ns/key = time / num_keys"
    stores: list[Any] = []

    def setup():
        stores.clear()
        gc.collect()
        stores.append(driver.new(scale.num_slots))
        return (stores[0], driver.store_batches(trace)), {}

    run(benchmark, driver, driver.store, scale.store_rounds, setup=setup)
    # The last round's store holds exactly the second half of the keys.
    assert driver.lookup(stores[0], driver.present_batches(trace)) == scale.num_slots
    assert driver.lookup(stores[0], [trace.keys[: scale.batch]]) == 0
    record(benchmark, driver, "store", scale.num_keys)
    stores.clear()
    per_entry = driver.bytes_per_entry(trace)
    assert per_entry > 0
    if not benchmark.disabled:
        RESULTS.setdefault(driver.name, {})["bytes"] = per_entry
    if isinstance(driver, KvoffloadDriver):
        assert per_entry <= 128, f"{driver.name}: {per_entry:.1f} bytes per entry"


def test_lookup(benchmark, driver, scale):
    trace = trace_for(scale)
    s = full_store(driver, trace)
    benchmark.group = "lookup: ns/key = time / num_slots"
    hits = run(
        benchmark,
        driver,
        driver.lookup,
        scale.lookup_rounds,
        args=(s, driver.present_batches(trace)),
    )
    assert hits == scale.num_slots
    record(benchmark, driver, "lookup", scale.num_slots)


def test_load(benchmark, driver, scale):
    trace = trace_for(scale)
    s = full_store(driver, trace)
    benchmark.group = "load (prepare_load + touch + complete_load): ns/key"
    run(benchmark, driver, driver.load, scale.load_rounds, args=(s, driver.present_batches(trace)))
    # Every pin was released: the keys are still there and another load works.
    assert driver.lookup(s, driver.present_batches(trace)) == scale.num_slots
    if isinstance(s, CpuStore):
        assert s.stats().pinned == 0
    driver.load(s, driver.present_batches(trace)[:1])
    record(benchmark, driver, "load", scale.num_slots)


def test_prefix_lookup(benchmark, driver, scale):
    trace = trace_for(scale)
    s = full_store(driver, trace)
    benchmark.group = f"one prefix lookup of {scale.prefix} keys: us"
    rounds = scale.prefix_rounds if not driver.vllm else max(1, scale.prefix_rounds // 5)
    hits = run(benchmark, driver, driver.lookup, rounds, args=(s, driver.prefix(trace)))
    assert hits == scale.prefix
    record(benchmark, driver, "prefix", 1, scale_to=1e6)


# --- the baseline is a fair one: same answers as CpuStore ---------------------------------------


def test_baseline_matches_cpustore_lru():
    rng = random.Random(7)
    ours, base = CpuStore(16, "lru"), OrderedDictLruStore(16)
    universe = [bytes([i]) * 36 for i in range(40)]
    pinned: list[list[bytes]] = []
    for _ in range(400):
        op = rng.random()
        keys = rng.sample(universe, rng.randint(1, 6))
        if op < 0.5:
            plan, bplan = ours.prepare_store(keys), base.prepare_store(keys)
            if plan is None or bplan is None:
                assert plan is None and bplan is None
                continue
            assert (plan.keys, plan.slots.tolist(), plan.evicted) == bplan
            success = rng.random() < 0.8
            ours.complete_store(plan.keys, success)
            base.complete_store(bplan[0], success)
        elif op < 0.7:
            assert ours.lookup_prefix(keys) == base.lookup_prefix(keys)
        elif op < 0.8:
            ready = [k for k in keys if ours.lookup([k])[0] == 2]
            assert ours.prepare_load(ready).tolist() == base.prepare_load(ready)
            pinned.append(ready)
        elif op < 0.9 and pinned:
            batch = pinned.pop(rng.randrange(len(pinned)))
            ours.complete_load(batch)
            base.complete_load(batch)
        else:
            ours.touch(keys)
            base.touch(keys)
        assert ours.recency_order() == [base.recency_order()]
    assert ours.stats().evictions > 20
