"""The console over plain HTTP (tests/browser drives it in Chromium): sessions, CSRF,
security headers, bounded input, and the shared overview reading."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.config.tokens import TokenSet
from service.http.console.overview import OverviewCache
from service.http.console.render import CSP
from service.http.console.sessions import COOKIE, Sessions
from service.ledger import gauges
from service.protocols.egress import public_roots
from service.runtime import Runtime
from tests.conftest import TOKEN_A, TOKEN_B, LiveServer, eventually, test_settings
from tests.fakes.clock import ManualClock
from tests.integration.test_pipeline import make_policies

PAGES = ["", "/runs", "/items", "/scopes", "/webhooks", "/audit", "/overview/live",
         "/items?status=dead", "/runs?kind=report-only", "/scope?name=tenant%3Aacme",
         "?window=week", "/charts/outcomes", "/charts/leases?window=day",
         "/charts/backlog?window=week", "/charts/oldest", "/charts/outcomes?policy=carts"]


@dataclass
class Browser:
    """An httpx client holding the console's cookies, signed in as one operator."""

    client: httpx.AsyncClient

    async def csrf(self, path: str = "") -> str:
        page = await self.client.get("/console" + path)
        found = re.search(r'name="csrf" value="([^"]+)"', page.text)
        assert found, page.text
        return found.group(1)

    async def post(self, path: str, data: dict[str, str | list[str]],
                   **kwargs: object) -> httpx.Response:
        return await self.client.post("/console" + path, data=data, **kwargs)  # type: ignore[arg-type]


async def sign_in(client: httpx.AsyncClient, token: str = TOKEN_A) -> httpx.Response:
    form = await client.get("/console/sign-in")
    csrf = re.search(r'name="csrf" value="([^"]+)"', form.text)
    assert csrf, form.text
    return await client.post("/console/sign-in", data={"csrf": csrf.group(1), "token": token})


@pytest.fixture
async def live(db_url: str) -> AsyncIterator[LiveServer]:
    policies = make_policies("http://127.0.0.1:9")
    async with LiveServer(test_settings(db_url), policies, db_url) as server:
        async with server.client() as api:
            answer = await api.post("/v1/items", json={"items": [
                {"tenant_id": "acme", "object_id": f"cart-{i}", "policy": "carts",
                 "due_at": "2026-01-01T00:00:00Z"} for i in range(5)]})
            assert answer.status_code == 200, answer.text
        yield server


@pytest.fixture
async def browser(live: LiveServer) -> AsyncIterator[Browser]:
    async with live.client(None) as client:
        signed = await sign_in(client)
        assert signed.status_code == 303 and signed.headers["location"] == "/console"
        yield Browser(client)


async def test_every_page_answers_with_the_security_headers(browser: Browser) -> None:
    for path in PAGES:
        page = await browser.client.get("/console" + path)
        assert page.status_code == 200, (path, page.text)
        assert page.headers["content-security-policy"] == CSP
        assert page.headers["x-frame-options"] == "DENY"
        assert page.headers["x-content-type-options"] == "nosniff"
        assert page.headers["cache-control"] == "no-store"
        assert "<script>" not in page.text and " style=" not in page.text
    assert "'unsafe-inline'" not in CSP and "frame-ancestors 'none'" in CSP


async def test_unauthenticated_requests_are_sent_to_sign_in(live: LiveServer) -> None:
    async with httpx.AsyncClient(verify=public_roots(), base_url=live.base_url) as client:
        for path in PAGES:
            page = await client.get("/console" + path)
            assert (page.status_code, page.headers["location"]) == (303, "/console/sign-in")
    async with httpx.AsyncClient(verify=public_roots(), base_url=live.base_url,
                                 cookies={COOKIE: "A" * 43 + "." + "B" * 22}) as client:
        forged = await client.get("/console")
        assert forged.status_code == 303
        post = await client.post("/console/workers/pause", data={"reason": "x"})
        assert post.status_code == 403 and "Sign in first" in post.text


async def test_a_bad_token_or_an_expired_form_does_not_sign_in(live: LiveServer) -> None:
    async with httpx.AsyncClient(verify=public_roots(), base_url=live.base_url) as client:
        wrong = await sign_in(client, "not-the-token")
        assert wrong.status_code == 401 and "not valid" in wrong.text
        assert COOKIE not in client.cookies
        await client.get("/console/sign-in")
        stale = await client.post("/console/sign-in", data={"csrf": "x", "token": TOKEN_A})
        assert stale.status_code == 403 and COOKIE not in client.cookies


async def test_sessions_end_at_expiry_sign_out_and_token_rotation(
        db_url: str, engine: AsyncEngine) -> None:
    policies = make_policies("http://127.0.0.1:9")
    async with LiveServer(test_settings(db_url), policies, db_url) as server:
        async with httpx.AsyncClient(verify=public_roots(), base_url=server.base_url) as client:
            await sign_in(client)
            assert (await client.get("/console")).status_code == 200
            async with engine.begin() as conn:
                await conn.execute(text(
                    "UPDATE console_sessions SET expires_at = now() - interval '1 second'"))
            assert (await client.get("/console")).status_code == 303
            await sign_in(client, TOKEN_B)
            browser = Browser(client)
            out = await browser.post("/sign-out", {"csrf": await browser.csrf()})
            assert out.status_code == 303
            assert (await client.get("/console")).status_code == 303
            await sign_in(client, TOKEN_B)
            kept = client.cookies[COOKIE]
    # TOKEN_B is rotated out: its sessions end with it
    async with LiveServer(test_settings(db_url, api_tokens=TOKEN_A), policies,
                          db_url) as server:
        async with httpx.AsyncClient(verify=public_roots(), base_url=server.base_url,
                                     cookies={COOKIE: kept}) as client:
            assert (await client.get("/console")).status_code == 303


async def test_forms_need_this_sessions_token_and_origin(browser: Browser) -> None:
    csrf = await browser.csrf()
    assert (await browser.post("/workers/pause", {"reason": "x"})).status_code == 403
    assert (await browser.post("/workers/pause", {"reason": "x", "csrf": csrf + "x"})
            ).status_code == 403
    cross = await browser.post("/workers/pause", {"reason": "x", "csrf": csrf},
                               headers={"Origin": "http://evil.example"})
    assert cross.status_code == 403 and "Cross-site" in cross.text
    null = await browser.post("/workers/pause", {"reason": "x", "csrf": csrf},
                              headers={"Origin": "null"})
    assert null.status_code == 403
    ok = await browser.post("/workers/pause", {"reason": "drill", "csrf": csrf})
    assert ok.status_code == 303
    assert "Paused on every replica" in (await browser.client.get("/console/scopes")).text


@pytest.mark.parametrize(("path", "status"), [
    ("/runs?limt=5", 422), ("/runs?before=abc", 422), ("/runs?before=0", 422),
    ("/items?status=dead&status=pending", 422),
    ("/runs?before=99999999999999999999", 422), ("/runs?policy=nope", 422),
    ("/items?status=gone", 422), ("/items?object_id=cart-1", 422),
    ("/items?tenant_id=" + "a" * 513, 422), ("/items?tenant_id=a%01b", 422),
    ("/items?tenant_id=%ED%A0%80", 200), ("/runs/abc", 404), ("/runs/0", 404),
    ("/runs/99999999999999999999", 404), ("/items/1e3", 404), ("/scope", 422),
    ("/scope?name=nope", 404), ("/runs/777", 404), ("/items/777", 404),
    ("/static/..%2Frender.py", 404), ("/static/nope.css", 404),
    ("/static/vendor/uplot/LICENSE", 404), ("/static/vendor/uplot/uPlot.iife.min.js", 200),
    ("?window=month", 422), ("/charts/outcomes?window=month", 422),
    ("/charts/outcomes?windw=day", 422), ("/charts/outcomes?policy=nope", 422),
    ("/charts/scope", 404), ("/charts/scope?name=nope", 404),
    ("/charts/scope?name=nope&window=day&window=week", 422), ("/charts/runs/abc", 404),
    ("/charts/runs/777", 404), ("/charts/runs/1?window=day", 422)])
async def test_bad_parameters_get_a_clear_page_not_a_500(browser: Browser, path: str,
                                                         status: int) -> None:
    page = await browser.client.get("/console" + path)
    assert page.status_code == status, page.text
    if "%2F" not in path:  # an encoded '/' is a path no console route matches
        assert page.headers["content-security-policy"] == CSP


async def test_bad_forms_are_refused_and_change_nothing(browser: Browser) -> None:
    csrf = await browser.csrf()
    client = browser.client
    as_json = await client.post("/console/workers/pause", json={"csrf": csrf})
    assert as_json.status_code == 415
    huge = await browser.post("/workers/pause", {"csrf": csrf, "reason": "x" * 300_000})
    assert huge.status_code == 413
    unknown = await browser.post("/workers/pause", {"csrf": csrf, "reasn": "typo"})
    assert unknown.status_code == 422 and "reasn" in unknown.text
    twice = await browser.post("/workers/pause", {"csrf": csrf, "reason": ["a", "b"]})
    assert twice.status_code == 422
    bad_utf8 = await client.post("/console/workers/pause", content=b"reason=%FF&csrf=" +
                                 csrf.encode(), headers={
                                     "Content-Type": "application/x-www-form-urlencoded"})
    assert bad_utf8.status_code == 400
    control = await browser.post("/workers/pause", {"csrf": csrf, "reason": "a\x00b"})
    assert control.status_code == 422
    assert "Claiming on every replica" in (await client.get("/console/scopes")).text


async def test_a_bulk_change_previews_then_applies_with_its_reason(
        browser: Browser, engine: AsyncEngine) -> None:
    csrf = await browser.csrf("/items")
    base = {"csrf": csrf, "action": "cancel", "target": "filter", "tenant_id": "acme"}
    no_why = await browser.post("/items/action", {**base, "why": "  "})
    assert no_why.status_code == 422 and "reason is required" in no_why.text
    nothing = await browser.post("/items/action", {**base, "target": "selected", "why": "x"})
    assert nothing.status_code == 422
    preview = await browser.post("/items/action", {**base, "why": "tenant left"})
    assert preview.status_code == 200 and "change <strong>5</strong> pending items" in (
        preview.text)
    async with engine.connect() as conn:
        assert (await conn.execute(text(
            "SELECT count(*) FROM items WHERE status = 'pending'"))).scalar() == 5
    done = await browser.post("/items/action", {**base, "why": "tenant left",
                                                "step": "confirm"})
    assert done.status_code == 200 and "5 items withdrawn" in done.text
    async with engine.connect() as conn:
        row = (await conn.execute(text(
            "SELECT actor, action, reason, details FROM operator_actions "
            "ORDER BY id DESC LIMIT 1"))).one()
    assert row.action == "cancel" and row.reason == "tenant left"
    assert row.actor.endswith("(console)") and row.details["count"] == 5
    again = await browser.post("/items/action", {**base, "why": "again"})
    assert "change <strong>0</strong>" in again.text and "disabled" in again.text


async def test_the_budget_form_validates_like_the_api(browser: Browser) -> None:
    csrf = await browser.csrf()
    scope = {"csrf": csrf, "name": "tenant:acme"}
    for rate, burst, message in (("0", "5", "greater than or equal to 0.001"),
                                 ("abc", "5", "must be a number"),
                                 ("nan", "5", "finite"), ("1e9", "5", "less than or equal"),
                                 ("5", "1.5", "whole number"), ("5", "0", "greater than")):
        refused = await browser.post("/scope/budget", {**scope, "rate_per_second": rate,
                                                       "burst": burst})
        assert refused.status_code == 422 and message in refused.text, (rate, burst)
    changed = await browser.post("/scope/budget", {**scope, "rate_per_second": "2.5",
                                                   "burst": "4", "weight": "3",
                                                   "reason": "asked"})
    assert changed.status_code == 303
    page = await browser.client.get(changed.headers["location"])
    assert '<dd id="rate">2.5</dd>' in page.text and '<dd id="weight">3</dd>' in page.text
    missing = await browser.post("/scope/budget", {**scope, "name": "tenant:nope",
                                                   "rate_per_second": "1", "burst": "1"})
    assert missing.status_code == 404


async def _reported(browser: Browser, csrf: str) -> tuple[str, str]:
    """A report-only run of `carts` started from the overview, once its page offers the
    deleting run: its location and that page."""
    started = await browser.post("/runs", {"csrf": csrf, "policy": "carts"})
    assert started.status_code == 303 and started.headers["location"].startswith(
        "/console/runs/")
    report = started.headers["location"]

    async def published() -> str:
        page = await browser.client.get(report)
        return page.text if 'id="delete-preview"' in page.text else ""

    return report, await eventually(published, "the report's delete form")


async def test_a_runs_evidence_downloads_from_the_console(browser: Browser) -> None:
    csrf = await browser.csrf()
    report, _page = await _reported(browser, csrf)
    started = await browser.post(report.removeprefix("/console") + "/delete", {
        "csrf": csrf, "why": "retention", "confirm": "5"})
    assert started.status_code == 303
    run_page = await browser.client.get(started.headers["location"])
    assert run_page.status_code == 200 and "Download deletion evidence" in run_page.text
    export = await browser.client.get(started.headers["location"] + "/evidence")
    assert export.status_code == 200
    assert "attachment" in export.headers["content-disposition"]
    closing = json.loads(export.text.strip().splitlines()[-1])
    assert set(closing) == {"manifest", "signature"}  # the export ends with its manifest
    assert closing["manifest"]["run_id"] == int(started.headers["location"].rsplit("/", 1)[1])


async def test_the_overview_is_read_once_per_interval_whatever_the_viewers(
        engine: AsyncEngine) -> None:
    policies = make_policies("http://127.0.0.1:9")
    runtime = Runtime(settings=test_settings("postgresql://unused/x"), policies=policies,
                      engine=engine, tokens=TokenSet(()), schema_head="",
                      exporter=gauges.ledger_exporter(engine, policies.policies))
    clock = ManualClock()
    cache = OverviewCache(max_age_s=2.0, monotonic=clock)
    views = await asyncio.gather(*(cache.get(runtime) for _ in range(25)))
    assert cache.readings == 1 and all(v is views[0] for v in views)
    assert [p["name"] for p in views[0].policies] == ["carts"]
    clock.advance(1.99)
    assert await cache.get(runtime) is views[0]
    clock.advance(0.01)
    assert await cache.get(runtime) is not views[0]
    assert cache.readings == 2


async def test_a_forged_cookie_costs_no_database_read() -> None:
    class NoDatabase:
        def __getattr__(self, name: str) -> object:
            raise AssertionError(f"the database was used ({name})")

    sessions = Sessions(NoDatabase(), TokenSet(()), lifetime_s=300)  # type: ignore[arg-type]
    sessions._key = b"k" * 32  # as after the first request of the process
    for cookie in (None, "", "x", "a.b.c", "A" * 43 + "." + "B" * 22, "é" * 80, "A" * 10_000,
                   "AAAA.%%%%"):
        assert await sessions.session(cookie) is None


@pytest.mark.parametrize("always", [False, True])
async def test_cookies_are_secure_over_https_or_when_told(db_url: str, always: bool) -> None:
    settings = test_settings(db_url, console_secure_cookies=always)
    async with LiveServer(settings, make_policies("http://127.0.0.1:9"), db_url) as server:
        async with httpx.AsyncClient(verify=public_roots(), base_url=server.base_url) as client:
            form = await client.get("/console/sign-in")
            login = form.headers["set-cookie"].lower()
            assert "httponly" in login and "samesite=strict" in login
            assert ("secure" in login.split("; ")) is always
            # as a TLS proxy in FORWARDED_ALLOW_IPS (127.0.0.1) forwards a request
            proxied = await client.get("/console/sign-in",
                                       headers={"X-Forwarded-Proto": "https"})
            assert "secure" in proxied.headers["set-cookie"].lower().split("; ")


async def test_head_and_options_are_answered_like_the_apis(browser: Browser) -> None:
    options = await browser.client.options("/console/items")
    assert options.status_code == 204
    assert options.headers["allow"] == "GET, HEAD, OPTIONS"
    head = await browser.client.head("/console/items")
    assert head.status_code == 200 and head.content == b""


async def test_a_report_only_run_shows_its_difference_from_the_previous_one(
        browser: Browser) -> None:
    pages = []
    for _ in range(2):
        started = await browser.post("/runs", {"csrf": await browser.csrf(), "policy": "carts"})
        assert started.status_code == 303

        async def compared(location: str = started.headers["location"]) -> str:
            page = await browser.client.get(location)
            return page.text if 'id="comparison"' in page.text else ""

        pages.append(await eventually(compared, "the report-only run's comparison"))
    assert "nothing to compare with" in pages[0]
    assert "5 candidates: +0 against the previous report-only run" in pages[1]


async def test_the_console_deletes_only_from_a_reports_figures_with_a_reason_and_the_count(
        browser: Browser, live: LiveServer) -> None:
    """The overview starts report-only runs only; a deleting run starts from a published
    report's page, with a reason and its candidate count typed back, capped at that count,
    once per report, and the audit trail names both runs and the reason."""
    csrf = await browser.csrf()
    refused = await browser.post("/runs", {"csrf": csrf, "policy": "carts", "dry_run": ""})
    assert refused.status_code == 422  # no such field: the overview cannot start a deletion
    report, page = await _reported(browser, csrf)
    assert "deletes at most <strong>5</strong> items" in page and "Type 5 to confirm" in page
    path = report.removeprefix("/console") + "/delete"
    for form, problem in (({"why": "", "confirm": "5"}, "Say why"),
                          ({"why": "retention", "confirm": "4"}, "Type the count"),
                          ({"why": "retention"}, "Type the count")):
        answer = await browser.post(path, {"csrf": csrf, **form})
        assert answer.status_code == 422 and problem in answer.text, answer.text
    async with live.client() as api:
        assert [r for r in (await api.get("/v1/runs")).json()["runs"] if not r["dry_run"]] == []
        confirmed = {"csrf": csrf, "why": "quarterly retention", "confirm": "5"}
        deleting = await browser.post(path, confirmed)
        assert deleting.status_code == 303
        again = await browser.post(path, confirmed)  # a second click: the same run
        assert again.headers["location"] == deleting.headers["location"]
        run_id = int(deleting.headers["location"].rsplit("/", 1)[1])
        run = (await api.get(f"/v1/runs/{run_id}")).json()
        assert (run["dry_run"], run["policy"], run["max_items"]) == (False, "carts", 5)
    # a deleting run, a run still publishing or none at all is no report to delete from
    for other, status in ((run_id, 409), (999_999, 404), ("x", 404)):
        answer = await browser.post(f"/runs/{other}/delete", confirmed)
        assert answer.status_code == status, answer.text
    audit = (await browser.client.get("/console/audit")).text
    assert audit.count("run.trigger") == 2 and "quarterly retention" in audit
    assert f'"report_run_id": {report.rsplit("/", 1)[1]}' in audit


async def test_a_run_started_over_the_api_is_in_the_audit_trail(live: LiveServer,
                                                                db_url: str) -> None:
    async with live.client() as api:
        run = (await api.post("/v1/runs", json={"policy": "carts"},
                              headers={"Idempotency-Key": "cron-2026-12-05"})).json()
        await api.post("/v1/runs", json={"policy": "carts"},
                       headers={"Idempotency-Key": "cron-2026-12-05"})  # a retry: one row
    engine = live.runtime.engine
    async with engine.connect() as conn:
        rows = (await conn.execute(text(
            "SELECT actor, action, reason, details FROM operator_actions"))).all()
    [(actor, action, reason, details)] = rows
    assert actor.startswith("token:") and (action, reason) == ("run.trigger", None)
    assert details["run_id"] == run["id"] and details["trigger_key"] == "cron-2026-12-05"
    assert (details["policy"], details["dry_run"]) == ("carts", False)



async def test_a_bulk_change_is_one_audit_row_its_ids_a_click_away(browser: Browser,
                                                                  live: LiveServer) -> None:
    """Cancelling 1,200 items is one row of the audit trail with its count and selection;
    every id is on the action's own page, 500 to a page, none inline."""
    async with live.client() as api:
        await api.post("/v1/items", json={"items": [
            {"tenant_id": "bulk-co", "object_id": f"o-{i}", "policy": "carts",
             "due_at": "2030-01-01T00:00:00Z"} for i in range(1200)]})
        cancelled = (await api.post("/v1/items/cancel", json={
            "tenant_id": "bulk-co", "why": "registered by mistake"})).json()
    assert cancelled["count"] == 1200
    audit = await browser.client.get("/console/audit")
    row = re.search(r'<a href="(/console/audit/\d+)">1200 items</a>', audit.text)
    assert row is not None, audit.text
    assert str(cancelled["item_ids"][600]) not in audit.text  # no id inline
    assert '&#34;tenant_id&#34;: &#34;bulk-co&#34;' in audit.text or \
        '"tenant_id": "bulk-co"' in audit.text  # the selection is
    shown: list[int] = []
    for page_no in (1, 2, 3):
        page = (await browser.client.get(f"{row.group(1)}?page={page_no}")).text
        assert f"page {page_no} of 3" in page
        shown += [int(i) for i in re.findall(r'<li><a href="/console/items/(\d+)">', page)]
    assert shown == cancelled["item_ids"]


async def test_the_small_things_read_right(browser: Browser, live: LiveServer,
                                           engine: AsyncEngine) -> None:
    """A report-only run says it releases nothing; a run of one batch says "1 batch"; a run
    that finished with dead items is not shown as done; a tenant's run names its tenant; a
    report's dates read as every other date; an unsigned server's evidence says so; a
    negative token count is explained."""
    live.count_progress_afresh()
    async with live.client() as api:
        report = (await api.post("/v1/runs", json={"policy": "carts", "dry_run": True})).json()
        run = (await api.post("/v1/runs", json={"policy": "carts", "tenant_id": "acme"})).json()

        async def published() -> bool:
            runs = (await api.get("/v1/runs")).json()["runs"]
            return all(r["state"] == "published" for r in runs)

        await eventually(published, "both runs published")
    async with engine.begin() as conn:  # no workers here: the ledger as they would leave it
        await conn.execute(text(
            "UPDATE items SET status = CASE WHEN object_id = 'cart-0' THEN 'dead' "
            "ELSE 'succeeded' END, dead_reason = CASE WHEN object_id = 'cart-0' "
            "THEN 'permanent:http_422' END, completed_at = now() WHERE batch_id IS NOT NULL"))
        # granted ahead, refilling slowly: still below zero when the pages read it
        await conn.execute(text("UPDATE scopes SET tokens = -2.4, rate_per_second = 0.001, "
                                "refilled_at = now() WHERE name = 'tenant:acme'"))
    report_page = (await browser.client.get(f"/console/runs/{report['id']}")).text
    assert "A report-only run releases nothing" in report_page
    assert "None yet" not in report_page
    assert '<time datetime="2026-01-01T00:00:00+00:00">2026-01-01 00:00:00Z</time>' in report_page
    run_page = (await browser.client.get(f"/console/runs/{run['id']}")).text
    assert "5 released in 1 batch," in run_page
    assert "JSON lines, unsigned: this server has no signing key" in run_page
    runs = (await browser.client.get("/console/runs")).text
    row = runs[runs.index(f'data-run="{run["id"]}"'):]
    row = row[:row.index("</tr>")]
    assert "finished, 1 dead" in row and 'class="drained"' not in row
    assert "<td><bdi>acme</bdi></td>" in row
    scope = (await browser.client.get("/console/scope?name=tenant%3Aacme")).text
    assert "-2.40 <span" in scope and "granted ahead" in scope
    assert "granted ahead" in (await browser.client.get("/console/scopes")).text


async def test_charts_of_one_series_share_one_reading(browser: Browser, live: LiveServer
                                                      ) -> None:
    """The outcomes and leases charts draw one series, the backlog and oldest-age charts
    another: each is read once per few seconds per process, not once per chart."""
    charts = live.server.lifespan.state["console"].charts
    charts.max_age_s = 3600.0  # however slow the machine, these requests fall in one age
    before = charts.readings
    for path in ("/charts/outcomes", "/charts/leases", "/charts/backlog", "/charts/oldest",
                 "/charts/outcomes", "/charts/outcomes?window=day"):
        assert (await browser.client.get("/console" + path)).status_code == 200, path
    assert charts.readings - before == 3  # outcomes (hour), backlog (hour), outcomes (day)
