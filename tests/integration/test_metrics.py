"""/metrics: the text format by default (promtool checks it) and OpenMetrics when asked
(its parser refuses clashing names); ledger gauges follow the database; counters with known
label values exist from the start; no label ever carries a tenant, scope or object id, and no
request can add a route or method label value."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Final

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.routing import Route

from service.observability import metrics
from service.observability.metrics import DEAD_REASONS, LeaseReturn, ScopeSignal
from service.outcomes import Outcome
from service.protocols.egress import public_roots
from service.upstreams.deletion_api import Upstreams
from service.worker import database_pool
from tests.conftest import TOKEN_A, LiveServer, free_port, policies_from, test_settings
from tests.fakes.upstream import FakeUpstream, Fault
from tests.integration.test_cli import _stop
from tests.integration.test_pipeline import drain, make_policies, register, release_all

AUTH = {"Authorization": f"Bearer {TOKEN_A}"}
TENANT = "tenant-7f3a9"
OBJECT_ID = re.compile(r"\bcart-\d")  # the objects registered here: cart-0 ... cart-29
TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"
# what Prometheus sends when it scrapes: OpenMetrics first, the text format as a fallback
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,"
                     "application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")

CONVERTOR = re.compile(r"\{(\w+):\w+\}")
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(exposition: str,
            parse: Callable[[str], Iterable[Metric]] = text_string_to_metric_families
            ) -> Samples:
    out = {}
    for family in parse(exposition):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("SWEEPER_REQUIRE_TOOLS"):
            pytest.fail("promtool is not installed (Debian package prometheus)")
        pytest.skip("promtool is not installed (Debian package prometheus); .ci/run installs it")
    return found


def promtool_check(exposition: str) -> None:
    check = subprocess.run([promtool(), "check", "metrics"], input=exposition,
                           capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr


async def scrape(base_url: str) -> str:
    async with httpx.AsyncClient(base_url=base_url, verify=public_roots()) as client:
        response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"] == TEXT_FORMAT
    return response.text


async def scrape_openmetrics(base_url: str) -> str:
    async with httpx.AsyncClient(base_url=base_url, verify=public_roots()) as client:
        response = await client.get("/metrics", headers={"Accept": PROMETHEUS_ACCEPT})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith(
        "application/openmetrics-text; version=1.0.0; charset=utf-8")
    return response.text


async def test_metrics_pass_promtool_and_follow_the_ledger(db_url: str, engine: AsyncEngine
                                                           ) -> None:
    policies = make_policies("http://127.0.0.1:9")
    await register(engine, policies, 30, tenant=TENANT,
                   due=datetime.now(UTC) - timedelta(hours=2))
    await release_all(engine)
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE items SET status = 'dead', dead_reason = 'permanent', "
                                "completed_at = now() WHERE object_id IN ('cart-0', 'cart-1')"))
        await conn.execute(text(
            "INSERT INTO scopes (name, rate_per_second, burst, tokens, refilled_at, "
            "closed_until, paused, paused_reason) VALUES "
            f"('tenant:{TENANT}', 5, 5, 5, now(), now() + interval '1 hour', true, 'operator')"
            " ON CONFLICT (name) DO UPDATE SET closed_until = now() + interval '1 hour', "
            "paused = true, paused_reason = 'operator'"))
    settings = test_settings(db_url, workers=0)
    async with LiveServer(settings, policies, db_url) as live:
        async with live.client() as client:
            assert (await client.get("/v1/runs")).status_code == 200
            assert (await client.get("/no-such-route")).status_code == 404
        exposition = await scrape(live.base_url)

    promtool_check(exposition)

    got = samples(exposition)
    assert got[("sweeper_ledger_up", ())] == 1
    assert got[("sweeper_items_eligible", (("policy", "carts"),))] == 28
    assert got[("sweeper_ledger_items_dead", (("policy", "carts"),))] == 2
    age = got[("sweeper_oldest_eligible_age_seconds", (("policy", "carts"),))]
    assert 7_000 < age < 7_400
    assert got[("sweeper_scopes_closed", ())] == 1
    assert got[("sweeper_scopes_paused", ())] == 1
    route = (("method", "GET"), ("route", "/v1/runs"), ("status", "2xx"))
    assert got[("sweeper_http_request_duration_seconds_count", route)] >= 1
    unmatched = (("method", "other"), ("route", "unmatched"), ("status", "4xx"))
    assert got[("sweeper_http_request_duration_seconds_count", unmatched)] >= 1

    # no label value may name a tenant, a scope or an object (the registry is the process's:
    # other tests' policies, such as `cart-retention`, may be labels too, and are allowed)
    for (_name, labels) in got:
        for _key, value in labels:
            assert TENANT not in value and not OBJECT_ID.search(value), value
            assert "tenant:" not in value, value


async def test_ledger_gauges_are_cached_between_scrapes(db_url: str, engine: AsyncEngine
                                                        ) -> None:
    policies = make_policies("http://127.0.0.1:9")
    await register(engine, policies, 3)
    await release_all(engine)
    async with LiveServer(test_settings(db_url, workers=0), policies, db_url) as live:
        first = samples(await scrape(live.base_url))
        await register(engine, policies, 5)
        await release_all(engine)
        second = samples(await scrape(live.base_url))
    key = ("sweeper_items_eligible", (("policy", "carts"),))
    assert first[key] == 3
    # within the cache period the database is not asked again
    assert second[key] == 3


async def test_a_scrape_answers_while_the_database_is_down() -> None:
    url = "postgresql://postgres@127.0.0.1:1/nowhere"
    async with LiveServer(test_settings(url, workers=0), make_policies("http://127.0.0.1:9"),
                          url) as live:
        got = samples(await scrape(live.base_url))
    assert got[("sweeper_ledger_up", ())] == 0


async def test_run_publication_is_counted(engine: AsyncEngine) -> None:
    policies = make_policies("http://127.0.0.1:9")
    released = metrics.REGISTRY.get_sample_value("sweeper_run_items_released_total") or 0
    published = metrics.REGISTRY.get_sample_value(
        "sweeper_run_publication_duration_seconds_count") or 0
    await register(engine, policies, 120)
    await release_all(engine)
    assert metrics.REGISTRY.get_sample_value("sweeper_run_items_released_total") == (
        released + 120)
    assert metrics.REGISTRY.get_sample_value(
        "sweeper_run_publication_duration_seconds_count") == published + 1


async def test_openmetrics_when_asked_after_real_traffic(db_url: str, engine: AsyncEngine
                                                         ) -> None:
    # a dead item through the real pipeline: the counter sweeper_items_dead_total and the
    # ledger gauge of dead items both carry series, and OpenMetrics refuses a name clash
    async with FakeUpstream() as upstream:
        policies = make_policies(upstream.base_url)
        await register(engine, policies, 3)
        await release_all(engine)
        upstream.inject(Fault.STATUS, status=422, match="cart-0")
        ups = Upstreams(policies.upstreams)
        try:
            await drain(database_pool(engine, policies, ups, concurrency=2), engine)
        finally:
            await ups.aclose()
    async with LiveServer(test_settings(db_url, workers=0), policies, db_url) as live:
        async with live.client() as client:
            assert (await client.get("/v1/runs")).status_code == 200
        exposition = await scrape_openmetrics(live.base_url)

    # promtool reads only the text format; the OpenMetrics parser is the check here
    assert exposition.endswith("# EOF\n")
    got = samples(exposition, openmetrics_families)
    assert got[("sweeper_items_dead_total", (("policy", "carts"), ("reason", "http_422")))] >= 1
    assert got[("sweeper_ledger_items_dead", (("policy", "carts"),))] == 1
    assert got[("sweeper_completions_total", (("outcome", "succeeded"), ("policy", "carts")))
               ] >= 2
    assert got[("sweeper_ledger_up", ())] == 1


async def test_the_text_format_is_the_default(db_url: str) -> None:
    async with LiveServer(test_settings(db_url, workers=0), make_policies("http://127.0.0.1:9"),
                          db_url) as live:
        async with httpx.AsyncClient(verify=public_roots(), base_url=live.base_url) as client:
            answers = [await client.get("/metrics", headers=headers) for headers in (
                {}, {"Accept": "*/*"}, {"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"})]
    for response in answers:
        assert response.status_code == 200
        assert response.headers["content-type"] == TEXT_FORMAT
        assert "# EOF" not in response.text
        assert ("sweeper_ledger_up", ()) in samples(response.text)


async def test_process_and_runtime_series_are_exported(db_url: str) -> None:
    async with LiveServer(test_settings(db_url, workers=0), make_policies("http://127.0.0.1:9"),
                          db_url) as live:
        got = samples(await scrape(live.base_url))
    names = {name for name, _ in got}
    assert got[("process_resident_memory_bytes", ())] > 0
    assert got[("process_cpu_seconds_total", ())] > 0
    assert {"process_open_fds", "process_start_time_seconds"} <= names
    assert any(name.startswith("python_gc_") for name in names)
    assert "python_info" in names


def expected_at_start(policy: str) -> list[tuple[str, tuple[tuple[str, str], ...]]]:
    """Every series that must exist before its first event, for one configured policy."""
    by_policy = (("policy", policy),)
    return [
        ("sweeper_items_claimed_total", by_policy),
        ("sweeper_lease_expiries_reclaimed_total", by_policy),
        ("sweeper_late_completions_total", by_policy),
        *(("sweeper_completions_total", (("outcome", outcome.value), ("policy", policy)))
          for outcome in Outcome),
        *(("sweeper_leases_returned_total", (("reason", reason.value),))
          for reason in LeaseReturn),
        *(("sweeper_scope_signals_total", (("reason", reason.value),))
          for reason in ScopeSignal),
        *(("sweeper_items_dead_total", (("policy", policy), ("reason", reason)))
          for reason in DEAD_REASONS),
    ]


# a webhook source's series at start: one per result, and one per reason of a refusal
WEBHOOK_SERIES: Final = [("accepted", ""), ("duplicate", ""), ("ignored", "no-rule"),
                         *(("rejected", reason) for reason in (
                             "signature", "timestamp", "malformed", "unmappable", "too-large",
                             "too-slow", "overloaded", "unavailable"))]


async def test_a_fresh_app_exports_known_series_at_zero(db_url: str) -> None:
    # a policy name no other test uses: its counters in this process can only be fresh
    policy = f"fresh-{uuid.uuid4().hex[:8]}"
    source = f"hooks-{uuid.uuid4().hex[:8]}"
    policies = policies_from({
        "upstreams": {"shop": {"base_url": "http://127.0.0.1:9"}},
        "policies": {policy: {"version": 1, "upstream": "shop", "path": "/carts/{object_id}",
                              "rate": {"per_second": 1, "burst": 1}}},
        "webhooks": {source: {"scheme": "hmac-sha256", "secret_env": "HOOKS_SECRET",
                              "signature_header": "X-Signature", "topic_header": "X-Event",
                              "rules": [{"topic": "cart.gone", "policy": policy,
                                         "tenant": "body:shop", "object_id": "body:id"}]}}},
        env={"HOOKS_SECRET": "s" * 32})
    async with LiveServer(test_settings(db_url, workers=0), policies, db_url) as live:
        got = samples(await scrape(live.base_url))
    for key in expected_at_start(policy):
        assert key in got, key
        if ("policy", policy) in key[1]:
            assert got[key] == 0, key
    for result, reason in WEBHOOK_SERIES:
        key = ("sweeper_webhooks_total", (("reason", reason), ("result", result),
                                          ("source", source)))
        assert got.get(key) == 0, key
    # no signing key in the test settings; no run publishing
    assert got[("sweeper_evidence_signing", ())] == 0
    assert got[("sweeper_run_publishing_age_seconds", ())] == 0
    assert ("sweeper_runs_failed_total", ()) in got


@pytest.mark.slow  # a sweeper worker process
def test_sweeper_worker_serves_openmetrics_and_known_series_at_zero(db_url: str,
                                                                   tmp_path: Path) -> None:
    # a fresh `sweeper worker` process: its probes server negotiates the format as the API does,
    # and the series are initialised by the same function as the app's
    policies_file = tmp_path / "policies.toml"
    policies_file.write_text(
        '[upstreams.shop]\nbase_url = "http://127.0.0.1:9"\n\n'
        '[policies.carts]\nversion = 1\nupstream = "shop"\npath = "/carts/{object_id}"\n'
        'rate = { per_second = 1.0, burst = 1 }\n', encoding="utf-8")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWEEPER_")}
    env.update({"SWEEPER_DATABASE_URL": db_url, "SWEEPER_POLICIES_FILE": str(policies_file),
                "SWEEPER_WORKERS": "1", "SWEEPER_METRICS_PORT": str(port),
                "SWEEPER_MIGRATE_ON_START": "false"})
    stderr = tmp_path / "worker.log"
    with stderr.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "service", "worker"], env=env,
                                stdout=subprocess.DEVNULL, stderr=log)
    try:
        # the metrics port opens before the pool starts; the pool logs once it is running
        deadline = time.monotonic() + 30
        while "worker started" not in stderr.read_text():
            assert proc.poll() is None, stderr.read_text()
            assert time.monotonic() < deadline, "the worker never started"
            time.sleep(0.1)
        url = f"http://127.0.0.1:{port}/metrics"
        openmetrics = httpx.get(url, headers={"Accept": PROMETHEUS_ACCEPT}, timeout=5)
        plain = httpx.get(url, timeout=5)
    finally:
        _stop(proc)
    assert plain.headers["content-type"] == TEXT_FORMAT
    promtool_check(plain.text)
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text;")
    got = samples(openmetrics.text, openmetrics_families)
    # a fresh process: every known series is there, and all of them are still 0
    for key in expected_at_start("carts"):
        assert got[key] == 0, key
    assert got[("process_resident_memory_bytes", ())] > 0


def route_methods(app: FastAPI) -> dict[str, set[str]]:
    """Each route template with the methods its routes declare: the operations of the
    OpenAPI document, plus the routes outside it."""
    out = {path: {method.upper() for method in operations}
           for path, operations in app.openapi()["paths"].items()}
    # FastAPI's own documentation routes, and the console's (not in the document; the app's
    # flat list of routes holds them)
    for route in [*app.routes, *app.state.route_methods.routes]:
        if isinstance(route, Route):
            out.setdefault(route.path_format, set()).update(route.methods or ())
    return out


def concrete(template: str) -> str:
    """A path that matches the template, with a fresh value for every parameter."""
    out = template
    while "{" in out:
        start, end = out.index("{"), out.index("}")
        out = out[:start] + uuid.uuid4().hex[:6] + out[end + 1:]
    return out


@pytest.mark.slow
async def test_http_series_stay_bounded_whatever_the_method_or_path(db_url: str) -> None:
    methods = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "PROPFIND",
               "TRACE", "MKCOL", "LOCK"]
    async with LiveServer(test_settings(db_url, workers=0), make_policies("http://127.0.0.1:9"),
                          db_url) as live:
        templates = route_methods(live.app)
        paths = [concrete(t) for t in templates]
        paths += [f"/{uuid.uuid4().hex}", f"/v1/{uuid.uuid4().hex}/x", "/v1/runs/",
                  "/%2e%2e/etc/passwd", "/metrics/extra"]
        async with live.client(None) as client:
            async def hit(method: str, path: str, headers: dict[str, str] | None = None
                          ) -> None:
                # the server may refuse a method outright: no series either way
                with contextlib.suppress(httpx.HTTPError):
                    await client.request(method, path, headers=headers)

            for method in methods:
                await asyncio.gather(*(hit(method, path) for path in paths))
                # and as an operator: past the token check, into the routes
                await asyncio.gather(*(hit(method, path, AUTH) for path in paths))
        got = samples(await scrape(live.base_url))

    allowed = {(path, m) for path, declared in templates.items() for m in declared}
    allowed |= {(path, "other") for path in templates} | {("unmatched", "other")}
    # a route label names its parameters as the document does (`{scope}`, not `{scope:path}`)
    seen = {(dict(labels)["route"], dict(labels)["method"], dict(labels)["status"])
            for name, labels in got if name == "sweeper_http_request_duration_seconds_count"}
    assert not any(CONVERTOR.search(route) for route, _, _ in seen)
    # at most |allowed| x 5 status classes series, whatever was sent
    assert {(route, method) for route, method, _ in seen} <= allowed
    assert {status for _, _, status in seen} <= {"1xx", "2xx", "3xx", "4xx", "5xx"}
    # the fuzzing did reach the middleware: unknown paths, and undeclared methods on a route
    assert ("unmatched", "other", "4xx") in seen
    assert ("/v1/runs", "other", "4xx") in seen
    assert ("/v1/runs", "GET", "2xx") in seen
