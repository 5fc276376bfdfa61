"""An operator's session in the console, in a real headless Chromium: sign in, trigger a run
and watch the overview show it drained (live, without reloading), re-drive a dead item with
a reason, pause and resume a scope, change its rate, read the audit trail, sign out and be
refused; hostile ids render as text and run nothing; a forged cross-site POST changes
nothing; every page passes axe-core with no serious violation."""

from __future__ import annotations

import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from selenium.common.exceptions import NoAlertPresentException, WebDriverException
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from drills.upstream import Fault
from service.protocols.egress import public_roots
from tests.browser.conftest import (
    Console,
    axe_violations,
    screenshot,
    sign_in,
    submit,
    wait_for,
)

pytestmark = pytest.mark.slow

HOSTILE = ["<script>alert(1)</script>", '"><img src=x onerror=alert(1)>',
           "abc\u202edcba.exe", "x' onmouseover='alert(1)"]


def no_alert(driver: WebDriver) -> bool:
    try:
        driver.switch_to.alert  # noqa: B018 - the lookup is the check
    except NoAlertPresentException:
        return True
    return False


def text_now(driver: WebDriver, css: str) -> str:
    """The element's text, or '' while it is not on the page (a live section may be
    between two refreshes)."""
    try:
        found = driver.find_elements(By.CSS_SELECTOR, css)
        return str(found[0].text) if found else ""
    except WebDriverException:  # replaced by a refresh between the look-up and the read
        return ""


def text_of(driver: WebDriver, css: str) -> str:
    """The text of an element that must be on the page (waiting for it to appear)."""
    return str(wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, css), what=css)[0].text)


def test_sign_in_trigger_a_run_and_watch_it_drain(driver: WebDriver, console: Console) -> None:
    console.register([{"tenant_id": "shop-a", "object_id": f"cart-{i}"} for i in range(40)])
    sign_in(driver, console)
    assert driver.current_url.endswith("/console")
    # the overview starts a report-only run; its page then offers the deleting run
    driver.find_element(By.ID, "run-policy").send_keys("carts")
    submit(driver, By.CSS_SELECTOR, "form[action='/console/runs'] button")
    report_url = wait_for(lambda: "/console/runs/" in driver.current_url and driver.current_url,
                          what="the report's page")

    def delete_form() -> bool:
        driver.get(report_url)
        return bool(driver.find_elements(By.ID, "delete-preview"))

    wait_for(delete_form, what="the report's figures and its delete form")
    assert "deletes at most 40 items" in text_of(driver, "#delete-preview")
    screenshot(driver, "report")
    driver.find_element(By.ID, "delete-why").send_keys("quarterly cart retention")
    driver.find_element(By.ID, "delete-confirm").send_keys("40")
    submit(driver, By.CSS_SELECTOR, "form[action$='/delete'] button")
    run_url = wait_for(lambda: driver.current_url != report_url and driver.current_url,
                       what="the deleting run's page")
    run_id = run_url.rsplit("/", 1)[1]
    driver.get(console.base_url + "/console")
    row = f"tr[data-run='{run_id}'] td.progress"
    # the overview refreshes its figures itself: the page is not reloaded here
    wait_for(lambda: "done" in text_now(driver, row), timeout=30, what="the run drained")
    assert "40 of 40" in text_of(driver, row)
    screenshot(driver, "overview")
    driver.get(run_url)
    wait_for(lambda: "Drained." in driver.find_element(By.ID, "live").text, what="drained")
    assert driver.find_element(By.PARTIAL_LINK_TEXT, "Download deletion evidence")
    screenshot(driver, "run")


def test_redrive_a_dead_item_with_a_reason(driver: WebDriver, console: Console) -> None:
    console.upstream.inject(Fault.STATUS, status=422, match="/carts/doomed-1")
    console.register([{"tenant_id": "shop-b", "object_id": "doomed-1"}])
    with console.api() as api:
        api.post("/v1/runs", json={"policy": "carts"}).raise_for_status()
        dead = wait_for(lambda: api.get("/v1/items", params={
            "status": "dead", "tenant_id": "shop-b"}).json()["items"], what="a dead item")
    item_id = dead[0]["id"]
    sign_in(driver, console)
    driver.get(console.base_url + "/console/items?status=dead&tenant_id=shop-b")
    submit(driver, By.LINK_TEXT, f"#{item_id}")
    timeline = text_of(driver, "ol.timeline")
    assert "permanent" in timeline and "HTTP 422" in timeline
    screenshot(driver, "item")
    driver.find_element(By.ID, "why").send_keys("upstream fixed its validation (INC-42)")
    submit(driver, By.CSS_SELECTOR, "button[value=preview]")
    assert "change 1 dead item" in text_of(driver, "#preview")
    screenshot(driver, "confirm")
    submit(driver, By.CSS_SELECTOR, "button[value=confirm]")
    assert "1 item back to pending" in text_of(driver, "#result")
    with console.api() as api:
        wait_for(lambda: api.get("/v1/items", params={"tenant_id": "shop-b"}).json()
                 ["items"][0]["status"] == "succeeded", what="the re-driven item succeeded")
    submit(driver, By.LINK_TEXT, "audit trail")
    first = driver.find_element(By.CSS_SELECTOR, "table.audit tbody tr")
    assert "redrive" in first.text and "INC-42" in first.text and "(console)" in first.text


def test_bulk_cancel_by_filter_previews_the_count(driver: WebDriver, console: Console) -> None:
    with console.api() as api:  # paused workers: the items stay pending
        api.post("/v1/workers/pause", json={"reason": "bulk test"}).raise_for_status()
        try:
            console.register([{"tenant_id": "shop-c", "object_id": f"c-{i}"}
                              for i in range(7)])
            sign_in(driver, console)
            driver.get(console.base_url + "/console/items?status=pending&tenant_id=shop-c")
            driver.find_element(By.ID, "a-cancel").click()
            driver.find_element(By.ID, "t-filter").click()
            driver.find_element(By.ID, "why").send_keys("shop-c closed its account")
            submit(driver, By.CSS_SELECTOR, "button[value=preview]")
            assert "change 7 pending items" in text_of(driver, "#preview")
            submit(driver, By.CSS_SELECTOR, "button[value=confirm]")
            assert "7 items withdrawn" in text_of(driver, "#result")
            left = api.get("/v1/items", params={"tenant_id": "shop-c"}).json()["items"]
            assert {i["status"] for i in left} == {"cancelled"}
        finally:
            api.post("/v1/workers/resume", json={}).raise_for_status()


def test_pause_resume_and_rebudget_a_scope(driver: WebDriver, console: Console) -> None:
    console.register([{"tenant_id": "shop-d", "object_id": "d-1"}])
    sign_in(driver, console)
    driver.get(console.base_url + "/console/scopes")
    submit(driver, By.LINK_TEXT, "tenant:shop-d")
    driver.find_element(By.ID, "p-reason").send_keys("upstream maintenance")
    submit(driver, By.XPATH, "//button[text()='Pause scope']")
    assert "upstream maintenance" in text_of(driver, "#paused")
    driver.find_element(By.ID, "p-reason").send_keys("maintenance over")
    submit(driver, By.XPATH, "//button[text()='Resume scope']")
    assert text_of(driver, "#paused") == "no"
    for field, value in (("b-rate", "0"), ("b-burst", "3")):
        driver.find_element(By.ID, field).clear()
        driver.find_element(By.ID, field).send_keys(value)
    submit(driver, By.XPATH, "//button[text()='Change budget']")
    assert "greater than or equal to 0.001" in text_of(driver, "[role=alert]")
    assert text_of(driver, "#rate") == "200"  # unchanged
    driver.find_element(By.ID, "b-rate").clear()
    driver.find_element(By.ID, "b-rate").send_keys("7.5")
    driver.find_element(By.ID, "b-reason").send_keys("upstream asked for less")
    submit(driver, By.XPATH, "//button[text()='Change budget']")
    assert (text_of(driver, "#rate"), text_of(driver, "#burst")) == ("7.5", "3")
    screenshot(driver, "scope")
    driver.get(console.base_url + "/console/audit")
    rows = driver.find_elements(By.CSS_SELECTOR, "table.audit tbody tr")[:3]
    # newest first; the columns: when, who, action, why, details
    cells = [[cell.text for cell in row.find_elements(By.TAG_NAME, "td")] for row in rows]
    assert [(who.endswith("(console)"), action, why) for _, who, action, why, _ in cells] == [
        (True, "scope.budget", "upstream asked for less"),
        (True, "scope.resume", "maintenance over"),
        (True, "scope.pause", "upstream maintenance")]


def test_sign_out_and_be_refused(driver: WebDriver, console: Console) -> None:
    sign_in(driver, console)
    cookie = driver.get_cookie("sweeper_console")
    assert cookie is not None and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    submit(driver, By.XPATH, "//button[text()='Sign out']")
    wait_for(lambda: driver.current_url.endswith("/console/sign-in"), what="signed out")
    driver.get(console.base_url + "/console/items")
    assert driver.current_url.endswith("/console/sign-in")
    # the old cookie, replayed, is refused: the session ended on the server
    with httpx.Client(verify=public_roots(), base_url=console.base_url,
                      cookies={"sweeper_console": cookie["value"]}) as client:
        answer = client.get("/console/items")
        assert answer.status_code == 303 and answer.headers["location"] == "/console/sign-in"
    driver.find_element(By.ID, "token").send_keys("not-a-token")
    submit(driver, By.CSS_SELECTOR, "form button[type=submit]")
    assert "not valid" in text_of(driver, "[role=alert]")


def test_hostile_ids_render_as_text(driver: WebDriver, console: Console) -> None:
    with console.api() as api:
        api.post("/v1/workers/pause", json={"reason": "hostile ids"}).raise_for_status()
        try:
            console.register([{"tenant_id": "<b>evil</b>", "object_id": value}
                              for value in HOSTILE])
            sign_in(driver, console)
            driver.get(console.base_url + "/console/items?tenant_id=%3Cb%3Eevil%3C%2Fb%3E")
            # loaded, images and all: an injected script or onerror handler has run by now
            wait_for(lambda: driver.execute_script("return document.readyState") == "complete",
                     what="the page loaded")
            assert no_alert(driver)
            assert not driver.find_elements(By.CSS_SELECTOR, "main img, main b, main script")
            page = driver.find_element(By.CSS_SELECTOR, "table.items").text
            for value in HOSTILE[:2] + HOSTILE[3:]:
                assert value in page
            assert "abc\\u202edcba.exe" in page  # the override shown, not obeyed
            screenshot(driver, "items-hostile")
            submit(driver, By.PARTIAL_LINK_TEXT, "#")
            assert no_alert(driver)
            assert not driver.find_elements(By.CSS_SELECTOR, "main img, main script")
        finally:
            api.post("/v1/workers/resume", json={}).raise_for_status()


class _Attacker(BaseHTTPRequestHandler):
    """Another site's page that posts a form to the console as soon as it loads."""

    target = ""

    def do_GET(self) -> None:
        body = (f'<!doctype html><form id="f" method="post" action="{self.target}">'
                '<input name="reason" value="forged"></form>'
                '<script>document.getElementById("f").submit()</script>').encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_forged_cross_site_post_changes_nothing(driver: WebDriver, console: Console) -> None:
    sign_in(driver, console)
    _Attacker.target = console.base_url + "/console/workers/pause"
    # another site: 'localhost' is not the console's 127.0.0.1
    attacker = ThreadingHTTPServer(("127.0.0.1", 0), _Attacker)
    threading.Thread(target=attacker.serve_forever, daemon=True).start()
    try:
        driver.get(f"http://localhost:{attacker.server_address[1]}/")
        wait_for(lambda: "/console/workers/pause" in driver.current_url, what="the post")
        # the browser withheld the session cookie (SameSite=Strict) from the other site's
        # form; a cookie sent without the form's token is refused below
        assert text_of(driver, "main h1") == "Sign in first"
    finally:
        attacker.shutdown()
    with console.api() as api:
        assert api.get("/v1/workers").json()["workers_paused"] is False
    # the same post from a client that does send the cookie, without the form's token
    session = driver.get_cookie("sweeper_console")
    assert session is not None
    with httpx.Client(verify=public_roots(), base_url=console.base_url,
                      cookies={"sweeper_console": session["value"]}) as client:
        forged = client.post("/console/workers/pause", data={"reason": "forged"})
        assert forged.status_code == 403
        evil = client.post("/console/workers/pause", data={"reason": "forged"},
                           headers={"Origin": "http://evil.example"})
        assert evil.status_code == 403
    with console.api() as api:
        assert api.get("/v1/workers").json()["workers_paused"] is False


def test_every_page_passes_axe(driver: WebDriver, console: Console) -> None:
    console.register([{"tenant_id": "shop-e", "object_id": "e-1"}, {
        "tenant_id": "shop-e", "object_id": "e-2", "due_at": "2030-01-01T00:00:00Z"}])
    with console.api() as api:
        run = api.post("/v1/runs", json={"policy": "carts", "dry_run": True,
                                         "tenant_id": "shop-e"}).json()
        wait_for(lambda: api.get(f"/v1/runs/{run['id']}").json()["state"] == "published",
                 what="the report published")
        [item] = [i for i in api.get("/v1/items", params={"tenant_id": "shop-e"}).json()[
            "items"] if i["object_id"] == "e-1"]
        api.post("/v1/items/cancel", json={"items": [
            {"tenant_id": "shop-e", "object_id": "e-2", "policy": "carts"}],
            "why": "not this one"}).raise_for_status()
    driver.delete_all_cookies()
    driver.get(console.base_url + "/console/sign-in")
    problems = {"sign-in": axe_violations(driver)}
    screenshot(driver, "sign-in")
    sign_in(driver, console)
    pages = {"overview": "", "runs": "/runs", "run-report-only": f"/runs/{run['id']}",
             "items": "/items", "item-pending": f"/items/{item['id']}", "scopes": "/scopes",
             "scope-page": "/scope?name=tenant%3Ashop-e", "webhooks": "/webhooks",
             "audit": "/audit"}
    for name, path in pages.items():
        driver.get(console.base_url + "/console" + path)
        problems[name] = axe_violations(driver)
        screenshot(driver, name)
        if name == "run-report-only":
            # what the page says, as an operator reads it
            assert "A report-only run releases nothing" in text_of(driver, "#report-only")
            assert "deletes at most 1 item," in text_of(driver, "#delete-preview")
        if name == "audit":
            # a bulk change: its count links to the action's own page, where its ids are
            submit(driver, By.CSS_SELECTOR, "table.audit td a[href^='/console/audit/']")
            problems["audit-action"] = axe_violations(driver)
            assert text_of(driver, "#ids-h").startswith("1 item")
            screenshot(driver, "audit-action")
    found = {name: [(v["id"], v["help"], len(v["nodes"])) for v in violations]
             for name, violations in problems.items() if violations}
    assert not found


def test_the_small_things_read_right_in_the_browser(driver: WebDriver,
                                                    console: Console) -> None:
    """As an operator reads them in Chromium: a report-only run releases nothing; a run of
    one batch says "1 batch"; a run that finished with a dead item is not shown as done and
    names its tenant; dates read alike; unsigned evidence says so. (A negative token count's
    note: tests/integration/test_console.py, where no worker refills the bucket.)"""
    console.register([{"tenant_id": "shop-s", "object_id": f"s-{i}"} for i in range(3)])
    with console.api() as api:
        report = api.post("/v1/runs", json={"policy": "carts", "dry_run": True,
                                            "tenant_id": "shop-s"}).json()
        console.upstream.inject(Fault.STATUS, status=422)  # one item's answer: permanent
        run = api.post("/v1/runs", json={"policy": "carts", "tenant_id": "shop-s"}).json()

        def finished() -> bool:
            items = api.get(f"/v1/runs/{run['id']}").json()["items"]
            return bool(items.get("succeeded", 0) + items.get("dead", 0) == 3)

        wait_for(finished, timeout=30, what="the run finished")
    sign_in(driver, console)
    driver.get(f"{console.base_url}/console/runs/{report['id']}")
    assert "A report-only run releases nothing" in text_of(driver, "#report-only")
    assert "None yet" not in driver.find_element(By.TAG_NAME, "main").text
    driver.get(f"{console.base_url}/console/runs/{run['id']}")
    main = driver.find_element(By.TAG_NAME, "main").text
    assert "3 released in 1 batch," in main
    assert "JSON lines, unsigned: this server has no signing key" in main
    for label in ("Cutoff", "Created"):  # every date in one format
        assert re.search(label + r"\n\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ", main), main
    driver.get(f"{console.base_url}/console/runs")
    row = text_of(driver, f"tr[data-run='{run['id']}']")
    assert "finished, 1 dead" in row and "done" not in row and "shop-s" in row
    screenshot(driver, "small-things-runs")
