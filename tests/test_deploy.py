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


KUBERNETES = DEPLOY / "kubernetes" / "base"
#: kinds of the Prometheus Operator, whose schemas are CRDs (not Kubernetes' own)
OPERATOR_KINDS = {"PodMonitor", "PrometheusRule"}


def kustomized() -> list[dict[str, Any]]:
    """The base's resources, every document of every file it lists."""
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    listed = kustomization["resources"]
    on_disk = sorted(p.name for p in KUBERNETES.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == on_disk  # nothing left out, nothing missing
    return [d for name in listed for d in yaml.safe_load_all((KUBERNETES / name).read_text()) if d]


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return (
        doc["spec"]["template"]["spec"]["containers"] if "template" in doc.get("spec", {}) else []
    )


def test_the_kubernetes_manifests_are_valid_against_the_kubernetes_schemas() -> None:
    import kubernetes_validate

    docs = kustomized()
    version = kubernetes_validate.latest_version()
    for doc in docs:
        if doc["kind"] in OPERATOR_KINDS:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            continue
        kubernetes_validate.validate(doc, version, strict=True)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("StatefulSet", "kvsp-holder") in kinds
    assert ("StatefulSet", "kvsp-redis") in kinds
    assert {("Secret", "kvsp-principals"), ("Secret", "kvsp-tenants")} <= kinds
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]


def test_every_kvsp_container_probes_livez_and_readyz_and_mounts_what_it_names() -> None:
    docs = kustomized()
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    for doc in docs:
        for container in containers(doc):
            if container["image"] != "kvsp":
                continue
            assert container["livenessProbe"]["httpGet"]["path"] == "/kvsp/livez"
            assert container["readinessProbe"]["httpGet"]["path"] == "/kvsp/readyz"
            volumes = {v["name"]: v for v in doc["spec"]["template"]["spec"]["volumes"]}
            claims = {c["metadata"]["name"] for c in doc["spec"].get("volumeClaimTemplates", [])}
            for mount in container["volumeMounts"]:
                assert mount["name"] in volumes.keys() | claims, mount
            mounts = {m["mountPath"]: volumes.get(m["name"], {}) for m in container["volumeMounts"]}
            for arg in container["args"]:
                if arg.startswith("/etc/kvsp/"):
                    folder, _, file = arg.rpartition("/")
                    secret = mounts[folder]["secret"]
                    keys = [i["key"] for i in secret.get("items", [])] or list(
                        secrets[secret["secretName"]]["stringData"]
                    )
                    assert file in keys, (doc["metadata"]["name"], arg)


def test_every_kvsp_container_runs_a_command_line_kvsp_accepts() -> None:
    import typer.main

    from kvsp.cli import app

    for doc in kustomized():
        for container in containers(doc):
            if container["image"] != "kvsp":
                continue
            command: Any = typer.main.get_command(app)
            args = list(container["args"])
            ctx = command.make_context("kvsp", args)
            while hasattr(command, "resolve_command"):  # a group: down to its subcommand
                _, command, rest = command.resolve_command(ctx, [*ctx._protected_args, *ctx.args])
                ctx = command.make_context(command.name, rest, parent=ctx)
            assert not ctx.args, (doc["metadata"]["name"], ctx.args)


def test_the_dockerfile_installs_with_the_readme_s_make_targets() -> None:
    """One source of truth: the image is set up by the Makefile target the README's two
    commands begin with, never by install steps of its own."""
    root = DEPLOY.parent
    dockerfile = (root / "Dockerfile").read_text()
    runs = [line for line in dockerfile.splitlines() if line.startswith("RUN ")]
    assert any("make setup" in run for run in runs)
    assert not any(re.search(r"\bpip\b|\buv\b", run) for run in runs if "rm -rf" not in run)
    makefile = (root / "Makefile").read_text()
    assert re.search(r"^demo: setup$", makefile, re.M)
    assert re.search(r"^test: lint consumer-deps browser-deps$", makefile, re.M)
    assert re.search(r"^lint: setup$", makefile, re.M)
    readme = (root / "README.md").read_text()
    assert "make demo" in readme
    assert "make test" in readme
    for copied in re.findall(r"^COPY (.+) \S+$", dockerfile, re.M):
        for name in copied.split():
            assert list(root.glob(name)) or name.endswith("*"), name
