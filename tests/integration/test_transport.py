"""The real wire (service/transport.py under service/upstream.py) against the fake upstream
on loopback: what each fault becomes, what reaches the upstream, and the pool's limit."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest

from drills.upstream import FakeUpstream, Fault
from service.outcomes import Answer, Failure
from service.policies import Policies, resolve_policies
from service.upstream import CallResult, Upstreams

KEY = "op-key-0123456789"


@pytest.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as fake:
        yield fake


def policies_for(base_url: str, *, timeout: float = 2.0, max_connections: int = 100,
                 **policy: Any) -> Policies:
    cfg: dict[str, Any] = {"version": 1, "upstream": "shop", "path": "/carts/{object_id}",
                           "rate": {"per_second": 1000, "burst": 1000}}
    cfg.update(policy)
    return resolve_policies({
        "upstreams": {"shop": {"base_url": base_url, "timeout_seconds": timeout,
                               "max_connections": max_connections}},
        "policies": {"carts": cfg}}, {}, source="<test>")


async def call(policies: Policies, object_id: str = "cart-1",
               upstreams: Upstreams | None = None) -> CallResult:
    ups = upstreams or Upstreams(policies.upstreams)
    try:
        policy = policies.policies["carts"]
        return await ups.for_policy(policy).delete(policy, tenant_id="acme",
                                                   object_id=object_id, operation_key=KEY)
    finally:
        if upstreams is None:
            await ups.aclose()


@pytest.mark.parametrize(("fault", "params", "failure"), [
    # the upstream read the request: whatever it did, the deletion may have happened
    (Fault.RESET, {}, Failure.RESET_AFTER_SEND),
    (Fault.CLOSE, {}, Failure.RESET_AFTER_SEND),
    (Fault.HANG, {"seconds": 5}, Failure.TIMEOUT_AFTER_SEND),
    (Fault.DRIP, {"seconds": 5, "interval": 0.1}, Failure.TIMEOUT_AFTER_SEND),
], ids=["reset", "close", "hang", "drip"])
async def test_each_fault_is_one_call_and_one_failure(upstream: FakeUpstream, fault: Fault,
                                                      params: dict[str, Any],
                                                      failure: Failure) -> None:
    upstream.inject(fault, **params)
    result = await call(policies_for(upstream.base_url, timeout=0.5))
    assert result.answer == Answer(failure=failure)
    # never sent again by the transport: a resend would spend no token and leave no attempt
    assert len(upstream.calls()) == 1


async def test_a_refused_connection_was_never_sent() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = await call(policies_for(f"http://127.0.0.1:{port}"))
    assert result.answer == Answer(failure=Failure.CONNECT)


async def test_an_answer_that_is_not_http_is_a_reset(upstream: FakeUpstream) -> None:
    server = await asyncio.start_server(_not_http, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        result = await call(policies_for(f"http://127.0.0.1:{port}"))
    assert result.answer == Answer(failure=Failure.RESET_AFTER_SEND)


async def _not_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"SMTP ready\r\n\r\n")
    await writer.drain()
    writer.close()


async def test_garbage_bodies_are_drained_and_the_status_kept(upstream: FakeUpstream) -> None:
    upstream.inject(Fault.GARBAGE, status=200, size=200_000)
    result = await call(policies_for(upstream.base_url))
    assert result.answer.status == 200 and result.answer.failure is None


async def test_what_reaches_the_upstream(upstream: FakeUpstream) -> None:
    policies = policies_for(upstream.base_url, method="POST",
                            body={"id": "{object_id}", "tenant": "{tenant_id}"})
    await call(policies, object_id='a/b "c" ?#%2F')
    [seen] = upstream.calls()
    # the id stays in its one segment, percent-encoded as rendered; nothing re-quotes it
    assert seen.path == "/carts/a%2Fb%20%22c%22%20%3F%23%252F"
    assert seen.body == '{"id":"a/b \\"c\\" ?#%2F","tenant":"acme"}'
    headers = {k.lower(): v for k, v in seen.headers.items()}
    assert headers["idempotency-key"] == KEY
    assert headers["content-type"] == "application/json"
    assert headers["content-length"] == str(len(seen.body))
    assert headers["user-agent"].startswith("sweeper/")
    # no compression asked for: answer bodies are read as sent
    assert "accept-encoding" not in headers


async def test_a_bodiless_post_says_its_length(upstream: FakeUpstream) -> None:
    await call(policies_for(upstream.base_url, method="POST"))
    [seen] = upstream.calls()
    headers = {k.lower(): v for k, v in seen.headers.items()}
    assert headers["content-length"] == "0" and seen.body == ""


async def test_calls_never_exceed_max_connections(upstream: FakeUpstream) -> None:
    upstream.inject(Fault.STATUS, times=None, status=204, delay=0.05)
    policies = policies_for(upstream.base_url, max_connections=3)
    ups = Upstreams(policies.upstreams)
    try:
        results = await asyncio.gather(*(call(policies, f"cart-{i}", ups) for i in range(12)))
    finally:
        await ups.aclose()
    assert {r.answer.status for r in results} == {204}
    assert upstream.max_in_flight() == 3


async def test_keep_alive_connections_are_reused(upstream: FakeUpstream) -> None:
    policies = policies_for(upstream.base_url, max_connections=1)
    ups = Upstreams(policies.upstreams)
    try:
        for i in range(5):
            assert (await call(policies, f"cart-{i}", ups)).answer.status == 204
    finally:
        await ups.aclose()
    assert upstream.connections_accepted() == 1
