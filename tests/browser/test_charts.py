"""The console's charts in Chromium: drawn by uPlot from the ledger's minutes, updated while
the page stays open, on the overview, a scope's page and a run's page, in each window."""

from __future__ import annotations

from typing import Any

from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from drills.upstream import Fault
from tests.browser.conftest import Console, axe_violations, screenshot, sign_in, submit, wait_for

# The total a chart's series shows over its window (values are per second of a bucket),
# or null until the chart is drawn.
_TOTAL = """
const figure = document.getElementById(arguments[0]);
if (!figure || !figure.plot) { return null; }
const i = figure.plot.series.findIndex(s => s.label === arguments[1]);
if (i < 0) { return null; }
const bucket = Number(figure.getAttribute("data-bucket-s"));
return figure.plot.data[i].reduce((sum, v) => sum + (v || 0) * bucket, 0);"""
_LAST = """
const figure = document.getElementById(arguments[0]);
if (!figure || !figure.plot) { return null; }
const i = figure.plot.series.findIndex(s => s.label === arguments[1]);
return i < 0 ? null : figure.plot.data[i].filter(v => v !== null).slice(-1)[0];"""
_LABELS = """
const figure = document.getElementById(arguments[0]);
return figure && figure.plot ? figure.plot.series.slice(1).map(s => s.label) : [];"""


def total(driver: WebDriver, chart: str, label: str) -> Any:
    return driver.execute_script(_TOTAL, chart, label)


def test_charts_draw_the_drain_as_it_happens(driver: WebDriver, console: Console) -> None:
    console.register([{"tenant_id": "shop-c", "object_id": f"c-{i}"} for i in range(30)])
    sign_in(driver, console)
    # the overview is open before the run starts: its charts must follow without a reload
    driver.get(console.base_url + "/console")
    wait_for(lambda: driver.execute_script(_LABELS, "chart-outcomes"), what="charts drawn")
    console.upstream.inject(Fault.STATUS, times=4, status=429, headers={"Retry-After": "0"})
    with console.api() as api:
        run = api.post("/v1/runs", json={"policy": "carts", "tenant_id": "shop-c"}).json()
        wait_for(lambda: api.get(f"/v1/runs/{run['id']}").json()["items"].get(
            "succeeded") == 30, timeout=30, what="the run drained")
    # each process adds its tally every 10 s and the page fetches the charts every 10 s
    wait_for(lambda: (total(driver, "chart-outcomes", "succeeded") or 0) >= 30, timeout=45,
             what="the outcomes chart showing the drain")
    assert (total(driver, "chart-outcomes", "throttled (429)") or 0) >= 4
    assert "expired leases taken over" in driver.execute_script(_LABELS, "chart-leases")
    wait_for(lambda: "carts" in driver.execute_script(_LABELS, "chart-backlog"),
             what="the backlog sampled")
    assert driver.find_element(By.CSS_SELECTOR, "#chart-outcomes canvas")
    assert not axe_violations(driver)
    screenshot(driver, "charts-overview")

    submit(driver, By.LINK_TEXT, "Last week")
    assert driver.current_url.endswith("/console?window=week")
    wait_for(lambda: (total(driver, "chart-outcomes", "succeeded") or 0) >= 30,
             what="the week's chart")
    src = driver.find_element(By.ID, "chart-outcomes").get_attribute("data-chart")
    assert src is not None and src.endswith("window=week")

    driver.get(console.base_url + "/console/scope?name=tenant%3Ashop-c")
    wait_for(lambda: (total(driver, "chart-scope", "calls") or 0) >= 34,
             what="the scope's calls, 429s included")
    assert driver.execute_script(_LAST, "chart-scope", "budget (rate)") == 200
    assert not axe_violations(driver)
    screenshot(driver, "charts-scope")

    driver.get(console.base_url + f"/console/runs/{run['id']}")
    wait_for(lambda: driver.execute_script(_LAST, "chart-run", "finished") == 30,
             what="the run's progress")
    assert driver.execute_script(_LAST, "chart-run", "released") == 30
    assert not axe_violations(driver)
    screenshot(driver, "charts-run")
