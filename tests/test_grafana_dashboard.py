"""The Grafana dashboard ``examples/grafana/pagedllm.json``: importable (a Prometheus
input, a templated ``datasource`` variable and a ``model_name`` variable), its rows,
every panel with a unique id, a title, a one-line description, a unit and queries on the
templated datasource, every selector filtered on ``$model_name``, p50/p90/p99 of each
latency and block lifetime histogram; and every metric it queries is in the ``/metrics``
of a live server (spec decoding's series appear only with speculation on: for those
alone, the collector declared in pagedllm/server/metrics.py stands in)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.server.launcher import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "examples" / "grafana" / "pagedllm.json"
METRICS_SOURCE = ROOT / "pagedllm" / "server" / "metrics.py"
MODEL = "SmolLM2-135M-Instruct"
SERVE_ARGS = ["--kv-cache-memory", "48MiB", "--max-model-len", "1024"]
SERVE_ARGS += ["--log-stats-interval", "0", "--kv-cache-metrics"]
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
MODEL_FILTER = 'model_name="$model_name"'
MODEL_QUERY = "label_values(vllm:num_requests_running, model_name)"
ROWS = [
    "Throughput & latency",
    "Requests & queues",
    "KV cache pool",
    "Prefix cache & block tables",
    "Block lifetimes (opt-in --kv-cache-metrics)",
    "Speculative decoding",
]
HISTOGRAMS = [
    "vllm:time_to_first_token_seconds",
    "vllm:time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:kv_block_lifetime_seconds",
    "vllm:kv_block_idle_before_evict_seconds",
    "vllm:kv_block_reuse_gap_seconds",
]
"""Histograms the dashboard shows as p50, p90 and p99."""

SPEC_DECODE_PREFIX = "vllm:spec_decode_"
"""The one exception to "exported by the live server": these series exist only when the
server speculates (the per-position counter gets no series before a first draft)."""
EXPOSITION_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
"""What prometheus-client appends to a collector's name, by kind (gauges: nothing)."""
COLLECTOR_KINDS = {
    "counter": "counter",
    "Counter": "counter",
    "gauge": "gauge",
    "Gauge": "gauge",
    "histogram": "histogram",
    "Histogram": "histogram",
}
"""Calls in metrics.py that declare a collector, its name the first argument."""

PROMQL_WORDS = frozenset((
    "sum", "avg", "min", "max", "count", "group", "stddev", "stdvar", "topk", "bottomk",
    "quantile", "count_values", "rate", "irate", "increase", "delta", "idelta", "deriv",
    "predict_linear", "resets", "changes", "histogram_quantile", "avg_over_time",
    "min_over_time", "max_over_time", "sum_over_time", "count_over_time", "last_over_time",
    "abs", "ceil", "floor", "round", "clamp", "clamp_min", "clamp_max", "sqrt", "exp", "ln",
    "log2", "log10", "absent", "vector", "scalar", "time", "timestamp", "sort", "sort_desc",
    "label_replace", "label_join", "by", "without", "on", "ignoring", "group_left",
    "group_right", "and", "or", "unless", "bool", "offset", "le", "inf", "nan",
))  # fmt: skip
"""PromQL functions, aggregations, keywords and the bucket label: never metric names."""
NAME = re.compile(r"(?<![\w:.$])[a-zA-Z_:][a-zA-Z0-9_:]*")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
MATCHERS = re.compile(r"\s*\{([^}]*)\}")


def _blank_inside(pattern: str, text: str) -> str:
    """``text`` with the inside of each match of ``pattern`` (its first and last
    characters kept) turned to spaces, so positions stay put."""
    return re.sub(pattern, lambda m: m[0][0] + " " * (len(m[0]) - 2) + m[0][-1], text)


def metric_uses(expr: str) -> list[tuple[str, str | None]]:
    """Each metric name in a PromQL expression, in order, with the text of its label
    matchers (None for a bare name). Label matchers, range windows, grouping label lists
    and ``$variables`` are not names; nor is a word followed by ``(`` (a function)."""
    masked = _blank_inside(r"\{[^}]*\}", expr)
    masked = _blank_inside(r"\[[^\]]*\]", masked)
    masked = GROUPING.sub(lambda m: m[0][: m.start(1) - m.start()] + " " * len(m[1]) + ")", masked)
    uses = []
    for match in NAME.finditer(masked):
        name = match[0]
        if name in PROMQL_WORDS or masked[match.end() :].lstrip().startswith("("):
            continue
        matchers = MATCHERS.match(expr, match.end())
        uses.append((name, matchers[1] if matchers else None))
    return uses


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def all_panels(panels: list[dict]) -> list[dict]:
    """Every panel, rows and those inside collapsed rows included."""
    found = []
    for panel in panels:
        found.append(panel)
        found += all_panels(panel.get("panels", []))
    return found


def query_panels(dashboard: dict) -> list[dict]:
    return [p for p in all_panels(dashboard["panels"]) if p["type"] != "row"]


def expressions(dashboard: dict) -> list[str]:
    return [t["expr"] for p in query_panels(dashboard) for t in p["targets"]]


def variable(dashboard: dict, name: str) -> dict:
    (found,) = [v for v in dashboard["templating"]["list"] if v["name"] == name]
    return found


def declared_collectors() -> dict[str, str]:
    """Collector name -> kind, for each collector metrics.py declares by a literal name."""
    declared = {}
    for node in ast.walk(ast.parse(METRICS_SOURCE.read_text(encoding="utf-8"))):
        if not (
            isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
        ):
            continue
        func = node.func
        called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        if called in COLLECTOR_KINDS and isinstance(node.args[0].value, str):
            declared[node.args[0].value] = COLLECTOR_KINDS[called]
    return declared


def declared_series(name: str, declared: dict[str, str]) -> bool:
    """Whether ``name`` is a series name of a collector in ``declared``."""
    if declared.get(name) == "gauge":
        return True
    return any(
        name.endswith(suffix) and declared.get(name.removesuffix(suffix)) == kind
        for kind, suffixes in EXPOSITION_SUFFIXES.items()
        for suffix in suffixes
    )


def test_metric_uses_reads_names_not_functions_labels_or_variables():
    expr = (
        'histogram_quantile(0.9, sum by (le) (rate(a:b_bucket{model_name="$model_name"}'
        "[$__rate_interval]))) / ignoring(position) group_left sum(c_total) * 1e6"
    )
    assert metric_uses(expr) == [("a:b_bucket", MODEL_FILTER), ("c_total", None)]
    assert metric_uses("sum(rate(x{a='b'}[5m])) by (mode)") == [("x", "a='b'")]
    assert declared_series("vllm:spec_decode_num_drafts_total", declared_collectors())
    for wrong in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_drafts_bucket"):
        assert not declared_series(wrong, declared_collectors())


def test_it_is_an_importable_dashboard_on_a_templated_prometheus():
    dashboard = load_dashboard()
    assert dashboard["schemaVersion"] >= 39 and dashboard["title"] and dashboard["uid"]
    assert {"name": "DS_PROMETHEUS", "type": "datasource", "pluginId": "prometheus"}.items() <= (
        dashboard["__inputs"][0].items()
    )
    datasource = variable(dashboard, "datasource")
    assert (datasource["type"], datasource["query"]) == ("datasource", "prometheus")
    assert datasource["current"]["value"] == "${DS_PROMETHEUS}"
    model = variable(dashboard, "model_name")
    assert model["type"] == "query" and model["datasource"] == DATASOURCE
    query = model["query"]["query"] if isinstance(model["query"], dict) else model["query"]
    assert query == MODEL_QUERY and model["definition"] == MODEL_QUERY


def test_panels_are_grouped_in_rows_and_each_is_complete():
    dashboard = load_dashboard()
    rows = [p for p in dashboard["panels"] if p["type"] == "row"]
    assert [r["title"] for r in rows] == ROWS
    assert dashboard["panels"][0]["type"] == "row"
    ids = [p["id"] for p in all_panels(dashboard["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    panels = query_panels(dashboard)
    assert {p["type"] for p in panels} == {"timeseries", "stat"}
    for panel in panels:
        title = panel.get("title")
        assert title, f"panel {panel['id']} has no title"
        description = panel.get("description", "")
        assert description and "\n" not in description, f"{title}: one-line description"
        assert panel["fieldConfig"]["defaults"].get("unit"), f"{title}: no unit"
        assert panel["datasource"] == DATASOURCE, f"{title}: datasource"
        targets = panel.get("targets", [])
        assert targets, f"{title}: no target"
        assert len({t["refId"] for t in targets}) == len(targets), f"{title}: refIds"
        for target in targets:
            assert target["datasource"] == DATASOURCE, f"{title}: target datasource"
            assert target["expr"].strip(), f"{title}: empty expression"
    for row in rows:
        assert row.get("datasource", DATASOURCE) == DATASOURCE
    for row, following in zip(rows, rows[1:] + [None], strict=True):
        top = dashboard["panels"]
        inside = top[top.index(row) + 1 : top.index(following) if following else len(top)]
        assert row.get("panels") or inside, f"row {row['title']} is empty"


def test_every_selector_filters_on_the_model():
    for expr in expressions(load_dashboard()):
        assert "$model_name" in expr, expr
        uses = metric_uses(expr)
        assert uses, f"no metric in {expr}"
        for name, matchers in uses:
            assert matchers is not None and MODEL_FILTER in matchers, f"{name} in {expr}"


def test_histograms_show_p50_p90_p99_from_rates_of_buckets_by_le():
    exprs = expressions(load_dashboard())
    quantile = re.compile(r"histogram_quantile\((0\.\d+), sum by \(le\) \(rate\(([\w:]+)_bucket\{")
    shown = {}
    for expr in exprs:
        if "histogram_quantile" in expr:
            match = quantile.match(expr)
            assert match and "[$__rate_interval]" in expr, expr
            shown.setdefault(match[2], set()).add(match[1])
    assert shown == dict.fromkeys(HISTOGRAMS, {"0.5", "0.9", "0.99"})


@pytest.fixture(scope="module")
def live_metrics() -> dict[str, set[str]]:
    """Series name -> the model_name labels it has, from a live server's /metrics after
    one completion."""
    with ServerProcess(SERVE_ARGS) as process:
        body = {"model": MODEL, "prompt": "Hello there, tell me about paging.", "max_tokens": 8}
        response = httpx.post(f"{process.base_url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        text = httpx.get(f"{process.base_url}/metrics", timeout=30).text
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, set()).add(sample.labels.get("model_name"))
    return series


@pytest.mark.slow
def test_every_metric_queried_is_exported_by_a_live_server(live_metrics):
    dashboard = load_dashboard()
    used = {name for expr in expressions(dashboard) for name, _ in metric_uses(expr)}
    used.add("vllm:num_requests_running")  # the model_name variable's query
    assert live_metrics["vllm:num_requests_running"] == {MODEL}
    absent = sorted(used - live_metrics.keys())
    not_exported = [n for n in absent if not n.startswith(SPEC_DECODE_PREFIX)]
    assert not_exported == [], "queried, but not in a live server's /metrics"
    declared = declared_collectors()
    undeclared = [n for n in absent if not declared_series(n, declared)]
    assert undeclared == [], "spec decoding series metrics.py does not declare"
    for name in used & live_metrics.keys():
        assert MODEL in live_metrics[name], f"{name} has no series for the model"
