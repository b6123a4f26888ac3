"""deploy/: the Grafana dashboard's and the alert rules' queries name only series that kvsp's
running services export (checked against a scrape of a real cluster), and the files are
well formed."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvsp.local import LocalCluster

DEPLOY = Path(__file__).parents[1] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "kvsp-cluster.json"
ALERTS = DEPLOY / "prometheus" / "kvsp-alerts.yaml"

#: PromQL's own words (functions, aggregations, modifiers), never series
_PROMQL = {"sum", "max", "min", "avg", "count", "rate", "increase", "histogram_quantile",
           "by", "without", "on", "ignoring", "and", "or", "unless", "group_left",
           "group_right"}  # fmt: skip


def series_named(expr: str) -> set[str]:
    """The series a PromQL expression reads: its identifiers, less label matchers, ranges,
    grouping labels and PromQL's own words."""
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)
    names = set(re.findall(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", expr))
    return names - _PROMQL


def dashboard_queries() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in doc["panels"] for t in p["targets"]]


def alert_queries() -> list[str]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [r["expr"] for g in doc["groups"] for r in g["rules"]]


def test_the_query_parser_finds_series_and_nothing_else() -> None:
    expr = ('histogram_quantile(0.95, sum by (le, tenant) (rate(kvsp_a_bucket{x="y"}'
            '[$__rate_interval]))) / sum without (pod) (vllm:b_total) > 0.5')  # fmt: skip
    assert series_named(expr) == {"kvsp_a_bucket", "vllm:b_total"}


def test_the_dashboard_and_rules_are_well_formed() -> None:
    doc = json.loads(DASHBOARD.read_text())
    assert doc["uid"] == "kvsp-cluster"
    assert doc["templating"]["list"][0]["type"] == "datasource"
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    for panel in doc["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"], panel["title"]
        assert {t["refId"] for t in panel["targets"]} == {
            chr(65 + i) for i in range(len(panel["targets"]))
        }
    rules = yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for rule in rules:
        assert rule["labels"]["severity"] in ("critical", "warning", "info")
        assert rule["annotations"]["summary"]
        assert rule["annotations"]["description"]


def exported(http: httpx.Client, up: LocalCluster) -> set[str]:
    """Every series name the cluster's services export, as a query names it."""
    names = set()
    auth = {"authorization": f"Bearer {up.metrics_token}"}
    for process in [up.index, up.holder, up.controller, up.instance_processes[0]]:
        text = http.get(process.url + "metrics", headers=auth).text
        for family in text_string_to_metric_families(text):
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
            names |= {family.name + s for s in suffixes.get(family.type, [""])}
            names |= {s.name for s in family.samples}
    return names


@pytest.mark.slow
def test_every_query_names_a_series_the_running_services_export(operated_cluster: Any) -> None:
    up: LocalCluster = operated_cluster
    with httpx.Client(timeout=120) as http:
        answer = http.post(
            up.frontend.url + "v1/completions",
            json={"model": "x", "prompt": "Dashboards read what services say.", "max_tokens": 3},
            headers={"authorization": f"Bearer {up.api_key}"},
        )
        assert answer.status_code == 200, answer.text
        names = exported(http, up)
    queries = dashboard_queries() + alert_queries()
    assert len(queries) >= 20
    unknown = {q: series_named(q) - names for q in queries if series_named(q) - names}
    assert unknown == {}
