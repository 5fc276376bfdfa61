"""The real wire (service/protocols/transport.py under service/upstreams/deletion_api.py) against
the fake upstream on loopback: what each fault becomes, what reaches the upstream, and the pool's
limit; then against scripted servers: each framing of an answer, reuse and its limits, TLS."""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import re
import socket
import ssl
import time
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvloop
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from drills.upstream import FakeUpstream, Fault
from service.config.policies import Policies, resolve_policies
from service.outcomes import Answer, Failure
from service.protocols import http1_connection
from service.protocols.transport import SEND_BY, SEND_GATE, Http1Transport
from service.upstreams.deletion_api import CallResult, Upstreams
from service.upstreams.exchange import send
from tests.conftest import eventually

KEY = "op-key-0123456789"



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


async def test_user_info_in_the_base_url_is_sent_as_basic_credentials(
        upstream: FakeUpstream) -> None:
    await call(policies_for(upstream.base_url.replace("://", "://shop:p%40ss@")))
    [seen] = upstream.calls()
    headers = {k.lower(): v for k, v in seen.headers.items()}
    assert headers["authorization"] == "Basic " + base64.b64encode(b"shop:p@ss").decode()


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


# ---------------------------------------------------------------------------- the wire itself
# Answers the fake upstream never gives: a scripted server writes exactly the bytes a test
# names, so each HTTP/1.1 case the transport must read is pinned down.

class Scripted:
    """A loopback server answering its nth request with `answers[n]` (the last one repeats),
    closing the connection after an answer that ends with CLOSE: its side first, then,
    once the client has closed its own, the rest (`finished` counts the connections
    ended)."""

    CLOSE = b"<close>"

    def __init__(self, *answers: bytes, tls: ssl.SSLContext | None = None) -> None:
        self.answers = answers
        self.tls = tls
        self.requests: list[bytes] = []
        self.connections = 0
        self.finished = 0
        self._server: asyncio.Server | None = None
        self._open: dict[asyncio.StreamWriter, asyncio.Task[Any]] = {}

    async def __aenter__(self) -> Scripted:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._open:
            writer.close()
        await asyncio.gather(*self._open.values(), return_exceptions=True)

    @property
    def base_url(self) -> str:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._open[writer] = task
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                body = await reader.readexactly(int(length[1])) if length else b""
                self.requests.append(head + body)
                answer = self.answers[min(len(self.requests), len(self.answers)) - 1]
                writer.write(answer.removesuffix(self.CLOSE))
                await writer.drain()
                if answer.endswith(self.CLOSE):
                    if writer.can_write_eof():  # not over TLS
                        writer.write_eof()
                        while await reader.read(65536):  # until the client closes too
                            pass
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            del self._open[writer]
            self.finished += 1


def request(url: str, *, timeouts: dict[str, float] | None = None, **headers: str
            ) -> httpx.Request:
    return httpx.Request("DELETE", url + "/carts/1", headers=headers,
                         extensions={"timeout": timeouts or {"pool": 1, "connect": 1, "read": 1}})


def everything(status: int) -> bool:
    return True


async def answer_to(transport: Http1Transport, url: str, **headers: str) -> Answer:
    """One call as service/upstreams/exchange.py makes it, reading the whole body."""
    return await send(transport, request(url, **headers), 2.0, everything, 1 << 20)


NO_CONTENT = b"HTTP/1.1 204 No Content\r\n\r\n"


FRAMINGS = {
    "chunked": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n", b"hello world"),
    "interim-1xx": (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 102 Processing\r\n\r\n"
                    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", b"ok"),
    "close-delimited": (b"HTTP/1.1 200 OK\r\n\r\nuntil the end" + Scripted.CLOSE,
                        b"until the end"),
    "http-1.0": (b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\nold" + Scripted.CLOSE,
                 b"old"),
}


@pytest.mark.parametrize(("answer", "body"), FRAMINGS.values(), ids=FRAMINGS.keys())
async def test_each_framing_of_an_answer_is_read_whole(answer: bytes, body: bytes) -> None:
    transport = Http1Transport(4)
    async with Scripted(answer) as server:
        first = await answer_to(transport, server.base_url)
        second = await answer_to(transport, server.base_url)
    await transport.aclose()
    assert first == second == Answer(status=200, body=body)
    # a connection whose answer ends with its close is not reused; a kept-alive one is
    assert server.connections == (2 if answer.endswith(Scripted.CLOSE) else 1)


async def test_an_answer_saying_connection_close_is_not_reused() -> None:
    transport = Http1Transport(4)
    answer = b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n"
    async with Scripted(answer) as server:
        for _ in range(3):
            assert (await answer_to(transport, server.base_url)).status == 204
    await transport.aclose()
    assert server.connections == 3


async def test_a_connection_the_upstream_closed_while_idle_is_not_reused() -> None:
    transport = Http1Transport(4)
    async with Scripted(NO_CONTENT + Scripted.CLOSE) as server:
        assert (await answer_to(transport, server.base_url)).status == 204
        # the client closes its side once it has seen the close: no longer reusable
        await eventually(lambda: server.finished == 1, "the close seen by the client")
        assert (await answer_to(transport, server.base_url)).status == 204
    await transport.aclose()
    assert server.connections == 2


async def test_an_idle_connection_past_its_keepalive_is_not_reused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http1_connection, "KEEPALIVE_SECONDS", 0.05)
    transport = Http1Transport(4)
    async with Scripted(NO_CONTENT) as server:
        assert (await answer_to(transport, server.base_url)).status == 204
        await asyncio.sleep(0.1)
        assert (await answer_to(transport, server.base_url)).status == 204
    await transport.aclose()
    assert server.connections == 2


async def test_bytes_after_the_answer_make_the_connection_unusable() -> None:
    transport = Http1Transport(4)
    async with Scripted(NO_CONTENT + b"HTTP/1.1 200 OK\r\n\r\n") as server:
        # which of the two answered the request cannot be known: the call's outcome is
        # unknown (retried with its key), and the second answer is never the next call's
        assert await answer_to(transport, server.base_url) == Answer(
            failure=Failure.RESET_AFTER_SEND)
        assert await answer_to(transport, server.base_url) == Answer(
            failure=Failure.RESET_AFTER_SEND)
    await transport.aclose()
    assert server.connections == 2


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort" + Scripted.CLOSE,
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel" + Scripted.CLOSE,
    b"HTTP/1.1 20" + Scripted.CLOSE,
    Scripted.CLOSE,
], ids=["short-body", "cut-chunk", "cut-status", "nothing"])
async def test_an_answer_cut_short_is_a_reset_after_send(answer: bytes) -> None:
    transport = Http1Transport(4)
    async with Scripted(answer) as server:
        result = await answer_to(transport, server.base_url)
    await transport.aclose()
    assert result == Answer(failure=Failure.RESET_AFTER_SEND)
    assert len(server.requests) == 1


@pytest.mark.parametrize("head", [
    # each over a megabyte: more than one read (256 KiB at most), whatever the timing
    b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 1_100_000 + b"\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\n" + b"X-Many: a\r\n" * 100_000 + b"Content-Length: 0\r\n\r\n",
    b"HTTP/1.1 100 Continue\r\n\r\n" * 50_000 + NO_CONTENT,
], ids=["one-huge-header", "many-headers", "endless-interim-answers"])
async def test_an_answer_head_over_its_bound_is_refused(head: bytes) -> None:
    """A hostile upstream cannot make the worker hold an unbounded status line and headers
    (the parser gathers each header whole): past MAX_HEAD_BYTES the answer is refused as
    not HTTP, and the connection is not reused."""
    transport = Http1Transport(4)
    async with Scripted(head, NO_CONTENT) as server:
        assert await answer_to(transport, server.base_url) == Answer(
            failure=Failure.RESET_AFTER_SEND)
        assert (await answer_to(transport, server.base_url)).status == 204
    await transport.aclose()
    assert server.connections == 2


async def test_a_header_with_a_line_break_is_never_sent() -> None:
    transport = Http1Transport(4)
    async with Scripted(NO_CONTENT) as server:
        result = await answer_to(transport, server.base_url,
                                 authorization="Bearer x\r\nX-Admin: yes")
    await transport.aclose()
    assert result == Answer(failure=Failure.INVALID_REQUEST)
    assert server.connections == 0


async def test_a_request_past_its_send_by_moment_is_never_written() -> None:
    """The worker's token tolerance (SEND_BY) holds up to the write: a request that could
    not leave in time is refused before a byte goes out, and its connection stays pooled."""
    transport = Http1Transport(1)
    async with Scripted(NO_CONTENT) as server:
        assert (await answer_to(transport, server.base_url)).status == 204
        for moment, expected in ((time.monotonic() - 0.001, Answer(failure=Failure.SENT_TOO_LATE)),
                                 (time.monotonic() + 60, Answer(status=204, body=b""))):
            timed = request(server.base_url)
            timed.extensions[SEND_BY] = moment
            assert await send(transport, timed, 3.0, everything, 1 << 20) == expected
    await transport.aclose()
    assert len(server.requests) == 2 and server.connections == 1


async def test_a_request_its_gate_refuses_at_the_write_is_never_written() -> None:
    """The hold gate (SEND_GATE) is asked once the connection is taken, in the step that
    would write: a refused request is WITHHELD before a byte goes out, and its connection
    stays pooled for the next."""
    transport = Http1Transport(1)
    asked: list[bool] = []

    def gate(answer: bool) -> Callable[[], bool]:
        def may_send() -> bool:
            asked.append(answer)
            return answer
        return may_send

    async with Scripted(NO_CONTENT) as server:
        assert (await answer_to(transport, server.base_url)).status == 204
        for allowed, expected in ((False, Answer(failure=Failure.WITHHELD)),
                                  (True, Answer(status=204, body=b""))):
            gated = request(server.base_url)
            gated.extensions[SEND_GATE] = gate(allowed)
            assert await send(transport, gated, 3.0, everything, 1 << 20) == expected
    await transport.aclose()
    assert asked == [False, True]
    assert len(server.requests) == 2 and server.connections == 1


@pytest.mark.parametrize("answer", [b"", b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npart"],
                         ids=["before-the-status", "mid-body"])
async def test_a_cancelled_answer_frees_its_connection(answer: bytes) -> None:
    """A call cut off mid-answer closes its connection (the rest of that answer would be
    read as the next call's) and gives its place back: with one connection allowed, the
    next call gets a new one."""
    transport = Http1Transport(1)
    async with Scripted(answer, NO_CONTENT) as server:
        slow = await send(transport, request(server.base_url), 0.2, everything, 1 << 20)
        assert slow == Answer(failure=Failure.TIMEOUT_AFTER_SEND)
        assert (await answer_to(transport, server.base_url)).status == 204
    await transport.aclose()
    assert server.connections == 2


async def test_waiting_past_the_pool_timeout_was_never_sent() -> None:
    transport = Http1Transport(1)
    async with Scripted(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nx",
                        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\ny") as server:
        held = await transport.handle_async_request(request(server.base_url))  # body unread
        with pytest.raises(httpx.PoolTimeout):
            await transport.handle_async_request(
                request(server.base_url, timeouts={"pool": 0.1, "connect": 1, "read": 1}))
        waiting = asyncio.create_task(answer_to(transport, server.base_url))
        await asyncio.sleep(0.05)
        await held.aclose()  # not read to its end, so closed: its place goes to the waiter
        assert (await waiting).status == 200
    await transport.aclose()
    assert len(server.requests) == 2


async def test_a_wait_for_a_connection_ends_at_the_send_by_moment() -> None:
    """A worker's call waits for a free connection no longer than its token's tolerance:
    it is not sent (SENT_TOO_LATE, so the lease goes back), and not held for the whole pool
    timeout, which the overall deadline would cut as maybe sent."""
    transport = Http1Transport(1)
    async with Scripted(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nx") as server:
        held = await transport.handle_async_request(request(server.base_url))  # body unread
        waiting = request(server.base_url, timeouts={"pool": 60, "connect": 60, "read": 60})
        waiting.extensions[SEND_BY] = time.monotonic() + 0.05
        waited = await send(transport, waiting, 60, everything, 1 << 20)
        assert waited == Answer(failure=Failure.SENT_TOO_LATE)
        await held.aclose()
    await transport.aclose()
    assert len(server.requests) == 1


async def test_a_host_without_idle_connections_takes_another_hosts_place() -> None:
    transport = Http1Transport(1)
    async with Scripted(NO_CONTENT) as first, Scripted(NO_CONTENT) as second:
        assert (await answer_to(transport, first.base_url)).status == 204
        assert (await answer_to(transport, second.base_url)).status == 204
        assert (await answer_to(transport, first.base_url)).status == 204
    await transport.aclose()
    assert (first.connections, second.connections) == (2, 1)


async def test_an_unread_body_is_not_buffered_whole() -> None:
    """The caller reads at most its cap; a body it has not read yet pauses the socket instead
    of filling memory (an upstream can announce gigabytes)."""
    sent = 0
    stalled = asyncio.Event()

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000\r\n\r\n")
        chunk = b"x" * 65_536
        try:
            while sent < 500_000_000:
                writer.write(chunk)
                sent += len(chunk)
                try:
                    await asyncio.wait_for(writer.drain(), 0.3)
                except TimeoutError:
                    break  # the reader stopped reading
        finally:
            stalled.set()
            writer.close()

    server = await asyncio.start_server(flood, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport = Http1Transport(1)
    async with server:
        response = await transport.handle_async_request(request(f"http://127.0.0.1:{port}"))
        await asyncio.wait_for(stalled.wait(), 10)
        await response.aclose()
    await transport.aclose()
    assert sent < 64_000_000  # socket buffers on both sides, and the pause's high-water mark


def self_signed(tmp_path: Path) -> Path:
    """A certificate for 127.0.0.1 that no public root signed, and its key, in one PEM."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sweeper test upstream")])
    now = datetime.now(UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=1))
            .not_valid_after(now + timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    pem = tmp_path / "upstream.pem"
    pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return pem


async def test_tls_verifies_the_upstreams_certificate(tmp_path: Path) -> None:
    pem = self_signed(tmp_path)
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(pem)
    trusting = Http1Transport(4, ssl.create_default_context(cafile=str(pem)))
    default = Http1Transport(4)  # certifi's roots, as production
    async with Scripted(NO_CONTENT, tls=served) as server:
        assert server.base_url.startswith("https://")
        assert (await answer_to(trusting, server.base_url)).status == 204
        assert (await answer_to(trusting, server.base_url)).status == 204
        # an upstream no public root vouches for is refused before anything is sent
        assert await answer_to(default, server.base_url) == Answer(failure=Failure.CONNECT)
    await trusting.aclose()
    await default.aclose()
    assert len(server.requests) == 2
    assert server.connections == 1  # the refused handshake never reached the server's HTTP


async def test_ssl_cert_file_names_a_private_ca(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """An upstream behind a private CA: SSL_CERT_FILE replaces certifi's roots, as
    docs/configuration.md says."""
    pem = self_signed(tmp_path)
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(pem)
    monkeypatch.setenv("SSL_CERT_FILE", str(pem))
    transport = Http1Transport(4)
    async with Scripted(NO_CONTENT, tls=served) as server:
        assert (await answer_to(transport, server.base_url)).status == 204
    await transport.aclose()


def test_the_wire_under_uvloop(tmp_path: Path) -> None:
    """`sweeper serve` runs on uvloop, as uvicorn picks it, and `sweeper worker` on asyncio's
    own loop: the cases above once more over uvloop's transports, which are not asyncio's
    classes."""
    cases: list[Callable[[], Coroutine[Any, Any, None]]] = [
        *(partial(test_each_framing_of_an_answer_is_read_whole, *framing)
          for framing in FRAMINGS.values()),
        test_an_answer_saying_connection_close_is_not_reused,
        test_a_connection_the_upstream_closed_while_idle_is_not_reused,
        test_bytes_after_the_answer_make_the_connection_unusable,
        partial(test_an_answer_cut_short_is_a_reset_after_send, b"HTTP/1.1 20" + Scripted.CLOSE),
        test_a_header_with_a_line_break_is_never_sent,
        test_a_request_past_its_send_by_moment_is_never_written,
        partial(test_a_cancelled_answer_frees_its_connection, b""),
        test_waiting_past_the_pool_timeout_was_never_sent,
        test_a_host_without_idle_connections_takes_another_hosts_place,
        test_an_unread_body_is_not_buffered_whole,
        partial(test_tls_verifies_the_upstreams_certificate, tmp_path),
    ]
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        for case in cases:
            runner.run(case())
