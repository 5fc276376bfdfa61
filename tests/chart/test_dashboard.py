"""The Grafana dashboard in charts/sweeper/dashboards: every query names a metric the
service really exports, groups by labels those metrics carry, and is valid PromQL (promtool
parses each one as a recording rule)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from service.ledger import gauges
from service.observability import metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "charts" / "sweeper" / "dashboards" / (
    "sweeper.json")
METRIC = re.compile(r"\bsweeper_[a-z0-9_]+\b")
GROUPING = re.compile(r"\bby\s*\(([^)]*)\)")
SELECTOR = re.compile(r"\{([^}]*)\}")
MATCHER_LABEL = re.compile(r"([a-z_]+)\s*(?:=~|!~|!=|=)")
# Grafana's variables, as Grafana would substitute them before the query reaches Prometheus
GRAFANA_VARS = {"$__rate_interval": "1m", "$__range": "1h", "$policy": ".*"}


def exported() -> dict[str, set[str]]:
    """Every series name the service exports, with its label names."""
    out: dict[str, set[str]] = {}
    for value in vars(metrics).values():
        if not isinstance(value, MetricWrapperBase):
            continue
        name, labels = value._name, set(value._labelnames)
        kind = value._type
        if kind == "counter":
            out[name + "_total"] = labels
        elif kind == "histogram":
            for suffix in ("_bucket", "_sum", "_count"):
                out[name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
        elif kind == "info":
            out[name + "_info"] = labels
        else:
            out[name] = labels
    collector = gauges.LedgerCollector(engine=None, policies=["p"])  # type: ignore[arg-type]
    for family in collector.collect():
        out[family.name] = {k for s in family.samples for k in s.labels}
    # and what an app's own registry adds (sweeper_evidence_signing)
    for family in gauges.Exporter(collector, signing=True).registry.collect():
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def queries() -> list[tuple[str, str]]:
    doc = json.loads(DASHBOARD.read_text())
    found = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            walk(panel.get("panels", []))
            for target in panel.get("targets", []):
                found.append((panel["title"], target["expr"]))

    walk(doc["panels"])
    for var in doc["templating"]["list"]:
        if var["type"] == "query":
            found.append((f"variable {var['name']}", var["query"]["query"]))
    return found


def test_dashboard_is_well_formed() -> None:
    doc = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert doc["uid"] and doc["title"]
    names = {v["name"] for v in doc["templating"]["list"]}
    assert {"datasource", "policy"} <= names
    assert len(queries()) >= 20


@pytest.mark.parametrize(("panel", "expr"), queries())
def test_every_query_names_exported_metrics_and_their_labels(panel: str, expr: str) -> None:
    known = exported()
    used = set(METRIC.findall(expr))
    assert used, f"{panel}: no sweeper_ metric in {expr!r}"
    missing = used - set(known)
    assert not missing, f"{panel}: {sorted(missing)} not exported by the service"
    labels = set().union(*(known[m] for m in used)) | {"le"}
    for group in GROUPING.findall(expr):
        for label in filter(None, (x.strip() for x in group.split(","))):
            assert label in labels, f"{panel}: groups by {label!r}, which {used} lack"
    for selector in SELECTOR.findall(expr):
        for label in MATCHER_LABEL.findall(selector):
            assert label in labels, f"{panel}: matches on {label!r}, which {used} lack"


def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("SWEEPER_REQUIRE_TOOLS"):
            pytest.fail("promtool is not installed (Debian package prometheus)")
        pytest.skip("promtool is not installed (Debian package prometheus); .ci/run installs it")
    rules = []
    for i, (_panel, expr) in enumerate(queries()):
        if expr.startswith("label_values("):
            continue  # a Grafana function, not PromQL
        for var, value in GRAFANA_VARS.items():
            expr = expr.replace(var, value)
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    check = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                           text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr


# A query whose values are seconds: a duration histogram's quantile or a gauge of seconds
# (`_seconds_count` and `_seconds_sum` rates are not)
IN_SECONDS = re.compile(r"_seconds(?:_bucket)?\b(?!_)")


def test_every_series_in_seconds_is_shown_in_seconds() -> None:
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        config = panel.get("fieldConfig", {})
        by_ref = {o["matcher"]["options"]: p["value"] for o in config.get("overrides", [])
                  if o["matcher"]["id"] == "byFrameRefID"
                  for p in o["properties"] if p["id"] == "unit"}
        for target in panel.get("targets", []):
            if IN_SECONDS.search(target["expr"]):
                unit = by_ref.get(target["refId"], config.get("defaults", {}).get("unit"))
                assert unit == "s", (panel["title"], target["refId"], unit)
