"""The alerting rules in charts/sweeper/alerts: valid (promtool check rules), each alert
proven by its own unit test (promtool test rules), built on series the service exports, and
each with a runbook section in docs/operations.md."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.chart.test_dashboard import METRIC, exported

ALERTS = Path(__file__).resolve().parents[2] / "charts" / "sweeper" / "alerts"
OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((ALERTS / "sweeper.rules.yaml").read_text(encoding="utf-8"))
    return [rule for group in doc["groups"] for rule in group["rules"]]


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("SWEEPER_REQUIRE_TOOLS"):
            pytest.fail("promtool is not installed (Debian package prometheus)")
        pytest.skip("promtool is not installed (Debian package prometheus); .ci/run installs it")
    return subprocess.run([found, *args], cwd=ALERTS, capture_output=True, text=True,
                          timeout=60)


def test_the_rules_are_valid_and_pass_their_unit_tests() -> None:
    checked = promtool("check", "rules", "sweeper.rules.yaml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = promtool("test", "rules", "sweeper.rules.test.yaml")
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_has_a_unit_test() -> None:
    tests = yaml.safe_load((ALERTS / "sweeper.rules.test.yaml").read_text(encoding="utf-8"))
    proven = {case["alertname"] for test in tests["tests"] for case in test["alert_rule_test"]
              if case.get("exp_alerts")}
    assert {rule["alert"] for rule in rules()} == proven


def test_every_alert_reads_exported_series_and_has_its_runbook() -> None:
    known = exported()
    headings = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
                for h in re.findall(r"^#+ (.+)$", OPERATIONS.read_text(encoding="utf-8"),
                                    re.MULTILINE)}
    for rule in rules():
        used = set(METRIC.findall(rule["expr"]))
        assert used and used <= set(known), (rule["alert"], used - set(known))
        assert rule["labels"]["severity"] in {"warning", "critical"}
        url = rule["annotations"]["runbook_url"]
        assert url == f"docs/operations.md#{rule['alert'].lower()}", url
        assert rule["alert"].lower() in headings, f"no section {rule['alert']} in operations.md"
