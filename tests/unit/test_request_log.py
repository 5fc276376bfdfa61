"""The request log (service/http/request_log.py) over a bare ASGI app: every answer carries
the request id problem answers name, one line per request at the level its status
deserves, and probes logged only when they fail."""

from __future__ import annotations

import logging

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from service.http.api.problems import REQUEST_ID
from service.http.request_log import RequestLog


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
    assert (line.levelno, line.__dict__["path"], line.__dict__["status"]) == (
        logging.INFO, "/v1/items", 200)  # never the query string
    assert line.__dict__["request_id"] == request_id


@pytest.mark.parametrize(("status", "logged"), [(200, False), (503, True)])
async def test_probes_are_logged_only_when_they_fail(
        caplog: pytest.LogCaptureFixture, status: int, logged: bool) -> None:
    with caplog.at_level(logging.INFO, logger="service.http"):
        await get(answering(status), "/readyz")
    assert [r.levelno for r in lines(caplog)] == ([logging.WARNING] if logged else [])
