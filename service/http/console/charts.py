"""The console's charts: each one's series as JSON, read from the ledger's minutes
(service/history/minutes.py), which console.js draws with uPlot and fetches again every
few seconds while the page is open. Counts are shown per second (a bucket's count over its
width), so the hour, day and week windows read on one scale, against a scope's rate."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from service.budget import scope_controls
from service.history import minutes
from service.history.minutes import WINDOWS, Series
from service.history.tally import FINISHED, OUTCOMES
from service.http.console.pages import path_id, run_or_404
from service.http.console.render import ConsoleError, secure
from service.http.console.web import (
    PREFIX,
    ConsoleRoute,
    Params,
    console_of,
    runtime_of,
    signed_in,
    window_of,
)

router = APIRouter(prefix=f"{PREFIX}/charts", route_class=ConsoleRoute,
                   include_in_schema=False)

# one colour per outcome on every chart; policies take the palette in name order
COLOURS: Final[Mapping[str, str]] = {
    "succeeded": "#1a7f37", "throttled": "#bc4c00", "transient": "#9a6700",
    "unknown": "#8250df", "permanent": "#cf222e", "unauthorized": "#a40e26",
    "skipped": "#57606a", "dead": "#cf222e", "fenced": "#8250df", "reclaimed": "#0969da",
    "closures": "#bc4c00", "calls": "#0969da", "budget": "#57606a", "finished": "#1a7f37",
    "released": "#57606a"}
PALETTE: Final = ("#0969da", "#1a7f37", "#bc4c00", "#8250df", "#cf222e", "#9a6700",
                  "#1b7c83", "#57606a")
LABELS: Final[Mapping[str, str]] = {
    "reclaimed": "expired leases taken over", "fenced": "late completions (fenced)",
    "closures": "scope closures", "throttled": "throttled (429)", "calls": "calls",
    "budget": "budget (rate)"}


def _json(body: dict[str, Any]) -> Response:
    response = JSONResponse(body)
    secure(response)
    return response


def _line(name: str, values: Sequence[float | None], colour: str | None = None,
          dash: bool = False) -> dict[str, Any]:
    return {"label": LABELS.get(name, name), "colour": colour or COLOURS.get(name, PALETTE[0]),
            "values": list(values), "dash": dash}


def _per_second(series: Series, names: Sequence[str], *, keep: Sequence[str] = ()
                ) -> list[dict[str, Any]]:
    """Each named count per second, a bucket without a row being a bucket in which nothing
    happened (0); a series with nothing in the window is left out (unless in `keep`), so a
    quiet chart is not a legend of zeros."""
    lines = []
    for name in names:
        values: list[float | None] = [(v or 0) / series.bucket_s for v in series.ys[name]]
        if name in keep or any(values):
            lines.append(_line(name, values))
    return lines


def _chart(title: str, unit: str, series: Series, lines: list[dict[str, Any]]
           ) -> dict[str, Any]:
    return {"title": title, "unit": unit, "x": series.x, "bucket_s": series.bucket_s,
            "series": lines}


async def _begin(request: Request, allowed: Sequence[str]) -> tuple[Params, str, float]:
    await signed_in(request)
    params = Params(request, ("window", *allowed))
    return params, window_of(params), time.time()


async def _shared(request: Request, key: str, read: Callable[[], Awaitable[Any]]) -> Any:
    """What `read` gives, shared with every viewer (and chart) asking for the same `key`
    within a few seconds (service/http/console/overview.py SharedReadings): the outcomes
    chart and the leases chart read one series, the backlog and the oldest age another."""
    return await console_of(request).charts.get(key, read)


@router.get("/outcomes")
async def outcomes_chart(request: Request) -> Response:
    params, window, now = await _begin(request, ("policy",))
    runtime = runtime_of(request)
    policy = params.choice("policy", runtime.policies.policies)
    series = await _shared(request, f"outcomes:{window}:{policy or ''}",
                           lambda: minutes.outcomes(runtime.engine, window, now, policy))
    return _json(_chart("Outcomes", "items per second", series, _per_second(
        series, OUTCOMES, keep=("succeeded",))))


@router.get("/leases")
async def leases_chart(request: Request) -> Response:
    _, window, now = await _begin(request, ())
    engine = runtime_of(request).engine
    series = await _shared(request, f"outcomes:{window}:",
                           lambda: minutes.outcomes(engine, window, now))
    return _json(_chart("Expired leases, late completions, closures and dead items",
                        "per second", series, _per_second(
                            series, ("reclaimed", "fenced", "closures", "dead"),
                            keep=("reclaimed",))))


def _per_policy(series: Series) -> list[dict[str, Any]]:
    return [_line(name, values, PALETTE[i % len(PALETTE)])
            for i, (name, values) in enumerate(series.ys.items())]


async def _backlog(request: Request, window: str, now: float) -> tuple[Series, Series]:
    engine = runtime_of(request).engine
    backlog: tuple[Series, Series] = await _shared(
        request, f"backlog:{window}", lambda: minutes.backlog(engine, window, now))
    return backlog


@router.get("/backlog")
async def backlog_chart(request: Request) -> Response:
    _, window, now = await _begin(request, ())
    eligible, _oldest = await _backlog(request, window, now)
    return _json(_chart("Eligible items by policy", "items", eligible, _per_policy(eligible)))


@router.get("/oldest")
async def oldest_chart(request: Request) -> Response:
    _, window, now = await _begin(request, ())
    _eligible, oldest = await _backlog(request, window, now)
    return _json(_chart("Oldest eligible item's age by policy", "seconds", oldest,
                        _per_policy(oldest)))


@router.get("/scope")
async def scope_chart(request: Request) -> Response:
    """A scope's calls against its budget, with its 429s and closures."""
    params, window, now = await _begin(request, ("name",))
    name = params.string("name", 1_000)
    engine = runtime_of(request).engine

    async def read() -> dict[str, Any]:
        rows = await scope_controls.list_scopes(engine, name=name, limit=1) if name else []
        if not rows:
            raise ConsoleError(404, "No such scope", "name an existing scope: ?name=...")
        series = await minutes.scope(engine, window, now, str(name))
        lines = _per_second(series, ("calls", "succeeded", "throttled", "closures",
                                     "reclaimed"), keep=("calls",))
        rate = float(rows[0]["rate_per_second"])  # today's: a change shows as a step nowhere
        lines.insert(1, _line("budget", [rate] * len(series.x), dash=True))
        return _chart("Calls against the budget", "per second", series, lines)

    return _json(await _shared(request, f"scope:{window}:{name}", read))


def run_window(age_s: float) -> str:
    """The shortest window that holds a run `age_s` old (a week at most)."""
    return next((name for name, (span_s, _) in WINDOWS.items() if age_s <= span_s), "week")


@router.get("/runs/{run_id}")
async def run_chart(request: Request, run_id: str) -> Response:
    """A run's items finished so far, from its creation to now (each bucket's point at its
    end), against those it released: its window the shortest that holds the run."""
    await signed_in(request)
    Params(request, ())
    number = path_id(run_id, "run")

    async def read() -> dict[str, Any]:
        return await _run_progress(request, await run_or_404(request, number), time.time())

    return _json(await _shared(request, f"run:{number}", read))


async def _run_progress(request: Request, run: dict[str, Any], now: float) -> dict[str, Any]:
    created = run["created_at"].timestamp()
    series = await minutes.of_run(runtime_of(request).engine, run_window(now - created), now,
                                  int(run["id"]))
    counts = run["items"]
    per_bucket = [sum(series.ys[status][i] or 0 for status in FINISHED)
                  for i in range(len(series.x))]
    # what finished before the window began (a run older than a week) starts the line
    total = max(0.0, sum(counts.get(status, 0) for status in FINISHED) - sum(per_bucket))
    x, finished = [max(created, series.x[0])], [total]
    for start, n in zip(series.x, per_bucket, strict=True):
        if start + series.bucket_s > created:
            total += n
            x.append(min(start + series.bucket_s, now))
            finished.append(total)
    released = float(run["released"])
    return _chart("Items finished", "items", Series(x, {}, series.bucket_s),
                  [_line("finished", finished), _line("released", [released] * len(x),
                                                      dash=True)])
