"""The progress display of `sweeper run --follow` and `sweeper demo`, against a mock API."""

from __future__ import annotations

import io
from typing import Any

import httpx
import pytest

from service.commands import run_client


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def api(*runs: dict[str, Any]) -> httpx.AsyncClient:
    answers = iter(runs)

    def handle(_request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=next(answers))

    return httpx.AsyncClient(base_url="http://sweeper.test",
                             transport=httpx.MockTransport(handle))


def run(state: str, **items: int) -> dict[str, Any]:
    return {"id": 3, "state": state, "released": 3000, "dry_run": False, "items": items,
            "attempts": {"succeeded": items.get("succeeded", 0), "throttled": 41,
                         "transient": 7}}


async def test_a_terminal_line_never_wraps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A line wider than the terminal wraps, and `\\r` then redraws only its last row,
    leaving an older bar above newer counts."""
    monkeypatch.setattr(run_client, "POLL_INTERVAL_S", 0)
    monkeypatch.setenv("COLUMNS", "60")
    out = Terminal()
    async with api(run("published", pending=2412, succeeded=588),
                   run("published", succeeded=3000)) as client:
        final = await run_client.follow(client, 3, out=out)
    assert final["items"] == {"succeeded": 3000}
    drawn = [row for row in out.getvalue().split("\r\x1b[2K") if row.strip()]
    assert len(drawn) == 2
    assert all(len(row.rstrip("\n")) <= 59 for row in drawn)
    # fitted, not cut: a narrower bar, the counts whole, the most frequent outcome kept
    assert drawn[0] == "[#.........] 588/3000  20%     0.0/s ETA -  succeeded=588 …"


@pytest.mark.parametrize(("width", "drawn"), [
    (None, "[##########################....] 2643/3000  88%   264.3/s ETA 1s  attempts: "
           "succeeded=2643 throttled=1187 transient=29 unknown=2"),
    (100, "[########..] 2643/3000  88%   264.3/s ETA 1s  succeeded=2643 throttled=1187 "
          "transient=29 unknown=2"),
    # 80 columns, the last one left free: the demo's line was cut after `attempts: suc`
    (79, "[########..] 2643/3000  88%   264.3/s ETA 1s  succeeded=2643 throttled=1187 …"),
    (50, "[########..] 2643/3000  88%   264.3/s ETA 1s  …"),
    (30, "[########..] 2643/3000  88%   "),
])
def test_a_narrow_row_keeps_the_figures_and_the_most_frequent_outcomes(
        width: int | None, drawn: str) -> None:
    """Fitted to a row: the bar narrows first, then the attempts lose their label, then
    their least frequent outcomes; only a row too narrow for the figures cuts them."""
    answer = {"state": "published", "released": 3000,
              "items": {"succeeded": 2643, "pending": 357},
              "attempts": {"succeeded": 2643, "throttled": 1187, "transient": 29,
                           "unknown": 2}}
    line = run_client.Progress(started=0.0, first_done=0).line(answer, 10.0, width)
    assert line == drawn
    assert width is None or len(line) <= width


async def test_bar_and_attempts_come_from_one_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_client, "POLL_INTERVAL_S", 0)
    out = io.StringIO()
    async with api(run("published", succeeded=3000)) as client:
        await run_client.follow(client, 3, out=out)
    assert out.getvalue().endswith(
        "3000/3000 100%     0.0/s ETA -  attempts: succeeded=3000 throttled=41 transient=7\n")


@pytest.mark.parametrize(("status", "answer", "message"), [
    (422, {"title": "Request is not valid", "detail": "2 problem(s) in the request",
           "errors": [{"loc": ["body", "policy"], "message": "String should have at least "
                       "1 character", "type": "string_too_short"},
                      {"loc": ["body", "max_items"], "message": "Input should be greater "
                       "than or equal to 1", "type": "greater_than_equal"}]},
     "HTTP 422: Request is not valid: 2 problem(s) in the request\n"
     "  body.policy: String should have at least 1 character\n"
     "  body.max_items: Input should be greater than or equal to 1"),
    (409, {"title": "Conflict", "detail": "that key started another run"},
     "HTTP 409: Conflict: that key started another run"),
    (502, ["not", "a", "problem"], "HTTP 502"),
    (500, None, "HTTP 500"),
])
async def test_a_refused_trigger_says_what_was_wrong(status: int, answer: Any,
                                                     message: str) -> None:
    """`sweeper run` prints what the server said, down to each field a 422 names."""
    def handle(_request: httpx.Request) -> httpx.Response:
        return (httpx.Response(status, text="<html>") if answer is None
                else httpx.Response(status, json=answer))

    async with httpx.AsyncClient(base_url="http://sweeper.test",
                                 transport=httpx.MockTransport(handle)) as client:
        with pytest.raises(run_client.RunFailed) as refused:
            await run_client.trigger(client, {"policy": ""}, None)
    assert str(refused.value) == message
