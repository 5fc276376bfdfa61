"""A Sweeper as deployed, for the contract test to fuzz: a real uvicorn server on loopback with
its worker pool running against a fake upstream on loopback, a configured webhook source, and
a ledger seeded through the API itself so that every status, outcome and scope state the
answers can describe is there before the first generated request.

The seed (policy `carts` unless named; the fake upstream answers by object id):

    acme     cart-ok-*      204                    succeeded
             cart-dead-*    422                    dead (permanent)
             cart-retry-*   503                    pending, one attempt, next within 10 min
             cart-later-*   due in the future      pending, never released (no attempt planned)
             cart-drop-0    cancelled before it ran
    globex   cart-throttle  429 Retry-After 3600   pending; scope tenant:globex closed
    initech  cart-unauth    401                    pending; scope tenant:initech paused
    acme     (exports) *    404, absent = deleted  succeeded (scope credential:shop)
             webhook hint   orders/cancelled       inserted by a signed delivery, succeeded

plus a report-only run and a run keyed by an Idempotency-Key that released the due items.
The server runs in a thread with its own event loop (the schemathesis calls are blocking), so
the worker pool runs exactly as `sweeper serve` runs it: in the server's lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from service.config.policies import Policies
from service.protocols.egress import public_roots
from tests.conftest import TOKEN_A, LiveServer, policies_from, test_settings
from tests.fakes.upstream import FakeUpstream, Fault

SOURCE = "storefront"
SECRET_ENV = "CONTRACT_WEBHOOK_SECRET"
SECRET = "contract-webhook-secret-0123456789"
SIGNATURE_HEADER = "X-Signature"
ID_HEADER = "X-Delivery"
TOPIC_HEADER = "X-Topic"
SHOP_HEADER = "X-Shop-Domain"
SHOP = "storefront.example"
# the rules of the source: topic -> the body keys its rule reads
TOPICS = {"orders/cancelled": ("id",), "customers/redact": ("shop_domain", "customer")}
UNMAPPED_TOPIC = "products/update"

WORKERS = 4
SETTLE_TIMEOUT_S = 30.0
SERVER_START_TIMEOUT_S = 30.0
PAST = datetime(2026, 1, 1, tzinfo=UTC)
LATER = datetime.now(UTC) + timedelta(days=30)


def contract_policies(upstream_url: str) -> Policies:
    """Two policies on the fake upstream and the signed webhook source `SOURCE`."""
    policy: dict[str, Any] = {
        "version": 1, "upstream": "shop", "scope": "tenant:{tenant_id}",
        "rate": {"per_second": 1000, "burst": 1000}, "lease_seconds": 30, "max_attempts": 3,
        # a transient failure is retried within 10 minutes (full jitter over 600 s): most
        # often after this session; one retried inside it answers 503 again
        "backoff": {"base_seconds": 600, "max_seconds": 900}}
    return policies_from({
        "upstreams": {"shop": {"base_url": upstream_url, "timeout_seconds": 2}},
        "policies": {
            "carts": {**policy, "path": "/carts/{object_id}"},
            "exports": {**policy, "version": 2, "path": "/exports/{object_id}",
                        "scope": "credential:{upstream}", "absent_means_deleted": True},
        },
        "webhooks": {SOURCE: {
            "scheme": "hmac-sha256", "secret_env": SECRET_ENV,
            "signature_header": SIGNATURE_HEADER, "id_header": ID_HEADER,
            "topic_header": TOPIC_HEADER, "rules": [
                {"topic": "orders/cancelled", "policy": "carts",
                 "tenant": f"header:{SHOP_HEADER}", "object_id": "body:id"},
                {"topic": "customers/redact", "policy": "carts", "tenant": "body:shop_domain",
                 "object_id": "body:customer.id", "due": "P1D"},
            ]}},
    }, {SECRET_ENV: SECRET})


def sign(body: bytes) -> str:
    """The source's signature: hex HMAC-SHA256 of the raw body."""
    return hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()


def topic_for(body: bytes) -> str:
    """The event type a delivery of this body claims: the rule whose keys the body has, else
    one of the rules' topics or an unmapped one, picked by the body's digest (stable, so
    Hypothesis replays and shrinks the same request)."""
    try:
        payload = json.loads(body)
    except ValueError:
        payload = None
    if isinstance(payload, dict):
        for topic, keys in TOPICS.items():
            if all(key in payload for key in keys):
                return topic
    choices = [*TOPICS, UNMAPPED_TOPIC]
    return choices[hashlib.sha256(body).digest()[0] % len(choices)]


def delivery_headers(body: bytes) -> dict[str, str]:
    """Headers that make `body` an authentic delivery of `SOURCE`, with a fresh delivery id."""
    return {SIGNATURE_HEADER: sign(body), TOPIC_HEADER: topic_for(body),
            ID_HEADER: f"contract-{time.time_ns()}", SHOP_HEADER: SHOP}


def _faults(upstream: FakeUpstream) -> None:
    upstream.inject(Fault.STATUS, times=None, match="-dead-", status=422)
    upstream.inject(Fault.STATUS, times=None, match="-retry-", status=503)
    upstream.inject(Fault.STATUS, times=None, match="-throttle", status=429,
                    headers={"Retry-After": "3600"})
    upstream.inject(Fault.STATUS, times=None, match="-unauth", status=401)
    upstream.inject(Fault.STATUS, times=None, match="/exports/", status=404)


def _items() -> list[dict[str, str]]:
    def item(tenant: str, object_id: str, policy: str = "carts",
             due: datetime = PAST) -> dict[str, str]:
        return {"tenant_id": tenant, "object_id": object_id, "policy": policy,
                "due_at": due.isoformat()}

    return ([item("acme", f"cart-ok-{i}") for i in range(8)]
            + [item("acme", f"cart-dead-{i}") for i in range(3)]
            + [item("acme", f"cart-retry-{i}") for i in range(3)]
            + [item("acme", f"cart-later-{i}", due=LATER) for i in range(3)]
            + [item("acme", "cart-drop-0", due=LATER)]
            + [item("globex", "cart-throttle-0"), item("initech", "cart-unauth-0")]
            + [item("acme", f"export-{i}", "exports") for i in range(2)])


@dataclass(frozen=True)
class LedgerState:
    """What the ledger held when the seed had settled."""

    statuses: dict[str, int]
    retried: int  # pending items with an attempt behind them
    unreleased: int  # pending items no run has released yet
    closed_scopes: frozenset[str]
    paused_scopes: frozenset[str]

    def settled(self) -> bool:
        """Every outcome the seed aims at is there, and no lease is in flight."""
        return (not self.statuses.get("leased") and self.statuses.get("succeeded", 0) >= 11
                and self.statuses.get("dead", 0) >= 3 and self.retried >= 3
                and self.unreleased >= 3 and self.statuses.get("cancelled", 0) >= 1
                and "tenant:globex" in self.closed_scopes
                and "tenant:initech" in self.paused_scopes)


@dataclass(frozen=True)
class Seeded:
    """A running, seeded Sweeper: its address, the run the seed published, the fake
    upstream, and the ledger as the seed left it (fuzzing changes it from then on)."""

    base_url: str
    run_id: int
    upstream: FakeUpstream
    seed: LedgerState


def _seed(client: httpx.Client) -> int:
    """Register, report, publish, deliver a webhook; the id of the publishing run."""
    answer = client.post("/v1/items", json={"items": _items()})
    answer.raise_for_status()
    client.post("/v1/runs", json={"dry_run": True}).raise_for_status()
    run = client.post("/v1/runs", json={}, headers={"Idempotency-Key": "contract-seed"})
    run.raise_for_status()
    body = json.dumps({"id": 4242, "cancel_reason": "customer"}).encode()
    hook = client.post(f"/v1/webhooks/{SOURCE}", content=body,
                       headers={**delivery_headers(body), "Content-Type": "application/json"})
    assert hook.status_code == 202, hook.text
    drop = client.post("/v1/items/cancel", json={"items": [
        {"tenant_id": "acme", "object_id": "cart-drop-0", "policy": "carts"}],
        "why": "registered by mistake"})
    drop.raise_for_status()
    return int(run.json()["id"])


def _ledger_state(client: httpx.Client) -> LedgerState:
    items = client.get("/v1/items", params={"limit": 1000}).json()["items"]
    scopes = client.get("/v1/scopes").json()["scopes"]
    statuses: dict[str, int] = {}
    for item in items:
        statuses[item["status"]] = statuses.get(item["status"], 0) + 1
    pending = [i for i in items if i["status"] == "pending"]
    return LedgerState(
        statuses=statuses, retried=sum(1 for i in pending if i["attempts"] > 0),
        unreleased=sum(1 for i in pending if i["released_at"] is None),
        closed_scopes=frozenset(s["name"] for s in scopes if s["closed_until"] is not None),
        paused_scopes=frozenset(s["name"] for s in scopes if s["paused"]))


class _ServerThread:
    """A `LiveServer` on its own event loop in a daemon thread."""

    def __init__(self, db_url: str, policies: Policies) -> None:
        self._db_url, self._policies = db_url, policies
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.base_url = ""
        self._thread = threading.Thread(target=self._main, name="contract-server", daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported by start()
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        settings = test_settings(self._db_url, workers=WORKERS, log_level="WARNING")
        async with LiveServer(settings, self._policies, self._db_url) as live:
            self.base_url = live.base_url
            self._ready.set()
            await self._stop.wait()

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(SERVER_START_TIMEOUT_S):
            raise RuntimeError("the contract server did not start")
        if self._error is not None:
            raise RuntimeError("the contract server failed to start") from self._error

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=60)


@contextlib.contextmanager
def seeded_sweeper(db_url: str) -> Iterator[Seeded]:
    """A running Sweeper on `db_url` (migrated, empty) with the seed above in its ledger."""
    with FakeUpstream() as upstream:
        _faults(upstream)
        server = _ServerThread(db_url, contract_policies(upstream.base_url))
        server.start()
        try:
            with httpx.Client(verify=public_roots(), base_url=server.base_url, timeout=10,
                              headers={"Authorization": f"Bearer {TOKEN_A}"}) as client:
                run_id = _seed(client)
                deadline = time.monotonic() + SETTLE_TIMEOUT_S
                while not (state := _ledger_state(client)).settled():
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the seeded ledger did not settle: {state}")
                    time.sleep(0.1)
            yield Seeded(base_url=server.base_url, run_id=run_id, upstream=upstream,
                         seed=state)
        finally:
            server.stop()
