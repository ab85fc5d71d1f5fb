"""The Grafana dashboard (docs/grafana/kvoffload-dashboard.json) queries exactly the metrics
kvoffload exports, under the names Prometheus scrapes.

The names are read from the vLLM adapters' sources with `ast`, so that this runs without vLLM:
`kvoffload/vllm/connector/stats.py` (`_COUNTERS`, `GAUGES`, exported by `KVOffloadPromMetrics`
under the prefix of its f-strings, and each tier kind's per-place `Report`),
`kvoffload/vllm/tiering/redis.py` (`_COUNTERS` and the gauges of
`RedisTier.build_metric_definitions`, under `_METRIC`, and the per-node report under
`_NODE_METRIC`) and `kvoffload/vllm/tiering/disk.py` (the disk report's `DISK_COUNTERS` and
`DISK_GAUGES`, under `_METRIC`). prometheus_client scrapes a
counter named `x` as `x_total`, and a gauge under its own name.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from kvoffload.tiers import Report, registry
from kvoffload.tiers import disk as disk_kind
from kvoffload.tiers import redis as redis_kind
from kvoffload.tiers.disk import KIND as DISK
from kvoffload.tiers.redis import KIND as REDIS

ROOT = Path(__file__).parents[1]
DASHBOARD = ROOT / "docs" / "grafana" / "kvoffload-dashboard.json"
OPERATIONS = ROOT / "docs" / "operations.md"
VLLM = ROOT / "python" / "kvoffload" / "vllm"
STATS = VLLM / "connector" / "stats.py"
REDIS_TIER = VLLM / "tiering" / "redis.py"
DISK_TIER = VLLM / "tiering" / "disk.py"

# What a metric name may look like in PromQL; ours are the ones that mention kvoffload.
IDENTIFIER = re.compile(r"(?<![\w:$])[A-Za-z_:][A-Za-z0-9_:]*")
OURS = re.compile(r"(?:vllm:kvoffload_|kvoffload:redis_tier_|kvoffload:disk_tier_)[a-z_]+")


def scraped(name: str, kind: str) -> str:
    """The name prometheus_client exposes for a metric created as `name`."""
    assert kind in ("counter", "gauge"), kind
    return name.removesuffix("_total") + "_total" if kind == "counter" else name


def _module_literal(tree: ast.Module, name: str) -> object:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return ast.literal_eval(node.value)
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == name
            and node.value is not None
        ):
            return ast.literal_eval(node.value)
    raise AssertionError(f"no module-level {name} found")


def _name_prefixes(tree: ast.Module, factory: str) -> set[str]:
    """The constant heads of the f-strings passed as `name=` to `self.<factory>(...)`."""
    prefixes = set()
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == factory
        ):
            continue
        for kw in node.keywords:
            # The per-place metrics are named apart, from each kind's `Report`.
            if kw.arg == "name" and isinstance(kw.value, ast.JoinedStr):
                head = kw.value.values[0]
                assert isinstance(head, ast.Constant), ast.dump(head)
                prefixes.add(head.value)
    return prefixes


def _report_metrics(prefix: object, report: Report) -> dict[str, str]:
    """A per-place report's metrics: `prefix` + each of its counters and gauges."""
    assert isinstance(prefix, str)
    out = {scraped(prefix + n, "counter"): "counter" for n in report.counters}
    out.update({scraped(prefix + n, "gauge"): "gauge" for n in report.gauges})
    return out


def connector_metrics() -> dict[str, str]:
    """KVOffloadConnector's metrics: scraped name -> "counter" or "gauge"."""
    tree = ast.parse(STATS.read_text())
    counters = _module_literal(tree, "_COUNTERS")
    gauges = _module_literal(tree, "GAUGES")
    assert isinstance(counters, dict) and isinstance(gauges, dict)
    (counter_prefix,) = _name_prefixes(tree, "_counter_cls")
    (gauge_prefix,) = _name_prefixes(tree, "_gauge_cls")
    out = {scraped(counter_prefix + n, "counter"): "counter" for n in counters}
    out.update({scraped(gauge_prefix + n, "gauge"): "gauge" for n in gauges})
    # The renamed counters under their old names too, until the next release.
    renamed = _module_literal(tree, "RENAMED")
    assert isinstance(renamed, dict)
    out.update({scraped(counter_prefix + old, "counter"): "counter" for old in renamed})
    for kind in registry.kinds():
        if kind.report is not None:
            for metric in (kind.report.metric, *kind.report.renamed_from):
                out.update(_report_metrics("vllm:" + metric, kind.report))
    return out


def _tiering_metrics(path: Path) -> dict[str, str]:
    """A tiering adapter's metrics (through vLLM's OffloadingConnector, which creates each
    definition under its own name): every `metric_definitions(prefix, counters, gauges, ...)`
    call of its `build_metric_definitions`, each name read from the module's own literals or
    from its kind's folder."""
    tree = ast.parse(path.read_text())
    (build,) = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name == "build_metric_definitions"
    ]
    calls = [
        node
        for node in ast.walk(build)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "metric_definitions"
    ]
    assert calls, f"{path.name}: no metric_definitions call"

    def value(arg: ast.expr) -> object:
        assert isinstance(arg, ast.Name), ast.dump(arg)
        try:
            return _module_literal(tree, arg.id)
        except AssertionError:
            return getattr(redis_kind, arg.id, None) or getattr(disk_kind, arg.id)

    out = {}
    for call in calls:
        prefix, counters, gauges = (value(a) for a in call.args[:3])
        assert isinstance(prefix, str) and isinstance(counters, dict) and isinstance(gauges, dict)
        out.update({scraped(prefix + n, "counter"): "counter" for n in counters})
        out.update({scraped(prefix + n, "gauge"): "gauge" for n in gauges})
    return out


def disk_tier_metrics() -> dict[str, str]:
    return _tiering_metrics(DISK_TIER)


def redis_tier_metrics() -> dict[str, str]:
    return _tiering_metrics(REDIS_TIER)


def exported() -> dict[str, str]:
    return {**connector_metrics(), **redis_tier_metrics(), **disk_tier_metrics()}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(board: dict) -> list[dict]:
    """Every panel, rows' nested ones too (a row itself queries nothing)."""
    out = []
    for panel in board["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def queries(board: dict) -> list[dict]:
    return [p for p in panels(board) if p["type"] != "row"]


def metric_names(expr: str) -> set[str]:
    """The identifiers of a PromQL expression that name one of our metrics, or look like a
    metric name (a colon: recording-rule or vLLM style)."""
    unquoted = re.sub(r'"[^"]*"', '""', expr)
    return {
        token
        for token in IDENTIFIER.findall(unquoted)
        if ":" in token or "kvoffload" in token or OURS.fullmatch(token)
    }


def test_the_sources_give_the_expected_names():
    names = exported()
    # Counters get `_total`, gauges do not; RedisTier's names have no `vllm:` prefix.
    assert names["vllm:kvoffload_hit_tokens_total"] == "counter"
    assert names["vllm:kvoffload_store_refusals_total"] == "counter"
    assert names["vllm:kvoffload_secondary_writes_dropped_total"] == "counter"
    assert names["vllm:kvoffload_cpu_tier_usable_bytes"] == "gauge"
    assert names["vllm:kvoffload_cpu_tier_ready_ratio"] == "gauge"
    assert names["kvoffload:redis_tier_corrupt_total"] == "counter"
    assert names["kvoffload:redis_tier_load_missing_total"] == "counter"
    assert names["kvoffload:redis_tier_breaker_state"] == "gauge"
    assert "vllm:kvoffload_hit_tokens" not in names
    assert "kvoffload:redis_tier_breaker_state_total" not in names
    assert names["vllm:kvoffload_redis_node_bytes_read_total"] == "counter"
    assert names["vllm:kvoffload_redis_node_resting"] == "gauge"
    assert names["kvoffload:redis_tier_node_failures_total"] == "counter"
    assert names["kvoffload:redis_tier_node_resting"] == "gauge"
    assert names["vllm:kvoffload_disk_corrupt_total"] == "counter"
    assert names["vllm:kvoffload_disk_breaker_state"] == "gauge"
    assert names["kvoffload:disk_tier_denied_total"] == "counter"
    assert names["kvoffload:disk_tier_chunks"] == "gauge"
    assert names["vllm:kvoffload_trace_lines_dropped_total"] == "counter"
    # 19 counters, 4 per-node and 11 per-disk series; and 6 + 4 renamed ones under their old names.
    assert len(connector_metrics()) == 19 + 4 + 11 + 6 + 4
    assert len(redis_tier_metrics()) == 6 + 4
    assert len(disk_tier_metrics()) == 11


def test_suffix_rule_is_prometheus_clients():
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    labels = ["model_name", "engine"]
    counter = prometheus_client.Counter(
        "kvoffload:redis_tier_corrupt", "doc", labelnames=[*labels, "tier"], registry=registry
    )
    counter.labels("m", "0", "RedisTier").inc()
    prometheus_client.Counter(
        "vllm:kvoffload_lookups", "doc", labelnames=labels, registry=registry
    ).labels("m", "0").inc()
    prometheus_client.Gauge(
        "vllm:kvoffload_cpu_tier_ready_ratio", "doc", labelnames=labels, registry=registry
    ).labels("m", "0").set(0.5)
    text = prometheus_client.generate_latest(registry).decode()
    samples = {line.split("{")[0] for line in text.splitlines() if not line.startswith("#")}
    assert scraped("kvoffload:redis_tier_corrupt", "counter") in samples
    assert scraped("vllm:kvoffload_lookups", "counter") in samples
    assert scraped("vllm:kvoffload_cpu_tier_ready_ratio", "gauge") in samples
    assert "vllm:kvoffload_lookups" not in samples


def test_dashboard_is_valid():
    board = dashboard()
    assert board["schemaVersion"] == 39
    assert board["title"] and board["uid"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"model_name", "engine"} <= set(variables)
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids))
    for panel in panels(board):
        assert panel.get("title"), panel
    for panel in queries(board):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel.get("targets"), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]
            assert target["refId"], panel["title"]


def test_every_query_uses_exported_names_only():
    names = exported()
    board = dashboard()
    for panel in queries(board):
        for target in panel["targets"]:
            found = metric_names(target["expr"])
            assert found, f"{panel['title']!r}: no kvoffload metric in {target['expr']!r}"
            unknown = found - set(names)
            assert not unknown, f"{panel['title']!r} queries {sorted(unknown)}"
            for name in found:
                # rate() only on counters; a gauge is read as it is.
                is_rate = re.search(rf"rate\(\s*{re.escape(name)}\b", target["expr"])
                assert bool(is_rate) == (names[name] == "counter"), (panel["title"], name)
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            definition = variable["definition"]
            assert not metric_names(definition) - set(names), definition


def deprecated() -> set[str]:
    """The renamed metrics' old names, still exported until the next release."""
    tree = ast.parse(STATS.read_text())
    renamed = _module_literal(tree, "RENAMED")
    assert isinstance(renamed, dict)
    out = {scraped("vllm:kvoffload_" + old, "counter") for old in renamed}
    for kind in registry.kinds():
        if kind.report is not None:
            for metric in kind.report.renamed_from:
                out |= set(_report_metrics("vllm:" + metric, kind.report))
    return out


def test_every_exported_metric_has_a_panel():
    board = dashboard()
    used = set()
    for panel in queries(board):
        for target in panel["targets"]:
            used |= metric_names(target["expr"])
    current = set(exported()) - deprecated()
    assert len(deprecated()) == 10
    assert current <= used, sorted(current - used)
    assert not used & deprecated(), sorted(used & deprecated())


def test_operations_page_lists_every_metric():
    if not OPERATIONS.exists():
        pytest.skip("docs/operations.md is not there")
    text = OPERATIONS.read_text()
    assert "(grafana/kvoffload-dashboard.json)" in text
    for name in exported():
        assert f"`{name}`" in text, name
    for panel in queries(dashboard()):
        assert panel["title"] in text, panel["title"]


def test_vllm_scrapes_these_names():
    """With vLLM installed: the names its own Prometheus classes expose for both seams."""
    pytest.importorskip("vllm")
    import functools
    from types import SimpleNamespace

    import prometheus_client
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadPromMetrics,
    )

    from kvoffload.vllm.connector.stats import KVOffloadPromMetrics
    from kvoffload.vllm.tiering.redis import _BREAKER_STATES

    registry = prometheus_client.CollectorRegistry()
    metric_types = {
        cls: functools.partial(cls, registry=registry)
        for cls in (prometheus_client.Counter, prometheus_client.Gauge, prometheus_client.Histogram)
    }
    tier = {"type": "RedisTier", "module_path": "kvoffload.vllm", "url": "redis://h:1"}
    disk_tier = {"type": "DiskTier", "module_path": "kvoffload.vllm", "path": "/mnt/nvme/kv"}
    extra = {"spec_name": "TieringOffloadingSpec", "secondary_tiers": [tier, disk_tier]}
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))
    labelnames, per_engine = ["model_name", "engine"], {0: ["m", "0"]}
    connector = KVOffloadPromMetrics(config, metric_types, labelnames, per_engine)
    # The per-node series appear once a node is reported (their `node` label bound then).
    report = dict.fromkeys(("bytes_written", "bytes_read", "failures", "resting"), 1)
    connector.observe({REDIS.report.key: {"h:1": report}})
    # So do the per-disk ones once a disk tier is reported (their `path` label).
    disk = {name.removesuffix("_total").split("disk_tier_")[1]: 1 for name in disk_tier_metrics()}
    connector.observe({DISK.report.key: {"/mnt/nvme/kv": disk}})
    offloading = OffloadPromMetrics(config, metric_types, labelnames, per_engine)
    # Our tiers' series appear once observed (vLLM binds their `tier` label on first use).
    tiers = {**redis_tier_metrics(), **disk_tier_metrics()}
    created = {name.removesuffix("_total"): kind for name, kind in tiers.items()}

    def labels(name: str) -> tuple[str, ...]:
        tier = "DiskTier" if "disk_tier" in name else "RedisTier"
        return (tier, "h:1") if "_node_" in name else (tier,)

    offloading.observe(
        {
            "types": created,
            "data": {name: {labels(name): _BREAKER_STATES["down"]} for name in created},
        }
    )
    text = prometheus_client.generate_latest(registry).decode()
    samples = {}
    for line in text.splitlines():
        if "kvoffload" in line and not line.startswith("#") and "_created" not in line:
            name, labels = line.split("{", 1)
            samples[name] = labels
    assert set(samples) == set(exported())
    assert samples["kvoffload:redis_tier_breaker_state"].startswith(
        'engine="0",model_name="m",tier="RedisTier"}'
    )
    assert samples["vllm:kvoffload_lookups_total"].startswith('engine="0",model_name="m"}')
    assert samples["vllm:kvoffload_redis_node_resting"].startswith(
        'engine="0",model_name="m",node="h:1"}'
    )
    assert samples["vllm:kvoffload_disk_breaker_state"].startswith(
        'engine="0",model_name="m",path="/mnt/nvme/kv"}'
    )


def test_renamed_metrics_are_exported_under_both_names():
    """Until the next release, an old name carries the same value as its new one."""
    pytest.importorskip("vllm")
    import functools
    from types import SimpleNamespace

    import prometheus_client

    from kvoffload.vllm.connector.stats import KVOffloadPromMetrics

    registry_ = prometheus_client.CollectorRegistry()
    metric_types = {
        cls: functools.partial(cls, registry=registry_)
        for cls in (prometheus_client.Counter, prometheus_client.Gauge, prometheus_client.Histogram)
    }
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}))
    metrics = KVOffloadPromMetrics(config, metric_types, ["engine"], {0: ["0"]})
    node = {"bytes_written": 0, "bytes_read": 5, "failures": 0, "resting": 1}
    metrics.observe({"secondary_lookups": 3, REDIS.report.key: {"h:1": node}})
    metrics.observe({"secondary_lookups": 4})
    text = prometheus_client.generate_latest(registry_).decode()
    for name in ("secondary_lookups", "remote_lookups"):
        assert f'vllm:kvoffload_{name}_total{{engine="0"}} 7.0' in text
    for prefix in ("redis_node", "remote_node"):
        assert f'vllm:kvoffload_{prefix}_bytes_read_total{{engine="0",node="h:1"}} 5.0' in text
        assert f'vllm:kvoffload_{prefix}_resting{{engine="0",node="h:1"}} 1.0' in text
        # A node's series show from its first report, those still at 0 too.
        assert f'vllm:kvoffload_{prefix}_failures_total{{engine="0",node="h:1"}} 0.0' in text
