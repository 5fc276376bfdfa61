"""The LISTEN connection's failures are never silent (issue 44): a listener that could not
connect used to retry every second without a word while its workers quietly polled."""

from __future__ import annotations

import asyncio
import logging

import pytest

from service.observability.metrics import REGISTRY
from service.worker.postgres import Listener


async def first_line(caplog: pytest.LogCaptureFixture, url: str, message: str
                     ) -> logging.LogRecord:
    """Run a listener on `url` until it logs `message`; that record."""
    listener = asyncio.create_task(Listener(url).listen(lambda: None))
    try:
        with caplog.at_level(logging.WARNING, logger="service.worker"):
            async with asyncio.timeout(10):
                while not (lines := [r for r in caplog.records if r.getMessage() == message]):
                    await asyncio.sleep(0.01)
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
    return lines[0]


async def test_refused_listen_credentials_are_logged_by_class(
        db_url: str, caplog: pytest.LogCaptureFixture) -> None:
    host = db_url.split("@", 1)[1]
    line = await first_line(caplog, f"postgresql://no_such_role_44@{host}",
                            "listen: cannot connect; workers poll until it can")
    assert line.error_type == "InvalidAuthorizationSpecificationError"  # type: ignore[attr-defined]
    assert "no_such_role_44" not in caplog.text  # the class, never the text


async def test_an_unexpected_listen_failure_is_logged_and_counted(
        caplog: pytest.LogCaptureFixture) -> None:
    before = REGISTRY.get_sample_value("sweeper_internal_errors_total",
                                       {"where": "listen"}) or 0.0
    # a URL asyncpg refuses to parse: a bug in the configuration, not an outage
    line = await first_line(caplog, "postgresql://127.0.0.1:not-a-port/x", "internal error")
    assert line.where == "listen"  # type: ignore[attr-defined]
    assert REGISTRY.get_sample_value("sweeper_internal_errors_total",
                                     {"where": "listen"}) == before + 1
