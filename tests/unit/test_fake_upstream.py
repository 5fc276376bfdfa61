"""Tests of the FakeUpstream test double itself, over real loopback HTTP (no database)."""

from __future__ import annotations

import ast
import asyncio
import base64
import fcntl
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import httpx
import pytest

import drills.upstream
from service.protocols.egress import public_roots
from tests.fakes.upstream import Call, FakeUpstream, Fault, over_limit

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
async def up() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as fake:
        yield fake


@pytest.fixture
async def client(up: FakeUpstream) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=up.base_url, timeout=5.0, verify=public_roots()) as c:
        yield c


async def _wait_for_calls(up: FakeUpstream, n: int, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while len(up.calls()) < n:
        assert time.monotonic() < deadline, f"expected {n} calls, saw {up.calls()}"
        await asyncio.sleep(0.01)


async def _raw(up: FakeUpstream, payload: bytes) -> bytes:
    """Send raw bytes and read until the server closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", up.port)
    try:
        writer.write(payload)
        await writer.drain()
        return await asyncio.wait_for(reader.read(-1), 2.0)
    finally:
        writer.close()


async def test_success_is_204_and_the_call_is_recorded(
    up: FakeUpstream, client: httpx.AsyncClient
) -> None:
    r = await client.delete("/carts/a%2Fb", params={"dry": "1"},
                            headers={"Idempotency-Key": "k-1", "X-Scope": "tenant:acme"})
    assert r.status_code == 204
    assert r.content == b""
    [call] = up.calls()
    assert (call.method, call.path, call.query) == ("DELETE", "/carts/a%2Fb", "dry=1")
    assert call.idempotency_key == "k-1"
    assert call.scope == "tenant:acme"
    assert call.outcome == "ok"
    assert call.headers["idempotency-key"] == "k-1"
    assert all(name == name.lower() for name in call.headers)
    assert call.received_at <= time.monotonic()
    assert abs(call.wall_time - time.time()) < 5
    r = await client.post("/other", content=b"{}")
    assert r.status_code == 204
    assert up.calls()[1].idempotency_key is None
    assert up.calls()[1].scope == "default"
    assert up.calls_for_key("k-1") == [call]


@pytest.mark.slow  # the fake's trailing-second window, in real time
async def test_rate_limit_answers_429_with_integer_retry_after(
    up: FakeUpstream, client: httpx.AsyncClient
) -> None:
    up.limit("s", 5, burst=1)
    statuses: list[int] = []
    retry_afters: list[str] = []
    for _ in range(20):
        r = await client.delete("/x", headers={"X-Scope": "s"})
        statuses.append(r.status_code)
        if r.status_code == 429:
            retry_afters.append(r.headers["retry-after"])
    throttled = statuses.count(429)
    assert statuses[0] == 204
    assert set(statuses) == {204, 429}
    assert throttled >= 10
    assert up.throttled_count("s") == throttled == up.throttled_count()
    assert [c.outcome for c in up.calls()].count("throttled") == throttled
    assert all(ra.isdigit() and int(ra) >= 1 for ra in retry_afters)
    # Other scopes have their own (here: no) limit.
    assert (await client.delete("/x", headers={"X-Scope": "other"})).status_code == 204
    assert up.throttled_count("other") == 0
    await asyncio.sleep(int(retry_afters[-1]))
    assert (await client.delete("/x", headers={"X-Scope": "s"})).status_code == 204


async def test_retry_after_is_the_ceiling_of_the_time_to_the_next_token(
    up: FakeUpstream, client: httpx.AsyncClient
) -> None:
    up.limit("default", 0.5)
    assert (await client.delete("/a")).status_code == 204
    r = await client.delete("/a")
    assert r.status_code == 429
    assert r.headers["retry-after"] == "2"
    up.limit("default", None)
    assert (await client.delete("/a")).status_code == 204


async def test_default_limit_and_custom_scope_fn() -> None:
    def by_tenant(method: str, path: str, headers: Mapping[str, str]) -> str:
        return path.split("/")[2]

    async with FakeUpstream(default_limit=0.5, scope_fn=by_tenant) as fake:
        async with httpx.AsyncClient(verify=public_roots(), base_url=fake.base_url) as c:
            codes = [(await c.delete(p)).status_code
                     for p in ("/t/acme/1", "/t/acme/2", "/t/globex/1")]
            # A scope_fn that raises kills only that connection, not the server.
            with pytest.raises(httpx.RemoteProtocolError):
                await c.delete("/boom")
            assert (await c.delete("/t/initech/1")).status_code == 204
        assert codes == [204, 429, 204]
        assert [call.scope for call in fake.calls()] == ["acme", "acme", "globex", "initech"]
        assert fake.throttled_count("acme") == 1


@pytest.mark.slow  # the fake's trailing-second window, in real time
async def test_default_window_allows_n_calls_in_any_trailing_second() -> None:
    async with FakeUpstream(default_limit=3, default_window=True) as fake:
        async with httpx.AsyncClient(verify=public_roots(), base_url=fake.base_url) as c:
            first = [(await c.delete(f"/x/{i}")).status_code for i in range(4)]
            over = await c.delete("/x/over")
            await asyncio.sleep(1.05)  # the first three leave the window together
            again = [(await c.delete(f"/y/{i}")).status_code for i in range(4)]
        assert first == [204, 204, 204, 429] and again == [204, 204, 204, 429]
        assert over.status_code == 429 and over.headers["Retry-After"] == "1"


@pytest.mark.slow  # the fake's trailing-second window, in real time
async def test_over_limit_throttles_with_the_headers_the_test_chooses(
    up: FakeUpstream, client: httpx.AsyncClient
) -> None:
    up.inject(Fault.STATUS, times=None, status=429, headers={"Retry-After": "0"},
              match=over_limit(3))
    first = [await client.delete(f"/x/{i}", headers={"X-Scope": "s"}) for i in range(5)]
    assert [r.status_code for r in first] == [204, 204, 204, 429, 429]
    assert first[3].headers["Retry-After"] == "0"
    # each scope has its own window
    assert (await client.delete("/x", headers={"X-Scope": "other"})).status_code == 204
    await asyncio.sleep(1.05)  # the first three leave the window together
    again = [(await client.delete(f"/y/{i}", headers={"X-Scope": "s"})).status_code
             for i in range(4)]
    assert again == [204, 204, 204, 429]
    assert [c.outcome for c in up.calls()].count("status") == 3
    with pytest.raises(ValueError, match="per_second"):
        over_limit(0)


async def test_status_fault_with_headers_and_body(
    up: FakeUpstream, client: httpx.AsyncClient
) -> None:
    up.inject("status", status=503, headers={"Retry-After": "7"}, body=b"busy")
    r = await client.delete("/a")
    assert (r.status_code, r.headers["retry-after"], r.content) == (503, "7", b"busy")
    assert (await client.delete("/a")).status_code == 204
    assert [c.outcome for c in up.calls()] == ["status", "ok"]


async def test_hang_leads_to_a_read_timeout_and_is_recorded(
    up: FakeUpstream, client: httpx.AsyncClient
) -> None:
    up.inject(Fault.HANG)
    with pytest.raises(httpx.ReadTimeout):
        await client.delete("/a", headers={"Idempotency-Key": "h"}, timeout=0.3)
    assert [(c.idempotency_key, c.outcome) for c in up.calls()] == [("h", "hang")]
    assert (await client.delete("/a")).status_code == 204


async def test_a_hang_ends_when_the_test_ends_it(
    up: FakeUpstream, client: httpx.AsyncClient
) -> None:
    up.inject(Fault.HANG)  # an hour, unless ended
    hanging = asyncio.create_task(client.delete("/a", timeout=30))
    await _wait_for_calls(up, 1)
    assert up.end_hangs() == 1
    with pytest.raises(httpx.RemoteProtocolError):  # closed without an answer
        await hanging
    assert up.end_hangs() == 0
    assert (await client.delete("/a")).status_code == 204


async def test_drip_sends_headers_then_starves_the_body_read(
    up: FakeUpstream, client: httpx.AsyncClient
) -> None:
    up.inject("drip", interval=0.5, seconds=5)
    async with client.stream("DELETE", "/a", timeout=0.3) as r:
        assert r.status_code == 200
        assert int(r.headers["content-length"]) > 1_000_000
        chunks = r.aiter_raw()
        assert await anext(chunks) == b"x"
        with pytest.raises(httpx.ReadTimeout):
            await anext(chunks)
    assert up.calls()[0].outcome == "drip"


async def test_reset_aborts_without_response(up: FakeUpstream, client: httpx.AsyncClient) -> None:
    up.inject("reset")
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        await client.delete("/a")
    assert up.calls()[0].outcome == "reset"
    assert (await client.delete("/a")).status_code == 204


async def test_reset_is_a_tcp_rst_and_close_is_a_clean_fin(up: FakeUpstream) -> None:
    request = b"DELETE /a HTTP/1.1\r\nHost: x\r\n\r\n"
    up.inject("reset")
    with pytest.raises(ConnectionResetError):
        await _raw(up, request)
    up.inject("close")
    assert await _raw(up, request) == b""
    assert [c.outcome for c in up.calls()] == ["reset", "close"]


async def test_garbage_is_a_correctly_framed_non_utf8_body(
    up: FakeUpstream, client: httpx.AsyncClient
) -> None:
    size = 3 * 1024 * 1024 + 7
    up.inject("garbage", size=size)
    r = await client.delete("/a")
    assert r.status_code == 200
    assert int(r.headers["content-length"]) == len(r.content) == size
    with pytest.raises(UnicodeDecodeError):
        r.content.decode("utf-8")
    # The connection stays usable: the framing was correct.
    assert (await client.delete("/a")).status_code == 204


async def test_close_ends_the_connection_without_answer(
    up: FakeUpstream, client: httpx.AsyncClient
) -> None:
    up.inject("close")
    with pytest.raises(httpx.RemoteProtocolError):
        await client.delete("/a")
    assert up.calls()[0].outcome == "close"


async def test_times_match_and_fifo_semantics(
    up: FakeUpstream, client: httpx.AsyncClient
) -> None:
    up.inject("status", status=500, times=2, match="/orders/")
    codes = [(await client.delete(p)).status_code
             for p in ("/carts/1", "/orders/1", "/orders/2", "/orders/3")]
    assert codes == [204, 500, 500, 204]

    def key_is_k2(call: Call) -> bool:
        return call.idempotency_key == "k2"

    up.inject("status", status=410, match=key_is_k2)
    up.inject("status", status=500)
    up.inject("status", status=502)
    assert (await client.delete("/a", headers={"Idempotency-Key": "k1"})).status_code == 500
    assert (await client.delete("/a", headers={"Idempotency-Key": "k2"})).status_code == 410
    assert (await client.delete("/a")).status_code == 502
    assert (await client.delete("/a")).status_code == 204

    up.inject("status", status=401, times=None)
    assert [(await client.delete("/a")).status_code for _ in range(4)] == [401] * 4
    up.clear_faults()
    assert (await client.delete("/a")).status_code == 204

    up.fail_next(2)
    assert [(await client.delete("/a")).status_code for _ in range(3)] == [503, 503, 204]
    with pytest.raises(ValueError, match="bad parameters"):
        up.inject("hang", status=500)
    with pytest.raises(ValueError, match="not a valid Fault"):
        up.inject("explode")


async def test_control_api_over_http(up: FakeUpstream, client: httpx.AsyncClient) -> None:
    r = await client.post("/_control/faults", json={
        "fault": "status", "status": 409, "times": None, "path_contains": "/x/",
        "headers": {"X-Why": "conflict"}, "body_b64": base64.b64encode(b"\xffno").decode()})
    assert r.status_code == 201
    assert (await client.delete("/y", headers={"Idempotency-Key": "k"})).status_code == 204
    for _ in range(2):
        r = await client.delete("/x/1")
        assert (r.status_code, r.headers["x-why"], r.content) == (409, "conflict", b"\xffno")

    r = await client.get("/_control/calls")
    assert r.status_code == 200
    calls = r.json()
    assert [(c["path"], c["outcome"]) for c in calls] == [
        ("/y", "ok"), ("/x/1", "status"), ("/x/1", "status")]
    assert calls[0]["idempotency_key"] == "k"
    assert isinstance(calls[0]["received_at"], float)
    assert set(calls[0]) == {f.name for f in Call.__dataclass_fields__.values()}
    assert len((await client.get("/_control/calls", params={"since": 2})).json()) == 1

    assert (await client.delete("/_control/faults")).status_code == 200
    assert (await client.delete("/x/1")).status_code == 204

    r = await client.post("/_control/faults", json={"fault": "status", "status": 500,
                                                     "scope": "s1"})
    assert r.status_code == 201
    assert (await client.delete("/a", headers={"X-Scope": "s2"})).status_code == 204
    assert (await client.delete("/a", headers={"X-Scope": "s1"})).status_code == 500

    r = await client.post("/_control/limits", json={"scope": "lim", "per_second": 0.5})
    assert r.status_code == 200
    codes = [(await client.delete("/a", headers={"X-Scope": "lim"})).status_code
             for _ in range(2)]
    assert codes == [204, 429]
    stats = (await client.get("/_control/stats")).json()
    assert stats["throttled"] == {"lim": 1}
    assert stats["calls"] == len(up.calls()) == 8

    assert (await client.post("/_control/reset")).status_code == 200
    assert up.calls() == []
    assert up.throttled_count() == 0
    assert (await client.delete("/a", headers={"X-Scope": "lim"})).status_code == 204
    assert (await client.post("/_control/faults", json={"fault": "nope"})).status_code == 400
    assert (await client.post("/_control/faults", content=b"[1]")).status_code == 400
    assert (await client.get("/_control/nothing")).status_code == 404
    # Control requests are never recorded as deletion calls.
    assert [c.path for c in up.calls()] == ["/a"]


def test_thread_mode_with_a_sync_client() -> None:
    with FakeUpstream() as fake, httpx.Client(verify=public_roots(), base_url=fake.base_url,
                                              timeout=5.0) as c:
        fake.fail_next(1, status=502)
        assert c.delete("/a", headers={"Idempotency-Key": "t"}).status_code == 502
        assert c.delete("/a", headers={"Idempotency-Key": "t"}).status_code == 204
        assert [call.outcome for call in fake.calls_for_key("t")] == ["status", "ok"]
        fake.inject("hang")
        with pytest.raises(httpx.ReadTimeout):
            c.delete("/b", timeout=0.3)
        base_url = fake.base_url
    # stop_thread() closed the listener.
    with pytest.raises(httpx.ConnectError):
        httpx.delete(base_url + "/a", timeout=1.0)


async def test_max_in_flight_per_key_and_overall(
    up: FakeUpstream, client: httpx.AsyncClient
) -> None:
    up.inject("hang", times=2, match=lambda c: c.idempotency_key == "a", seconds=0.3)
    results = await asyncio.gather(
        *(client.delete("/a", headers={"Idempotency-Key": "a"}) for _ in range(2)),
        return_exceptions=True)
    assert all(isinstance(r, httpx.RemoteProtocolError) for r in results), results
    for _ in range(3):
        assert (await client.delete("/b", headers={"Idempotency-Key": "b"})).status_code == 204
    assert up.max_in_flight("a") == 2
    assert up.max_in_flight("b") == 1
    assert up.max_in_flight() == 2
    assert up.max_in_flight("never") == 0
    # the stats a benchmark polls name only the keys that overlapped, so their size does
    # not grow with the calls
    stats = (await client.get("/_control/stats")).json()
    assert (stats["max_in_flight"], stats["keys_in_flight_together"]) == (2, {"a": 2})


async def test_close_ends_hanging_and_dripping_connections_quickly() -> None:
    fake = FakeUpstream()
    await fake.start()
    fake.inject("hang", match="/hang")
    fake.inject("drip", match="/drip", interval=0.05, seconds=3600)
    async with httpx.AsyncClient(verify=public_roots(), base_url=fake.base_url, timeout=30.0) as c:

        async def drip() -> None:
            async with c.stream("DELETE", "/drip") as r:
                async for _ in r.aiter_raw():
                    pass

        tasks = [asyncio.create_task(c.delete("/hang")), asyncio.create_task(drip())]
        await _wait_for_calls(fake, 2)
        started = time.monotonic()
        await fake.close()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 2.0)
        elapsed = time.monotonic() - started
    assert elapsed < 2.0
    assert all(isinstance(r, httpx.TransportError) for r in results), results


async def test_malformed_and_oversized_requests(up: FakeUpstream) -> None:
    assert (await _raw(up, b"NONSENSE\r\n\r\n")).startswith(b"HTTP/1.1 400 ")
    assert (await _raw(up, b"GET / HTTP/1.1\r\nbad header\r\n\r\n")).startswith(b"HTTP/1.1 400 ")
    big = b"DELETE /a HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n"
    assert (await _raw(up, big)).startswith(b"HTTP/1.1 413 ")
    assert up.calls() == []
    # A failing connection handler does not take the server down.
    ok = await _raw(up, b"DELETE /a HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert ok.startswith(b"HTTP/1.1 204 ")


async def test_keep_alive_and_connection_close(up: FakeUpstream) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", up.port)
    body = b'{"why": "gdpr"}'
    writer.write(b"DELETE /a HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2.0)
    assert head.startswith(b"HTTP/1.1 204 ")
    writer.write(b"DELETE /b HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    rest = await asyncio.wait_for(reader.read(-1), 2.0)  # returns only at EOF
    writer.close()
    assert rest.startswith(b"HTTP/1.1 204 ")
    assert b"Connection: close" in rest
    assert [c.path for c in up.calls()] == ["/a", "/b"]


def _wait_for_ready_file(proc: subprocess.Popen[bytes], ready: Path) -> str:
    deadline = time.monotonic() + 10
    while not ready.exists():
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline, "ready file never appeared"
        time.sleep(0.02)
    return ready.read_text()


@pytest.mark.slow  # the fake upstream in a process of its own
def test_module_entry_point_runs_until_sigterm(tmp_path: Path) -> None:
    ready = tmp_path / "url"
    with subprocess.Popen(
        [sys.executable, "-m", "tests.fakes.upstream", "--port", "0", "--default-limit", "20",
         "--ready-file", str(ready)],
        cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    ) as proc:
        try:
            base_url = _wait_for_ready_file(proc, ready)
            assert base_url.startswith("http://127.0.0.1:")
            with httpx.Client(verify=public_roots(), base_url=base_url, timeout=5.0) as c:
                assert c.delete("/a", headers={"Idempotency-Key": "p"}).status_code == 204
                calls = c.get("/_control/calls").json()
            assert [(x["path"], x["idempotency_key"]) for x in calls] == [("/a", "p")]
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=5) == 0
        finally:
            if proc.poll() is None:
                proc.kill()


@pytest.mark.slow  # the fake upstream in a process of its own
@pytest.mark.parametrize(("limit", "window", "statuses"), [
    ("0.5", False, [200, 200, 429]),  # a bucket of 2, one token back every 2 s
    ("1", True, [200, 429, 429]),  # one call in any trailing second; the burst plays no part
])
def test_package_entry_point_takes_every_option(
    tmp_path: Path, limit: str, window: bool, statuses: list[int]
) -> None:
    ready = tmp_path / "url"
    options = ["--host", "127.0.0.1", "--port", "0", "--default-limit", limit,
               "--default-burst", "2", "--success-status", "200", "--ready-file", str(ready),
               "--log-level", "debug", *(["--default-window"] if window else [])]
    with subprocess.Popen(
        [sys.executable, "-m", "drills.upstream", *options],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    ) as proc:
        try:
            base_url = _wait_for_ready_file(proc, ready)
            assert base_url.startswith("http://127.0.0.1:")
            with httpx.Client(verify=public_roots(), base_url=base_url, timeout=5.0) as c:
                assert [c.delete("/a").status_code for _ in range(3)] == statuses
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=5) == 0
            assert proc.stdout is not None and proc.stdout.read().decode().strip() == base_url
        finally:
            if proc.poll() is None:
                proc.kill()


@pytest.mark.parametrize(("options", "words"), [
    (["--default-limit", "0.5", "--default-window"], "a window limit counts whole calls"),
    (["--default-window"], "a window limit counts whole calls"),
    (["--default-limit", "0"], "must be > 0"),
    (["--default-limit", "5", "--default-burst", "0"], "burst >= 1"),
])
def test_limits_that_cannot_work_are_refused_at_start(
        capsys: pytest.CaptureFixture[str], options: list[str], words: str) -> None:
    """A window of under one call per second used to crash the first call (an empty window
    read from its front): refused when the fake starts, before it listens."""
    from drills.upstream.cli import main as upstream_main

    with pytest.raises(SystemExit) as exited:
        upstream_main(["--port", "0", *options])
    assert exited.value.code == 2
    assert words in capsys.readouterr().err


def test_each_module_of_the_package_imports_only_those_listed_before_it() -> None:
    """The package docstring's module map is also the import order, so no cycle can form."""
    doc = drills.upstream.__doc__ or ""
    order = [line.split("`")[1] for line in doc.splitlines() if line.startswith("- `")]
    package = REPO_ROOT / "drills" / "upstream"
    assert {p.stem for p in package.glob("*.py")} == {*order, "__init__", "__main__"}
    for i, name in enumerate(order):
        tree = ast.parse((package / f"{name}.py").read_text())
        used: set[str] = set()
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                used.add(f"a relative import ({node.module})")
            elif node.module == "drills.upstream":
                used |= {alias.name for alias in node.names}
            elif node.module and node.module.startswith("drills.upstream."):
                used.add(node.module.removeprefix("drills.upstream."))
        assert used <= set(order[:i]), f"{name} imports {sorted(used - set(order[:i]))}"


async def test_a_route_answers_its_calls_after_limits_and_faults(
    up: FakeUpstream, client: httpx.AsyncClient
) -> None:
    up.route("/list/", lambda call: (200, {"Content-Type": "application/json"},
                                     f'{{"query": "{call.query}"}}'.encode()))
    r = await client.get("/list/a", params={"cursor": "c1"})
    assert (r.status_code, r.json()) == (200, {"query": "cursor=c1"})
    assert (await client.delete("/carts/1")).status_code == 204  # outside the route
    up.inject(Fault.STATUS, times=1, status=503, match="/list/")
    assert (await client.get("/list/a")).status_code == 503  # a fault comes first
    up.limit("s", 0.001, 1)
    assert (await client.get("/list/b", headers={"X-Scope": "s"})).status_code == 200
    assert (await client.get("/list/b", headers={"X-Scope": "s"})).status_code == 429
    up.reset()
    assert (await client.get("/list/c")).status_code == 200  # a route stays through reset
    assert [c.outcome for c in up.calls()] == ["ok"]


def test_a_call_is_timed_by_its_arrival_not_by_the_fake_loop() -> None:
    """The fake's loop is blocked while a request arrives: the call's time is still when
    it arrived (the kernel's stamp), not when the loop got to it. Otherwise a busy fake
    stamps calls in bunches and a drill sees more calls in a second than were sent."""
    with FakeUpstream() as up:
        assert up._loop is not None
        blocked, release = threading.Event(), threading.Event()

        def block() -> None:
            blocked.set()
            release.wait(10)

        # a first call opens the connection, so the second needs no accept
        with httpx.Client(base_url=up.base_url, timeout=10) as client:
            assert client.delete("/t/a/o1").status_code == 204
            up._loop.call_soon_threadsafe(block)
            assert blocked.wait(10)
            sent = time.time()
            pending = threading.Thread(target=client.delete, args=("/t/a/o2",))
            pending.start()
            # the request is in the kernel's buffer once the fake's socket has bytes queued
            deadline = time.monotonic() + 10
            while not _queued_bytes(up):
                assert time.monotonic() < deadline, "the request never reached the fake"
            unblocked = time.time()
            release.set()
            pending.join(10)
        second = up.calls()[1]
        assert sent <= second.wall_time <= unblocked, (sent, second.wall_time, unblocked)


def _queued_bytes(up: FakeUpstream) -> bool:
    """Whether any of the fake's accepted connections has unread bytes in the kernel."""
    for writer in list(up._conns.values()):
        sock = writer.get_extra_info("socket")
        out = fcntl.ioctl(sock.fileno(), termios.FIONREAD, struct.pack("i", 0))
        if struct.unpack("i", out)[0] > 0:
            return True
    return False
