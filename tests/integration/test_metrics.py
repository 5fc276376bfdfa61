"""/metrics: the text format passes promtool, ledger gauges follow the database, and no
label ever carries a tenant, scope or object id."""

from __future__ import annotations

import os
import shutil
import subprocess
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service import metrics
from tests.conftest import TOKEN_A, LiveServer, test_settings
from tests.integration.test_pipeline import make_policies, register, release_all

AUTH = {"Authorization": f"Bearer {TOKEN_A}"}
TENANT = "tenant-7f3a9"


def samples(exposition: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(exposition):
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


async def scrape(base_url: str) -> str:
    async with httpx.AsyncClient(base_url=base_url) as client:
        response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=")
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
        async with httpx.AsyncClient(base_url=live.base_url, headers=AUTH) as client:
            assert (await client.get("/v1/runs")).status_code == 200
            assert (await client.get("/no-such-route")).status_code == 404
        exposition = await scrape(live.base_url)

    check = subprocess.run([promtool(), "check", "metrics"], input=exposition,
                           capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr

    got = samples(exposition)
    assert got[("sweeper_ledger_up", ())] == 1
    assert got[("sweeper_items_eligible", (("policy", "carts"),))] == 28
    assert got[("sweeper_items_dead", (("policy", "carts"),))] == 2
    age = got[("sweeper_oldest_eligible_age_seconds", (("policy", "carts"),))]
    assert 7_000 < age < 7_400
    assert got[("sweeper_scopes_closed", ())] == 1
    assert got[("sweeper_scopes_paused", ())] == 1
    route = (("method", "GET"), ("route", "/v1/runs"), ("status", "2xx"))
    assert got[("sweeper_http_request_duration_seconds_count", route)] >= 1
    unmatched = (("method", "GET"), ("route", "unmatched"), ("status", "4xx"))
    assert got[("sweeper_http_request_duration_seconds_count", unmatched)] >= 1

    # no label value may name a tenant, a scope or an object
    for (_name, labels) in got:
        for _key, value in labels:
            assert TENANT not in value and "cart-" not in value and "tenant:" not in value


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
