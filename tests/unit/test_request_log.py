"""The request log (service/http/request_log.py) over a bare ASGI app: every answer carries
the request id problem answers name, one line per request at the level its status
deserves, and probes logged only when they fail."""

from __future__ import annotations

import io
import json
import logging

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from service.http.api.problems import REQUEST_ID
from service.http.request_log import RequestLog
from service.observability.logs import JsonFormatter


def answering(status: int) -> RequestLog:
    """The request log around an app that answers `status` and keeps the request's id."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"x-seen-id", scope[REQUEST_ID].encode())]})
        await send({"type": "http.response.body", "body": b""})

    return RequestLog(app)


async def get(log: RequestLog, path: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=log)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.get(path)


def lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "service.http" and r.msg == "request"]


async def test_the_answer_names_the_request_the_app_saw(caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    with caplog.at_level(logging.INFO, logger="service.http"):
        answer = await get(answering(200), "/v1/items?after=3")
    request_id = answer.headers["x-request-id"]
    assert len(request_id) == 16 and answer.headers["x-seen-id"] == request_id
    [line] = lines(caplog)
    # the route template (none matched here), never the path or its query string
    assert (line.levelno, line.__dict__["http.route"],
            line.__dict__["http.response.status_code"]) == (logging.INFO, "unmatched", 200)
    assert "/v1/items" not in str(line.__dict__)


def logging_app(status: int) -> RequestLog:
    """The request log around an app that logs a line of its own before answering."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        logging.getLogger("service.worker").info("claimed", extra={"item_id": 7})
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    return RequestLog(app)


@pytest.mark.parametrize(("sent", "kept"), [
    (None, False), ("req-42.a_b:c", True), ("x" * 64, True), ("x" * 65, False),
    ("has space", False), ("caf\u00e9", False), ("", False)])
async def test_every_line_of_a_request_carries_its_id_and_a_plain_callers_id_is_kept(
        sent: str | None, kept: bool) -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())  # formats as it is logged, in the request's context
    root = logging.getLogger()
    root.addHandler(handler)
    level = root.level
    root.setLevel(logging.INFO)
    try:
        transport = httpx.ASGITransport(app=logging_app(200))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            headers = {} if sent is None else {"X-Request-ID": sent.encode()}  # bytes: UTF-8
            answer = await client.get("/v1/tenants/acme/credentials", headers=headers)
        logging.getLogger("service.worker").info("after")  # outside any request
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    request_id = answer.headers["x-request-id"]
    assert (request_id == sent) is kept
    # (the test's own client logs too, under httpx)
    ours = [doc for doc in map(json.loads, out.getvalue().splitlines())
            if doc["scope"].startswith("service.")]
    lines = {doc["body"]: doc for doc in ours}
    assert lines["claimed"]["attributes"] == {"item_id": 7, "request_id": request_id}
    assert lines["request"]["attributes"]["request_id"] == request_id
    assert "acme" not in json.dumps(ours)  # the raw path is never logged
    assert "request_id" not in lines["after"]["attributes"]
    assert lines["request"]["resource"]["service.name"] == "sweeper"


@pytest.mark.parametrize(("status", "logged"), [(200, False), (503, True)])
async def test_probes_are_logged_only_when_they_fail(
        caplog: pytest.LogCaptureFixture, status: int, logged: bool) -> None:
    with caplog.at_level(logging.INFO, logger="service.http"):
        await get(answering(status), "/readyz")
    assert [r.levelno for r in lines(caplog)] == ([logging.WARNING] if logged else [])
