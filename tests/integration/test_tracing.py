"""Tracing as an operator turns it on: `sweeper serve` started with the standard OTEL_*
variables only, exporting over OTLP/HTTP to a receiver on loopback (tests/fakes/
otlp_receiver.py, the opentelemetry-proto messages a collector reads), while its worker pool
drains a run against the fake upstream. One item's life reads as one trace: the cron
trigger's request (continuing the caller's `traceparent`), the publication, the batch, each
item's claim, call and completion, linked to the claim round and the flush whose statements
ran them. Spans carry no object id, tenant id or raw path; the upstream gets a `traceparent`
only from the policy that asks; log lines name the trace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from drills.upstream import FakeUpstream
from service.observability import tracing
from service.observability.metrics import LeaseReturn
from tests.conftest import TOKEN_A, free_port
from tests.fakes.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.integration.test_cli import _stop, _wait_ready

pytestmark = pytest.mark.slow  # a `sweeper serve` process

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
TENANT = "tenant-4c1d"
ITEMS = 6  # per policy
STATEMENTS = "opentelemetry.instrumentation.asyncpg"  # the statements' spans

POLICIES = """
[upstreams.shop]
base_url = "{base}"

[policies.carts]
version = 1
upstream = "shop"
path = "/carts/{{tenant_id}}/{{object_id}}"
scope = "tenant:{{tenant_id}}"
rate = {{ per_second = 50.0, burst = 10 }}
tracing = {{ send_traceparent = true }}

[policies.exports]
version = 1
upstream = "shop"
path = "/exports/{{tenant_id}}/{{object_id}}"
scope = "exports:{{tenant_id}}"
rate = {{ per_second = 50.0, burst = 10 }}

[webhooks.store]
scheme = "header"
signature_header = "X-Store-Secret"
secret_env = "TRACING_WEBHOOK_SECRET"
topic_path = "scope"

[[webhooks.store.rules]]
topic = "store/cart/abandoned"
policy = "carts"
tenant = "body:producer"
object_id = "body:data.id"
due = "now"
"""
WEBHOOK_SECRET = "tracing-webhook-secret-0123456789"
HOOK_TRACE = "0af7651916cd43dd8448eb211c80319c"
HOOK_SPAN = "b7ad6b7169203331"


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    receiver.start()
    yield receiver
    receiver.stop()


def test_the_variables_decide() -> None:
    assert not tracing.requested({})
    assert tracing.requested({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert tracing.requested({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"})
    assert tracing.requested({"OTEL_TRACES_EXPORTER": "console"})
    assert not tracing.requested({"OTEL_TRACES_EXPORTER": "none",
                                  "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert not tracing.requested({"OTEL_SDK_DISABLED": "true",
                                  "OTEL_TRACES_EXPORTER": "otlp"})
    # otlp is http/protobuf unless a protocol variable says otherwise
    assert tracing.exporter_names({}) == ["otlp_proto_http"]
    assert tracing.exporter_names({"OTEL_TRACES_EXPORTER": "otlp,console",
                                   "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) == [
        "otlp_proto_grpc", "console"]
    assert tracing.exporter_names({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                                   "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}) == [
        "otlp_proto_http"]


def test_an_item_of_an_unsampled_trace_makes_no_spans() -> None:
    """Its trace was left out by the sampler (flags 00): its claims, calls and completions
    would not be recorded either, so the worker does not build them."""
    # the sampled bit alone decides (the SDK also sets 0x02: a random trace id)
    for flags, unsampled in (("00", True), ("02", True), ("01", False), ("03", False)):
        assert tracing.unsampled(f"00-{CALLER_TRACE}-{CALLER_SPAN}-{flags}") is unsampled
    assert not tracing.unsampled(None)
    assert not tracing.unsampled("garbage")


def test_an_unknown_exporter_stops_the_start(db_url: str, tmp_path: Path) -> None:
    """A variable naming an exporter that is not installed is a configuration error (exit
    2, one line), not a process that runs untraced."""
    env = _env(db_url, tmp_path, "http://127.0.0.1:9", free_port())
    env.update({"OTEL_TRACES_EXPORTER": "zipkin"})
    result = subprocess.run([sys.executable, "-m", "service", "serve"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "no span exporter 'zipkin' is installed" in result.stderr


def _env(db_url: str, tmp_path: Path, upstream: str, port: int) -> dict[str, str]:
    policies = tmp_path / "policies.toml"
    policies.write_text(POLICIES.format(base=upstream), encoding="utf-8")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SWEEPER_", "OTEL_"))}
    env.update({"SWEEPER_DATABASE_URL": db_url, "SWEEPER_POLICIES_FILE": str(policies),
                "SWEEPER_API_TOKENS": TOKEN_A, "SWEEPER_WORKERS": "4",
                "SWEEPER_PORT": str(port), "SWEEPER_MIGRATE_ON_START": "false",
                "SWEEPER_LOG_LEVEL": "DEBUG", "SWEEPER_LOG_FORMAT": "json",
                "TRACING_WEBHOOK_SECRET": WEBHOOK_SECRET})
    return env


def test_one_item_reads_as_one_trace(db_url: str, tmp_path: Path,
                                     receiver: OtlpReceiver) -> None:
    with FakeUpstream() as upstream:
        port = free_port()
        env = _env(db_url, tmp_path, upstream.base_url, port)
        # the SDK's own variables only: where to send, and a short export delay
        env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
                    "OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_SERVICE_NAME": "sweeper-test"})
        stderr = tmp_path / "serve.log"
        with stderr.open("w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "service", "serve"], env=env,
                                    stdout=subprocess.DEVNULL, stderr=log, text=True)
        try:
            base = f"http://127.0.0.1:{port}"
            _wait_ready(f"{base}/readyz", proc, 60)
            run_id = _trigger(base)

            def alive() -> None:
                assert proc.poll() is None, stderr.read_text()

            receiver.wait_for(lambda r: _completed(r) == 2 * ITEMS, alive=alive)
            _deliver(base)
            receiver.wait_for(lambda r: _completed(r) == 2 * ITEMS + 1, alive=alive)
            httpx.get(f"{base}/v1/runs/{run_id}", headers={
                "Authorization": f"Bearer {TOKEN_A}"}, timeout=10).raise_for_status()
            receiver.wait_for(lambda r: bool(r.named("GET /v1/runs/{run_id}")), alive=alive)
        finally:
            _stop(proc)
        calls = upstream.calls()
    spans = receiver.spans
    by_id = {span.span_id: span for span in spans}

    # the trigger continues the caller's trace; the publication and the batches continue it
    [trigger] = [s for s in receiver.named("POST /v1/runs") if s.kind == "server"]
    assert (trigger.trace_id, trigger.parent_id) == (CALLER_TRACE, CALLER_SPAN)
    assert trigger.resource["service.name"] == "sweeper-test"
    [publish] = receiver.named("sweeper.publish")
    assert (publish.trace_id, publish.parent_id) == (CALLER_TRACE, trigger.span_id)
    batches = receiver.named("sweeper.batch")
    assert batches and {b.parent_id for b in batches} == {publish.span_id}
    assert any(by_id.get(s.parent_id) is publish for s in spans if s.kind == "client"
               and s.scope == STATEMENTS), "publication's statements are its children"

    # a call not made (a loaded machine starts it later than its token allows: its lease
    # goes back and the item is claimed again) ends its span saying why; the rest were made
    made = [c for c in receiver.named("sweeper.call")
            if "sweeper.not_made" not in c.attributes]
    assert {c.attributes["sweeper.not_made"] for c in receiver.named("sweeper.call")
            if c not in made} <= {LeaseReturn.LATE_START, LeaseReturn.LEASE_ENDING}

    # an item a webhook released: its call continues the delivery's trace
    [hooked] = [c for c in made if c.trace_id == HOOK_TRACE]
    [delivery] = [s for s in spans if s.name == "POST /v1/webhooks/{source}"
                  and s.kind == "server"]
    assert (delivery.trace_id, delivery.parent_id) == (HOOK_TRACE, HOOK_SPAN)
    assert hooked.parent_id == delivery.span_id

    # every item: its claim, its call and its completion, in the run's trace
    item_calls = [c for c in made if c is not hooked]
    assert len(item_calls) == 2 * ITEMS
    for call in item_calls:
        assert call.trace_id == CALLER_TRACE
        assert by_id[call.parent_id].name == "sweeper.batch"
        assert call.attributes["sweeper.outcome"] == ["succeeded"]
        assert call.attributes["http.response.status_code"] in (200, 204)
        [round_link] = call.links
        assert by_id[round_link[1]].name == "sweeper.claim_round"
    # a claim per call made, and one per call not made (each claimed again after)
    claims = Counter(c.trace_id for c in receiver.named("sweeper.claim"))
    assert set(claims) == {CALLER_TRACE, HOOK_TRACE}
    assert claims[CALLER_TRACE] >= 2 * ITEMS and claims[HOOK_TRACE] >= 1
    completions = receiver.named("sweeper.complete")
    for completion in completions:
        assert by_id[completion.parent_id].name == "sweeper.call"
        assert completion.attributes["sweeper.status"] == ["succeeded"]
        assert completion.attributes["sweeper.fenced"] == 0
        [flush_link] = completion.links
        flush = by_id[flush_link[1]]
        assert flush.name == "sweeper.flush" and flush.parent_id == ""
        assert any(s.parent_id == flush.span_id for s in spans), "the flush's statement"
    # a statement outside any operation of ours (heartbeats, polls) is not exported
    assert not [s for s in spans if s.scope == STATEMENTS and not s.parent_id]

    _assert_nothing_identifying(spans)
    # the upstream was told the trace only by the policy that asks
    sent = {(call.path.split("/")[1], call.path.split("/")[3]): call.headers.get("traceparent")
            for call in calls}
    assert {key for key, value in sent.items() if value is None} == {
        ("exports", f"obj-exports-{i}") for i in range(ITEMS)}
    assert {value.split("-")[1] for key, value in sent.items() if key[0] == "carts"} == {
        CALLER_TRACE, HOOK_TRACE}
    _assert_logs_name_the_trace(stderr)


def _trigger(base: str) -> int:
    auth = {"Authorization": f"Bearer {TOKEN_A}"}
    items = [{"tenant_id": TENANT, "object_id": f"obj-{policy}-{i}", "policy": policy,
              "due_at": "2026-01-01T00:00:00Z"}
             for policy in ("carts", "exports") for i in range(ITEMS)]
    httpx.post(f"{base}/v1/items", json={"items": items}, headers=auth,
               timeout=10).raise_for_status()
    answer = httpx.post(f"{base}/v1/runs", json={}, timeout=10, headers={
        **auth, "traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"})
    answer.raise_for_status()
    return int(answer.json()["id"])


def _deliver(base: str) -> None:
    """A store's webhook making one more cart due now, sent within a trace of its own."""
    body = {"scope": "store/cart/abandoned", "producer": TENANT,
            "data": {"id": "obj-carts-hooked"}, "hash": "h1", "created_at": 1764547200}
    answer = httpx.post(f"{base}/v1/webhooks/store", json=body, timeout=10, headers={
        "X-Store-Secret": WEBHOOK_SECRET, "traceparent": f"00-{HOOK_TRACE}-{HOOK_SPAN}-01"})
    assert answer.status_code == 202, answer.text
    assert answer.json()["result"] == "applied"


def _completed(receiver: OtlpReceiver) -> int:
    return sum(1 for s in receiver.named("sweeper.call") if any(
        c.parent_id == s.span_id for c in receiver.named("sweeper.complete")))


def _assert_nothing_identifying(spans: list[ReceivedSpan]) -> None:
    """No object id, tenant id or credential in any span's name or attributes (the policy
    allows none), and request spans name their route, not their path."""
    for span in spans:
        text = json.dumps([span.name, span.attributes], default=str)
        assert "obj-" not in text and TENANT not in text, (span.name, span.attributes)
        assert TOKEN_A not in text
    [status] = [s for s in spans if s.name == "GET /v1/runs/{run_id}" and s.kind == "server"]
    assert status.attributes.get("http.target", "/v1/runs/{run_id}") == "/v1/runs/{run_id}"


def _assert_logs_name_the_trace(stderr: Path) -> None:
    """The trigger's access line and every attempt line carry the run's trace id."""
    lines = [json.loads(line) for line in stderr.read_text().splitlines()
             if line.startswith("{")]
    [access] = [line for line in lines if line["body"] == "request"
                and line["attributes"].get("http.route") == "/v1/runs"]
    assert access["trace_id"] == CALLER_TRACE
    attempts = [line for line in lines if line["body"] == "attempt"]
    assert len(attempts) == 2 * ITEMS + 1
    assert sorted(line["trace_id"] for line in attempts) == sorted(
        [CALLER_TRACE] * 2 * ITEMS + [HOOK_TRACE])
