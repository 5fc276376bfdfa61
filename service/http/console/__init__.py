"""The operator console at /console: server-rendered pages over the same domain functions
as the API, signed in with the API's bearer tokens (service/http/console/sessions.py).

    web.py       request plumbing: route class, sign-in check, CSRF, bounded params/forms
    sessions.py  session cookies and CSRF tokens
    overview.py  the overview's figures, read once per interval and shared by viewers
    pages.py     what operators read; actions.py what they change
    render.py    templates, escaping of ids, security headers
    charts.py    the charts' series, read from the ledger's minutes (service/history/)
    static/      console.css and console.js (no framework; served from here: CSP 'self'),
                 and uPlot, the charts' library, vendored from npm with its licence
"""

from __future__ import annotations

from typing import Final

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from service.http.console import actions, charts, pages
from service.http.console.overview import CHART_MAX_AGE_S, OverviewCache, SharedReadings
from service.http.console.render import HERE, ConsoleError
from service.http.console.sessions import Sessions
from service.http.console.web import PREFIX, ConsoleRoute, ConsoleState
from service.runtime import Runtime

__all__ = ["ConsoleState", "console_state", "routers"]

_TYPES: Final = {".css": "text/css; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".png": "image/png"}
# every static file, read once: the set is fixed at install time
_STATIC: Final = {path.relative_to(HERE / "static").as_posix(): (path.read_bytes(),
                                                               _TYPES[path.suffix])
                  for path in (HERE / "static").rglob("*") if path.suffix in _TYPES}

static = APIRouter(prefix=PREFIX, route_class=ConsoleRoute, include_in_schema=False)


@static.get("/static/{name:path}")
async def static_file(request: Request, name: str) -> Response:
    found = _STATIC.get(name)
    if found is None:
        raise ConsoleError(404, "Not found", "no such file")
    body, media_type = found
    response = Response(body, media_type=media_type)
    response.headers["Cache-Control"] = "public, max-age=300"
    return response


def console_state(runtime: Runtime) -> ConsoleState:
    """The console's per-process state for one runtime."""
    return ConsoleState(
        sessions=Sessions(runtime.engine, runtime.tokens,
                          lifetime_s=runtime.settings.console_session_seconds),
        overview=OverviewCache(), charts=SharedReadings(CHART_MAX_AGE_S))


routers: Final = (pages.router, charts.router, actions.router, static)
