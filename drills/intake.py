"""Drills of what arrives from outside: storefront webhooks (duplicated, replayed, out of
order, missing, forged), wrong bearer tokens, and hostile request bodies and ids."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import httpx

from drills.base import Drill, Facts, check
from drills.stage import Proc, Stage

SHOP = "shop"  # the webhook source's name in the drill's policies file
SECRET_ENV = "DRILL_SHOP_WEBHOOK_SECRET"  # noqa: S105 - the name of a variable
MAX_BODY = 4096

# A Shopify-style source: orders/cancelled makes the order's item due now; orders/updated
# (an older, slower signal) would make it due in an hour, which must never postpone it.
WEBHOOKS = f"""
[webhooks.{SHOP}]
scheme = "shopify"
secret_env = "{SECRET_ENV}"
max_body_bytes = {MAX_BODY}
[[webhooks.{SHOP}.rules]]
topic = "orders/cancelled"
policy = "drill"
tenant = "header:X-Shopify-Shop-Domain"
object_id = "body:id"
due = "now"
[[webhooks.{SHOP}.rules]]
topic = "orders/updated"
policy = "drill"
tenant = "header:X-Shopify-Shop-Domain"
object_id = "body:id"
due = "PT1H"
"""


class Storefront:
    """Signs deliveries the way Shopify does (base64 HMAC-SHA256 of the raw body)."""

    def __init__(self, stage: Stage) -> None:
        self.secret = secrets.token_hex(24)
        self.shop = stage.tenant()

    def delivery(self, topic: str, payload: dict[str, Any], webhook_id: str | None = None,
                 *, secret: str | None = None) -> tuple[bytes, dict[str, str]]:
        body = json.dumps(payload).encode()
        digest = hmac.new((secret or self.secret).encode(), body, hashlib.sha256).digest()
        return body, {"X-Shopify-Hmac-Sha256": base64.b64encode(digest).decode(),
                      "X-Shopify-Topic": topic, "X-Shopify-Shop-Domain": self.shop,
                      "X-Shopify-Webhook-Id": webhook_id or secrets.token_hex(8),
                      "Content-Type": "application/json"}


async def _stage_api(stage: Stage, *, workers: int = 1) -> tuple[Storefront, Proc, list[Proc]]:
    stage.start_upstream()
    path = stage.write_policies()
    path.write_text(path.read_text(encoding="utf-8") + WEBHOOKS, encoding="utf-8")
    store = Storefront(stage)
    api = await stage.start_api(env={SECRET_ENV: store.secret})
    procs = [stage.start_worker(workers=2, env={SECRET_ENV: store.secret})
             for _ in range(workers)]
    await stage.wait_started(*procs)
    return store, api, procs


async def _post(client: httpx.AsyncClient, delivery: tuple[bytes, dict[str, str]]
                ) -> httpx.Response:
    body, headers = delivery
    return await client.post(f"/v1/webhooks/{SHOP}", content=body, headers=headers)


async def _register(client: httpx.AsyncClient, stage: Stage, due: datetime,
                    objects: list[str]) -> None:
    items = [{"tenant_id": stage.tenant(), "object_id": o, "policy": "drill",
              "due_at": due.isoformat()} for o in objects]
    answer = await client.post("/v1/items", json={"items": items})
    check(answer.status_code == 200, f"registration answered {answer.status_code}")


async def webhook_hints(stage: Stage) -> Facts:
    store, api, _workers = await _stage_api(stage)
    later = datetime.now(UTC) + timedelta(days=7)
    async with stage.api_client(api) as client:
        await _register(client, stage, later, ["order-a", "order-b"])
        await _register(client, stage, datetime.now(UTC) - timedelta(days=1), ["order-c"])
        first = store.delivery("orders/cancelled", {"id": "order-a"}, "w-a")
        answers = [(await _post(client, first)).status_code,
                   (await _post(client, first)).status_code]              # duplicate
        b_now = store.delivery("orders/cancelled", {"id": "order-b"}, "w-b-new")
        b_old = store.delivery("orders/updated", {"id": "order-b"}, "w-b-old")
        answers += [(await _post(client, b_now)).status_code,
                    (await _post(client, b_old)).status_code]             # out of order
        check(answers[:3] == [202, 200, 202], f"deliveries answered {answers}")
        check(answers[3] in (200, 202), f"the older hint answered {answers[3]}")

        async def hinted_done() -> bool:
            rows = await stage.fetch("SELECT object_id FROM items WHERE status = 'succeeded'")
            return {r["object_id"] for r in rows} >= {"order-a", "order-b"}

        await stage.wait_for("hinted items drained without a run", hinted_done, 30)
        replay = (await _post(client, first)).status_code                 # replayed later
        # order-c's webhook never came: the next run finds it by age
        run = await client.post("/v1/runs", json={"policy": "drill"})
        check(run.status_code == 202, f"run answered {run.status_code}")
        await stage.wait_all_finished(3, 30)
    assert stage.upstream is not None
    calls = stage.upstream.calls()
    per_object = {o: sum(1 for c in calls if c.path.endswith("/" + o))
                  for o in ("order-a", "order-b", "order-c")}
    receipts = await stage.fetchval("SELECT count(*) FROM webhook_receipts")
    facts: Facts = {"answers": [*answers, replay], "calls_per_item": per_object,
                    "receipts": receipts}
    check(replay == 200, f"a replay answered {replay}")
    check(per_object == {"order-a": 1, "order-b": 1, "order-c": 1},
          f"upstream calls per item {per_object}")
    check(receipts == 3, f"{receipts} receipts for 3 distinct webhook ids")
    check(await stage.statuses() == {"succeeded": 3}, f"items {await stage.statuses()}")
    return facts


async def _counts(stage: Stage) -> dict[str, int]:
    return {t: int(await stage.fetchval(f"SELECT count(*) FROM {t}"))  # noqa: S608
            for t in ("items", "webhook_receipts", "runs", "operator_actions", "scopes")}


async def forged_and_wrong_tokens(stage: Stage) -> Facts:
    store, api, _workers = await _stage_api(stage, workers=0)
    before = await _counts(stage)
    answers: list[int] = []
    async with httpx.AsyncClient(base_url=api.base_url, timeout=10) as anon:
        good = store.delivery("orders/cancelled", {"id": "forged-1"}, "f1")
        wrong_secret = store.delivery("orders/cancelled", {"id": "forged-2"}, "f2",
                                      secret=secrets.token_hex(24))
        truncated = (good[0], {**good[1], "X-Shopify-Hmac-Sha256":
                               good[1]["X-Shopify-Hmac-Sha256"][:20]})
        missing = (good[0], {k: v for k, v in good[1].items()
                             if k != "X-Shopify-Hmac-Sha256"})
        altered = (good[0].replace(b"forged-1", b"forged-9"), good[1])
        for delivery in (wrong_secret, truncated, missing, altered):
            answers.append((await _post(anon, delivery)).status_code)
        bearer = {"Authorization": "Bearer " + secrets.token_hex(16)}
        for method, path, body in (
                ("POST", "/v1/items", {"items": [{"tenant_id": stage.tenant(),
                                                  "object_id": "x", "policy": "drill",
                                                  "due_at": "2026-01-01T00:00:00Z"}]}),
                ("POST", "/v1/runs", {}), ("POST", "/v1/workers/pause", {"reason": "x"}),
                ("PUT", f"/v1/scopes/{stage.scope()}", {"rate_per_second": 1, "burst": 1}),
                ("POST", "/v1/items/cancel", {"ids": [1], "why": "x"})):
            for headers in (bearer, {}):
                answer = await anon.request(method, path, json=body, headers=headers)
                answers.append(answer.status_code)
    after = await _counts(stage)
    facts: Facts = {"answers": answers, "rows_before": before, "rows_after": after}
    check(set(answers) == {401}, f"answers {answers}")
    check(after == before, f"rows changed: {before} -> {after}")
    return facts


HOSTILE_IDS = ["../../etc/passwd", "a/b", "%2F", "ü/ñ 漢字", "x'; DROP TABLE items;--",
               "?q=1#frag", "...", "semi;colon", "back\\slash"]


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def _slowloris(port: int, connections: int, seconds: float,
                     connected: asyncio.Event) -> None:
    """Open connections that send a request line (then `connected` is set) and then one
    header byte at a time."""
    loop = asyncio.get_running_loop()
    socks = []
    try:
        for _ in range(connections):
            sock = socket.socket()
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", port))
            await loop.sock_sendall(sock, b"POST /v1/items HTTP/1.1\r\nHost: x\r\n")
            socks.append(sock)
        connected.set()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for sock in socks:
                with contextlib.suppress(OSError):  # the server hung up on it: fine
                    await loop.sock_sendall(sock, b"X")
            await asyncio.sleep(0.2)  # a slow client's pace: a byte per connection at a time
    finally:
        for sock in socks:
            sock.close()


# Sends one request to the API and answers its status (recording it for the 5xx check)
_Send = Callable[..., Awaitable[int]]
_JSON = {"Content-Type": "application/json"}


async def _oversized(send: _Send, store: Storefront, item: dict[str, str]) -> dict[str, int]:
    """Bodies over a limit: too many items, 8 MB, a webhook over its source's byte limit."""
    content, headers = store.delivery("orders/cancelled", {"id": "x" * MAX_BODY})
    return {
        "too many items": await send("POST", "/v1/items", json={"items": [item] * 10_001}),
        "8 MB body": await send("POST", "/v1/items", headers=_JSON,
                                content=b'{"items": [' + b'"x",' * 2_000_000 + b'"x"]}'),
        "webhook over its limit": await send("POST", f"/v1/webhooks/{SHOP}",
                                             content=content, headers=headers),
    }


async def _malformed(send: _Send, item: dict[str, str]) -> dict[str, int]:
    """Bodies and paths that do not parse, or hold what no id may."""
    return {
        "truncated JSON": await send("POST", "/v1/runs", headers=_JSON, content=b'{"policy": '),
        "not JSON": await send("POST", "/v1/items", headers=_JSON, content=b"\xff\xfe<xml/>"),
        "wrong shape": await send("POST", "/v1/items", json=[1, 2, 3]),
        "id with NUL": await send("POST", "/v1/items/cancel", headers=_JSON,
                                  content=b'{"tenant_id": "a\\u0000", "why": "x"}'),
        "scope with %2F": await send("PUT", "/v1/scopes/tenant%2F..%2Fx",
                                     json={"rate_per_second": 1, "burst": 1}),
        # a dot segment would be normalised out of the upstream URL: refused up front
        "id ..": await send("POST", "/v1/items", json={"items": [{**item, "object_id": ".."}]}),
    }


async def _health_beside_slow_clients(send: _Send, port: int) -> tuple[int, float]:
    """/healthz's status and seconds while 30 slow clients hold connections: slow clients
    must not starve the others."""
    connected = asyncio.Event()
    slow = asyncio.create_task(_slowloris(port, 30, 3.0, connected))
    await connected.wait()  # every slow connection open and mid-request
    started = time.monotonic()
    healthy = await send("GET", "/healthz")
    health_s = time.monotonic() - started
    await slow
    return healthy, health_s


async def hostile_input(stage: Stage) -> Facts:
    store, api, _workers = await _stage_api(stage)
    statuses: list[int] = []
    rss_before = _rss_kib(api.pid)
    async with stage.api_client(api, timeout=30) as client:
        async def send(method: str, path: str, **kwargs: Any) -> int:
            status = (await client.request(method, path, **kwargs)).status_code
            statuses.append(status)
            return status

        item = {"tenant_id": stage.tenant(), "object_id": "o", "policy": "drill",
                "due_at": "2026-01-01T00:00:00Z"}
        oversized = await _oversized(send, store, item)
        malformed = await _malformed(send, item)
        healthy, health_s = await _health_beside_slow_clients(send, api.port)
        # hostile ids are stored as given and never leave their path segment
        items = [{**item, "object_id": o} for o in HOSTILE_IDS]
        registered = await send("POST", "/v1/items", json={"items": items})
        await send("POST", "/v1/runs", json={"policy": "drill"})
        await stage.wait_all_finished(len(HOSTILE_IDS), 30)
    rss_after = _rss_kib(api.pid)
    assert stage.upstream is not None
    segments = {}
    for call in stage.upstream.calls():
        parts = call.path.split("/")
        segments[unquote(parts[-1])] = len(parts)
    facts: Facts = {"oversized": oversized, "malformed": malformed, "health_s": round(
        health_s, 3), "rss_growth_kib": rss_after - rss_before,
        "five_xx": [s for s in statuses if s >= 500]}
    check(facts["five_xx"] == [], f"5xx answers {facts['five_xx']}")
    check(oversized == {"too many items": 422, "8 MB body": 422,
                        "webhook over its limit": 413}, f"oversized {oversized}")
    check(malformed == {"truncated JSON": 400, "not JSON": 400, "wrong shape": 422,
                        "id with NUL": 422, "scope with %2F": 404, "id ..": 422},
          f"malformed {malformed}")
    check(healthy == 200 and health_s < 2.0,
          f"/healthz took {health_s:.2f} s beside 30 slow clients")
    check(registered == 200, f"hostile ids registered with {registered}")
    check(segments == {o: 4 for o in HOSTILE_IDS},
          f"upstream paths by id (segments): {segments}")
    check(rss_after - rss_before < 200_000, f"API memory grew {rss_after - rss_before} KiB")
    check(await stage.statuses() == {"succeeded": len(HOSTILE_IDS)},
          f"items {await stage.statuses()}")
    return facts


DRILLS = [
    Drill(16, "webhook-hints",
          "an API with a Shopify-style source, a worker; orders a and b registered due in a "
          "week, order c due yesterday",
          "a's hint delivered twice and replayed after it drained; b's hints out of order "
          "(due now, then an older 'in an hour'); no webhook at all for c",
          "one upstream call per item, 3 receipts for 3 webhook ids, the duplicate and the "
          "replay answer 200 with nothing changed, c drained by the next run", webhook_hints),
    Drill(17, "forged-and-wrong-tokens",
          "an API with a Shopify-style source",
          "deliveries with a wrong secret, a truncated, a missing and a stale signature "
          "(body altered after signing); operator calls with a wrong or no bearer token",
          "401 for every one, zero rows written anywhere", forged_and_wrong_tokens),
    Drill(18, "hostile-input",
          "an API and a worker",
          "10,001 items, an 8 MB body, a webhook over its byte limit, malformed JSON, NUL and "
          "%2F in ids, 30 slowloris connections, ids like ../../etc/passwd, %2F, unicode and "
          "SQL",
          "the right 4xx and zero 5xx, /healthz answers beside the slow clients, API memory "
          "bounded, each id drained as one path segment of its upstream call", hostile_input),
]
