"""Hostile callers against a real `sweeper serve` process: huge and slow bodies, slow
headers, and more connections than it takes. The process must stay responsive, keep its
memory, and keep webhook intake open for authentic deliveries."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from service.protocols.egress import public_roots
from tests.conftest import TOKEN_A, free_port
from tests.integration.test_cli import EXAMPLE, GOOD_ENV, _stop, _wait_ready

pytestmark = pytest.mark.slow

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.5
MAX_CONNECTIONS = 60
SHOP = "acme.myshopify.com"


@dataclass
class Served:
    proc: subprocess.Popen[str]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")


@pytest.fixture
def served(db_url: str) -> Iterator[Served]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWEEPER_")}
    env.update(GOOD_ENV)
    env.update({"SWEEPER_DATABASE_URL": db_url, "SWEEPER_PORT": str(port),
                "SWEEPER_API_TOKENS": TOKEN_A, "SWEEPER_WORKERS": "2",
                "SWEEPER_POLICIES_FILE": str(EXAMPLE), "SWEEPER_LOG_FORMAT": "json",
                "SWEEPER_HEADER_READ_TIMEOUT_SECONDS": str(HEADER_TIMEOUT_S),
                "SWEEPER_BODY_READ_TIMEOUT_SECONDS": str(BODY_TIMEOUT_S),
                "SWEEPER_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
                "SWEEPER_WEBHOOK_MAX_IN_FLIGHT": "4"})
    proc = subprocess.Popen([sys.executable, "-m", "service", "serve"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    try:
        _wait_ready(f"http://127.0.0.1:{port}/readyz", proc, 60)
        yield Served(proc, port)
    finally:
        _stop(proc)


def signed_delivery(object_id: int) -> tuple[bytes, dict[str, str]]:
    body = json.dumps({"id": object_id}).encode()
    digest = hmac.new(GOOD_ENV["SHOPIFY_WEBHOOK_SECRET"].encode(), body, hashlib.sha256)
    return body, {"X-Shopify-Hmac-Sha256": base64.b64encode(digest.digest()).decode(),
                  "X-Shopify-Topic": "orders/cancelled", "X-Shopify-Shop-Domain": SHOP,
                  "X-Shopify-Webhook-Id": str(uuid.uuid4()),
                  "Content-Type": "application/json"}


async def healthz_seconds(url: str) -> float:
    """How long /healthz takes to answer 200 right now."""
    started = time.perf_counter()
    async with httpx.AsyncClient(verify=public_roots(), timeout=5) as client:
        assert (await client.get(f"{url}/healthz")).status_code == 200
    return time.perf_counter() - started


async def raw_request(port: int, head: bytes) -> tuple[asyncio.StreamReader,
                                                       asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    await writer.drain()
    return reader, writer


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """What the server sent before closing the connection; fails if it stays open."""
    async with asyncio.timeout(seconds):
        return await reader.read()


async def test_unauthenticated_huge_bodies_cost_nothing(served: Served) -> None:
    """A 500 MB body, announced or chunked, is refused with 401 from its headers; the
    process neither reads it nor grows."""
    rss_before = served.rss_bytes()
    for framing in (b"Content-Length: 500000000\r\n", b"Transfer-Encoding: chunked\r\n"):
        reader, writer = await raw_request(
            served.port, b"POST /v1/items HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\n" + framing + b"\r\n")
        # the client keeps sending while the server has already answered
        writer.write(b"8000\r\n" + b"x" * 0x8000 + b"\r\n" if b"chunked" in framing
                     else b"x" * 0x8000)
        async with asyncio.timeout(5):
            status = await reader.readline()
        writer.close()
        assert status.startswith(b"HTTP/1.1 401 "), status
    assert served.rss_bytes() - rss_before < 20 * 2**20


async def test_an_oversized_body_is_cut_off_and_the_loop_stays_free(served: Served) -> None:
    """An authenticated 40 MB body is refused once past the 10 MiB limit (413), at once when
    announced; the event loop keeps answering meanwhile, and the memory is bounded."""
    rss_before = served.rss_bytes()
    chunk = b"[" + b"0," * 500_000

    async def body() -> Iterator[bytes]:  # type: ignore[misc]
        for _ in range(40):
            yield chunk

    async with httpx.AsyncClient(verify=public_roots(), base_url=served.url, timeout=30,
                                 headers={"Authorization": f"Bearer {TOKEN_A}"}) as client:
        reader, writer = await raw_request(
            served.port, b"POST /v1/items HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " +
            TOKEN_A.encode() + b"\r\nContent-Length: " + str(11 * 2**20).encode() + b"\r\n\r\n")
        async with asyncio.timeout(5):
            assert (await reader.readline()).startswith(b"HTTP/1.1 413 ")
        writer.close()
        upload = asyncio.create_task(client.post("/v1/items", content=body()))
        worst = max([await healthz_seconds(served.url) for _ in range(10)])
        try:
            answer = await upload
            assert answer.status_code == 413
            assert answer.json()["type"] == "urn:sweeper:problem:payload-too-large"
        except httpx.TransportError:
            pass  # the server answered and closed while the client was still sending
    assert worst < 1.0
    assert served.rss_bytes() - rss_before < 60 * 2**20


async def test_slow_headers_are_cut_off(served: Served) -> None:
    """Connections that send part of their headers, or nothing, are closed after the header
    deadline; meanwhile the server answers others."""
    stalled = [await raw_request(served.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: b")
               for _ in range(20)]
    silent = [await raw_request(served.port, b"") for _ in range(20)]
    assert await healthz_seconds(served.url) < 1.0
    for reader, writer in stalled + silent:
        assert await closed_within(reader, HEADER_TIMEOUT_S + 3) == b""
        writer.close()


async def test_more_connections_than_the_cap_get_503_until_they_go(served: Served) -> None:
    """Past SWEEPER_MAX_CONNECTIONS the server answers 503 at once; once the slow
    connections are cut off it serves again."""
    stalled = [await raw_request(served.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
               for _ in range(MAX_CONNECTIONS + 5)]
    async with httpx.AsyncClient(verify=public_roots(), timeout=5) as client:
        assert (await client.get(f"{served.url}/healthz")).status_code == 503
        for reader, writer in stalled:
            await closed_within(reader, HEADER_TIMEOUT_S + 3)
            writer.close()
        assert (await client.get(f"{served.url}/healthz")).status_code == 200


async def test_slow_webhook_senders_never_close_intake(served: Served) -> None:
    """Far more slow, unsigned webhook senders than intake slots (4) are connected, their
    headers sent and their bodies trickling: an authentic delivery is still applied, and
    the slow ones get 408 once the body deadline passes."""
    slow = []
    for n in range(40):
        reader, writer = await raw_request(
            served.port, b"POST /v1/webhooks/shopify HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 100\r\n"
                         b"X-Shopify-Topic: orders/cancelled\r\n\r\n{\"id\": " +
                         str(n).encode())
        slow.append((reader, writer))
    body, headers = signed_delivery(4242)
    async with httpx.AsyncClient(verify=public_roots(), timeout=5) as client:
        started = time.perf_counter()
        answer = await client.post(f"{served.url}/v1/webhooks/shopify", content=body,
                                   headers=headers)
        assert answer.status_code == 202, answer.text
        assert time.perf_counter() - started < 1.0
    for reader, writer in slow:
        async with asyncio.timeout(BODY_TIMEOUT_S + 3):
            status = await reader.readline()
        assert status.startswith(b"HTTP/1.1 408 "), status
        writer.close()
