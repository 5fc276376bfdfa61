"""Secrets and customer data never reach the logs, error answers or /metrics.

A real `sweeper serve` process runs with JSON logs at DEBUG (its whole stderr is captured:
HTTP, publisher, worker and upstream-client records). Planted: the API token, a database
password, an upstream header secret (headers_from_env) and a webhook secret (secret_env);
a customer's email and name in request bodies (valid and invalid), query strings and
headers, and in the fake upstream's response bodies and headers. Each channel also carries
a control marker that it *does* show by design, so an empty search proves the absence of a
leak rather than the absence of data.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote, quote_plus

import httpx
import pytest
from sqlalchemy.engine import make_url

from service.protocols.egress import public_roots
from tests.conftest import free_port
from tests.fakes.upstream import FakeUpstream, Fault

# every test here starts processes (see the marker in pyproject.toml)
pytestmark = pytest.mark.slow

RUN = uuid.uuid4().hex[:10]
API_TOKEN = f"sk-live-apitoken-{RUN}"
DB_PASSWORD = f"db-pass-{RUN}"
UPSTREAM_SECRET = f"upstream-secret-{RUN}"
WEBHOOK_SECRET = f"whsec-{RUN}"
EMAIL = f"jane.customer.{RUN}@example.com"
NAME = f"Jane Q. Customer {RUN}"
PLANTED = {"api token": API_TOKEN, "database password": DB_PASSWORD,
           "upstream secret": UPSTREAM_SECRET, "webhook secret": WEBHOOK_SECRET,
           "email": EMAIL, "name": NAME}

# Shown by design: tenant ids are identifiers (the limiter scope `tenant:{tenant_id}` is
# logged) and policy names are metric labels. Error answers show neither: their
# `instance` is the request id, not the path.
CONTROL = f"ctl{RUN}"
POLICY = f"carts-{CONTROL}"

POLICIES = """
[upstreams.shop]
base_url = "{base_url}"
headers_from_env = {{ Authorization = "SHOP_API_AUTH" }}
timeout_seconds = 2

[policies.{policy}]
version = 1
upstream = "shop"
path = "/carts/{{object_id}}"
scope = "tenant:{{tenant_id}}"
rate = {{ per_second = 50, burst = 10 }}
lease_seconds = 10
max_attempts = 5
backoff = {{ base_seconds = 0.2, max_seconds = 0.5 }}
retry_after_max_seconds = 1

[webhooks.shop]
scheme = "shopify"
secret_env = "SHOP_WEBHOOK_SECRET"
[[webhooks.shop.rules]]
topic = "orders/cancelled"
policy = "{policy}"
tenant = "header:X-Shopify-Shop-Domain"
object_id = "body:id"
"""

# What the customer's data looks like on the wire, in every form it could be written.
PII_HEADERS = {"X-Customer-Email": EMAIL, "X-Customer-Name": NAME,
               "Cookie": f"session={UPSTREAM_SECRET}; email={quote(EMAIL)}"}
PII_BODY = json.dumps({"customer": {"email": EMAIL, "name": NAME}}).encode()


def variants(value: str) -> set[str]:
    """The forms a planted value could take in text: raw, JSON-escaped, URL-encoded."""
    return {value, json.dumps(value)[1:-1], quote(value, safe=""), quote_plus(value)}


def find(text: str, planted: dict[str, str]) -> list[str]:
    """The names of the planted values that appear in `text`."""
    return sorted(name for name, value in planted.items()
                  if any(form in text for form in variants(value)))


def test_search_sees_every_encoding() -> None:
    for form in variants(EMAIL) | variants(NAME):
        assert find(f"…{form}…", PLANTED), form
    assert find("nothing planted here", PLANTED) == []


def _upstream_faults(up: FakeUpstream) -> None:
    """Every answer from the fake upstream carries the customer's data in body and headers."""
    for path, status in (("ok-", 200), ("perm-", 422), ("flaky-", 500), ("busy-", 429),
                         ("locked-", 401)):
        headers = {**PII_HEADERS, "Content-Type": "application/json",
                   "X-Request-Echo": f"Bearer {UPSTREAM_SECRET}"}
        if status == 429:
            headers["Retry-After"] = EMAIL  # unreadable: the policy's backoff applies
        if status == 401:
            headers["WWW-Authenticate"] = f'Bearer error="invalid_token", user="{EMAIL}"'
        up.inject(Fault.STATUS, times=1, match=path, status=status, headers=headers,
                  body=PII_BODY)
    # the retries of the transient and throttled items succeed, still chatty
    up.inject(Fault.STATUS, times=None, match="-", status=200,
              headers={**PII_HEADERS, "Content-Type": "application/json"}, body=PII_BODY)


def _serve(db_url: str, policies_file: Path, port: int, log: IO[str]) -> subprocess.Popen[str]:
    """`sweeper serve` with its stderr going to `log`, a file: a pipe nobody reads until
    the end would fill up with DEBUG lines and block the server's event loop."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWEEPER_")}
    url = make_url(db_url).set(password=DB_PASSWORD)  # trust auth: accepted, ignored
    env.update({
        "SWEEPER_DATABASE_URL": url.render_as_string(hide_password=False),
        "SWEEPER_POLICIES_FILE": str(policies_file), "SWEEPER_API_TOKENS": API_TOKEN,
        "SWEEPER_PORT": str(port), "SWEEPER_WORKERS": "2", "SWEEPER_LOG_LEVEL": "DEBUG",
        "SWEEPER_LOG_FORMAT": "json", "SWEEPER_MIGRATE_ON_START": "false",
        "SHOP_API_AUTH": f"Bearer {UPSTREAM_SECRET}", "SHOP_WEBHOOK_SECRET": WEBHOOK_SECRET})
    return subprocess.Popen([sys.executable, "-m", "service", "serve"], env=env,
                            stdout=subprocess.DEVNULL, stderr=log, text=True)


def _wait_ready(base: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, "sweeper serve exited before it was ready"
        try:
            if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("server not ready within 30 s")


def _bad_requests(client: httpx.Client) -> list[httpx.Response]:
    """Invalid requests carrying customer data and secrets; each must be a clean 4xx."""
    due = "2020-01-01T00:00:00Z"
    item = {"tenant_id": f"t-{CONTROL}", "object_id": "x", "policy": POLICY, "due_at": due}
    bad_token = {"Authorization": f"Bearer {UPSTREAM_SECRET}", **PII_HEADERS}
    no_scheme = {"Authorization": WEBHOOK_SECRET}
    cases: list[tuple[str, str, dict[str, Any]]] = [
        # 422 from the app's own checks
        ("POST", "/v1/items", {"json": {"items": [{**item, "policy": EMAIL}]}}),
        ("POST", "/v1/items", {"json": {"items": [{**item, "object_id": f"{NAME}\x07{EMAIL}"}]}}),
        ("POST", "/v1/items", {"json": {"items": [{**item, "object_id": EMAIL * 20}]}}),
        ("POST", "/v1/runs", {"json": {"policy": EMAIL, "tenant_id": NAME}}),
        ("POST", "/v1/items/redrive", {"json": {"why": NAME, "items": [
            {"tenant_id": "t", "object_id": EMAIL, "policy": NAME}]}}),
        ("POST", "/v1/items/cancel", {"json": {"why": EMAIL}}),
        # 422 from schema validation: wrong types, ranges, enums, extra-long values
        ("POST", "/v1/items", {"json": {"items": [{**item, "due_at": EMAIL}]}}),
        ("POST", "/v1/items", {"json": {"items": [{**item, "due_at": "2020-01-01T00:00:00"}]}}),
        ("POST", "/v1/items", {"json": {"items": [{"email": EMAIL, "name": NAME}]}}),
        ("POST", "/v1/items", {"json": {"items": [item], "email": EMAIL}}),  # unknown field
        ("POST", "/v1/items", {"json": {"items": EMAIL}}),
        ("POST", "/v1/items", {"json": [EMAIL, NAME]}),
        ("POST", "/v1/runs", {"json": {"cutoff": EMAIL, "max_items": NAME, "dry_run": EMAIL}}),
        ("POST", "/v1/runs", {"json": {"policy": POLICY}, "headers": {
            "Idempotency-Key": EMAIL * 30}}),
        ("PUT", f"/v1/scopes/tenant:t-{CONTROL}", {"json": {"rate_per_second": EMAIL,
                                                             "burst": -1, "reason": NAME}}),
        ("PUT", f"/v1/scopes/tenant:t-{CONTROL}", {"json": {"rate_per_second": 1, "burst": 1,
                                                             "reason": EMAIL * 100}}),
        ("GET", "/v1/items", {"params": {"status": EMAIL, "limit": NAME, "after": EMAIL}}),
        ("GET", "/v1/runs", {"params": {"before": EMAIL, "limit": -1}}),
        # 400: bodies that are not JSON
        ("POST", "/v1/items", {"content": f'{{"items": [{{"email": "{EMAIL}", "name": '
                                          f'"{NAME}"', "headers": {
                                              "Content-Type": "application/json"}}),
        ("POST", "/v1/runs", {"content": f"email={quote_plus(EMAIL)}&name={NAME}",
                              "headers": {"Content-Type": "application/x-www-form-urlencoded"}}),
        ("POST", "/v1/runs", {"content": EMAIL.encode("utf-16"),
                              "headers": {"Content-Type": "application/json"}}),
        # 401: missing, malformed and wrong tokens (one of them a real secret of ours)
        ("GET", "/v1/runs", {"headers": bad_token, "params": {"email": EMAIL}}),
        ("POST", "/v1/items", {"headers": no_scheme, "json": {"email": EMAIL}}),
        ("GET", "/v1/scopes", {"headers": {"Authorization": f"Basic {quote(EMAIL)}"}}),
        # 404 / 405
        ("GET", f"/v1/runs/{2**62}", {"params": {"email": EMAIL}}),
        ("GET", f"/v1/nothing-{CONTROL}", {"params": {"email": EMAIL, "name": NAME}}),
        ("DELETE", "/v1/runs", {"params": {"email": EMAIL}}),
        ("POST", f"/v1/scopes/tenant:nobody-{CONTROL}/pause", {"json": {"reason": EMAIL}}),
    ]
    answers = []
    for method, path, kwargs in cases:
        headers = {**PII_HEADERS, **kwargs.pop("headers", {})}
        if headers.get("Authorization") is None and "/v1/" in path:
            headers["Authorization"] = f"Bearer {API_TOKEN}"
        answer = client.request(method, path, headers=headers, **kwargs)
        assert 400 <= answer.status_code < 500, (method, path, answer.status_code, answer.text)
        assert answer.headers["content-type"] == "application/problem+json", (path, answer)
        answers.append(answer)
    return answers


def _good_requests(client: httpx.Client) -> None:
    """Valid requests whose bodies, queries and headers also carry the customer's data."""
    headers = {**PII_HEADERS, "Authorization": f"Bearer {API_TOKEN}"}
    items = [{"tenant_id": f"t{n}-{CONTROL}", "object_id": f"{kind}{EMAIL}", "policy": POLICY,
              "due_at": "2020-01-01T00:00:00Z"}
             for n, kind in enumerate(("ok-", "perm-", "flaky-", "busy-", "locked-"))]
    answer = client.post("/v1/items", json={"items": items}, headers=headers)
    assert answer.status_code == 200, answer.text
    answer = client.post("/v1/runs", json={"policy": POLICY},
                         headers={**headers, "Idempotency-Key": f"slot-{RUN}"})
    assert answer.status_code == 202, answer.text
    for path, params in (("/v1/items", {"tenant_id": EMAIL, "reason": NAME}),
                         ("/v1/scopes", {"after": EMAIL})):
        assert client.get(path, params=params, headers=headers).status_code == 200
    # an undeclared query parameter is refused: the answer names it, never its value
    answer = client.get("/v1/runs", params={"email": EMAIL}, headers=headers)
    assert answer.status_code == 422, answer.text
    assert answer.json()["errors"][0]["loc"] == ["query", "email"]
    answer = client.post("/v1/items/cancel", headers=headers,
                         json={"why": f"privacy request from {NAME} <{EMAIL}>",
                               "tenant_id": EMAIL})
    assert answer.status_code == 200, answer.text
    answer = client.post("/v1/workers/pause", json={"reason": EMAIL}, headers=headers)
    assert answer.status_code == 200, answer.text
    answer = client.post("/v1/workers/resume", json={"reason": NAME}, headers=headers)
    assert answer.status_code == 200, answer.text


def _settle(client: httpx.Client) -> dict[str, str]:
    """Wait until every item reached the state its upstream answers lead to."""
    headers = {"Authorization": f"Bearer {API_TOKEN}"}
    want = {"ok-": "succeeded", "perm-": "dead", "flaky-": "succeeded", "busy-": "succeeded",
            "locked-": "pending"}
    deadline = time.monotonic() + 30
    while True:
        rows = client.get("/v1/items", headers=headers).json()["items"]
        seen = {kind: row["status"] for row in rows for kind in want
                if row["object_id"].startswith(kind)}
        locked = [r for r in rows if r["object_id"].startswith("locked-")]
        if seen == want and locked and locked[0]["last_outcome"] == "unauthorized":
            return seen
        assert time.monotonic() < deadline, rows
        time.sleep(0.2)


def test_no_secret_or_customer_data_in_logs_errors_or_metrics(db_url: str, tmp_path: Path
                                                             ) -> None:
    with FakeUpstream() as up:
        _upstream_faults(up)
        policies_file = tmp_path / "policies.toml"
        policies_file.write_text(POLICIES.format(base_url=up.base_url, policy=POLICY))
        port = free_port()
        log_path = tmp_path / "serve.log"
        log = log_path.open("w", encoding="utf-8")
        proc = _serve(db_url, policies_file, port, log)
        base = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(base, proc)
            with httpx.Client(verify=public_roots(), base_url=base, timeout=10) as client:
                errors = _bad_requests(client)
                _good_requests(client)
                _settle(client)
                metrics = client.get("/metrics").text
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
            log.close()
        calls = up.calls()
    stderr = log_path.read_text(encoding="utf-8")

    assert proc.returncode == 0, stderr[-4000:]
    # the planted upstream secret really was sent, and the customer data really came back
    assert all(c.headers.get("authorization") == f"Bearer {UPSTREAM_SECRET}" for c in calls)
    assert {c.outcome for c in calls} == {"status"}

    # logs: one JSON event per line, every one of them
    # (the OpenTelemetry log data model: docs/operations.md, "Logs")
    events = [json.loads(line) for line in stderr.splitlines()]
    assert all({"timestamp", "severity_text", "severity_number", "body", "attributes", "scope",
                "resource"} <= e.keys() for e in events)
    assert all(e["resource"]["service.name"] == "sweeper" for e in events)
    attempts = [e["attributes"] for e in events if e["body"] == "attempt"]
    assert {e["outcome"] for e in attempts} >= {"succeeded", "permanent", "transient",
                                                 "throttled", "unauthorized"}
    for attributes in attempts:
        assert {"item_id", "operation_key", "scope", "outcome", "policy"} <= attributes.keys()
    requests = [e["attributes"] for e in events if e["body"] == "request"]
    assert requests and all("request_id" in r and "http.route" in r for r in requests)
    assert any(e["body"] == "run published" and "run_id" in e["attributes"] for e in events)

    error_text = "\n".join(r.text + json.dumps(dict(r.headers)) for r in errors)
    # controls: each channel shows what it shows by design, so the searches below can fail
    assert CONTROL in stderr  # worker attempt events at DEBUG: scope = tenant:t0-ctl...
    assert f'"scope": "tenant:t0-{CONTROL}"' in stderr
    assert POLICY in metrics  # policy is a metric label
    assert CONTROL not in error_text  # not even in `instance`, which names the request id
    assert "urn:sweeper:request:" in error_text
    assert find(stderr + EMAIL, PLANTED) == ["email"]

    assert find(stderr, PLANTED) == [], "planted values in the logs"
    assert find(error_text, PLANTED) == [], "planted values in error answers"
    assert find(metrics, PLANTED) == [], "planted values in /metrics"
