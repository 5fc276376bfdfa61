"""How the console answers: Jinja2 templates with autoescaping on, filters that show ids as
text whatever they hold, the security headers on every answer, and the error page.

Ids and reasons come from callers (tenants, storefronts, operators): `ident` escapes them,
shows invisible and direction-changing characters (U+202E and the like, controls) as
visible `\\u202e` escapes, and isolates the text in <bdi> so it cannot reorder the page."""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlencode

from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape
from markupsafe import Markup, escape
from starlette.responses import HTMLResponse, Response

HERE: Final = Path(__file__).resolve().parent

# No inline script or style anywhere: scripts and styles come from /console/static only.
CSP: Final = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
              "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; "
              "base-uri 'none'")
SECURITY_HEADERS: Final = {
    "Content-Security-Policy": CSP,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",  # no-referrer would send Origin: null on POSTs
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cache-Control": "no-store",
}


class ConsoleError(Exception):
    """An answer other than the page: its status, a title and what to do about it."""

    def __init__(self, status: int, title: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.title = title
        self.detail = detail


def _visible(ch: str) -> bool:
    category = unicodedata.category(ch)
    # controls, format characters (bidi overrides, zero-width joiners), separators other
    # than the space, surrogates and unassigned code points are shown as escapes
    return not (category in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp")
                or (category == "Zs" and ch != " "))


def ident(value: object) -> Markup:
    """An id or reason as inert, isolated text; invisible characters shown as escapes."""
    if value is None:
        return Markup('<span class="none">–</span>')
    parts: list[str] = []
    for ch in str(value):
        if _visible(ch):
            parts.append(str(escape(ch)))
        else:
            code = ord(ch)
            shown = f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"
            parts.append(f'<span class="esc" title="invisible character">{shown}</span>')
    return Markup("<bdi>" + "".join(parts) + "</bdi>")  # noqa: S704 - every part escaped


def timestamp(value: datetime | str | None) -> Markup:
    """An instant in UTC, to the second, in a <time> element: one format on every page,
    whether it came from a column or as ISO 8601 text from a report's JSON."""
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            return ident(value)
    if value is None:
        return Markup('<span class="none">–</span>')
    utc = value.astimezone(UTC)
    return Markup('<time datetime="{}">{}</time>').format(
        utc.isoformat(), utc.strftime("%Y-%m-%d %H:%M:%SZ"))


def duration(seconds: float | None) -> str:
    """Seconds as the two largest units, e.g. '3m 20s'."""
    if seconds is None or math.isnan(seconds):
        return "–"
    seconds = max(0, int(seconds))
    days, rest = divmod(seconds, 86_400)
    hours, rest = divmod(rest, 3_600)
    minutes, secs = divmod(rest, 60)
    units = [(days, "d"), (hours, "h"), (minutes, "m"), (secs, "s")]
    shown = [f"{n}{unit}" for n, unit in units if n][:2]
    return " ".join(shown) or "0s"


def query(base: Mapping[str, object], **changes: object) -> str:
    """A query string of `base` with `changes`, dropping empty values."""
    merged = {**base, **changes}
    return urlencode({k: v for k, v in merged.items() if v not in (None, "", False)})


_env = Environment(
    loader=FileSystemLoader(HERE / "templates"),
    autoescape=select_autoescape(default=True, default_for_string=True),
    undefined=StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
def without(mapping: dict[str, object], *keys: str) -> dict[str, object]:
    """`mapping` less `keys` (an audit row's details shown without its item ids)."""
    return {k: v for k, v in mapping.items() if k not in keys}


_env.filters.update(ident=ident, ts=timestamp, duration=duration, without=without)
_env.globals.update(query=query)


def secure(response: Response) -> Response:
    """The console's headers on any answer of it."""
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    return response


def page(template: str, context: Mapping[str, Any], status: int = 200) -> HTMLResponse:
    """A rendered page with the console's headers."""
    html = _env.get_template(template).render(**context)
    response = HTMLResponse(html, status_code=status)
    secure(response)
    return response


def error_page(error: ConsoleError, context: Mapping[str, Any]) -> HTMLResponse:
    return page("error.html", {**context, "error": error}, status=error.status)
