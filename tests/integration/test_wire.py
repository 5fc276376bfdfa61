"""What any HTTP client behind the upstream call must get right on a hostile wire: scripted
raw-socket upstreams that answer out of turn, and the call's answer for each. A client that
replaces service/protocols/transport.py must pass these (they drive `upstream.send`, the call port's
one entry, and UpstreamClient where the policy's settings matter)."""

from __future__ import annotations

import asyncio
import re
import ssl
from collections.abc import Callable, Coroutine, Sequence
from datetime import UTC, datetime
from functools import partial
from typing import Any

import httpx
import pytest
import uvloop

from service.outcomes import Answer, Failure, Outcome, classify
from service.protocols import http1_connection
from service.protocols.transport import SEND_BY, Http1Transport
from service.upstreams.deletion_api import UpstreamClient
from service.upstreams.exchange import send
from tests.conftest import policies_from

NO_CONTENT = b"HTTP/1.1 204 No Content\r\n\r\n"
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
UNAVAILABLE = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n"

# For the nth request on a connection (from 0) and its head: [(delay in seconds, bytes)].
Script = Callable[[int, bytes], Sequence[tuple[float, bytes]]]


class Wire:
    """A loopback server writing exactly what its script says: `on_accept` as soon as a
    connection is accepted, then each request's steps, each after its delay."""

    def __init__(self, script: Script, on_accept: bytes = b"",
                 tls: ssl.SSLContext | None = None) -> None:
        self.script = script
        self.tls = tls
        self.on_accept = on_accept
        self.requests: list[bytes] = []
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    async def __aenter__(self) -> Wire:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    @property
    def url(self) -> str:
        assert self._server is not None
        scheme = "https" if self.tls else "http"
        return f"{scheme}://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        try:
            if self.on_accept:
                writer.write(self.on_accept)
            n = 0
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                if length:
                    await reader.readexactly(int(length[1]))
                self.requests.append(head)
                for delay, data in self.script(n, head):
                    if delay:
                        await asyncio.sleep(delay)
                    writer.write(data)
                n += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def request(url: str, **headers: str) -> httpx.Request:
    return httpx.Request("DELETE", url + "/carts/1", headers=headers,
                         extensions={"timeout": {"pool": 2, "connect": 2, "read": 2}})


async def answer_to(transport: Http1Transport, url: str) -> Answer:
    """One call as service/upstreams/exchange.py makes it, reading the whole body."""
    return await send(transport, request(url), 3.0, lambda status: True, 1 << 20)


async def the_answer_to(written: bytes) -> tuple[Answer, Wire]:
    """One call on a new transport to an upstream that writes `written` for each request."""
    transport = Http1Transport(4)
    async with Wire(lambda n, head: [(0, written)]) as wire:
        answer = await answer_to(transport, wire.url)
    await transport.aclose()
    return answer, wire


def deleted(answer: Answer) -> bool:
    return classify(answer, absent_means_deleted=True, now=datetime.now(UTC)).outcome \
        is Outcome.SUCCEEDED


@pytest.mark.parametrize("delay", [0.0, 0.0005, 0.002, 0.01])
async def test_an_unrequested_answer_after_a_failure_is_never_the_next_calls(
        delay: float) -> None:
    """#46: a 503, then moments later an unrequested 200 on the same connection: 150 of
    300 calls were recorded as deleted. Sequential and concurrent calls: none is."""
    distrusted: list[str] = []
    transport = Http1Transport(4, distrusted=distrusted.append)
    async with Wire(lambda n, head: [(0, UNAVAILABLE), (delay, OK)]) as wire:
        answers = [await answer_to(transport, wire.url) for _ in range(20)]
        answers += await asyncio.gather(*(answer_to(transport, wire.url) for _ in range(40)))
    await transport.aclose()
    assert not any(deleted(a) for a in answers), answers
    # each a 503, or (the two answers read together) unknown: never the 200
    assert {a.status for a in answers} <= {503, None}


async def test_an_answer_written_on_accept_is_never_a_requests() -> None:
    """#46: a 200 written on accept, before any request was read, shifted every later answer
    on that connection by one: no call may take it (or a later shifted one) as its own."""
    distrusted: list[str] = []
    transport = Http1Transport(4, distrusted=distrusted.append)
    async with Wire(lambda n, head: [(0, UNAVAILABLE)], on_accept=OK) as wire:
        answers = [await answer_to(transport, wire.url) for _ in range(20)]
    await transport.aclose()
    assert not any(deleted(a) for a in answers), answers
    assert distrusted and set(distrusted) <= {"out_of_turn", "surplus"}


async def test_a_host_that_spoke_out_of_turn_gets_a_new_connection_per_request() -> None:
    distrusted: list[str] = []
    transport = Http1Transport(4, distrusted=distrusted.append)
    # the first connection's first answer is followed, once idle, by an unrequested one
    async with Wire(lambda n, head: [(0, NO_CONTENT), (0.01, OK)] if n == 0 and not
                    wire.requests[:-1] else [(0, NO_CONTENT)]) as wire:
        assert (await answer_to(transport, wire.url)).status == 204

        async def closed_for_it() -> None:
            while not distrusted:
                await asyncio.sleep(0.005)
        await asyncio.wait_for(closed_for_it(), 5)
        for _ in range(3):
            assert (await answer_to(transport, wire.url)).status == 204
    await transport.aclose()
    assert distrusted == ["out_of_turn"]
    assert wire.connections == 4  # one per request since: each says Connection: close
    assert all(b"\r\nConnection: close\r\n" in head for head in wire.requests[1:])
    assert b"connection:" not in wire.requests[0].lower()


async def test_keep_alive_off_sends_one_request_per_connection() -> None:
    transport = Http1Transport(4, keep_alive=False)
    async with Wire(lambda n, head: [(0, NO_CONTENT)]) as wire:
        for _ in range(3):
            assert (await answer_to(transport, wire.url)).status == 204
    await transport.aclose()
    assert wire.connections == 3
    assert all(head.count(b"\r\nConnection: close\r\n") == 1 for head in wire.requests)


async def test_a_trailer_is_never_read_as_the_answers_header() -> None:
    chunked = (b"HTTP/1.1 429 Too Many Requests\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"2\r\nno\r\n0\r\nRetry-After: 999\r\n\r\n")
    answer, _ = await the_answer_to(chunked)
    assert answer.status == 429 and answer.retry_after is None


async def test_a_status_below_100_fails_at_once() -> None:
    started = asyncio.get_running_loop().time()
    answer, _ = await the_answer_to(b"HTTP/1.1 099 Odd\r\nContent-Length: 0\r\n\r\n")
    assert answer == Answer(failure=Failure.RESET_AFTER_SEND)
    assert asyncio.get_running_loop().time() - started < 1.0  # not the 3 s deadline


async def test_a_connection_not_used_keeps_its_keep_alive_clock(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A call given up before its write hands back its connection as idle as it was: the
    keep-alive clock is not restarted, so it is not reused past KEEPALIVE_SECONDS."""
    monkeypatch.setattr(http1_connection, "KEEPALIVE_SECONDS", 0.3)
    transport = Http1Transport(4)
    async with Wire(lambda n, head: [(0, NO_CONTENT)]) as wire:
        assert (await answer_to(transport, wire.url)).status == 204
        loop = asyncio.get_running_loop()
        used_at = loop.time()
        late = request(wire.url)
        late.extensions[SEND_BY] = 0.0  # long past: taken, then not written
        assert await send(transport, late, 3.0, lambda status: True, 1 << 20) == Answer(
            failure=Failure.SENT_TOO_LATE)
        await asyncio.sleep(max(0.0, used_at + 0.35 - loop.time()))
        assert (await answer_to(transport, wire.url)).status == 204
    await transport.aclose()
    assert wire.connections == 2


def echoing_policies(url: str) -> Any:
    return policies_from({
        "upstreams": {"shop": {"base_url": url, "echo_header": "X-Request-Id"}},
        "policies": {"carts": {"version": 1, "upstream": "shop", "path": "/carts/{object_id}",
                               "scope": "shop", "rate": {"per_second": 100}}}})


@pytest.mark.parametrize(("echo", "expected"), [
    ("same", Answer(status=204)),
    ("other", Answer(failure=Failure.ECHO_MISMATCH)),
    ("none", Answer(failure=Failure.ECHO_MISMATCH)),
])
async def test_an_upstream_that_echoes_a_request_id_is_checked(echo: str,
                                                                expected: Answer) -> None:
    def script(n: int, head: bytes) -> list[tuple[float, bytes]]:
        sent = re.search(rb"(?i)\r\nx-request-id: *([0-9a-f]+)", head)
        assert sent is not None
        value = {"same": sent[1], "other": b"0" * 32, "none": None}[echo]
        header = b"" if value is None else b"X-Request-Id: " + value + b"\r\n"
        return [(0, b"HTTP/1.1 204 No Content\r\n" + header + b"\r\n")]

    async with Wire(script) as wire:
        policies = echoing_policies(wire.url)
        client = UpstreamClient(policies.upstreams["shop"])
        try:
            result = await client.delete(policies.policies["carts"], tenant_id="t",
                                         object_id="1", operation_key="k" * 64)
        finally:
            await client.aclose()
    assert result.answer == expected


async def test_a_redirect_is_refused_at_once_naming_where_to() -> None:
    moved = (b"HTTP/1.1 301 Moved Permanently\r\nLocation: https://new.example/v2/carts/1"
             b"\r\nContent-Length: 0\r\n\r\n")
    answer, wire = await the_answer_to(moved)
    verdict = classify(answer, absent_means_deleted=False, now=datetime.now(UTC))
    assert verdict.outcome is Outcome.PERMANENT
    assert verdict.reason == "http_301:redirect:https://new.example/v2/carts/1"
    assert len(wire.requests) == 1  # never followed


def test_the_hostile_wire_under_uvloop() -> None:
    """`sweeper serve` runs on uvloop: the out-of-turn cases once more over its transports."""
    cases: list[Callable[[], Coroutine[Any, Any, None]]] = [
        partial(test_an_unrequested_answer_after_a_failure_is_never_the_next_calls, 0.002),
        test_an_answer_written_on_accept_is_never_a_requests,
        test_a_trailer_is_never_read_as_the_answers_header,
        test_a_status_below_100_fails_at_once,
        test_keep_alive_off_sends_one_request_per_connection,
    ]
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        for case in cases:
            runner.run(case())


async def test_connections_per_host_stay_within_their_limit() -> None:
    """max_connections_per_host: one tenant's host never holds more than its share of the
    upstream's connections, and the other hosts still get theirs."""
    transport = Http1Transport(6, max_per_host=2)
    open_now: dict[str, int] = {}
    most: dict[str, int] = {}

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host = writer.get_extra_info("sockname")[0]
        open_now[host] = open_now.get(host, 0) + 1
        most[host] = max(most.get(host, 0), open_now[host])
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                await asyncio.sleep(0.02)
                writer.write(NO_CONTENT)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            open_now[host] -= 1
            writer.close()

    servers = [await asyncio.start_server(serve, host, 0)
               for host in ("127.0.0.1", "127.0.0.2")]
    urls = [f"http://{s.sockets[0].getsockname()[0]}:{s.sockets[0].getsockname()[1]}"
            for s in servers]
    answers = await asyncio.gather(*(answer_to(transport, url) for url in urls * 8))
    await transport.aclose()
    for server in servers:
        server.close()
    assert {a.status for a in answers} == {204}
    assert most == {"127.0.0.1": 2, "127.0.0.2": 2}
