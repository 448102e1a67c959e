"""The Grafana dashboard (``deploy/grafana/mmserver.json``) and the PromQL of
``docs/operations.md`` name only metrics and labels that a running server exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.harness import Harness, Serve

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "mmserver.json"
OPERATIONS = ROOT / "docs" / "operations.md"

_METRIC = re.compile(r"\b((?:mmserver|process)_[a-z_]+)\b")
#: A selector's braces (after a metric name) and a ``by (...)`` clause.
_SELECTOR = re.compile(r"\b((?:mmserver|process)_[a-z_]+)\{([^}]*)\}")
_MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"[^"]*"\s*')
_BY = re.compile(r"\bby\s*\(([^)]*)\)")
_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", ())]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            queries.append(variable["definition"])
    return queries


def page_queries() -> list[str]:
    blocks = re.findall(r"```promql\n(.*?)```", OPERATIONS.read_text(), re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


@pytest.fixture
async def exported(serve: Serve) -> dict[str, set[str]]:
    """Every sample name a server with per-model labels exports, with its label names (a
    request answered and one refused, so the per-model series exist)."""
    server: Harness = await serve(metrics_model_label="all")
    assert (await server.post("/predictions/sklearn-0", "[[0.5]]")).status == 200
    assert (await server.post("/predictions/sklearn-0", "[[0.5]")).status == 400
    text = await (await server.client.get("/metrics")).text()
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for suffix in _SUFFIXES.get(family.type, ("",)):
            labels = names.setdefault(family.name + suffix, set())
            if family.type == "histogram" and suffix == "_bucket":
                labels.add("le")
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    # The families' declared labels: a family with no series yet (no scaling so far) has them.
    for family in server.metrics.families():
        for suffix in _SUFFIXES[family.kind]:
            names.setdefault(family.name + suffix, set()).update(family.labelnames)
    return names


def check(query: str, exported: dict[str, set[str]]) -> None:
    assert query.count("(") == query.count(")"), f"unbalanced parentheses: {query}"
    metrics = _METRIC.findall(query)
    assert metrics, f"no metric of the server in {query}"
    used: set[str] = set()
    for metric in metrics:
        assert metric in exported, f"{metric} is not exported (in {query})"
        used |= exported[metric]
    for metric, matchers in _SELECTOR.findall(query):
        for label, _ in _MATCHER.findall(matchers):
            # model="" selects the server-wide series, which have no model label.
            assert label in exported[metric], f"{metric} has no label {label} (in {query})"
    for clause in _BY.findall(query):
        for label in (part.strip() for part in clause.split(",")):
            assert label in used, f"no metric of {query} has the label {label}"


async def test_dashboard_queries_name_exported_metrics(exported: dict[str, set[str]]) -> None:
    queries = dashboard_queries()
    assert len(queries) >= 20
    for query in queries:
        check(query, exported)


async def test_operations_page_queries_name_exported_metrics(
    exported: dict[str, set[str]],
) -> None:
    queries = page_queries()
    assert len(queries) >= 15
    for query in queries:
        check(query, exported)


def test_the_check_refuses_unknown_metrics_and_labels() -> None:
    exported = {"mmserver_requests_total": {"model", "code"}}
    check('sum by (model) (rate(mmserver_requests_total{code!="200"}[5m]))', exported)
    with pytest.raises(AssertionError, match="not exported"):
        check("rate(mmserver_request_total[5m])", exported)
    with pytest.raises(AssertionError, match="no label lane"):
        check('mmserver_requests_total{lane="x"}', exported)
    with pytest.raises(AssertionError, match="has the label instance_id"):
        check("sum by (instance_id) (mmserver_requests_total)", exported)


def test_dashboard_is_importable() -> None:
    """Unique panel ids, a grid within 24 columns, and a data source on every query."""
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        for target in panel.get("targets", ()):
            assert target["datasource"]["uid"] == "${datasource}"
            assert target["refId"]
